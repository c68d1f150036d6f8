#!/usr/bin/env bash
# gpu_bundle.sh: builds, on a machine with nvcc and no GPU, every binary the
# device check (scripts/gpu_check.sh) runs, and packs them with the shared
# libraries they need into one kvq-gpu-bundle.tar.xz that runs on a GPU
# machine with only a driver, the CUDA tools (compute-sanitizer) and python3
# (docs/CUDA.md, "The GPU bundle").
#
#   scripts/gpu_bundle.sh                      # build-gpu-bundle/, sm_90a, NCCL when found
#   scripts/gpu_bundle.sh --build-dir build --no-build --out /tmp/b.tar.xz
#
# --build-dir DIR  a CUDA build (KVQ_WITH_CUDA=ON) to take the binaries from;
#                  configured (Release, KVQ_CUDA_ARCHITECTURES, default 90a,
#                  KVQ_WITH_NCCL when nccl.h is found) when it has no CMakeCache.txt.
# --no-build       take the binaries as they are (CI: the tree is built already).
# --out FILE       the archive (default DIR/kvq-gpu-bundle.tar.xz).
#
# Every binary and library gets an $ORIGIN-relative RUNPATH (patchelf) and is
# stripped. Not carried: glibc, libstdc++ and libgcc_s (nothing may need a
# symbol version newer than Debian 12's), the driver's libcuda, and NCCL,
# which gpu_check.sh finds in python3's nvidia-nccl-cu13 wheel. The archive
# must stay under 40 MiB. Exits non-zero, saying why, on any violation.
set -euo pipefail
source "$(dirname "$0")/env.sh"

BUILD="$KVQ_ROOT/build-gpu-bundle"
OUT_FILE=""
DO_BUILD=1
while (($#)); do
  case "$1" in
    --build-dir) BUILD="$(cd "$2" && pwd)"; shift 2 ;;
    --no-build) DO_BUILD=0; shift ;;
    --out) OUT_FILE="$2"; shift 2 ;;
    *) echo "gpu_bundle: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
OUT_FILE="${OUT_FILE:-$BUILD/kvq-gpu-bundle.tar.xz}"
MAX_BYTES=$((40 << 20))
# Newest symbol versions Debian 12 (bookworm) provides: glibc 2.36, GCC 12's
# libstdc++.
MAX_GLIBC=2.36
MAX_GLIBCXX=3.4.30
MAX_CXXABI=1.3.13

die() { echo "gpu_bundle: $*" >&2; exit 1; }

# The binaries gpu_check.sh runs, by file name: found wherever the build
# tree puts them.
BINARIES=(
  kvq-server kvq kvq-bench
  device_page_pool_test cuda_quantize_test cuda_attention_test transport_gpu_test
  client_server_test
  kv_stream_test attention_test attention_contract_test raw_pages_test fork_test accounting_test
  crq_test cuda_crq_test
)
TARGETS=(kvq_server kvq_cli kvq_bench device_page_pool_test cuda_quantize_test
         cuda_attention_test transport_gpu_test client_server_test kv_stream_test attention_test
         attention_contract_test raw_pages_test fork_test accounting_test crq_test
         cuda_crq_test)

# Libraries a binary may need that the bundle does not carry: glibc's, the
# compiler's C++ runtime, the driver's libcuda and NCCL.
is_system_lib() {
  [[ "$1" =~ ^(linux-vdso|ld-linux-x86-64|libc|libm|libmvec|libpthread|libdl|librt|libresolv|libutil|libanl|libnsl|libstdc\+\+|libgcc_s|libcuda|libnccl)\.so ]]
}
allowed_missing() { [[ "$1" =~ ^(libcuda|libnccl)\.so ]]; }

if [[ $DO_BUILD == 1 ]]; then
  if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
    "$KVQ_ROOT/scripts/install_deps.sh"
    nccl=()
    if [[ -f "$CUDA_HOME/include/nccl.h" || -f /usr/include/nccl.h || -f /usr/local/include/nccl.h ]]; then
      nccl=(-DKVQ_WITH_NCCL=ON)
    fi
    cmake -S "$KVQ_ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKVQ_WITH_CUDA=ON \
      -DKVQ_CUDA_ARCHITECTURES="${KVQ_CUDA_ARCHITECTURES:-90a}" "${nccl[@]}" ${KVQ_CMAKE_ARGS:-} \
      >/dev/null
  fi
  cmake --build "$BUILD" -j "$KVQ_JOBS" --target "${TARGETS[@]}"
fi
grep -q '^KVQ_WITH_CUDA:BOOL=ON' "$BUILD/CMakeCache.txt" 2>/dev/null ||
  die "$BUILD is not a CUDA build (KVQ_WITH_CUDA=ON in its CMakeCache.txt)"
# Build-tree path of each binary, relative to $BUILD.
declare -A built=()
for name in "${BINARIES[@]}"; do
  mapfile -t found < <(cd "$BUILD" && find . -path ./CMakeFiles -prune -o -path '*/CMakeFiles/*' \
    -prune -o -type f -name "$name" -perm -u+x -print)
  ((${#found[@]} == 1)) ||
    die "found ${#found[@]} executables named $name in $BUILD (want 1): build the targets ${TARGETS[*]}"
  built[$name]="${found[0]#./}"
done

STAGE_PARENT="$(mktemp -d)"
trap 'rm -rf "$STAGE_PARENT"' EXIT
STAGE="$STAGE_PARENT/kvq-gpu-bundle"
mkdir -p "$STAGE/bin" "$STAGE/lib"

# Every library the binaries need, transitively (ldd resolves the closure),
# that the bundle carries: soname -> resolved path.
declare -A carried=()
for name in "${BINARIES[@]}"; do
  b="${built[$name]}"
  while read -r line; do
    if [[ $line =~ ^([^[:space:]]+)[[:space:]]=\>[[:space:]]not[[:space:]]found ]]; then
      name="${BASH_REMATCH[1]}"
      allowed_missing "$name" || die "$b needs $name, which ldd does not find here"
      continue
    fi
    [[ $line =~ ^([^[:space:]]+)[[:space:]]=\>[[:space:]](/[^[:space:]]+) ]] || continue
    name="${BASH_REMATCH[1]}" path="${BASH_REMATCH[2]}"
    is_system_lib "$name" || carried[$name]="$path"
  done < <(ldd "$BUILD/$b")
done

for name in "${BINARIES[@]}"; do
  dst="$STAGE/bin/$name"
  cp "$BUILD/${built[$name]}" "$dst"
  strip --strip-unneeded "$dst"
  patchelf --set-rpath '$ORIGIN/../lib' "$dst"
done
for name in "${!carried[@]}"; do
  dst="$STAGE/lib/$name"
  cp -L "${carried[$name]}" "$dst"
  chmod u+w "$dst"
  strip --strip-unneeded "$dst"
  patchelf --set-rpath '$ORIGIN' "$dst"
done

# No binary or carried library may need a symbol version newer than Debian 12's.
newest() {  # newest PREFIX FILE: the highest PREFIX_x.y.z version FILE references.
  { objdump -T "$2" | grep -o "(${1}_[0-9][0-9.]*)" || true; } | tr -d '()' |
    sed "s/^${1}_//" | sort -V | tail -1
}
too_new() { [[ -n "$1" && "$(printf '%s\n%s\n' "$1" "$2" | sort -V | tail -1)" != "$2" ]]; }
for f in "$STAGE"/bin/* "$STAGE"/lib/*; do
  for pair in GLIBC:$MAX_GLIBC GLIBCXX:$MAX_GLIBCXX CXXABI:$MAX_CXXABI; do
    prefix="${pair%%:*}" limit="${pair#*:}"
    v="$(newest "$prefix" "$f")"
    if too_new "$v" "$limit"; then
      die "$(basename "$f") needs ${prefix}_$v, newer than Debian 12's ${prefix}_$limit"
    fi
  done
done

install -m 0755 "$KVQ_ROOT/scripts/gpu_check.sh" "$STAGE/gpu_check.sh"
{
  echo "kvq GPU bundle"
  echo "commit: $(git -C "$KVQ_ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "built: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "cuda_architectures: $(sed -n 's/^KVQ_CUDA_ARCHITECTURES:STRING=//p' "$BUILD/CMakeCache.txt")"
  echo "nccl: $(sed -n 's/^KVQ_WITH_NCCL:BOOL=//p' "$BUILD/CMakeCache.txt")"
  echo "binaries: $(cd "$STAGE/bin" && ls | tr '\n' ' ')"
  echo "libraries: $(cd "$STAGE/lib" && ls | tr '\n' ' ')"
} >"$STAGE/MANIFEST"

mkdir -p "$(dirname "$OUT_FILE")"
XZ_OPT="-9 -T0" tar -C "$STAGE_PARENT" -cJf "$OUT_FILE" kvq-gpu-bundle
size=$(stat -c %s "$OUT_FILE")
if ((size > MAX_BYTES)); then
  die "$OUT_FILE is $((size >> 20)) MiB, over the 40 MiB limit"
fi
echo "gpu_bundle: $OUT_FILE: $(awk -v s="$size" 'BEGIN { printf "%.1f", s / 1048576 }') MiB," \
  "${#BINARIES[@]} binaries, ${#carried[@]} libraries carried"
