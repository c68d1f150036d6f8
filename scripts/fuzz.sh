#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (address and
# undefined-behaviour sanitizers) into build-fuzz/ and runs each for a
# bounded time from its seed corpus. Fails on any crash, leak, sanitizer
# report, timeout or out-of-memory; the input that caused it is left in
# build-fuzz/artifacts/<target>/.
#
#   scripts/fuzz.sh [seconds_per_target]      # default 20
#
# KVQ_FUZZ_SEED=N fixes libFuzzer's random seed (default 0: a new one each
# run); scripts/test.sh fixes it, so that CI explores the same inputs on
# every run and fails only for a change, not for an unlucky draw.
# KVQ_FUZZ_JOBS=N runs N targets at a time (default KVQ_JOBS, the cores).
# KVQ_FUZZ_TARGETS="rpc_fuzz npy_fuzz" runs only those; KVQ_FUZZ_SIMD=ALL
# builds every SIMD target (default: AVX2 only, compiled for Haswell, where
# the CPU has it; CMakeLists.txt).
# New inputs the fuzzers find go to build-fuzz/corpus/<target>/ (kept
# between runs, not committed); tests/fuzz/corpus/<target>/ holds the
# committed seeds.
# docs/RELIABILITY.md ("Fuzzing") describes the targets and the long run.
set -euo pipefail
seconds="${1:-20}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || ((seconds < 1)); then
  echo "usage: $0 [seconds_per_target]" >&2
  exit 2
fi
source "$(dirname "$0")/env.sh"
"$KVQ_ROOT/scripts/install_deps.sh"

build="$KVQ_ROOT/build-fuzz"
# The AVX2-only build runs the AVX2 kernels without dispatch: it needs what
# -march=haswell -maes let the compiler use. A CPU without it gets every target.
simd="${KVQ_FUZZ_SIMD:-AVX2}"
if [[ "$simd" == AVX2 ]]; then
  for flag in avx2 fma bmi1 bmi2 f16c abm aes pclmulqdq movbe; do
    if ! grep -qw "$flag" /proc/cpuinfo; then
      echo "fuzz: this CPU lacks $flag: building every SIMD target (KVQ_FUZZ_SIMD=ALL)" >&2
      simd=ALL
      break
    fi
  done
fi
CC=clang CXX=clang++ cmake -S "$KVQ_ROOT" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DKVQ_FUZZ=ON -DKVQ_FUZZ_SIMD="$simd" -DKVQ_WITH_CUDA=OFF -DKVQ_BUILD_TESTS=OFF \
  -DKVQ_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" -j "$KVQ_JOBS" --target kvq_fuzz

all_targets=(quant_spec_fuzz npy_fuzz gguf_fuzz append_decoder_fuzz raw_page_fuzz rpc_fuzz)
read -r -a targets <<<"${KVQ_FUZZ_TARGETS:-${all_targets[*]}}"

# Leaks fail a run; UB already aborts (-fno-sanitize-recover).
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:${UBSAN_OPTIONS:-}"
# Runs target $1 for its budget; its report goes to build-fuzz/logs/$1.out
# and it exits non-zero when the target failed.
fuzz_one() {
  local t="$1"
  local seeds="$KVQ_ROOT/tests/fuzz/corpus/$t"
  local corpus="$build/corpus/$t"
  local artifacts="$build/artifacts/$t"
  local log="$build/logs/$t.log"
  mkdir -p "$corpus" "$artifacts" "$(dirname "$log")"
  # -timeout: one input taking 30 s is a hang; -rss_limit_mb / -malloc_limit_mb:
  # the memory bound. The run's own time limit is twice its budget plus a
  # minute, in case a timeout report itself hangs.
  if timeout --signal=KILL $((2 * seconds + 60)) "$build/tests/fuzz/$t" \
      -max_total_time="$seconds" -timeout=30 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
      -max_len=8192 -print_final_stats=1 -artifact_prefix="$artifacts/" \
      -seed="${KVQ_FUZZ_SEED:-0}" \
      "$corpus" "$seeds" >"$log" 2>&1; then
    # The last status line: executions, coverage, features, corpus.
    local summary execs rate
    summary="$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)"
    execs="$(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}' || true)"
    rate="$(grep -E '^stat::average_exec_per_sec' "$log" | awk '{print $2}' || true)"
    echo "fuzz: $t ok: ${execs:-?} execs, ${rate:-?}/s; ${summary}"
  else
    echo "fuzz: $t FAILED (log $log, artifacts $artifacts):"
    grep -E 'ERROR|runtime error|Fail|deadly signal|rpc_fuzz:|_fuzz:' "$log" | head -n 20 || true
    tail -n 40 "$log"
    return 1
  fi
}

# The targets run KVQ_FUZZ_JOBS at a time (default KVQ_JOBS, the cores):
# each libFuzzer run is one thread, so on N cores N of them take what one
# alone would, and the smoke takes 1/N of the time. Each report is printed
# whole when its target ends.
jobs="${KVQ_FUZZ_JOBS:-$KVQ_JOBS}"
mkdir -p "$build/logs"
declare -A running=()  # pid -> target
failed=()
reap_one() {
  local pid rc
  wait -n -p pid "${!running[@]}" && rc=0 || rc=$?
  local t="${running[$pid]}"
  unset "running[$pid]"
  cat "$build/logs/$t.out" >&2
  if ((rc != 0)); then failed+=("$t"); fi
}
for t in "${targets[@]}"; do
  while ((${#running[@]} >= jobs)); do reap_one; done
  echo "fuzz: $t for ${seconds}s" >&2
  fuzz_one "$t" >"$build/logs/$t.out" 2>&1 &
  running[$!]="$t"
done
while ((${#running[@]} > 0)); do reap_one; done
if ((${#failed[@]} > 0)); then
  echo "fuzz: failed: ${failed[*]}" >&2
  exit 1
fi
