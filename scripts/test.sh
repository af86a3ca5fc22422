#!/usr/bin/env bash
# Set up (if needed) and run the test suite. GPU tests skip cleanly without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
# The checkout's top-level kernels/ (installed as kimi_cg.kernels) must not shadow an installed
# package named `kernels` (Hugging Face's, which transformers >= 5.25 imports): keep the working
# directory off sys.path, in pytest, its workers and the scripts the tests start.
export PYTHONSAFEPATH=1
# Two pytest workers (pytest-xdist), whole files per worker so module fixtures are built once:
# tracing is single-threaded Python, so two workers on two cores nearly halve the run.
# KIMI_CG_TEST_WORKERS=0 runs in one process.
workers=${KIMI_CG_TEST_WORKERS:-2}
if [ "$workers" != "0" ] && python -c "import xdist" >/dev/null 2>&1; then
  parallel=(-n "$workers" --dist loadfile)
else
  parallel=()
fi
if [ ${#parallel[@]} -eq 0 ]; then
  exec python -m pytest -q -p no:cacheprovider tests "$@"
fi
# Tests marked `alone` time themselves against a wall clock: they run afterwards, by themselves.
# Exit status 5 means "nothing selected" (e.g. a -k that matches only one of the two parts).
for part in "not alone" "alone"; do
  if [ "$part" = "alone" ]; then parallel=(); fi
  status=0
  python -m pytest -q -p no:cacheprovider "${parallel[@]}" -m "$part" tests "$@" || status=$?
  if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
done
