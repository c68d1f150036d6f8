#!/usr/bin/env python3
"""Compares two kvq-bench binaries on `kvq-bench kernels`, run alternately.

A change that should not move the kernels (a refactor) is shown not to by
running the binary built before it and the one built after it in turns on
the same machine, so that load that comes and goes hits both alike:

    bench/ab_kernels.py --before OLD/kvq-bench --after NEW/kvq-bench \
        --rounds 5 -- --quick --schemes=fp16,kivi2,kivi4 --contexts=4096

Per row (layout, context, scheme): the median decode_us of each binary over
the rounds, their ratio (after / before), and whether the attention error
is the same (the same code computes the same numbers). On a shared machine
read the ratios, not the absolute times. `--stat min` takes each run's
fastest call (decode_us_min) instead of its median: on a loaded machine a
call of a few milliseconds is preempted in most reps when the schemes' turns
fall in step with the scheduler's time slice, and the fastest call is the
one that ran undisturbed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

Key = tuple[str, int, str]


def run(binary: str, args: list[str]) -> dict[Key, dict[str, Any]]:
    proc = subprocess.run([binary, "kernels", "--json", *args], check=True,
                          capture_output=True, text=True)
    doc = json.loads(proc.stdout)
    return {(r["layout"], r["context"], r["scheme"]): r for r in doc["rows"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="kvq-bench built before the change")
    parser.add_argument("--after", required=True, help="kvq-bench built after the change")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each, alternating")
    parser.add_argument("--stat", choices=["median", "min"], default="median",
                        help="per run: the median call (decode_us) or the fastest (decode_us_min)")
    parser.add_argument("bench_args", nargs="*", help="arguments of `kvq-bench kernels`")
    args = parser.parse_args(argv)

    times: dict[str, dict[Key, list[float]]] = {"before": {}, "after": {}}
    errors: dict[str, dict[Key, float]] = {"before": {}, "after": {}}
    for i in range(args.rounds):
        # Alternate which goes first, so neither always runs on a warmer cache.
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        for which in order:
            rows = run(getattr(args, which), args.bench_args)
            for key, row in rows.items():
                field = "decode_us" if args.stat == "median" else "decode_us_min"
                times[which].setdefault(key, []).append(float(row[field]))
                errors[which][key] = float(row["attn_rel_error"])
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)

    stat = "decode_us" if args.stat == "median" else "decode_us_min"
    print(f"# median {stat} over {args.rounds} alternating runs of each; "
          f"kvq-bench kernels {' '.join(args.bench_args)}")
    print(f"{'layout':8} {'context':>7} {'scheme':28} {'before_us':>10} {'after_us':>10} "
          f"{'after/before':>12} {'same_error':>10}")
    ratios = []
    same_all = True
    for key in sorted(times["before"]):
        before = statistics.median(times["before"][key])
        after = statistics.median(times["after"].get(key, [float("nan")]))
        ratio = after / before if before > 0 else float("nan")
        ratios.append(ratio)
        same = errors["before"][key] == errors["after"].get(key)
        same_all = same_all and same
        print(f"{key[0]:8} {key[1]:>7} {key[2]:28} {before:>10.1f} {after:>10.1f} "
              f"{ratio:>12.3f} {str(same):>10}")
    print(f"# median of the row ratios: {statistics.median(ratios):.3f}; "
          f"attention errors identical in every row: {same_all}")
    return 0 if same_all else 1


if __name__ == "__main__":
    sys.exit(main())
