#!/usr/bin/env bash
# gpu_check.sh: every check that needs a CUDA device, run from an unpacked
# GPU bundle (scripts/gpu_bundle.sh puts this script beside bin/ and lib/).
# Needs no compiler, CMake or package manager: only the driver, bash,
# coreutils, and for some steps compute-sanitizer and python3.
#
#   ./gpu_check.sh smoke          # < 3 min: pool, quantize, attention, crq, memcheck
#   ./gpu_check.sh full           # bench, typed suites, integration, IPC, NCCL, racecheck
#   OUT=/some/dir ./gpu_check.sh smoke full
#
# Writes $OUT/gpu_check.md (the table it prints), $OUT/bench.json (full) and
# $OUT/gpu_check_logs.tar.gz (every step's log); OUT defaults to ./out.
# Every step has its own timeout, and each stage a budget
# (KVQ_GPU_CHECK_BUDGET_S, default 160 s for smoke, 400 s for full) after
# which its remaining steps are SKIPPED. A step is PASS only when it ran
# something and nothing failed; a gtest binary that ran 0 cases FAILS.
# Statuses: PASS, FAIL (why), SKIPPED (why). Exit status: 0 when every step
# passed, 1 when one failed, 2 when none failed but one was skipped (no
# device: every step is SKIPPED).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN="${KVQ_BUNDLE_BIN:-$HERE/bin}"
if [[ ! -x "$BIN/kvq-bench" ]]; then
  echo "gpu_check: no bundle binaries in $BIN: run this script from an unpacked" \
    "kvq-gpu-bundle.tar.xz (scripts/gpu_bundle.sh builds it; docs/CUDA.md)" >&2
  exit 1
fi
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/kvq-gpu-check.XXXXXX")"
STAGES=("$@")
((${#STAGES[@]})) || STAGES=(smoke)
for s in "${STAGES[@]}"; do
  [[ $s == smoke || $s == full ]] || { echo "gpu_check: unknown stage $s (smoke, full)" >&2; exit 1; }
done

rows=()
any_fail=0
any_skip=0
STAGE=""
STAGE_END=0
NO_DEVICE=""

STARTED="$(date -u +%Y-%m-%dT%H:%MZ)"
COMMIT="$(sed -n 's/^commit: //p' "$HERE/MANIFEST" 2>/dev/null)"

# The results table so far.
table() {
  echo "## gpu_check ${STAGES[*]}: $STARTED, commit ${COMMIT:-unknown}"
  echo
  echo "device: $DEVICE; NCCL: $NCCL_NOTE; compute-sanitizer: ${SANITIZER:-not found}"
  echo
  echo "| stage | step | status | time | detail |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
}

# $OUT/gpu_check.md and the logs as they are now: a run stopped from
# outside still leaves what it had finished.
save_results() {
  table >"$OUT/gpu_check.md"
  tar -C "$LOGS" -czf "$OUT/gpu_check_logs.tar.gz" . 2>/dev/null
}

# record STEP STATUS SECONDS DETAIL: one table row.
record() {
  local detail="${4//|//}"
  rows+=("| $STAGE | $1 | $2 | ${3}s | ${detail:0:300} |")
  case "$2" in
    PASS*) ;;
    SKIPPED*) any_skip=1 ;;
    *) any_fail=1 ;;
  esac
  echo "gpu_check: $STAGE/$1: $2 (${3}s) $detail" >&2
  save_results
}

# The seconds a step may take: its own limit, cut to what is left of the
# stage's budget; 0 when the budget is spent.
limit_for() {
  local left=$((STAGE_END - SECONDS))
  ((left < 10)) && { echo 0; return; }
  ((left < $1)) && { echo "$left"; return; }
  echo "$1"
}

# Why a binary cannot start, or nothing: a library the bundle does not carry
# (NCCL) missing here is a SKIPPED reason; any other missing one is a FAIL.
missing_libs() { ldd "$1" 2>/dev/null | awk '/not found/ { print $1 }' | tr '\n' ' '; }

# start STEP LIMIT CMD...: starts CMD in the background under a timeout,
# into $LOGS/STEP.log. Returns 1 (and records the row) when the step cannot
# run: no device, the stage's budget spent, a missing library.
declare -A PIDS=() STARTS=()
start() {
  local step="$1" limit="$2"
  shift 2
  if [[ -n $NO_DEVICE ]]; then record "$step" "SKIPPED (no device: $NO_DEVICE)" 0 ""; return 1; fi
  local t
  t="$(limit_for "$limit")"
  if ((t == 0)); then record "$step" "SKIPPED (the stage's time budget is spent)" 0 ""; return 1; fi
  # Every bundle binary the command names (KVQ_SERVER_BIN=... included) must
  # find its libraries.
  local arg exe miss
  for arg in "$@"; do
    exe="${arg#*=}"
    [[ $exe == "$BIN"/* ]] || continue
    miss="$(missing_libs "$exe")"
    if [[ $miss == *libnccl* ]]; then
      record "$step" "SKIPPED ($(basename "$exe") needs libnccl.so.2: $NCCL_NOTE)" 0 ""
      return 1
    elif [[ -n $miss ]]; then
      record "$step" "FAIL (bundle incomplete: $(basename "$exe") needs ${miss% })" 0 ""
      return 1
    fi
  done
  STARTS[$step]=$SECONDS
  timeout --kill-after=10 "$t" "$@" >"$LOGS/$step.log" 2>&1 &
  PIDS[$step]=$!
  return 0
}

# finish STEP: waits for a started step; sets RC (124: timed out) and TOOK.
finish() {
  wait "${PIDS[$1]}"
  RC=$?
  TOOK=$((SECONDS - STARTS[$1]))
  if ((RC == 137)); then RC=124; fi
}

# run STEP LIMIT CMD...: start, then finish.
run() {
  start "$@" || return 1
  finish "$1"
}

# gtest_result STEP WHAT: the row of a finished gtest binary: PASS only
# when it ran at least one case and none failed. WHAT names the cases in
# messages ("cuda cases").
gtest_result() {
  local step="$1" what="$2"
  local log="$LOGS/$step.log" ran passed failed skipped
  ran="$(sed -n 's/^\[==========\] \([0-9]*\) tests\? from .* ran\..*/\1/p' "$log" | tail -1)"
  passed="$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\?\..*/\1/p' "$log" | tail -1)"
  failed="$(sed -n 's/^\[  FAILED  \] \([0-9]*\) tests\?, listed below.*/\1/p' "$log" | tail -1)"
  skipped="$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\?, listed below.*/\1/p' "$log" | tail -1)"
  passed="${passed:-0}" failed="${failed:-0}" skipped="${skipped:-0}"
  local counts="$ran $what: $passed passed, $failed failed, $skipped skipped"
  if ((RC == 124)); then
    # Killed before its summary: what it had finished.
    local ok bad
    ok="$(grep -c '^\[       OK \]' "$log")" bad="$(grep -c '^\[  FAILED  \] [A-Za-z]' "$log")"
    record "$step" "FAIL (timed out after ${TOOK}s)" "$TOOK" "$ok $what passed, $bad failed before the timeout"
  elif [[ -z $ran ]]; then
    record "$step" "FAIL (exit $RC, no gtest summary)" "$TOOK" "$(tail -n 3 "$log" | tr '\n' ' ')"
  elif ((ran == 0)); then
    record "$step" "FAIL (0 $what ran)" "$TOOK" "$counts"
  elif ((failed > 0 || RC != 0)); then
    record "$step" "FAIL (exit $RC)" "$TOOK" \
      "$counts; $(grep -m3 '^\[  FAILED  \] [A-Za-z]' "$log" | cut -c14- | tr '\n' ' ')"
  elif ((passed == 0)); then
    record "$step" "SKIPPED ($(grep -m1 -A1 ': Skipped$' "$log" | tail -1))" "$TOOK" "$counts"
  else
    record "$step" PASS "$TOOK" "$counts"
  fi
}

# gtest_step STEP LIMIT WHAT BINARY [ARGS...]: runs a gtest binary and
# records its row.
gtest_step() {
  local step="$1" limit="$2" what="$3"
  shift 3
  run "$step" "$limit" "$@" || return 0
  gtest_result "$step" "$what"
}

# first_test BINARY PATTERN: the first test of BINARY whose full name
# matches PATTERN (grep -E), for the sanitizer steps' single case.
first_test() {
  "$1" --gtest_list_tests 2>/dev/null | awk '
    /^[^ ]/ { suite = $1; next }
    { print suite $1 }' | grep -m1 -E "$2"
}

# sanitizer_step STEP TOOL BINARY PATTERN: one test case under
# compute-sanitizer; PASS needs the case to pass and the tool to report 0
# errors.
sanitizer_step() {
  local step="$1" tool="$2" bin="$3" pattern="$4"
  if [[ -z $NO_DEVICE && -z $SANITIZER ]]; then
    record "$step" "SKIPPED (compute-sanitizer not found on PATH or under CUDA_HOME)" 0 ""
    return
  fi
  local test=""
  [[ -z $NO_DEVICE ]] && test="$(first_test "$bin" "$pattern")"
  if [[ -z $NO_DEVICE && -z $test ]]; then
    record "$step" "FAIL (no test of $(basename "$bin") matches $pattern)" 0 ""
    return
  fi
  gtest_step "$step" 240 "cases" "$SANITIZER" --tool "$tool" --error-exitcode=86 \
    "$bin" --gtest_filter="$test"
  local summary
  summary="$(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOGS/$step.log" 2>/dev/null)"
  if [[ -n $summary ]]; then
    rows[-1]="${rows[-1]% |} ($test; $summary) |"
    save_results
  fi
}

begin_stage() {
  STAGE="$1"
  local budget="${KVQ_GPU_CHECK_BUDGET_S:-$2}"
  STAGE_END=$((SECONDS + budget))
}

# --- The device, the sanitizer, NCCL. ---
DEVICE="$("$BIN/kvq-bench" device --probe 2>&1)"
if [[ $? != 0 ]]; then
  if [[ -n "$(missing_libs "$BIN/kvq-bench")" ]]; then
    # Not a missing device: the bundle is broken here; every step says how.
    DEVICE="unknown: kvq-bench does not start (needs $(missing_libs "$BIN/kvq-bench"))"
  else
    NO_DEVICE="$(echo "$DEVICE" | tail -1 | cut -c1-200)"
    DEVICE="none"
  fi
fi
SANITIZER="$(command -v compute-sanitizer || true)"
if [[ -z $SANITIZER && -x ${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer ]]; then
  SANITIZER="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"
fi
# NCCL: from KVQ_NCCL_LIB_DIR, else the nvidia-nccl-cu13 wheel in python3's
# site-packages (nvidia/nccl/lib/libnccl.so.2, or wherever under nvidia/
# the wheel puts it).
NCCL_DIR="${KVQ_NCCL_LIB_DIR:-}"
if [[ -z $NCCL_DIR ]] && command -v python3 >/dev/null; then
  NCCL_DIR="$(python3 - <<'EOF' 2>/dev/null
import glob, os, site, sys
dirs = sys.path + list(site.getsitepackages()) + [site.getusersitepackages()]
found = [p for d in dirs if os.path.isdir(os.path.join(d, "nvidia"))
         for p in sorted(glob.glob(os.path.join(d, "nvidia", "**", "libnccl.so.2"), recursive=True))]
if found:
    print(os.path.dirname(found[0]))
EOF
)"
fi
if [[ -n $NCCL_DIR && -f $NCCL_DIR/libnccl.so.2 ]]; then
  export LD_LIBRARY_PATH="$NCCL_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  NCCL_NOTE="$NCCL_DIR/libnccl.so.2"
else
  NCCL_NOTE="not found: no nvidia-nccl-cu13 wheel (nvidia/nccl/lib/libnccl.so.2) in python3's site-packages, and KVQ_NCCL_LIB_DIR unset"
fi
echo "gpu_check: device: $DEVICE; NCCL: $NCCL_NOTE; compute-sanitizer: ${SANITIZER:-not found}" >&2

smoke() {
  begin_stage smoke 160
  gtest_step device_page_pool 60 cases "$BIN/device_page_pool_test"
  gtest_step quantize_vs_reference 60 cases "$BIN/cuda_quantize_test"
  gtest_step attention_vs_reference 90 cases "$BIN/cuda_attention_test"
  sanitizer_step memcheck_quantize memcheck "$BIN/cuda_quantize_test" 'PagesAndRowsEqualReference/.*kivi2'
  sanitizer_step memcheck_attention memcheck "$BIN/cuda_attention_test" 'MatchesReferenceWithinContract/.*kivi2'
  # crq's kernels (cuda_crq.cu): pages and attention against cuda_host, the
  # typed suite's cuda cases, and one attention case under memcheck.
  gtest_step crq_vs_cuda_host 60 cases "$BIN/cuda_crq_test"
  gtest_step crq_vs_reference 90 "cuda cases" "$BIN/crq_test" --gtest_filter='*/cuda*-*/cuda_host*'
  sanitizer_step memcheck_crq memcheck "$BIN/crq_test" 'AttentionEqualsAttentionOverDequantizedRows/cuda_crq'
}

# The benchmark, then one row per target beside its figure (bench.json's checks).
bench_step() {
  run bench 240 "$BIN/kvq-bench" device --context=32768 --batch=64 \
    --json_out="$OUT/bench.json" || return 0
  if ((RC != 0)); then
    local why="exit $RC"
    ((RC == 124)) && why="timed out after ${TOOK}s"
    record bench "FAIL ($why)" "$TOOK" "$(tail -n 2 "$LOGS/bench.log" | tr '\n' ' ')"
    return
  fi
  record bench PASS "$TOOK" "table in gpu_check_logs/bench.log, figures in bench.json"
  if ! command -v python3 >/dev/null; then
    record targets "SKIPPED (no python3 to read bench.json)" 0 ""
    return
  fi
  local line
  while IFS=$'\t' read -r name outcome detail; do
    record "target: $name" "$outcome" 0 "$detail"
  done < <(python3 -c '
import json, sys
for c in json.load(open(sys.argv[1])).get("checks", []):
    o = c["outcome"] if c["outcome"] in ("PASS", "FAIL") else "SKIPPED (" + c["detail"] + ")"
    print(c["name"], o, c["detail"], sep="\t")' "$OUT/bench.json")
}

full() {
  begin_stage full 400
  bench_step
  # The typed suites' "cuda" instances: every scheme appended, read, forked,
  # raw-paged and attended over on the device against the reference.
  # The six run at once (each its own 1 GiB device pool; the machine's
  # cores run their host-side references).
  local started=()
  for suite in kv_stream_test attention_test attention_contract_test raw_pages_test fork_test \
               accounting_test; do
    start "$suite" 150 "$BIN/$suite" --gtest_filter='*/cuda_*-*/cuda_host_*' && started+=("$suite")
  done
  for suite in "${started[@]}"; do
    finish "$suite"
    gtest_result "$suite" "cuda cases"
  done
  gtest_step integration_cuda 120 cases env KVQ_TEST_SERVER_BACKEND=cuda \
    KVQ_SERVER_BIN="$BIN/kvq-server" KVQ_CLI_BIN="$BIN/kvq" "$BIN/client_server_test"
  gtest_step cuda_ipc 60 cases "$BIN/transport_gpu_test" --gtest_filter='*CudaIpc*'
  gtest_step nccl_two_ranks 60 cases "$BIN/transport_gpu_test" --gtest_filter='*Nccl*'
  sanitizer_step racecheck_attention racecheck "$BIN/cuda_attention_test" \
    'MatchesReferenceWithinContract/.*kivi4'
}

for s in "${STAGES[@]}"; do "$s"; done

echo "$(table)"
save_results
rm -rf "$LOGS"
if ((any_fail)); then exit 1; fi
if ((any_skip)); then exit 2; fi
exit 0
