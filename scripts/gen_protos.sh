#!/usr/bin/env bash
# Regenerates the committed Python stubs of jaxinfer/serving/v1/jaxinfer.proto (needs grpcio-tools, in the venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
"$PY" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. jaxinfer/serving/v1/jaxinfer.proto
