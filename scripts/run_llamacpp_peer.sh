#!/usr/bin/env bash
# Runs llama.cpp's quantized KV caches (f16, q8_0, q5_0, q4_0) on kvq-eval's
# token windows: bench/eval/llamacpp_peer.py, the peer of kvq's quality
# numbers. Not part of CI: the first run builds llama.cpp for this CPU through
# pip (llama-cpp-python), about 140 compile steps: 42 minutes with 2 jobs on
# 2 busy cores. To rebuild (other flags, a newer release), first
# `pip uninstall llama-cpp-python`.
#
# Usage: scripts/run_llamacpp_peer.sh WINDOWS.json [--out peer.json]
#                                     [--quick] [--max-windows N] ...
# (all arguments go to llamacpp_peer.py; see its --help).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${KVQ_PYTHON:-python3}"

"$root/scripts/fetch_eval_data.sh" >&2

if ! "$python" -c "import llama_cpp, numpy" 2>/dev/null; then
  echo "kvq: installing llama-cpp-python (builds llama.cpp for the CPU; this takes a while)" >&2
  # --no-cache-dir: pip would otherwise reinstall a wheel it built earlier,
  # with whatever flags that build had.
  pip_args=(--quiet --no-cache-dir)
  # An interpreter managed by the distribution (PEP 668) takes user installs.
  stdlib="$("$python" -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')"
  if [[ -f "$stdlib/EXTERNALLY-MANAGED" && -z "${VIRTUAL_ENV:-}" ]]; then
    pip_args+=(--user --break-system-packages)
  fi
  # CPU only: no GPU backend is probed or built, and neither are llama.cpp's
  # tools, tests, examples or the multimodal library, which the peer does
  # not use. GGML_NATIVE tunes the kernels to this CPU, as a local llama.cpp
  # build would be.
  export CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF \
    -DGGML_HIP=OFF -DGGML_SYCL=OFF -DGGML_OPENCL=OFF -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
  # -march=native turns on AMX where the CPU reports it, but a kernel, VM or
  # sandbox that does not grant the AMX tile state faults on the first tile
  # load (SIGILL in ggml's AMX matmul, on the first forward pass); the peer
  # measures quality, so its build leaves AMX out unless KVQ_LLAMACPP_AMX=1.
  if [[ "${KVQ_LLAMACPP_AMX:-0}" != 1 ]]; then
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    export CFLAGS="${CFLAGS:+$CFLAGS }$no_amx" CXXFLAGS="${CXXFLAGS:+$CXXFLAGS }$no_amx"
  fi
  export CMAKE_BUILD_PARALLEL_LEVEL="${KVQ_JOBS:-$(nproc)}"
  "$python" -m pip install "${pip_args[@]}" llama-cpp-python numpy >&2
fi

exec "$python" "$root/bench/eval/llamacpp_peer.py" "$@"
