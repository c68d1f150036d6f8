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

# Builds and installs the Python package (pyproject.toml at the root) for
# ${KVQ_PYTHON:-python3}. pip builds it in an isolated environment with the
# pinned build requirements; build-python/ keeps the CMake build between
# installs, so a reinstall compiles only what changed.
kvq_install_python_package() {
  local python="${KVQ_PYTHON:-python3}" stdlib
  local args=(--quiet)
  # An interpreter managed by the distribution (PEP 668) takes user installs.
  stdlib="$("$python" -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')"
  if [[ -f "$stdlib/EXTERNALLY-MANAGED" && -z "${VIRTUAL_ENV:-}" ]]; then
    args+=(--user --break-system-packages)
  fi
  # The package's build (scikit-build-core) compiles with Python's CC and
  # CXX (g++ here) unless told otherwise, and ccache keys on the compiler's
  # name: with the main build's compilers its kernels' compile lines are the
  # main build's, and ccache serves them instead of a second compile.
  # A fresh clone without a main build, or a CC/CXX the caller set, keeps
  # what it has.
  local cache="$KVQ_BUILD/CMakeCache.txt" compilers=() cc cxx
  if [[ -f "$cache" ]]; then
    cc="$(sed -n 's/^CMAKE_C_COMPILER:FILEPATH=//p' "$cache")"
    cxx="$(sed -n 's/^CMAKE_CXX_COMPILER:FILEPATH=//p' "$cache")"
    if [[ -z "${CC:-}" && -n "$cc" ]]; then compilers+=("CC=$cc"); fi
    if [[ -z "${CXX:-}" && -n "$cxx" ]]; then compilers+=("CXX=$cxx"); fi
  fi
  env "${compilers[@]}" "$python" -m pip install "${args[@]}" "$KVQ_ROOT" >&2
}
