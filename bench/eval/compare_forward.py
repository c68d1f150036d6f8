#!/usr/bin/env python3
"""Two forward passes on the same windows: kvq-eval's C++ one and the
transformers mode (hf_eval.py), or any runs of one protocol file.

Pairs the runs' per-window scores (JSON "per_window", by corpus and window
index) for every scheme and metric, pools them over the windows with the
bootstrap of pooling.py, and prints per (scheme, metric): each run's pooled
ΔPPL and KL with their 95% intervals, the difference of the candidate from
the base run with the paired interval of that difference, and with --floor
the spread of the base engine's own ΔPPL over runs that differ only in
rounding (SIMD targets, BLAS kernels), and each such run's paired
difference from the base with its interval: the chaos a last-bit
difference causes, against which "reproduces within 0.1 point" is judged
(docs/QUALITY.md).

  kvq-eval --contexts=256 --windows=2 --corpora=austen,code,kjv --passkey_contexts= \\
      --gen_tokens=32 --dump_windows=w.json --dump_only
  kvq-eval ... (the same flags) --schemes=S --out=cxx.json
  KVQ_SIMD_TARGET=AVX2 kvq-eval ... --out=cxx_avx2.json
  python3 bench/eval/hf_eval.py w.json --schemes=S --out=hf.json
  python3 bench/eval/compare_forward.py cxx.json hf.json --floor cxx_avx2.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pooling import paired_difference, pool  # noqa: E402


def per_window_rows(path: Path, corpus: str) -> dict:
    """(scheme, metric, context) -> {window id: score} of one result file."""
    out = {}
    for r in json.loads(path.read_text())["rows"]:
        if r.get("corpus") != corpus or "per_window" not in r:
            continue
        key = (r["scheme"], r.get("metric", "prefill"), r["context"])
        out[key] = {w["window"]: w for w in r["per_window"]}
    return out


def paired(a: dict, b: dict) -> tuple[list, list]:
    ids = sorted(set(a) & set(b))
    for i in ids:
        if a[i]["tokens"] != b[i]["tokens"]:
            raise ValueError(f"window {i}: {a[i]['tokens']} scored positions against "
                             f"{b[i]['tokens']}: not the same protocol")
    return [a[i] for i in ids], [b[i] for i in ids]


def fmt_ci(x: float, ci, f: str) -> str:
    return (f"{x:{f}}" + (f" [{ci[0]:{f}}, {ci[1]:{f}}]" if ci else ""))


def compare(base: Path, candidate: Path, floor: list[Path], corpus: str, resamples: int,
            seed: int) -> list[dict]:
    b_rows, c_rows = per_window_rows(base, corpus), per_window_rows(candidate, corpus)
    f_rows = [per_window_rows(f, corpus) for f in floor]
    out = []
    for key in sorted(set(b_rows) & set(c_rows), key=lambda k: (k[2], k[1], k[0])):
        scheme, metric, context = key
        bw, cw = paired(b_rows[key], c_rows[key])
        row = {"scheme": scheme, "metric": metric, "context": context, "windows": len(bw),
               "base": pool(bw, resamples, seed), "candidate": pool(cw, resamples, seed),
               "difference": paired_difference(cw, bw, resamples, seed)}
        spread = [row["base"]["delta_ppl_pct"]]
        row["floor"] = []
        for path, fr in zip(floor, f_rows):
            if key in fr:
                fw, bw2 = paired(fr[key], b_rows[key])
                if len(fw) == len(bw):
                    spread.append(pool(fw, resamples, seed)["delta_ppl_pct"])
                    # The floor run against the base, paired like the
                    # candidate: its interval is what rounding alone moves
                    # the difference by on these windows.
                    row["floor"].append(dict(paired_difference(fw, bw2, resamples, seed),
                                             run=path.name))
        row["floor_runs"] = len(spread)
        row["floor_spread"] = max(spread) - min(spread)
        out.append(row)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", type=Path, help="the reference run (kvq-eval's JSON)")
    ap.add_argument("candidate", type=Path, help="the run compared with it (hf_eval.py's JSON)")
    ap.add_argument("--floor", type=Path, nargs="*", default=[],
                    help="more runs of the base engine on the same windows that differ only "
                         "in rounding: their spread of pooled ΔPPL is the floor")
    ap.add_argument("--corpus", default="all", help="rows of this corpus (default: pooled)")
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tolerance", type=float, default=0.1,
                    help="ΔPPL points within which the passes count as agreeing")
    ap.add_argument("--json", type=Path, help="also write the comparison as JSON")
    args = ap.parse_args(argv)
    rows = compare(args.base, args.candidate, args.floor, args.corpus, args.resamples,
                   args.seed)
    print("| ctx | metric | scheme | windows | base ΔPPL % [95% CI] | candidate ΔPPL % [95% CI] "
          "| difference [paired 95% CI] | base KL | candidate KL | floor spread (runs) "
          f"| floor run − base [paired 95% CI] | within {args.tolerance} |")
    print("|---:|---|---|---:|---|---|---|---:|---:|---:|---|---|")
    for r in rows:
        b, c, d = r["base"], r["candidate"], r["difference"]
        ok = abs(d["difference"]) <= args.tolerance
        floors = "; ".join(fmt_ci(f["difference"], f.get("ci95"), "+.3f") for f in r["floor"])
        print(f"| {r['context']} | {r['metric']} | `{r['scheme']}` | {r['windows']} | "
              f"{fmt_ci(b['delta_ppl_pct'], b.get('delta_ppl_pct_ci95'), '+.3f')} | "
              f"{fmt_ci(c['delta_ppl_pct'], c.get('delta_ppl_pct_ci95'), '+.3f')} | "
              f"{fmt_ci(d['difference'], d.get('ci95'), '+.3f')} | {b['kl_mean']:.5f} | "
              f"{c['kl_mean']:.5f} | {r['floor_spread']:.3f} ({r['floor_runs']}) | "
              f"{floors or '—'} | {'yes' if ok else 'no'} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
