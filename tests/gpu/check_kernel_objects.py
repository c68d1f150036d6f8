#!/usr/bin/env python3
"""Reads the built CUDA kernels and fails on a memory-system regression.

For every kernel of cuda_attention.cu, cuda_quantize.cu and cuda_crq.cu in the given
objects or static libraries (cuobjdump reads both):
  - at most MAX_REGISTERS registers per thread (cuobjdump -res-usage REG),
  - no local memory: STACK and LOCAL are 0 (a spill or a dynamically
    indexed array lands there, and every access then goes through L1/L2),
  - a 128-bit global load (LDG.E.128...) or an asynchronous copy into
    shared memory (LDGSTS) in its SASS: the page and row loops read 16 bytes
    per instruction, not one element at a time.
docs/CUDA.md "Kernels" says why. Needs no GPU: ctest runs it wherever the
CUDA backend builds. cuobjdump and nvdisasm come with the CUDA toolkit or
the nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm wheels
(scripts/install_deps.sh installs the wheels when nvcc has no cuobjdump).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

MAX_REGISTERS = 128
# Mangled-name fragments of the source files whose kernels are checked.
SOURCES = ("cuda_attention_cu", "cuda_quantize_cu", "cuda_crq_cu")
VECTOR_LOAD = re.compile(r"\b(LDG\.E\.128(\.[A-Z]+)*|LDGSTS\.E(\.[A-Z0-9]+)*\.128)\b")


def find_tool(name: str, cuda_bin: str | None) -> str | None:
    """The tool from PATH, the CUDA toolkit, or the pip wheel's bin dir."""
    candidates = [shutil.which(name)]
    if cuda_bin:
        candidates.append(str(Path(cuda_bin) / name))
    for scheme_path in {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}:
        for sub in ("cu13", "cu12", "cuda_cuobjdump", "cuda_nvdisasm"):
            candidates.append(str(Path(scheme_path) / "nvidia" / sub / "bin" / name))
    user = sysconfig.get_path("purelib", f"{os.name}_user")
    if user:
        candidates.append(str(Path(user) / "nvidia" / "cu13" / "bin" / name))
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    return None


def template_args(args: str) -> list[str] | None:
    """The readable template arguments at the start of a mangled argument
    list: integers, float, half (unsigned short) and class templates named
    in the kernel's namespace (the split kernel's Math policy)."""
    if not args.startswith("I"):
        return None
    out: list[str] = []
    i = 1
    while i < len(args) and args[i] != "E":
        rest = args[i:]
        if m := re.match(r"Li(\d+)E", rest):
            out.append(m.group(1))
            i += m.end()
        elif m := re.match(r"N(?:S[0-9A-Z]*_)*(\d+)", rest):  # N <scope> <len><name> E
            n = int(m.group(1))
            out.append(rest[m.end():m.end() + n])
            i += m.end() + n + 1
        elif rest[0] in "ft":
            out.append("float" if rest[0] == "f" else "half")
            i += 1
        else:
            break
    return out


def kernel_label(mangled: str) -> str | None:
    """A short name for a kernel of the checked sources, else None."""
    if not any(s in mangled for s in SOURCES):
        return None
    # _ZN3kvq<n>_GLOBAL__N__<hash>_<file>_<hash><len><Name>...: the first
    # identifier after the file hash is the kernel's own name.
    m = re.search(r"_cu_[0-9a-f]{8}(\d+)", mangled)
    if not m:
        return mangled
    rest = mangled[m.end(1):]
    name = rest[: int(m.group(1))]
    targs = template_args(rest[int(m.group(1)):])
    return name + "<" + ", ".join(targs) + ">" if targs else name


def run_each(cuobjdump: str, flag: str, files: list[str], env: dict) -> str:
    """cuobjdump's output for each file in turn (it reads one file per call)."""
    return "\n".join(subprocess.run([cuobjdump, flag, f], check=True, capture_output=True,
                                    text=True, env=env).stdout for f in files)


def res_usage(cuobjdump: str, files: list[str], env: dict) -> dict[str, dict[str, int]]:
    out = run_each(cuobjdump, "-res-usage", files, env)
    usage: dict[str, dict[str, int]] = {}
    current = None
    for line in out.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            current = m.group(1)
            continue
        if current and "REG:" in line:
            usage[current] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)
                              if k in ("REG", "STACK", "LOCAL", "SHARED")}
            current = None
    return usage


def vector_loads(cuobjdump: str, files: list[str], env: dict) -> dict[str, int]:
    out = run_each(cuobjdump, "-sass", files, env)
    counts: dict[str, int] = {}
    current = None
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = m.group(1)
            counts.setdefault(current, 0)
            continue
        if current and VECTOR_LOAD.search(line):
            counts[current] += 1
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("objects", nargs="+", help="kvq_cuda objects or static library")
    parser.add_argument("--cuda-bin", help="the CUDA toolkit's bin directory")
    args = parser.parse_args()

    cuobjdump = find_tool("cuobjdump", args.cuda_bin)
    nvdisasm = find_tool("nvdisasm", args.cuda_bin)
    if not cuobjdump or not nvdisasm:
        print("FAIL: cuobjdump and nvdisasm are needed (CUDA toolkit, or the "
              "nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels that "
              "scripts/install_deps.sh installs)", file=sys.stderr)
        return 1
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(nvdisasm) + os.pathsep + env.get("PATH", "")

    usage = res_usage(cuobjdump, args.objects, env)
    loads = vector_loads(cuobjdump, args.objects, env)
    failures = []
    checked = 0
    print(f"{'kernel':40} {'REG':>4} {'STACK':>5} {'LOCAL':>5} {'128-bit loads':>13}")
    for fn in sorted(usage):
        label = kernel_label(fn)
        if label is None:
            continue
        checked += 1
        u = usage[fn]
        n = loads.get(fn, 0)
        print(f"{label:40} {u['REG']:>4} {u['STACK']:>5} {u['LOCAL']:>5} {n:>13}")
        if u["REG"] > MAX_REGISTERS:
            failures.append(f"{label}: {u['REG']} registers per thread, at most {MAX_REGISTERS}")
        if u["STACK"] or u["LOCAL"]:
            failures.append(f"{label}: local memory (STACK {u['STACK']}, LOCAL {u['LOCAL']}), "
                            "want none")
        if n == 0:
            failures.append(f"{label}: no 128-bit global load (LDG.E.128) or LDGSTS")
    if checked == 0:
        failures.append("no kernel of " + ", ".join(SOURCES) + " found in the objects")
    for f in failures:
        print("FAIL: " + f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
