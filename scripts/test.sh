#!/usr/bin/env bash
# Set up (if needed) and run the test suite. GPU tests skip cleanly without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
# Two pytest workers (pytest-xdist), whole files per worker so module fixtures are built once:
# tracing is single-threaded Python, so two workers on two cores nearly halve the run.
# KIMI_CG_TEST_WORKERS=0 runs in one process.
workers=${KIMI_CG_TEST_WORKERS:-2}
if [ "$workers" != "0" ] && python -c "import xdist" >/dev/null 2>&1; then
  parallel=(-n "$workers" --dist loadfile)
else
  parallel=()
fi
python -m pytest -q -p no:cacheprovider "${parallel[@]}" tests "$@"
