#!/usr/bin/env bash
# Builds kvq and runs every test in one ctest run: the CPU tests, the GPU
# tests (ctest label "gpu"), which skip themselves without a device, and the
# GPU bundle's checks (label "bundle"); the bundle's gpu_check.sh runs the
# device tests and benches on a machine with one (docs/CUDA.md). Then the
# fuzz smoke.
set -euo pipefail
source "$(dirname "$0")/env.sh"
# The real-model tests (tests/eval) read the model and corpora from the eval
# data dir; this fetches them once (a no-op afterwards).
"$KVQ_ROOT/scripts/fetch_eval_data.sh"
kvq_build
# The Python package (pyproject.toml: the native kernels kvq._native and the
# gRPC client kvq_client), built from this checkout and installed for
# python3: the Python tests (tests/python, run by ctest below) import it.
kvq_install_python_package
cd "$KVQ_BUILD"
# Every tests/python/test_*.py is run by some ctest (pytest on the file,
# where collecting no test is exit code 5, a failure): a file no ctest
# names would never run.
registered="$(ctest -N -V | grep -o 'tests/python/test_[A-Za-z0-9_]*\.py' | sort -u)"
for f in "$KVQ_ROOT"/tests/python/test_*.py; do
  if ! grep -qx "tests/python/$(basename "$f")" <<<"$registered"; then
    echo "kvq: tests/python/$(basename "$f") is run by no ctest: add it (tests/client, " \
         "tests/integration or bench/eval CMakeLists.txt)" >&2
    exit 1
  fi
done
# One run for the CPU and the gpu tests: the gpu tests are built (kvq_cuda
# and tests/gpu compile with -Werror for KVQ_CUDA_ARCHITECTURES, sm_90 by
# default) and run too; without a device each one skips itself, and ctest
# reports it skipped, not failed. Those that use a device hold the lock
# "gpu_device" (one at a time); the rest, the GPU bundle's checks included,
# share the cores with the CPU tests, and the long tests start first (their
# COST), so no core idles at the end (docs/DEVELOPING.md, "CI time").
# ctest runs KVQ_JOBS tests at once, one a core, so each test's OpenBLAS
# (the eval tests' forward pass) runs one thread, as kvq-eval's
# --blas_threads does by default: more would only wait for cores the other
# tests hold (docs/DEVELOPING.md, "CI time").
OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" ctest --output-on-failure -j "$KVQ_JOBS" "$@"
# The fuzz smoke (scripts/fuzz.sh, its own clang build); KVQ_SKIP_FUZZ=1
# skips it in local iterations. A fixed seed: the same inputs every run, so
# the smoke fails for a change, not for a draw (longer random campaigns:
# docs/RELIABILITY.md, "Fuzzing").
if [[ "${KVQ_SKIP_FUZZ:-0}" != 1 ]]; then
  KVQ_FUZZ_SEED="${KVQ_FUZZ_SEED:-1}" "$KVQ_ROOT/scripts/fuzz.sh" "${KVQ_FUZZ_SECONDS:-15}"
fi
