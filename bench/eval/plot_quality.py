#!/usr/bin/env python3
"""Plots KV-cache quality results of kvq-eval and the llama.cpp peer.

Reads one or more result JSON files, each {"rows": [...]} (or a bare list of
rows), where a row is
  {"engine": "kvq" | "llama.cpp", "scheme": "kivi4", "corpus": "kjv",
   "context": 2048, "delta_ppl_pct": 1.3, "kl_mean": 0.01,
   "bits_per_element": 4.5, ...}
and writes two PNGs to --out-dir:
  quality_dppl_vs_bits.png   ΔPPL (%) against bits per element, one point per
                             (engine, scheme) in one panel per context;
  quality_kl_vs_context.png  mean KL divergence against context, one line per
                             (engine, scheme).
Each point is the scheme's "all" row (every window of every corpus pooled by
tokens); --corpus plots one corpus instead. kvq's points are circles with
solid lines, llama.cpp's squares with dashed lines; each scheme has its own
colour.

With --frontier it writes one plot instead, quality_frontier.png: pooled
ΔPPL (decode metric) against bits per element with the 95% bootstrap
interval of each point as an error bar, a panel per context, marker by
family (KIVI, KVQuant-like, rotation, crq, llama.cpp), and the goals of
docs/QUALITY.md drawn as the region they allow.

Usage:
  python3 bench/eval/plot_quality.py results.json peer.json --out-dir docs/img
  python3 bench/eval/plot_quality.py --frontier kvq_frontier_*.json llamacpp_frontier.json \
      --out-dir docs/img
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

try:
    import matplotlib
except ImportError:  # A plotting-only dependency: not needed by CI.
    sys.exit("plot_quality: matplotlib is missing: python3 -m pip install matplotlib")

matplotlib.use("Agg")  # Files only; no display needed.
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MultipleLocator  # noqa: E402

# The frontier's families and goals are quality_tables.py's (same directory).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality_tables import GOALS, family, merge_windows, metrics_of, pool_corpora  # noqa: E402

ENGINE_STYLE = {
    "kvq": {"marker": "o", "linestyle": "-"},
    "llama.cpp": {"marker": "s", "linestyle": "--"},
}
OTHER_STYLE = {"marker": "^", "linestyle": ":"}
# Reference caches: ΔPPL and KL are zero by definition, so they anchor the
# ΔPPL plot but would only be noise on the KL plot.
REFERENCE_SCHEMES = {"fp16", "f16", "bf16", "fp32"}


def load_rows(paths: list[Path], metric: str | None = None) -> list[dict]:
    """All rows of all files (only those of `metric` when given; rows
    without one were scored on chunked prefill, and llama.cpp's stand for
    both: quality_tables.metrics_of); rows without an engine count as kvq's, and a
    row measured again (same engine, scheme, metric, corpus, context) is
    merged window by window with the earlier one, or keeps the later file's
    figures without per-window sums (quality_tables.merge_windows)."""
    rows = {}
    for p in paths:
        data = json.loads(p.read_text())
        file_rows = data["rows"] if isinstance(data, dict) else data
        for r in file_rows:
            r = dict(r)
            r.setdefault("engine", "kvq")
            if metric is not None and metric not in metrics_of(r):
                continue
            r.setdefault("metric", "prefill")
            if metric is not None:
                r["metric"] = metric
            key = (r["engine"], r["scheme"], r["metric"], r.get("corpus"), r.get("context"))
            rows[key] = merge_windows(rows[key], r) if key in rows else r
    return list(rows.values())


def average(rows: list[dict], field: str, corpus: str | None):
    """(engine, scheme, context) -> (mean of field over corpora, bits, corpora)."""
    acc: dict[tuple[str, str, int], list] = defaultdict(list)
    bits: dict[tuple[str, str, int], float] = {}
    for r in rows:
        if corpus is not None and r.get("corpus") != corpus:
            continue
        value = r.get(field)
        if value is None:
            continue
        key = (r["engine"], r["scheme"], int(r["context"]))
        acc[key].append(float(value))
        if r.get("bits_per_element") is not None:
            bits[key] = float(r["bits_per_element"])
    return {k: (sum(v) / len(v), bits.get(k), len(v)) for k, v in acc.items()}


def scheme_colours(rows: list[dict]) -> dict[tuple[str, str], tuple]:
    """A distinct colour per (engine, scheme), in a stable order, the same in
    both plots."""
    names = sorted({(r["engine"], r["scheme"]) for r in rows})
    cmap = plt.get_cmap("tab20" if len(names) > 10 else "tab10")
    return {n: cmap(i % cmap.N) for i, n in enumerate(names)}


def label(engine: str, scheme: str) -> str:
    """Legend text: llama.cpp's cache types are named as such."""
    return f"llama.cpp {scheme}" if engine == "llama.cpp" else scheme


def engine_handles(engines) -> list[Line2D]:
    """Legend entries that explain the marker and line style of each engine."""
    return [Line2D([], [], color="0.3", label=e,
                   **ENGINE_STYLE.get(e, OTHER_STYLE)) for e in sorted(engines)]


def place_labels(ax, items: list[tuple[float, float, str]],
                 fontsize: float = 7.0) -> None:
    """Writes each label next to its point, moving it up or down when it would
    overlap one already placed (schemes of nearly equal bits and ΔPPL are
    common: fp16 and f16, kivi4 and q4_0)."""
    fig = ax.figure
    fig.canvas.draw()  # Fixes the axis limits so data map to points.
    to_pt = 72.0 / fig.dpi
    # The markers themselves are obstacles too.
    placed: list[tuple[float, float, float, float]] = []
    for x, y, _ in items:
        px, py = (v * to_pt for v in ax.transData.transform((x, y)))
        placed.append((px - 4, py - 4, px + 4, py + 4))
    # Offsets in points, tried in order.
    offsets = [(5, 4), (5, -11), (5, 13), (5, -20), (5, 22), (5, -29),
               (5, 31), (5, -38)]
    for x, y, text in sorted(items, key=lambda t: (t[0], -t[1])):
        px, py = (v * to_pt for v in ax.transData.transform((x, y)))
        w, h = 0.56 * fontsize * len(text), 1.15 * fontsize
        for dx, dy in offsets:
            box = (px + dx, py + dy, px + dx + w, py + dy + h)
            if all(box[2] <= b[0] or box[0] >= b[2] or box[3] <= b[1]
                   or box[1] >= b[3] for b in placed):
                break
        placed.append(box)
        # A moved label gets a thin leader line back to its point.
        leader = (None if (dx, dy) == offsets[0] else
                  {"arrowstyle": "-", "color": "0.55", "linewidth": 0.5,
                   "shrinkA": 0, "shrinkB": 3})
        ax.annotate(text, (x, y), fontsize=fontsize, xytext=(dx, dy),
                    textcoords="offset points", arrowprops=leader)


def plot_dppl(points, contexts: list[int], colours, title_note: str,
              out: Path, annotate: bool) -> None:
    """ΔPPL (%) vs bits per element, a panel per context."""
    fig, axes = plt.subplots(1, len(contexts), figsize=(6.2 * len(contexts), 5.4),
                             sharey=True, squeeze=False)
    handles = {}
    for ax, ctx in zip(axes[0], contexts):
        here = {k: v for k, v in points.items() if k[2] == ctx and v[1] is not None}
        for (engine, scheme, _), (dppl, bits, _) in sorted(here.items()):
            style = ENGINE_STYLE.get(engine, OTHER_STYLE)
            h = ax.scatter(bits, dppl, s=55, marker=style["marker"],
                           color=colours[(engine, scheme)], edgecolor="black",
                           linewidth=0.5, zorder=3)
            handles[(engine, scheme)] = h
        # symlog: ΔPPL spans 0 (the reference) to tens of percent, and can be
        # slightly negative; linear within ±0.1 %, logarithmic beyond.
        if here:
            # Room on the right for the labels of the widest (16-bit) points.
            xs = [v[1] for v in here.values()]
            ax.set_xlim(min(xs) - 0.8, max(xs) + 0.25 * (max(xs) - min(xs)) + 1.0)
        ax.xaxis.set_major_locator(MultipleLocator(2))  # Whole bit counts.
        ax.set_yscale("symlog", linthresh=0.1)
        ax.axhline(0.0, color="0.6", linewidth=0.8)
        ax.set_xlabel("bits per element (K and V, all overheads)")
        ax.set_title(f"context {ctx}")
        ax.grid(True, which="both", alpha=0.3)
        if not here:
            ax.text(0.5, 0.5, "no rows", transform=ax.transAxes, ha="center")
    # symlog autoscaling leaves the extreme points on the frame: pad by a
    # factor (the panels share the y axis).
    ys = [v[0] for k, v in points.items() if k[2] in contexts and v[1] is not None]
    if ys:
        axes[0][0].set_ylim(min(-0.05, 1.8 * min(ys)), max(0.2, 1.8 * max(ys)))
    axes[0][0].set_ylabel("ΔPPL vs fp16 cache (%)")
    fig.suptitle(f"Perplexity cost of the KV-cache format{title_note}")
    legend1 = fig.legend([handles[k] for k in sorted(handles)],
                         [label(*k) for k in sorted(handles)],
                         loc="center left", bbox_to_anchor=(1.0, 0.55),
                         fontsize=8, title="scheme", frameon=False)
    fig.add_artist(legend1)
    fig.legend(handles=engine_handles({k[0] for k in handles}),
               loc="center left", bbox_to_anchor=(1.0, 0.15), fontsize=8,
               title="engine", frameon=False)
    fig.tight_layout()
    # Labels last: their overlap test needs the final axis layout.
    if annotate:
        for ax, ctx in zip(axes[0], contexts):
            place_labels(ax, [(v[1], v[0], label(k[0], k[1]))
                              for k, v in points.items()
                              if k[2] == ctx and v[1] is not None])
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)


def plot_kl(points, colours, title_note: str, out: Path) -> None:
    """Mean KL divergence vs context, a line per scheme."""
    series: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for (engine, scheme, ctx), (kl, _, _) in points.items():
        if scheme in REFERENCE_SCHEMES or kl <= 0:
            continue
        series[(engine, scheme)].append((ctx, kl))
    fig, ax = plt.subplots(figsize=(8.5, 5.4))
    contexts = sorted({c for pts in series.values() for c, _ in pts})
    for key in sorted(series):
        pts = sorted(series[key])
        style = ENGINE_STYLE.get(key[0], OTHER_STYLE)
        ax.plot([c for c, _ in pts], [k for _, k in pts], color=colours[key],
                marker=style["marker"], linestyle=style["linestyle"],
                markeredgecolor="black", markeredgewidth=0.5,
                label=label(*key))
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts or [512, 2048, 8192])
    ax.set_xticklabels([str(c) for c in (contexts or [512, 2048, 8192])])
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("mean KL(fp16 ‖ scheme) per token (nats)")
    ax.set_title(f"Next-token distribution drift vs context{title_note}")
    ax.grid(True, which="both", alpha=0.3)
    if not series:
        ax.text(0.5, 0.5, "no KL rows", transform=ax.transAxes, ha="center")
    fig.tight_layout()
    if series:
        # Figure legends (not axes ones) so the tight bounding box keeps them.
        fig.legend(*ax.get_legend_handles_labels(), loc="center left",
                   bbox_to_anchor=(1.0, 0.6), fontsize=8, title="scheme",
                   frameon=False)
        fig.legend(handles=engine_handles({k[0] for k in series}),
                   loc="center left", bbox_to_anchor=(1.0, 0.15), fontsize=8,
                   title="engine", frameon=False)
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)


# Families of the frontier plot: marker and colour, in legend order.
FAMILIES = [
    ("reference", "D", "0.35"),
    ("KIVI", "o", "tab:blue"),
    ("KVQuant-like (nuq levels)", "^", "tab:orange"),
    ("Hadamard rotation + uniform levels", "v", "tab:purple"),
    ("crq (calibrated, rotated, Lloyd-Max)", "*", "tab:red"),
    ("llama.cpp cache", "s", "tab:green"),
]
def plot_frontier(rows: list[dict], contexts: list[int], out: Path,
                  corpus: str = "all", max_bits: float = 9.0) -> None:
    """ΔPPL against bits with bootstrap error bars, goals shaded; formats
    wider than max_bits (fp16) are left out of the axes."""
    fig, axes = plt.subplots(1, len(contexts), figsize=(7.2 * len(contexts), 5.6),
                             sharey=True, squeeze=False)
    used = set()
    for ax, ctx in zip(axes[0], contexts):
        sel = [r for r in rows if r.get("corpus") == corpus and r.get("context") == ctx
               and r.get("delta_ppl_pct") is not None
               and r.get("bits_per_element") is not None
               and r["bits_per_element"] <= max_bits]
        # The goals: each allows the rectangle left of its budget, under its bound.
        for bits, dppl in GOALS:
            ax.fill_between([0, bits], -1, dppl, color="tab:green", alpha=0.07, zorder=0)
            ax.plot([bits, bits, 0], [-1, dppl, dppl], color="tab:green", linewidth=0.9,
                    linestyle=":", zorder=1)
            ax.annotate(f"goal ≤{bits:g} b, ≤{dppl:g}%", (bits, dppl), fontsize=7,
                        color="tab:green", xytext=(-4, 3), textcoords="offset points",
                        ha="right")
        items = []
        for r in sel:
            fam = family(r)
            used.add(fam)
            marker, colour = next(((m, c) for f, m, c in FAMILIES if f == fam), ("x", "k"))
            x, y = r["bits_per_element"], r["delta_ppl_pct"]
            ci = r.get("delta_ppl_pct_ci95")
            yerr = [[max(0.0, y - ci[0])], [max(0.0, ci[1] - y)]] if ci else None
            ax.errorbar([x], [y], yerr=yerr, fmt=marker, color=colour,
                        markeredgecolor="black", markeredgewidth=0.5, markersize=8,
                        ecolor=colour, elinewidth=1.2, capsize=3, zorder=3)
            items.append((x, y, label(r["engine"], r["scheme"])))
        ax.set_yscale("symlog", linthresh=0.5, linscale=0.6)
        ax.axhline(0.0, color="0.6", linewidth=0.8)
        xs = [x for x, _, _ in items] or [2.0, 9.0]
        ax.set_xlim(max(0.0, min(xs + [2.0]) - 0.4), max(xs + [5.0]) + 2.2)
        ax.xaxis.set_major_locator(MultipleLocator(0.5))
        ax.set_xlabel("bits per element (K and V, every overhead, from the allocation)")
        ax.set_title(f"context {ctx}, decode metric, "
                     + ("pooled over the corpora" if corpus == "all" else corpus))
        ax.grid(True, which="both", alpha=0.3)
        if not items:
            ax.text(0.5, 0.5, "no rows", transform=ax.transAxes, ha="center")
        ax._frontier_items = items  # Labelled once the layout is final.
    ys = [r["delta_ppl_pct_ci95"][1] if r.get("delta_ppl_pct_ci95") else r["delta_ppl_pct"]
          for r in rows if r.get("context") in contexts and r.get("corpus") == corpus
          and r.get("delta_ppl_pct") is not None]
    axes[0][0].set_ylim(-0.3, max(12.0, 1.5 * max(ys, default=10.0)))
    axes[0][0].set_ylabel("ΔPPL vs fp16 cache (%), 95% bootstrap interval over windows")
    handles = [Line2D([], [], marker=m, color=c, markeredgecolor="black", linestyle="",
                      markersize=8, label=f) for f, m, c in FAMILIES if f in used]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
               title="family", frameon=False)
    fig.suptitle("Quality frontier: perplexity cost of the KV-cache format against its size")
    fig.tight_layout()
    for ax in axes[0]:
        place_labels(ax, ax._frontier_items, fontsize=6.5)
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str]) -> int:
    """Reads the result files and writes both plots."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="result JSON files")
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--contexts", default="2048,8192",
                    help="contexts of the ΔPPL panels (default 2048,8192; "
                         "those without rows are dropped)")
    ap.add_argument("--corpus", default="all",
                    help="corpus to plot (default: 'all', the rows pooled over "
                         "corpora by tokens that kvq-eval and the peer write)")
    ap.add_argument("--metric", default="decode", choices=("decode", "prefill"),
                    help="perplexity metric to plot (rows without one are prefill)")
    ap.add_argument("--no-labels", action="store_true",
                    help="no scheme names next to the ΔPPL points")
    ap.add_argument("--frontier", action="store_true",
                    help="write the one frontier plot (quality_frontier.png) instead")
    args = ap.parse_args(argv)

    rows = load_rows(args.results, args.metric)
    if not rows:
        ap.error("no rows in the input")
    if args.frontier:
        # One-corpus runs pool into "all" rows with their intervals.
        rows = pool_corpora([r for r in rows if r.get("corpus") != "passkey"])
        wanted = [int(c) for c in args.contexts.split(",") if c]
        contexts = [c for c in wanted if any(r.get("context") == c and r.get("corpus") ==
                                             args.corpus for r in rows)]
        if not contexts:
            ap.error(f"no {args.corpus} rows at contexts {args.contexts}")
        args.out_dir.mkdir(parents=True, exist_ok=True)
        out = args.out_dir / "quality_frontier.png"
        plot_frontier(rows, contexts, out, args.corpus)
        print(f"plot_quality: wrote {out}")
        return 0
    corpora = sorted({r.get("corpus", "?") for r in rows
                      if args.corpus is None or r.get("corpus") == args.corpus})
    note = (f" ({args.corpus})" if args.corpus != "all"
            else " (pooled over the corpora)")

    dppl = average(rows, "delta_ppl_pct", args.corpus)
    kl = average(rows, "kl_mean", args.corpus)
    wanted = [int(c) for c in args.contexts.split(",") if c]
    contexts = [c for c in wanted if any(k[2] == c for k in dppl)]
    if not contexts:  # Fall back to whatever contexts the rows have.
        contexts = sorted({k[2] for k in dppl})[-2:]

    args.out_dir.mkdir(parents=True, exist_ok=True)
    out_a = args.out_dir / "quality_dppl_vs_bits.png"
    out_b = args.out_dir / "quality_kl_vs_context.png"
    colours = scheme_colours(rows)
    plot_dppl(dppl, contexts, colours, note, out_a,
              annotate=not args.no_labels)
    plot_kl(kl, colours, note, out_b)
    print(f"plot_quality: wrote {out_a} and {out_b}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
