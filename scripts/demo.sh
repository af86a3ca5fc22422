#!/usr/bin/env bash
# Set up (if needed) and run the main demo: compile a MoonViT tower with backend="kimi_cg", run a
# few grids, print compiled-vs-eager error and timings (tiny config on CPU, real config on a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
python scripts/demo.py "$@"
