#!/usr/bin/env bash
# gpu_check.sh: every check that needs a CUDA device, in one run on a
# machine with one (made to finish in under 8 minutes on one H100; each
# step has its own timeout and a step that fails or times out is reported,
# not fatal).
#
#   scripts/gpu_check.sh                       # sm_90 (H100)
#   KVQ_CUDA_ARCHITECTURES=80 scripts/gpu_check.sh
#   OUT=/some/dir scripts/gpu_check.sh         # also writes $OUT/gpu_check.md
#
# Steps: configure a CUDA build (KVQ_WITH_CUDA=ON) in build-gpu/, build the
# gpu tests, the typed suites, kvq-server, kvq-bench and the client/server
# integration test; `ctest -L gpu`; the typed suites' cuda instances; the
# device-to-device copy bandwidth (cudaMemcpy of 1 GiB,
# median of 5, from device_page_pool_test); `kvq-bench kernels
# --backend=cuda --json`; the client/server integration test against
# `kvq-server --backend=cuda`. Prints a table; exits 1 if a step failed.
set -uo pipefail
source "$(dirname "$0")/env.sh"
BUILD="${KVQ_GPU_BUILD:-$KVQ_ROOT/build-gpu}"
ARCH="${KVQ_CUDA_ARCHITECTURES:-90}"
JOBS="${KVQ_JOBS:-$(nproc)}"
LOGS="$BUILD/gpu_check_logs"
mkdir -p "$LOGS"
rows=()
failed=0

# step NAME TIMEOUT_S COMMAND...: runs COMMAND under a timeout, logs it to
# $LOGS/NAME.log, records PASS / FAIL (exit code) / TIMEOUT.
step() {
  local name="$1" limit="$2"
  shift 2
  local start=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  local took=$((SECONDS - start)) result
  if [[ $rc == 0 ]]; then
    result=PASS
  elif [[ $rc == 124 || $rc == 137 ]]; then
    result="TIMEOUT (${limit}s)"
    failed=1
  else
    result="FAIL (exit $rc)"
    failed=1
  fi
  LAST_RESULT="$result"
  LAST_SECONDS="$took"
  echo "gpu_check: $name: $result in ${took}s (log: $LOGS/$name.log)" >&2
  return $rc
}
row() { rows+=("| $1 | $2 | $3 | $4 |"); }

DEVICE="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  2>/dev/null | head -1)"

step configure 120 cmake -S "$KVQ_ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
  -DKVQ_WITH_CUDA=ON -DKVQ_CUDA_ARCHITECTURES="$ARCH" ${KVQ_CMAKE_ARGS:-}
row configure "$LAST_RESULT" "${LAST_SECONDS}s" "sm_$ARCH"

# The gpu tests (every target under tests/gpu), the server, the bench and
# the integration test: not the whole tree, to stay inside the budget.
# The typed suites run every backend BackendNames() lists, "cuda" included
# where a device is present (tests/unit/test_util.cc).
TYPED_SUITES=(kv_stream_test attention_test attention_contract_test raw_pages_test fork_test
              accounting_test)
step build 330 bash -c "cmake --build '$BUILD' -j $JOBS --target kvq_server kvq_bench \
  client_server_test ${TYPED_SUITES[*]} && make -C '$BUILD/tests/gpu' -j $JOBS"
row build "$LAST_RESULT" "${LAST_SECONDS}s" "kvq_cuda -Werror, tests/gpu, typed suites, kvq-server, kvq-bench"

step ctest_gpu 120 ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 90
summary="$(grep -E 'tests passed|tests failed' "$LOGS/ctest_gpu.log" | tail -1)"
skipped="$(grep -c '(Skipped)' "$LOGS/ctest_gpu.log")"
if [[ $LAST_RESULT == PASS && $skipped -gt 0 ]]; then LAST_RESULT="PASS, $skipped skipped"; fi
row "ctest -L gpu" "$LAST_RESULT" "${LAST_SECONDS}s" "${summary:-no summary}; $skipped skipped"

# The typed suites' "cuda" instances: every scheme appended, read, forked,
# raw-paged and attended over on the device against the reference, and the
# error contract (kernels/backend.h) on the device.
typed_step() {
  local name="$1"
  step "typed_$name" 60 "$BUILD/tests/unit/$name" --gtest_filter='*/cuda_*-*/cuda_host_*'
  local summary
  summary="$(grep -E '^\[  (PASSED|FAILED|SKIPPED)  \] [0-9]+ test' "$LOGS/typed_$name.log" | tr '\n' ' ')"
  row "$name on cuda" "$LAST_RESULT" "${LAST_SECONDS}s" "${summary:-no gtest summary}"
}
for suite in "${TYPED_SUITES[@]}"; do typed_step "$suite"; done

step d2d_bandwidth 60 "$BUILD/tests/gpu/device_page_pool_test" \
  --gtest_filter='*DeviceToDeviceCopyBandwidth*'
gbps="$(grep -o 'd2d_copy_gbps=[0-9.]*' "$LOGS/d2d_bandwidth.log" | cut -d= -f2)"
if [[ $LAST_RESULT == PASS && -z $gbps ]]; then LAST_RESULT="SKIPPED (no device)"; fi
row "D2D cudaMemcpy, 1 GiB, median of 5" "$LAST_RESULT" "${LAST_SECONDS}s" "${gbps:-?} GB/s"

# kvq-bench kernels on the device: append (quantize) time and fused decode
# attention per scheme at 32k, against the device's copy bandwidth measured
# in the same run (bench/kernels_bench.cc).
step bench_kernels 150 "$BUILD/bench/kvq-bench" kernels --backend=cuda --json --quick
if [[ $LAST_RESULT == PASS ]]; then
  cp "$LOGS/bench_kernels.log" "$LOGS/bench_kernels.json"
  detail="JSON in $LOGS/bench_kernels.json"
else
  detail="$(grep -v '^\s*$' "$LOGS/bench_kernels.log" | tail -1 | tr '|' '/')"
fi
row "kvq-bench kernels --backend=cuda --json --quick" "$LAST_RESULT" "${LAST_SECONDS}s" "$detail"

# The client/server integration test with every server it starts on the device.
step integration_cuda 150 env KVQ_TEST_SERVER_BACKEND=cuda \
  "$BUILD/tests/integration/client_server_test"
summary="$(grep -E '^\[  (PASSED|FAILED)  \] [0-9]+ test' "$LOGS/integration_cuda.log" | tr '\n' ' ')"
row "client_server_test vs kvq-server --backend=cuda" "$LAST_RESULT" "${LAST_SECONDS}s" \
  "${summary:-no gtest summary}"

table="$(
  echo "## gpu_check $(date -u +%Y-%m-%dT%H:%MZ) on ${DEVICE:-unknown device}, commit $(git -C "$KVQ_ROOT" rev-parse --short HEAD 2>/dev/null)"
  echo
  echo "| step | result | time | detail |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
)"
echo "$table"
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  echo "$table" >"$OUT/gpu_check.md"
  cp -r "$LOGS" "$OUT/gpu_check_logs" 2>/dev/null || true
fi
exit $failed
