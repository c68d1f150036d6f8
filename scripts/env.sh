# Sourced by the project's scripts: toolchain paths and the build directory.
# The CUDA toolkit lives in its standard prefix; nvcc is optional (the CPU
# backend always builds).
#
# KVQ_SANITIZE=address,undefined (any -fsanitize list) makes a checking build
# in build-sanitize, without CUDA: every test then runs under the sanitizers.
KVQ_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${KVQ_SANITIZE:-}" ]]; then
  KVQ_BUILD="${KVQ_BUILD:-$KVQ_ROOT/build-sanitize}"
  KVQ_CMAKE_ARGS="-DKVQ_SANITIZE=$KVQ_SANITIZE -DKVQ_WITH_CUDA=OFF ${KVQ_CMAKE_ARGS:-}"
fi
KVQ_BUILD="${KVQ_BUILD:-$KVQ_ROOT/build}"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
if [[ -d "$CUDA_HOME/bin" ]]; then export PATH="$CUDA_HOME/bin:$PATH"; fi
KVQ_JOBS="${KVQ_JOBS:-$(nproc)}"

kvq_build() {
  "$KVQ_ROOT/scripts/install_deps.sh"
  cmake -S "$KVQ_ROOT" -B "$KVQ_BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DKVQ_CUDA_ARCHITECTURES="${KVQ_CUDA_ARCHITECTURES:-90}" ${KVQ_CMAKE_ARGS:-} >/dev/null
  cmake --build "$KVQ_BUILD" -j "$KVQ_JOBS" "$@"
}
