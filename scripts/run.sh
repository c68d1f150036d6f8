#!/usr/bin/env bash
# The main job: builds kvq and runs the demo, which stores a generated KV set
# in every scheme and prints bits/element, attention error and speed.
set -euo pipefail
source "$(dirname "$0")/env.sh"
kvq_build --target kvq_bench
"$KVQ_BUILD/bench/kvq-bench" kernels --quick "$@"
