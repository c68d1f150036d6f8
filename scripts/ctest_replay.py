#!/usr/bin/env python3
"""Replays the per-test times of a ctest log on N slots: how long the test
phase takes with ctest's order on a fresh clone (no timing history: tests
start in descending COST, then in declaration order) against declaration
order alone and against the sum of the times / N.

    scripts/ctest_replay.py ci.log --build build --jobs 2
    scripts/ctest_replay.py build/Testing/Temporary/CTestCostData.txt --build build \
        --scale 'attention_test\.(AVX3|AVX2|SCALAR)=0.16'

The log is ctest's output (`Test #N: name .... Passed  1.23 sec` lines,
several runs' worth allowed) or the CTestCostData.txt a ctest run leaves
in its build tree (each test's mean time; needs --build, whose declaration
order it takes); --build reads each test's COST and RESOURCE_LOCK from that
build tree (`ctest --show-only=json-v1`). --scale REGEX=FACTOR multiplies
the times of the tests whose whole name matches (a cut measured on its own
applied to a full run's times). A test waits while another holding one of
its locks runs, as in ctest. Times are wall times of that run, so a test
that used both cores counts as one slot.
"""
from __future__ import annotations

import argparse
import heapq
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field

LINE = re.compile(r"Test +#(\d+): (\S+) .*?(Passed|Skipped|Failed|\*\*\*\S+|Not Run)\s+([\d.]+) sec")


@dataclass
class Test:
    index: int
    name: str
    seconds: float
    cost: float = 0.0
    locks: list[str] = field(default_factory=list)


TOTAL = re.compile(r"Total Test time \(real\) = +([\d.]+) sec")


def parse_log(path: str) -> list[tuple[list[Test], float]]:
    """Each ctest run of the log: its tests and its measured wall time."""
    runs: list[tuple[list[Test], float]] = []
    tests: list[Test] = []
    with open(path, errors="replace") as f:
        for line in f:
            if m := LINE.search(line):
                tests.append(Test(int(m.group(1)), m.group(2), float(m.group(4))))
            elif (m := TOTAL.search(line)) and tests:
                runs.append((sorted(tests, key=lambda t: t.index), float(m.group(1))))
                tests = []
    if tests:
        runs.append((sorted(tests, key=lambda t: t.index), float("nan")))
    return runs


def build_tests(build: str) -> list[dict]:
    out = subprocess.run(["ctest", "--show-only=json-v1"], cwd=build, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)["tests"]


def parse_cost_data(path: str, build: str) -> list[tuple[list[Test], float]]:
    """CTestCostData.txt (`name runs mean` lines, then `---` and the failed
    tests) as one run, numbered in the build tree's declaration order.
    Names are cut at the first space in both, as ctest writes them there
    (a parameterized gtest case's name ends in "  # GetParam() = ...")."""
    mean = {}
    with open(path) as f:
        for line in f:
            if line.startswith("---"):
                break
            parts = line.split()
            if len(parts) == 3:
                mean[parts[0]] = float(parts[2])
    names = [t["name"].split()[0] for t in build_tests(build)]
    tests = [Test(i + 1, n, mean[n]) for i, n in enumerate(names) if n in mean]
    return [(tests, float("nan"))] if tests else []


def read_properties(build: str, tests: list[Test]) -> None:
    props = {}
    for t in build_tests(build):
        # The logs' names end at the first space too.
        props[t["name"].split()[0]] = {p["name"]: p["value"] for p in t.get("properties", [])}
    for t in tests:
        p = props.get(t.name, {})
        t.cost = float(p.get("COST", 0.0))
        t.locks = list(p.get("RESOURCE_LOCK", []))


def replay(order: list[Test], jobs: int) -> float:
    """List scheduling: each free slot takes the first waiting test whose
    locks are free; returns when the last test ends."""
    waiting = list(order)
    running: list[tuple[float, int, Test]] = []  # (end, seq, test)
    held: set[str] = set()
    now = 0.0
    seq = 0
    while waiting or running:
        started = True
        while started and len(running) < jobs and waiting:
            started = False
            for i, t in enumerate(waiting):
                if not held.intersection(t.locks):
                    waiting.pop(i)
                    held.update(t.locks)
                    heapq.heappush(running, (now + t.seconds, seq, t))
                    seq += 1
                    started = True
                    break
        end, _, t = heapq.heappop(running)
        now = end
        held.difference_update(t.locks)
    return now


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--build", help="build tree to read COST and RESOURCE_LOCK from")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--scale", action="append", default=[], metavar="REGEX=FACTOR",
                    help="multiply the times of the tests whose name matches REGEX")
    args = ap.parse_args()
    if args.log.endswith("CTestCostData.txt"):
        if not args.build:
            print("a CTestCostData.txt needs --build (the declaration order)", file=sys.stderr)
            return 2
        runs = parse_cost_data(args.log, args.build)
    else:
        runs = parse_log(args.log)
    if not runs:
        print(f"{args.log}: no ctest result lines", file=sys.stderr)
        return 1
    # The model against the log: each run replayed in declaration order (a
    # fresh clone's order without COST) beside the wall time ctest reported.
    for i, (run, measured) in enumerate(runs):
        print(f"run {i + 1}: {len(run)} tests, replayed in declaration order on {args.jobs} "
              f"slots {replay(run, args.jobs):.0f} s, measured {measured:.0f} s")
    # Every test of the log as one run (scripts/test.sh runs them so).
    tests = sorted((t for run, _ in runs for t in run), key=lambda t: t.index)
    for rule in args.scale:
        pattern, _, factor = rule.rpartition("=")
        matched = [t for t in tests if re.fullmatch(pattern, t.name)]
        for t in matched:
            t.seconds *= float(factor)
        print(f"--scale {rule}: {len(matched)} tests")
    if args.build:
        read_properties(args.build, tests)
    total = sum(t.seconds for t in tests)
    declared = replay(tests, args.jobs)
    by_cost = replay(sorted(tests, key=lambda t: (-t.cost, t.index)), args.jobs)
    print(f"all {len(tests)} tests, {total:.0f} s of test time, as one run on {args.jobs} slots: "
          f"declaration order {declared:.0f} s, COST order {by_cost:.0f} s, "
          f"sum / {args.jobs} {total / args.jobs:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
