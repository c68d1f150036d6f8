#!/usr/bin/env python3
"""Renders kvq-eval (and llama.cpp peer) result JSON as the markdown tables
of docs/QUALITY.md, so the figures there are pasted, never typed.

    python3 bench/eval/quality_tables.py kvq.json [peer.json ...] [--corpus all] [--metric decode]

Prints one table per context: scheme, bits/element (measured allocation),
KV MiB, perplexity, ΔPPL against the engine's own fp16/f16 cache, mean KL,
greedy top-1 agreement, passkey, prefill and decode timings; then the
targets of the evaluation, each marked met or missed with the margin.
"""

import argparse
import json
import re
import sys


def metric_of(row):
    """The perplexity metric a row measured: kvq-eval names it ("decode" or
    "prefill"); rows without the field (older files, the llama.cpp peer)
    were scored on chunked prefill."""
    return row.get("metric", "prefill")


def load(paths, metric=None):
    """All rows of all files (only those of `metric` when given); a row
    measured again (same engine, scheme, metric, corpus and context, e.g.
    the fp16 reference of a later run) keeps the later file's figures."""
    rows = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                if metric is not None and metric_of(r) != metric:
                    continue
                rows[(r.get("engine", "kvq"), r["scheme"], metric_of(r), r["corpus"],
                      r["context"])] = r
    return list(rows.values())


def mean_code_bits(scheme):
    """Mean of the key and value code widths of a kivi scheme
    ("kivi4:v2" -> 3.0), None for the other schemes."""
    m = re.match(r"kivi(\d)", scheme)
    if not m:
        return None
    v = re.search(r":v(\d)(:|$)", scheme)
    return (int(m.group(1)) + int(v.group(1) if v else m.group(1))) / 2


def fmt(value, spec, missing="–"):
    return missing if value is None else format(value, spec)


def passkey_for(rows, engine, scheme, context):
    for r in rows:
        if (r.get("engine") == engine and r["scheme"] == scheme and r["corpus"] == "passkey"
                and r["context"] == context):
            return f'{r["passkey_ok"]}/{r["passkey_trials"]}'
    return "–"


def tables(rows, corpus):
    out = []
    contexts = sorted({r["context"] for r in rows if r["corpus"] == corpus})
    for ctx in contexts:
        sel = [r for r in rows if r["corpus"] == corpus and r["context"] == ctx and "ppl" in r]
        sel.sort(key=lambda r: (r["engine"] != "kvq", -r.get("bits_per_element", 0)))
        out.append(f"\n**{ctx} tokens** (corpus: {corpus}; windows: "
                   f"{max(r.get('windows', 1) for r in sel)})\n")
        out.append("| engine | scheme | bits/elem | KV MiB | PPL | ΔPPL % | KL | top-1 | passkey "
                   "| prefill s | decode ms/token |")
        out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in sel:
            kv = r.get("kv_bytes")
            out.append(
                f'| {r["engine"]} | `{r["scheme"]}` | {fmt(r.get("bits_per_element"), ".2f")} '
                f'| {fmt(kv / 2**20 if kv else None, ".1f")} | {r["ppl"]:.3f} '
                f'| {r["delta_ppl_pct"]:+.2f} | {fmt(r.get("kl_mean"), ".4f")} '
                f'| {fmt(r.get("top1_agree"), ".3f")} '
                f'| {passkey_for(rows, r["engine"], r["scheme"], ctx)} '
                f'| {fmt(r["prefill_ms"] / 1e3 if r.get("prefill_ms") else None, ".1f")} '
                f'| {fmt(r.get("decode_ms_per_token"), ".1f")} |')
    return out


def targets(rows, corpus):
    """The issue's figures at 2048 and 8192: best configuration per bit budget."""
    out = ["\n| context | target | best configuration | bits | ΔPPL % | verdict |",
           "|---:|---|---|---:|---:|---|"]
    for ctx in (2048, 8192):
        sel = [r for r in rows if r["corpus"] == corpus and r["context"] == ctx and "ppl" in r]
        kvq = [r for r in sel if r["engine"] == "kvq"]
        if not kvq:
            continue
        def best(pred):
            cands = [r for r in kvq if pred(r)]
            return min(cands, key=lambda r: r["delta_ppl_pct"]) if cands else None
        # Families by the mean code width of keys and values, so a mix such
        # as kivi4:v2 (3 bits on average) competes with kivi3; kivi4:v3
        # (3.5) is in none.
        def mean_width(bits):
            return lambda r: mean_code_bits(r["scheme"]) == bits
        budgets = [
            ("4-bit kivi ΔPPL ≤ 0.5%", mean_width(4), None, 0.5),
            ("≈3-bit (≤ 3.5 bits) ΔPPL ≤ 2%", mean_width(3), 3.5, 2.0),
            ("≈2-bit (≤ 2.6 bits) ΔPPL ≤ 6%", mean_width(2), 2.6, 6.0),
        ]
        for name, family, max_bits, max_dppl in budgets:
            fam = [r for r in kvq if family(r)]
            within = [r for r in fam if max_bits is None or r["bits_per_element"] <= max_bits]
            pick = min(within or fam, key=lambda r: r["delta_ppl_pct"]) if fam else None
            if pick is None:
                continue
            ok_bits = max_bits is None or pick["bits_per_element"] <= max_bits
            ok = ok_bits and pick["delta_ppl_pct"] <= max_dppl
            why = "met" if ok else "missed: " + ", ".join(
                s for s in [
                    None if ok_bits else f'{pick["bits_per_element"] - max_bits:+.2f} bits over',
                    None if pick["delta_ppl_pct"] <= max_dppl
                    else f'{pick["delta_ppl_pct"] - max_dppl:+.2f} pts over'] if s)
            out.append(f'| {ctx} | {name} | `{pick["scheme"]}` | {pick["bits_per_element"]:.2f} '
                       f'| {pick["delta_ppl_pct"]:+.2f} | {why} |')
        q4 = next((r for r in sel if r["engine"] == "llama.cpp" and r["scheme"] == "q4_0"), None)
        if q4:
            fewer = [r for r in kvq if r["bits_per_element"] < q4["bits_per_element"]
                     and r["scheme"] != "fp16"]
            pick = min(fewer, key=lambda r: r["delta_ppl_pct"]) if fewer else None
            if pick is None:
                out.append(f'| {ctx} | kvq below q4_0\'s {q4["bits_per_element"]} bits with lower '
                           f'ΔPPL than its {q4["delta_ppl_pct"]:+.2f}% | none measured under '
                           f'{q4["bits_per_element"]} bits | – | – | missed |')
            else:
                ok = pick["delta_ppl_pct"] < q4["delta_ppl_pct"]
                out.append(
                    f'| {ctx} | kvq below q4_0\'s {q4["bits_per_element"]} bits with lower ΔPPL than '
                    f'its {q4["delta_ppl_pct"]:+.2f}% | `{pick["scheme"]}` '
                    f'| {pick["bits_per_element"]:.2f} | {pick["delta_ppl_pct"]:+.2f} '
                    f'| {"met" if ok else "missed"} |')
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--corpus", default="all")
    ap.add_argument("--metric", default="decode", choices=("decode", "prefill"),
                    help="perplexity metric of the tables (rows without one are prefill)")
    args = ap.parse_args()
    rows = load(args.results, args.metric)
    print("\n".join(tables(rows, args.corpus) + targets(rows, args.corpus)))


if __name__ == "__main__":
    sys.exit(main())
