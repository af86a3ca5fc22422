#!/usr/bin/env bash
# Quick GPU smoke run (device machine): core tests under the GPU's torch, then the demo on the real config.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kimi_cg_out}; mkdir -p "$OUT"
# The device machine has no internet: install the wheel built here (pip wheel --no-deps -w .whl .)
# into /tmp/site, and run pytest (not python -m pytest) so that kimi_cg comes from there.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/kimi_cg-*.whl && export PYTHONPATH=/tmp/site
python3 -c "import torch, triton, kimi_cg.kernels; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 300 pytest -q -x -p no:cacheprovider tests/test_backend.py tests/test_models.py 2>&1 | tail -25 | tee "$OUT/core_tests.txt"
timeout 240 python3 scripts/demo.py 2>&1 | grep -v Warning | tail -12 | tee "$OUT/demo_moonvit.txt"
timeout 200 python3 scripts/demo.py --tower moonvit3d 2>&1 | grep -v Warning | tail -10 | tee "$OUT/demo_moonvit3d.txt"
