#!/usr/bin/env bash
# Set up (if needed) and run the test suite. GPU tests skip cleanly without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
python -m pytest -q -p no:cacheprovider tests "$@"
