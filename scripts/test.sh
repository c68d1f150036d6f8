#!/usr/bin/env bash
# Builds kvq and runs every CPU test, then the GPU tests (ctest label "gpu"),
# which skip themselves without a device, and the GPU bundle's checks
# (label "bundle"); the bundle's gpu_check.sh runs the device tests and
# benches on a machine with one (docs/CUDA.md).
set -euo pipefail
source "$(dirname "$0")/env.sh"
# The real-model tests (tests/eval) read the model and corpora from the eval
# data dir; this fetches them once (a no-op afterwards).
"$KVQ_ROOT/scripts/fetch_eval_data.sh"
kvq_build
cd "$KVQ_BUILD"
ctest -LE gpu --output-on-failure -j "$KVQ_JOBS" "$@"
# The gpu tests are built (kvq_cuda and tests/gpu compile with -Werror for
# KVQ_CUDA_ARCHITECTURES, sm_90 by default) and run too: without a device
# each one skips itself, and ctest reports it skipped, not failed.
ctest -L gpu --output-on-failure
# The fuzz smoke (scripts/fuzz.sh, its own clang build); KVQ_SKIP_FUZZ=1
# skips it in local iterations. A fixed seed: the same inputs every run, so
# the smoke fails for a change, not for a draw (longer random campaigns:
# docs/RELIABILITY.md, "Fuzzing").
if [[ "${KVQ_SKIP_FUZZ:-0}" != 1 ]]; then
  KVQ_FUZZ_SEED="${KVQ_FUZZ_SEED:-1}" "$KVQ_ROOT/scripts/fuzz.sh" "${KVQ_FUZZ_SECONDS:-15}"
fi
