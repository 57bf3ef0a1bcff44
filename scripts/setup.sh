#!/usr/bin/env bash
# Set up hetpipe in ./.venv on a fresh machine.
#   bash scripts/setup.sh          # runtime dependencies
#   bash scripts/setup.sh --dev    # plus test dependencies (pytest, hypothesis, transformers)
# torch is installed first, pinned, where the venv has none: an unpinned `torch`
# would pull a multi-GB CUDA build; `pip install torch==2.13.0` takes the CPU wheel here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  echo "installing torch==2.13.0 (CPU wheel)"
  "$VPY" -m pip install -q torch==2.13.0
fi
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
echo "installing hetpipe${extra}"
"$VPY" -m pip install -q -e ".${extra}"
echo "ready: $("$VPY" -c 'import torch, hetpipe; print("torch", torch.__version__, "| hetpipe", hetpipe.__version__)')"
