#!/usr/bin/env bash
# Installs the Debian packages kvq builds and tests with, and the pip packages
# of the Python client; does nothing for packages already present. Safe to run
# repeatedly.
set -euo pipefail

packages=(
  build-essential cmake ccache pkg-config
  libabsl-dev libhwy-dev libgtest-dev libgmock-dev libbenchmark-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  prometheus-cpp-dev
  libopenblas-dev libicu-dev  # kvq-eval: forward-pass BLAS, tokenizer Unicode classes.
  redis-server  # Benchmark only: the Redis baseline of `kvq-bench rpc`.
  clang libclang-rt-14-dev libomp-dev  # scripts/fuzz.sh: libFuzzer and clang's OpenMP.
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} > 0)); then
  echo "kvq: installing missing packages: ${missing[*]}" >&2
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

# Python client (client/python) and its tests: pip packages, as
# "module:package" pairs; only the ones whose module does not import are
# installed.
python_packages=(grpc:grpcio grpc_tools:grpcio-tools numpy:numpy pytest:pytest
                 gguf:gguf tokenizers:tokenizers)  # The last two: kvq-eval cross-checks.
python="${KVQ_PYTHON:-python3}"
py_missing=()
for pair in "${python_packages[@]}"; do
  if ! "$python" -c "import ${pair%%:*}" 2>/dev/null; then
    py_missing+=("${pair#*:}")
  fi
done

if ((${#py_missing[@]} > 0)); then
  echo "kvq: installing missing Python packages: ${py_missing[*]}" >&2
  pip_args=(--quiet)
  # An interpreter managed by the distribution (PEP 668) takes user installs.
  stdlib="$("$python" -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')"
  if [[ -f "$stdlib/EXTERNALLY-MANAGED" && -z "${VIRTUAL_ENV:-}" ]]; then
    pip_args+=(--user --break-system-packages)
  fi
  "$python" -m pip install "${pip_args[@]}" "${py_missing[@]}" >&2
fi
