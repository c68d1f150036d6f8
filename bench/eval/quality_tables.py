#!/usr/bin/env python3
"""Renders kvq-eval (and llama.cpp peer) result JSON as the markdown tables
of docs/QUALITY.md, so the figures there are pasted, never typed.

    python3 bench/eval/quality_tables.py kvq.json [peer.json ...] [--corpus all] [--metric decode]
    python3 bench/eval/quality_tables.py --frontier kvq_frontier_*.json llamacpp_frontier.json

Prints one table per context: scheme, bits/element (measured allocation),
KV MiB, perplexity, ΔPPL against the engine's own fp16/f16 cache, mean KL,
greedy top-1 agreement, passkey, prefill and decode timings; then the
targets of the evaluation, each marked met or missed with the margin.

--frontier prints docs/QUALITY.md's frontier instead: per context, every
format's pooled ΔPPL and KL with their 95% bootstrap intervals against
bits/element, its family and the per-corpus ΔPPL; then the quality goals
(bits budget, ΔPPL bound; passkey equal to fp16 with at least 20 trials),
each met, not met (with the measured bound) or not measured.
"""

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

# The peer's bootstrap (kvq-eval's method) pools windows of separate runs.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_peer import bootstrap  # noqa: E402


def metric_of(row):
    """The perplexity metric a row measured: kvq-eval names it ("decode" or
    "prefill"); rows without the field (older files, the llama.cpp peer
    before it named its metric) were scored on chunked prefill."""
    return row.get("metric", "prefill")


def metrics_of(row):
    """Every metric a row stands for: the llama.cpp peer's rows stand for
    both (newer files list them in "metrics"), since llama.cpp stores every
    token quantized before any query attends, in prefill as in decoding."""
    if row.get("engine") == "llama.cpp":
        return row.get("metrics", ["decode", "prefill"])
    return row.get("metrics", [metric_of(row)])


def load(paths, metric=None):
    """All rows of all files (only those of `metric` when given). A row
    measured again (same engine, scheme, metric, corpus and context) in a
    later file is merged with the earlier one when both carry per-window
    sums (`merge_windows`: runs of other windows of the same corpus add up
    to one row); otherwise it keeps the later file's figures (e.g. the fp16
    reference of a later run without per-window sums)."""
    rows = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                if metric is not None and metric not in metrics_of(r):
                    continue
                key = (r.get("engine", "kvq"), r["scheme"], metric or metric_of(r), r["corpus"],
                       r["context"])
                rows[key] = merge_windows(rows[key], r) if key in rows else r
    return list(rows.values())


def merge_windows(earlier, later):
    """One corpus's row from two runs: the union of their windows (by window
    index; a window both measured keeps the later figures), with ΔPPL, KL
    and perplexity pooled by tokens from the per-window sums and the 95%
    bootstrap interval over the union. Rows without indexed per-window sums
    on both sides, or pooled "all" rows (pool_corpora recomputes those),
    cannot be merged: the later row replaces the earlier."""
    def indexed(r):
        return r.get("per_window") and all("index" in w for w in r["per_window"])

    if earlier.get("corpus") == "all" or not (indexed(earlier) and indexed(later)):
        return later
    by_index = {w["index"]: w for w in earlier["per_window"]}
    by_index.update({w["index"]: w for w in later["per_window"]})
    windows = list(by_index.values())
    row = {k: v for k, v in later.items() if k != "window_indices"}
    row["per_window"] = windows
    return with_pooled_figures(row, windows)


def with_pooled_figures(row, windows):
    """`row` with its figures pooled by tokens from the per-window sums
    ("per_window": nll, ref_nll, kl, tokens) of `windows`: ΔPPL, KL and
    perplexity, and the 95% bootstrap interval over the windows (none
    with fewer than two)."""
    tokens = sum(w["tokens"] for w in windows)
    nll = sum(w["nll"] for w in windows) / tokens
    row.update({
        "windows": len(windows), "tokens_scored": tokens, "nll": nll, "ppl": math.exp(nll),
        "delta_ppl_pct": 100.0 * math.expm1(
            sum(w["nll"] - w["ref_nll"] for w in windows) / tokens),
        "kl_mean": sum(w["kl"] for w in windows) / tokens,
    })
    row.pop("delta_ppl_pct_ci95", None)
    row.pop("kl_mean_ci95", None)
    ci = bootstrap(windows)
    if ci:
        row["delta_ppl_pct_ci95"], row["kl_mean_ci95"] = ci
    return row


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


# The quality goals of the frontier (docs/QUALITY.md): at most `bits`
# bits/element with a pooled decode ΔPPL of at most `dppl` percent, at
# 2048 tokens (austen, code, kjv) and 8192 (austen, code).
GOALS = [(4.3, 0.5), (3.5, 2.5), (2.6, 10.0)]
GOAL_CONTEXTS = {2048: ("austen", "code", "kjv"), 8192: ("austen", "code")}
GOAL_MIN_WINDOWS = 5  # per corpus; formats screened on fewer are named, never picked
PASSKEY_MIN_BITS = 3.0
PASSKEY_MIN_TRIALS = 20


def family(row):
    """What a format is, in words, for the frontier's legend."""
    scheme, engine = row["scheme"], row.get("engine", "kvq")
    if engine != "kvq":
        return f"{engine} cache"
    if scheme in ("fp16", "int8", "fp8_e4m3"):
        return "reference"
    if scheme.startswith("crq"):
        return "crq (calibrated, rotated, Lloyd-Max)"
    if ":nuq" in scheme:
        return "KVQuant-like (nuq levels)"
    if ":rotate" in scheme:
        return "Hadamard rotation + uniform levels"
    return "KIVI"


def with_ci(row, field, spec):
    """`value [lo, hi]` with the 95% bootstrap interval when the row has one."""
    value = row.get(field)
    if value is None:
        return "–"
    ci = row.get(field + "_ci95")
    text = format(value, spec)
    return f"{text} [{format(ci[0], spec)}, {format(ci[1], spec)}]" if ci else text


def pool_corpora(rows):
    """The rows with every (engine, scheme, context)'s "all" row recomputed
    from its per-corpus rows' per-window sums ("per_window": nll, ref_nll,
    kl, tokens), so runs of one corpus each pool like one run: ΔPPL and KL
    by tokens, and the 95% bootstrap interval over all their windows.
    Groups without per-window sums keep the "all" row they came with."""
    groups = defaultdict(list)
    for r in rows:
        if r["corpus"] not in ("all", "passkey") and r.get("per_window"):
            groups[(r.get("engine", "kvq"), r["scheme"], r["context"])].append(r)
    pooled = {}
    for key, parts in groups.items():
        parts.sort(key=lambda r: r["corpus"])
        windows = [w for r in parts for w in r["per_window"]]
        row = {k: v for k, v in parts[0].items() if k not in ("per_window", "window_indices")}
        row.update({"corpus": "all", "corpora": [r["corpus"] for r in parts]})
        bits = [r["bits_per_element"] for r in parts if r.get("bits_per_element") is not None]
        if bits:
            row["bits_per_element"] = sum(bits) / len(bits)
        pooled[key] = with_pooled_figures(row, windows)
    out = [r for r in rows if not (r["corpus"] == "all" and
                                   (r.get("engine", "kvq"), r["scheme"], r["context"]) in pooled)]
    return out + list(pooled.values())


def frontier_rows(rows, context, corpus="all"):
    """The rows of one context, kvq first, each engine's by falling bits."""
    sel = [r for r in rows if r["corpus"] == corpus and r["context"] == context and "ppl" in r]
    sel.sort(key=lambda r: (r.get("engine", "kvq") != "kvq", -r.get("bits_per_element", 0),
                            r["scheme"]))
    return sel


def frontier_table(rows, contexts=None):
    """The frontier: one markdown table per context."""
    out = []
    contexts = contexts or sorted(GOAL_CONTEXTS)
    for ctx in contexts:
        sel = frontier_rows(rows, ctx)
        if not sel:
            continue
        corpora = sorted({r["corpus"] for r in rows if r["context"] == ctx and "ppl" in r}
                         - {"all", "passkey"})
        out.append(f"\n**{ctx} tokens** (pooled over {', '.join(corpora)})\n")
        out.append("| engine | scheme | family | bits/elem | windows | ΔPPL % [95% CI] | KL [95% CI] | "
                   + " | ".join(f"{c} ΔPPL %" for c in corpora) + " | passkey |")
        out.append("|---|---|---|---:|---:|---:|---:|" + "---:|" * len(corpora) + "---:|")
        for r in sel:
            engine = r.get("engine", "kvq")
            per = []
            for c in corpora:
                one = next((x for x in rows if x.get("engine", "kvq") == engine
                            and x["scheme"] == r["scheme"] and x["corpus"] == c
                            and x["context"] == ctx and "ppl" in x), None)
                per.append(fmt(one and one["delta_ppl_pct"], "+.2f"))
            # A row pooled over fewer corpora than the context's (a run
            # stopped early) says which, beside its window count.
            windows = str(r.get("windows", 1))
            if r.get("corpora") and sorted(r["corpora"]) != corpora:
                windows += f' ({", ".join(r["corpora"])} only)'
            out.append(f'| {engine} | `{r["scheme"]}` | {family(r)} '
                       f'| {fmt(r.get("bits_per_element"), ".2f")} | {windows} '
                       f'| {with_ci(r, "delta_ppl_pct", "+.2f")} | {with_ci(r, "kl_mean", ".4f")} '
                       f'| {" | ".join(per)} | {passkey_for(rows, engine, r["scheme"], ctx)} |')
    return out


def goal_windows(rows, row, context):
    """Whether `row` (a pooled row) was measured on at least GOAL_MIN_WINDOWS
    windows of every corpus the goal at `context` pools."""
    def windows(corpus):
        return max((r.get("windows", 1) for r in rows
                    if r.get("engine", "kvq") == row.get("engine", "kvq")
                    and r["scheme"] == row["scheme"] and r["corpus"] == corpus
                    and r["context"] == context and "ppl" in r), default=0)
    return all(windows(c) >= GOAL_MIN_WINDOWS for c in GOAL_CONTEXTS[context])


def goal_pick(rows, context, max_bits, screened=False):
    """The kvq format with the lowest pooled ΔPPL within `max_bits` at
    `context` among those measured on the goal's windows (with `screened`,
    among those measured on fewer), or None."""
    cands = [r for r in frontier_rows(rows, context)
             if r.get("engine", "kvq") == "kvq" and r["scheme"] != "fp16"
             and r.get("bits_per_element", 99) <= max_bits
             and goal_windows(rows, r, context) != screened]
    return min(cands, key=lambda r: r["delta_ppl_pct"]) if cands else None


def covered(rows, context):
    """Whether the context's pooled rows cover every corpus its goal asks for."""
    have = {r["corpus"] for r in rows if r["context"] == context and "ppl" in r}
    return all(c in have for c in GOAL_CONTEXTS[context])


def goals(rows):
    """Each goal of the frontier: met, not met (with the measured bound) or
    not measured, per context."""
    out = ["\n| goal | context | best kvq format within the budget | bits | ΔPPL % [95% CI] | status |",
           "|---|---:|---|---:|---:|---|"]
    for max_bits, max_dppl in GOALS:
        name = f"≤ {max_bits} bits, ΔPPL ≤ {max_dppl}%"
        for ctx in GOAL_CONTEXTS:
            if not covered(rows, ctx):
                out.append(f"| {name} | {ctx} | – | – | – | not measured |")
                continue
            pick = goal_pick(rows, ctx, max_bits)
            screen = goal_pick(rows, ctx, max_bits, screened=True)
            if pick is None and screen is not None:
                out.append(f'| {name} | {ctx} | none on ≥ {GOAL_MIN_WINDOWS} windows per corpus; '
                           f'screened: `{screen["scheme"]}` | {screen["bits_per_element"]:.2f} '
                           f'| {with_ci(screen, "delta_ppl_pct", "+.2f")} '
                           f'({screen.get("windows", 1)} windows) | not measured |')
                continue
            if pick is None:
                cheapest = min((r for r in frontier_rows(rows, ctx)
                                if r.get("engine", "kvq") == "kvq" and r["scheme"] != "fp16"),
                               key=lambda r: r.get("bits_per_element", 99), default=None)
                what = (f'none measured; the fewest bits: `{cheapest["scheme"]}` '
                        f'{cheapest["bits_per_element"]:.2f}' if cheapest else "none measured")
                out.append(f"| {name} | {ctx} | {what} | – | – | not met: no format "
                           f"≤ {max_bits} bits |")
                continue
            dppl = pick["delta_ppl_pct"]
            ci = pick.get("delta_ppl_pct_ci95")
            if dppl <= max_dppl:
                status = "met" + ("" if not ci or ci[1] <= max_dppl
                                  else f" (the interval reaches {ci[1]:+.2f})")
            else:
                status = f"not met: best {dppl:+.2f}%" + (f", interval from {ci[0]:+.2f}"
                                                           if ci else "")
            if screen is not None and screen["delta_ppl_pct"] < dppl:
                status += (f'; screened on {screen.get("windows", 1)} windows: '
                           f'`{screen["scheme"]}` {screen["bits_per_element"]:.2f} bits '
                           f'{screen["delta_ppl_pct"]:+.2f}%')
            out.append(f'| {name} | {ctx} | `{pick["scheme"]}` | {pick["bits_per_element"]:.2f} '
                       f'| {with_ci(pick, "delta_ppl_pct", "+.2f")} | {status} |')
    out.extend(passkey_goal(rows))
    return out


def passkey_goal(rows):
    """Passkey retrieval equal to fp16's for every kvq format of at least
    3 bits on the frontier (its perplexity rows at that context), with at
    least 20 trials per context: not met as soon as one format with enough
    trials (and fp16 with enough) retrieves fewer; met only when every such
    format has them."""
    out = []
    contexts = sorted(set(GOAL_CONTEXTS) | {r["context"] for r in rows
                                            if r["corpus"] == "passkey"})
    for ctx in contexts:
        ref = next((r for r in rows if r.get("engine", "kvq") == "kvq" and r["scheme"] == "fp16"
                    and r["corpus"] == "passkey" and r["context"] == ctx), None)
        bits = {r["scheme"]: r.get("bits_per_element") for r in rows
                if r.get("engine", "kvq") == "kvq" and r["context"] == ctx and "ppl" in r}
        runs = [r for r in rows if r.get("engine", "kvq") == "kvq" and r["corpus"] == "passkey"
                and r["context"] == ctx and r["scheme"] != "fp16"
                and (bits.get(r["scheme"]) or 99) >= PASSKEY_MIN_BITS]
        name = f"passkey equal to fp16 (≥ {PASSKEY_MIN_BITS:g} bits, ≥ {PASSKEY_MIN_TRIALS} trials)"
        if ref is None or not runs:
            out.append(f"| {name} | {ctx} | – | – | – | not measured |")
            continue
        enough = [r for r in runs if r["passkey_trials"] >= PASSKEY_MIN_TRIALS]
        worse = ([r for r in enough if r["passkey_ok"] < ref["passkey_ok"]]
                 if ref["passkey_trials"] >= PASSKEY_MIN_TRIALS else [])
        few = min([ref["passkey_trials"]] + [r["passkey_trials"] for r in runs])
        tried = {r["scheme"] for r in runs}
        missing = sorted(s for s, b in bits.items()
                         if s != "fp16" and b is not None and b >= PASSKEY_MIN_BITS
                         and s not in tried)
        score = ", ".join(f'`{r["scheme"]}` {r["passkey_ok"]}/{r["passkey_trials"]}'
                          for r in runs)
        if worse:
            status = "not met: " + ", ".join(f'`{r["scheme"]}` {r["passkey_ok"]}' for r in worse)
        elif few < PASSKEY_MIN_TRIALS:
            status = f"not measured ({few} trials < {PASSKEY_MIN_TRIALS})"
        elif missing:
            status = (f"not measured for {len(missing)} of {len(missing) + len(runs)} formats "
                      f"≥ {PASSKEY_MIN_BITS:g} bits")
        else:
            status = "met"
        out.append(f'| {name} | {ctx} | fp16 {ref["passkey_ok"]}/{ref["passkey_trials"]}; '
                   f"{score} | – | – | {status} |")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--corpus", default="all")
    ap.add_argument("--metric", default="decode", choices=("decode", "prefill"),
                    help="perplexity metric of the tables (rows without one are prefill)")
    ap.add_argument("--frontier", action="store_true",
                    help="the frontier table and the goals instead (passkey rows, scored by "
                         "chunked prefill, are kept whatever the metric)")
    args = ap.parse_args()
    if args.frontier:
        rows = pool_corpora(load(args.results, args.metric)) + [
            r for r in load(args.results) if r["corpus"] == "passkey"]
        print("\n".join(frontier_table(rows) + goals(rows)))
        return 0
    rows = load(args.results, args.metric)
    print("\n".join(tables(rows, args.corpus) + targets(rows, args.corpus)))


if __name__ == "__main__":
    sys.exit(main())
