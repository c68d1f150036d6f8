#!/usr/bin/env bash
# The quality frontier of docs/QUALITY.md: decode-metric ΔPPL against
# bits/element for kvq's formats and llama.cpp's caches on the same windows,
# then its table and its plot.
#
#   bench/eval/run_frontier.sh [OUT_DIR]     # default: docs/quality
#
#  1. kvq-eval, decode metric only (--metrics=decode skips the chunked
#     prefill and the generation, which only the prefill metric uses; the
#     decode rows are the same with or without it: tests/python/
#     test_eval_quick.py), 5 windows per corpus at 2048 tokens, the middle
#     one first (--window_order), one process per corpus (each rewrites its
#     JSON after every window, so a stopped run keeps what it measured);
#  2. the llama.cpp peer (f16, q8_0, q5_0, q4_0) on the same windows;
#  3. with KVQ_FRONTIER_LONG=1, the same at 8192 tokens on austen and code;
#  4. with KVQ_FRONTIER_PASSKEY=N, N passkey trials (depths spread over
#     0.05..0.95) at 2048 tokens (and 8192 with KVQ_FRONTIER_LONG=1) for
#     fp16 and the formats of at least 3 bits;
#  5. quality_tables.py --frontier and plot_quality.py --frontier.
#
# KVQ_FRONTIER_SCHEMES replaces the format list (crq schemes go there, with
# KVQ_FRONTIER_CALIBRATION naming the calibration file every kvq-eval run
# reads: kvq-eval --write_calibration=FILE --calib_tokens=8192 writes it);
# KVQ_FRONTIER_WINDOWS (default 5) sets the windows per corpus.
# OPENBLAS_CORETYPE is passed through: OpenBLAS falls back to its generic
# SSE3 kernels on CPUs it does not know, and every figure of one frontier
# should come from one kind of kernel (each JSON names its "blas_core").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:-$root/docs/quality}"
source "$root/scripts/env.sh"
"$root/scripts/fetch_eval_data.sh"
kvq_build --target kvq_eval >/dev/null
eval_bin="$KVQ_BUILD/bench/eval/kvq-eval"
windows="${KVQ_FRONTIER_WINDOWS:-5}"
# The middle window first (the one-window runs of run_quality.sh used it),
# then the others spread out; KVQ_FRONTIER_ORDER lists 0..windows-1 anew.
order="${KVQ_FRONTIER_ORDER:-2,0,4,1,3}"
mkdir -p "$out" "$root/docs/img"
calibration=()
if [[ -n "${KVQ_FRONTIER_CALIBRATION:-}" ]]; then
  calibration=(--calibration_file="$KVQ_FRONTIER_CALIBRATION")
fi

# KIVI near 4.3 bits (4-bit keys, 3-bit values) and all-4-bit, near 3.5
# (3-bit; 3-bit keys with 2-bit values under it) and near 2.6 (2-bit, fitted
# key ranges); the rotate option and a
# KVQuant-like configuration (nuq levels, pre-RoPE keys, 1% outliers, sink)
# on the 3-bit layout. Bits at 2048 tokens include the 64-token fp16 tail.
schemes="${KVQ_FRONTIER_SCHEMES:-fp16,kivi4:g64:r64:p8:pre_rope:sink=4,kivi4:v3:g64:r64:p8:pre_rope:sink=4,kivi3:g64:r64:p8:pre_rope:sink=4,kivi3:g64:r64:p8:rotate:sink=4,kivi3:g64:r64:p8:pre_rope:outliers=1:sink=4:nuq,kivi3:v2:g64:r64:p8:pre_rope:sink=4,kivi2:g64:r64:fit:p8:pre_rope:sink=4}"

# One process per corpus (the windows of one corpus share its fp16
# reference); OMP_NUM_THREADS=1 keeps the scoring reductions in one order.
run_context() {
  local context="$1" corpora="$2" pids=()
  for corpus in ${corpora//,/ }; do
    OMP_NUM_THREADS=1 "$eval_bin" --corpora="$corpus" --contexts="$context" \
      --windows="$windows" --window_order="$order" --metrics=decode --passkey_contexts= \
      --progress=false "${calibration[@]}" \
      --schemes="$schemes" --out="$out/kvq_frontier_${context}_${corpus}.json" >/dev/null &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  "$eval_bin" --corpora="$corpora" --contexts="$context" --windows="$windows" \
    --passkey_contexts= --dump_windows="$out/windows_frontier_${context}.json" --dump_only
  "$root/scripts/run_llamacpp_peer.sh" "$out/windows_frontier_${context}.json" \
    --cache-types=f16,q8_0,q5_0,q4_0 --window-order="$order" \
    --out="$out/llamacpp_frontier_${context}.json"
}
run_context 2048 austen,code,kjv
if [[ "${KVQ_FRONTIER_LONG:-0}" == 1 ]]; then
  run_context 8192 austen,code
fi
if [[ -n "${KVQ_FRONTIER_PASSKEY:-}" ]]; then
  n="$KVQ_FRONTIER_PASSKEY"
  depths="$(python3 -c "n=$n; print(','.join(f'{0.05 + 0.9 * i / max(1, n - 1):.4f}' for i in range(n)))")"
  passkey_contexts=(2048)
  if [[ "${KVQ_FRONTIER_LONG:-0}" == 1 ]]; then passkey_contexts+=(8192); fi
  for context in "${passkey_contexts[@]}"; do
    OMP_NUM_THREADS=1 "$eval_bin" --contexts= --passkey_contexts="$context" --passkey_depths="$depths" \
      --schemes="$schemes" --progress=false "${calibration[@]}" \
      --out="$out/kvq_frontier_passkey_${context}.json" >/dev/null
  done
fi

python3 "$root/bench/eval/quality_tables.py" --frontier "$out"/kvq_frontier_*.json \
  "$out"/llamacpp_frontier_*.json
python3 "$root/bench/eval/plot_quality.py" --frontier "$out"/kvq_frontier_*.json \
  "$out"/llamacpp_frontier_*.json --out-dir "$root/docs/img"
