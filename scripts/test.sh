#!/usr/bin/env bash
# Builds kvq and runs every CPU test (GPU tests carry the ctest label "gpu"
# and are excluded; run them with `ctest -L gpu` on a machine with a GPU).
set -euo pipefail
source "$(dirname "$0")/env.sh"
# The real-model tests (tests/eval) read the model and corpora from the eval
# data dir; this fetches them once (a no-op afterwards).
"$KVQ_ROOT/scripts/fetch_eval_data.sh"
kvq_build
cd "$KVQ_BUILD"
ctest -LE gpu --output-on-failure -j "$KVQ_JOBS" "$@"
# The fuzz smoke (scripts/fuzz.sh, its own clang build); KVQ_SKIP_FUZZ=1
# skips it in local iterations. A fixed seed: the same inputs every run, so
# the smoke fails for a change, not for a draw (longer random campaigns:
# docs/RELIABILITY.md, "Fuzzing").
if [[ "${KVQ_SKIP_FUZZ:-0}" != 1 ]]; then
  KVQ_FUZZ_SEED="${KVQ_FUZZ_SEED:-1}" "$KVQ_ROOT/scripts/fuzz.sh" "${KVQ_FUZZ_SECONDS:-15}"
fi
