#!/usr/bin/env bash
# Measures what KVQ_WITH_VLLM=1 costs a fresh machine: installs vllm (the
# version scripts/install_deps.sh pins) with pip's cache off into a new
# virtual environment, prints the wall time and the environment's size, and
# removes it. Usage: scripts/measure_vllm_install.sh [python]
set -euo pipefail
python="${1:-${KVQ_PYTHON:-python3}}"
version="$(sed -n 's/^vllm_version=\([0-9.]*\).*/\1/p' "$(dirname "$0")/install_deps.sh")"
venv="$(mktemp -d)"
trap 'rm -rf "$venv"' EXIT
"$python" -m venv "$venv"
start=$(date +%s)
# As install_deps.sh does it: vllm without dependencies, then its
# requirements less the one PyPI lacks.
"$venv/bin/pip" install --quiet --no-cache-dir --no-deps "vllm==$version"
mapfile -t requirements < <("$venv/bin/python" "$(dirname "$0")/vllm_requirements.py")
"$venv/bin/pip" install --quiet --no-cache-dir "${requirements[@]}"
end=$(date +%s)
echo "vllm==$version: install $((end - start)) s, environment $(du -sh "$venv" | cut -f1)" \
     "($("$python" --version))"
