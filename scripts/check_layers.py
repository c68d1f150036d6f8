#!/usr/bin/env python3
"""Fails when a source file includes from a layer above its own.

kvq's layers point one way: kernels at the bottom, the service and the client
on them, the benchmarks on top of those, the tests over everything. LAYERS is
the one table that says so; a file may include its own layer and the layers
below it, never one above nor a sibling on its level (the service and the
client do not know each other: they meet in the proto).

Run by ctest (check_layers, label "lint"), so CI fails on an upward include:

    scripts/check_layers.py [--root DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from typing import Iterator, NamedTuple

# Top-level folder -> rank. Lower ranks may not include higher or equal-rank
# other folders.
LAYERS: dict[str, int] = {
    "kernels": 0,    # storage, quantization, attention; the backends
    "synthetic": 1,  # seeded synthetic K/V (the bench data set, kvq-demo's prompt)
    "proto": 1,      # kvq.v1 messages and stubs
    "service": 2,    # the gRPC server, the page store, the server's transports
    "client": 2,     # the C++ client, CLI, demo and the client's device peers
    "bench": 3,      # kvq-bench, kvq-eval
    "tests": 4,      # every test
}

# Include prefixes that are not folders of the tree: generated headers.
ALIASES: dict[str, str] = {
    "kvq/": "proto",  # proto/kvq/v1/kvq.proto -> "kvq/v1/kvq.pb.h"
}

SOURCE_SUFFIXES = {".h", ".cc", ".inc", ".cu", ".cuh", ".proto"}
INCLUDE_RE = re.compile(r'^\s*(?:#\s*include|import)\s+"([^"]+)"')


class Violation(NamedTuple):
    path: str
    line: int
    target: str
    from_layer: str
    to_layer: str

    def __str__(self) -> str:
        return (f"{self.path}:{self.line}: layer '{self.from_layer}' (rank "
                f"{LAYERS[self.from_layer]}) includes \"{self.target}\" from layer "
                f"'{self.to_layer}' (rank {LAYERS[self.to_layer]})")


def layer_of_include(target: str) -> str | None:
    for prefix, layer in ALIASES.items():
        if target.startswith(prefix):
            return layer
    top = target.split("/", 1)[0]
    return top if top in LAYERS and "/" in target else None


def allowed(from_layer: str, to_layer: str) -> bool:
    return from_layer == to_layer or LAYERS[to_layer] < LAYERS[from_layer]


def source_files(root: pathlib.Path) -> Iterator[pathlib.Path]:
    for layer in LAYERS:
        base = root / layer
        if base.is_dir():
            for path in sorted(base.rglob("*")):
                if path.suffix in SOURCE_SUFFIXES and path.is_file():
                    yield path


def violations(root: pathlib.Path) -> list[Violation]:
    found: list[Violation] = []
    for path in source_files(root):
        rel = path.relative_to(root)
        from_layer = rel.parts[0]
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            match = INCLUDE_RE.match(line)
            if not match:
                continue
            to_layer = layer_of_include(match.group(1))
            if to_layer is not None and not allowed(from_layer, to_layer):
                found.append(Violation(rel.as_posix(), number, match.group(1), from_layer,
                                       to_layer))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=pathlib.Path,
                        default=pathlib.Path(__file__).resolve().parent.parent,
                        help="the source tree to check (default: this script's repository)")
    args = parser.parse_args(argv)
    root: pathlib.Path = args.root.resolve()
    if not (root / "kernels").is_dir():
        print(f"check_layers: {root} has no kernels/ folder; pass the source tree as --root",
              file=sys.stderr)
        return 2
    found = violations(root)
    for violation in found:
        print(violation)
    order = " < ".join(
        ", ".join(name for name, rank in LAYERS.items() if rank == r)
        for r in sorted(set(LAYERS.values())))
    if found:
        print(f"check_layers: {len(found)} include(s) from a layer above their own "
              f"(order: {order})")
        return 1
    print(f"check_layers: no upward includes (order: {order})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
