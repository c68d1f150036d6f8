#!/usr/bin/env bash
# Generates the Python protobuf/gRPC modules of proto/kvq/v1/kvq.proto into
# client/python/kvq_client/_gen (gitignored) with grpcio-tools, for using
# kvq_client from the source tree. The package's build (pip install . at the
# repository root) generates its own; from a source checkout the package also
# generates them on its first import when they are missing or stale.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec "${KVQ_PYTHON:-python3}" "$here/kvq_client/_proto.py" --force
