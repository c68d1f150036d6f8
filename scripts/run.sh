#!/usr/bin/env bash
# The main job: builds kvq, starts kvq-server on the CPU backend on
# localhost and runs the demo client against it (a long prompt stored in
# several schemes, decode steps through a DecodeStream, a fetch; memory saved
# and latency per scheme). The metrics URL is printed; the server stops when
# the demo ends unless --keep is given (then stop it with Ctrl-C).
#
#   ./scripts/run.sh [--keep] [kvq-demo flags, e.g. --tokens=8192 --schemes=fp16,kivi2]
set -euo pipefail
source "$(dirname "$0")/env.sh"
keep=0
if [[ "${1:-}" == "--keep" ]]; then keep=1; shift; fi
kvq_build --target kvq_server kvq_demo

run_dir="$(mktemp -d)"
trap 'kill -TERM "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; rm -rf "$run_dir"' EXIT
"$KVQ_BUILD/service/kvq-server" --address=127.0.0.1:0 --metrics_address=127.0.0.1:0 \
  --capacity_bytes=$((2 << 30)) --backend=cpu --port_file="$run_dir/port" \
  >"$run_dir/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do [[ -s "$run_dir/port" ]] && break; sleep 0.1; done
if [[ ! -s "$run_dir/port" ]]; then cat "$run_dir/server.log" >&2; exit 1; fi
cat "$run_dir/server.log"

"$KVQ_BUILD/client/kvq-demo" --server="127.0.0.1:$(cat "$run_dir/port")" "$@"

metrics_url="$(grep -o 'http://[^ ]*/metrics' "$run_dir/server.log")"
echo
echo "Metrics: $metrics_url"
if command -v curl >/dev/null; then
  curl -s "$metrics_url" | grep -E '^kvq_(capacity_bytes|used_bytes|compression_ratio|sequences_removed_total|rpc_requests_total\{code="OK",method="(Append|AppendAttend|DecodeStream|Attend)"\})' || true
fi
if ((keep)); then
  echo "kvq-server keeps running on 127.0.0.1:$(cat "$run_dir/port"); Ctrl-C stops it."
  wait "$server_pid"
fi
