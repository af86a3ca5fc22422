#!/usr/bin/env bash
# Shared set-up for scripts/demo.sh and scripts/test.sh: a virtual environment in .venv with kimi_cg
# installed (editable) and its test dependencies. Idempotent; safe to run on a fresh machine.
#   - No GPU: the CPU build torch==2.13.0.
#   - A GPU: the torch already installed for the system Python is kept (the venv sees system
#     site-packages); torch>=2.11 is installed only when none is importable.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_BIN=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON_BIN" -m venv --system-site-packages .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install -q "torch>=2.11"
  else
    python -m pip install -q "torch==2.13.0"
  fi
fi
if ! python -c "import kimi_cg.kernels, hypothesis, transformers, safetensors, triton, xdist" >/dev/null 2>&1; then
  python -m pip install -q -e ".[test]"
fi
python -c "import torch; print(f'kimi_cg env: python {__import__(\"sys\").version.split()[0]}, torch {torch.__version__}, cuda {torch.cuda.is_available()}')"
