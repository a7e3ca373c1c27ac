#!/usr/bin/env bash
# Regenerate the checked-in gRPC code from proto/shoal.proto (needs the dev extra: grpcio-tools).
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/shoal.proto
