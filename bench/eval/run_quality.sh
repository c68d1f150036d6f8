#!/usr/bin/env bash
# The full quality evaluation behind docs/QUALITY.md, one command:
#
#   bench/eval/run_quality.sh [OUT_DIR]      # default: docs/quality
#
#  1. kvq-eval, ablation: every option on its own and combined, at 512 and
#     2048 tokens, on the evaluation corpora, passkey at 2048;
#  2. the llama.cpp peer (scripts/run_llamacpp_peer.sh; builds
#     llama-cpp-python on first use) on exactly the same windows with f16,
#     q8_0 and q4_0 caches;
#  3. kvq-eval and the peer again at 8192 tokens for the picked
#     configurations, passkey at 8192;
#  4. the per-layer probe (a sixth of the layers at 3 bits at a time);
#  5. the markdown tables (quality_tables.py) and the plots
#     (plot_quality.py, into docs/img).
#
# Hours on a 2-core machine (a kvq-eval 8192-token window takes about two
# minutes per scheme there); not part of CI, which runs `kvq-eval --quick`.
# KVQ_QUALITY_WINDOWS (default 1) sets the windows per corpus and context;
# KVQ_QUALITY_CORPORA (default austen,code,kjv) the corpora of the short
# contexts, KVQ_QUALITY_LONG_CORPORA (default austen,code) those at 8192.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:-$root/docs/quality}"
source "$root/scripts/env.sh"
"$root/scripts/fetch_eval_data.sh"
kvq_build --target kvq_eval >/dev/null
eval_bin="$KVQ_BUILD/bench/eval/kvq-eval"
windows="${KVQ_QUALITY_WINDOWS:-5}"
corpora="${KVQ_QUALITY_CORPORA:-austen,code,kjv}"
mkdir -p "$out" "$root/docs/img"

# The configurations the defaults were picked from (docs/QUALITY.md): the
# best 4-, 3- and 2-bit ones of the ablation, and the leanest 4-bit one.
best4="kivi4:pre_rope:sink=4"
lean4="kivi4:g128:r128:pre_rope:sink=4"
# The most accurate 4-bit configuration: 16-token key groups (more
# metadata, 6.7 bits at 2048), the one under the 0.5% ΔPPL target.
acc4="kivi4:g16:r128:pre_rope:sink=4"
best3="kivi3:pre_rope:outliers=1:sink=4"
best2="kivi2:g16:r128:pre_rope:outliers=1:sink=4:nuq"
lean2="kivi2:g128:r128:pre_rope:outliers=1:sink=4:nuq"
# 8-bit group parameters (p8) with 64-token groups and window: the
# configurations under the bit budgets at 8192 tokens (4.41, 3.42 and 2.43
# bits), and lean4 with p8 for the cost of the 8-bit parameters.
p8_4="kivi4:g64:r64:p8:pre_rope:sink=4"
p8_lean4="kivi4:g128:r128:p8:pre_rope:sink=4"
p8_3="kivi3:g64:r64:p8:pre_rope:sink=4"
p8_3nuq="kivi3:g64:r64:p8:pre_rope:sink=4:nuq"
p8_2="kivi2:g64:r64:p8:pre_rope:sink=4"
p8=("$p8_4" "$p8_lean4" "$p8_3" "$p8_3nuq" "$p8_2")
# p8_3 without pre_rope, and with rotate instead; with a longer sink
# (2048 only); with the sparse outliers that fit 3.5 bits at 8192 (p8_3out).
p8_3out="kivi3:g64:r64:p8:pre_rope:outliers=0.2:sink=4"
p8_3ablation=("kivi3:g64:r64:p8:rotate:sink=4" "kivi3:g64:r64:p8:sink=4"
              "kivi3:g64:r64:p8:pre_rope:sink=16" "$p8_3out")
# Keys and values at different bits (vN) in the same p8 layout: which side
# takes the narrower codes. mix_43 (4.23 bits at 2048) is the configuration
# under q4_0's 4.5 bits at 2048.
mix_43="kivi4:v3:g64:r64:p8:pre_rope:sink=4"
mix=("$mix_43" "kivi4:v3:g32:r32:p8:pre_rope:sink=4" "kivi4:v2:g64:r64:p8:pre_rope:sink=4"
     "kivi3:v4:g64:r64:p8:pre_rope:sink=4" "kivi2:v4:g64:r64:p8:pre_rope:sink=4")
# Least-squares key ranges (fit) on the p8 configurations under the 3- and
# 2-bit budgets, and on the most accurate 2- and 3-bit ones (fit excludes
# nuq, so best2 without it).
fit=("kivi3:g64:r64:fit:p8:pre_rope:sink=4" "kivi2:g64:r64:fit:p8:pre_rope:sink=4"
     "kivi3:fit:pre_rope:outliers=1:sink=4" "kivi2:g16:r128:fit:pre_rope:outliers=1:sink=4")
# The ablation (KIVI / KVQuant style): per-token vs per-channel keys, with
# and without the residual window, each KVQuant option alone, rotate, their
# combinations, then the picked configurations.
ablation=(
  fp16 int8 fp8_e4m3 kivi4 kivi3 kivi2
  kivi2:ktok kivi2:r0
  kivi2:pre_rope kivi2:outliers=1 kivi2:sink=4 kivi2:nuq kivi2:rotate
  kivi2:pre_rope:outliers=1:sink=4 kivi2:pre_rope:outliers=1:sink=4:nuq
  kivi2:rotate:outliers=1:sink=4
  kivi4:pre_rope kivi4:sink=4 kivi4:pre_rope:outliers=1:sink=4
  kivi4:g16:r128:pre_rope:outliers=1:sink=4
  "$best4" "$lean4" "$acc4" "$best3" "$best2" "$lean2" "${p8[@]}" "${p8_3ablation[@]}"
  "${mix[@]}" "${fit[@]}"
)
long=(fp16 kivi4 "$best4" "$lean4" "$acc4" "$best3" "$best2" "${p8[@]}" "$p8_3out" "$mix_43"
      "kivi4:v3:g32:r32:p8:pre_rope:sink=4" "kivi2:g64:r64:fit:p8:pre_rope:sink=4"
      "kivi3:g64:r64:fit:p8:pre_rope:outliers=0.2:sink=4")
long_corpora="${KVQ_QUALITY_LONG_CORPORA:-austen,code}"
join() { local IFS=,; echo "$*"; }
passkey="$(join fp16 "$best4" "$best3" "$best2" "$p8_4" "$p8_3" "$p8_2" "${mix[@]}" "${fit[@]:0:2}")"

"$eval_bin" --schemes="$(join "${ablation[@]}")" --contexts=512,2048 --windows="$windows" \
  --corpora="$corpora" --passkey_contexts=2048 --passkey_schemes="$passkey" \
  --dump_windows="$out/windows_short.json" --out="$out/kvq_short.json"
"$root/scripts/run_llamacpp_peer.sh" "$out/windows_short.json" --out="$out/llamacpp_short.json"
"$eval_bin" --schemes="$(join "${long[@]}")" --contexts=8192 --windows="$windows" \
  --corpora="$long_corpora" --passkey_contexts=8192 --passkey_depths=0.1,0.5,0.9 \
  --passkey_schemes="$(join fp16 "$best4" "$p8_4" "$p8_3" "$mix_43")" --dump_windows="$out/windows_long.json" --out="$out/kvq_long.json"
"$root/scripts/run_llamacpp_peer.sh" "$out/windows_long.json" --out="$out/llamacpp_long.json"

# Per-layer sensitivity of the 3-bit p8 configuration: one sixth of the
# layers quantized at a time (scheme@A-B), the rest fp16. Its file is not
# a kvq_*.json: its fp16 rows cover two corpora only and must not replace
# the tables' references.
layer_probe=()
for r in 0-4 5-9 10-14 15-19 20-24 25-29; do layer_probe+=("$p8_3@$r"); done
"$eval_bin" --schemes="$(join "$p8_3" "${layer_probe[@]}")" --contexts=2048 --corpora=austen,code \
  --passkey_contexts= --gen_tokens=32 --out="$out/probe_layers_kivi3.json"

# The decode metric (kvq's rows), then chunked prefill (where the llama.cpp
# peer's rows are).
python3 "$root/bench/eval/quality_tables.py" --metric=decode "$out"/kvq_*.json "$out"/llamacpp_*.json
python3 "$root/bench/eval/quality_tables.py" --metric=prefill "$out"/kvq_*.json "$out"/llamacpp_*.json
python3 "$root/bench/eval/plot_quality.py" "$out"/kvq_*.json "$out"/llamacpp_*.json \
  --out-dir "$root/docs/img"
