#!/usr/bin/env bash
# Generates the Python protobuf/gRPC modules of proto/kvq/v1/kvq.proto into
# client/python/kvq_client/_gen (gitignored) with grpcio-tools. Run it after
# changing the proto, and before building a wheel. From a source checkout the
# package also generates them on its first import when they are missing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec "${KVQ_PYTHON:-python3}" "$here/kvq_client/_proto.py" --force
