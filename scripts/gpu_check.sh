#!/usr/bin/env bash
# GPU proof on the H200: core tests under the GPU machine's torch, the GPU tests (CUDA-graph replays
# vs eager in bf16, fuzzed, poisoned pool; data_parallel over NCCL where the host has two GPUs), then a
# short summary. Parts, each meant for a call of at most 10 minutes (`all` runs them one after another):
#   gpu     tiny towers, program cache, threads; the core CPU suite beside them (test_gpu alone took 487 s on
#           a slower H100 host at ee37e63, 2026-12-07: kernels have their own part so each fits one call)
#   kernels the kernels (merge gather, resize, unpack, table gather, attention, linear + GELU), data_parallel,
#           and the runtime's CUDA cases
#   towers  transformers' towers (tiny, bf16, fuzzed; ~40 s each on the H200, 2026-12-05)
#   real    real-size Kimi-VL / MoonViT3d fuzz and exact-size graphs
#   cpu     the other CPU suites (foreign towers, program fuzz, reliability, testing, dumps)
#   families  transformers' towers at real sizes (Kimi-K2.5, Qwen2.5-VL-7B, Qwen2-VL-7B, GLM-4V; bf16, random
#           weights) fuzzed against an fp32 copy with a NaN-poisoned pool: scripts/family_bench.py --systems none
#           (KIMI_CG_FAMILIES and KIMI_CG_FAMILY_FUZZ_EXAMPLES choose; 4 examples took 47 s for GLM-4V, 62 s for
#           Qwen2-VL and 250 s for Qwen2.5-VL on an H100 at fd3e94d: one or two families per 10-minute call)
# On a GPU host without internet access kimi_cg comes from a wheel built beforehand:
#   pip wheel --no-deps --no-build-isolation -w .whl .   (and copy .whl/ along with the tree)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kimi_cg_gpu}; mkdir -p "$OUT"
if ls .whl/kimi_cg-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/kimi_cg_site .whl/kimi_cg-*.whl && export PYTHONPATH=/tmp/kimi_cg_site
fi
python3 -P -c "import torch, kimi_cg.kernels; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
export KIMI_CG_GPU_SUMMARY="$OUT/gpu_summary.json"
rm -f "$KIMI_CG_GPU_SUMMARY"  # the GPU tests add their cases to it, part after part
status=0
part=${1:-all}
case "$part" in all|gpu|kernels|towers|real|cpu|families) ;; *) echo "usage: $0 [all|gpu|kernels|towers|real|cpu|families]" >&2; exit 2 ;; esac
want() { [ "$part" = all ] || [ "$part" = "$1" ]; }
# The core (CPU) suite under this machine's torch runs beside the GPU tests, on the CPU only
# (dynamo's unbacked-integer handling differs between torch versions). Full logs go to $OUT as they
# are written, so they come back even if the run hits its time limit.
core=
want gpu && (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=4 python3 -P -m pytest -q -p no:cacheprovider --durations=5 \
  tests/test_backend.py tests/test_runtime.py tests/test_models.py tests/test_resize.py tests/test_dynamo_settings.py \
  tests/test_soundness.py tests/test_diagnostics.py tests/test_seed_style.py tests/test_flash_path.py tests/test_program_cache.py > "$OUT/core_tests.txt" 2>&1) &
want gpu && core=$!
# Foreign towers (this machine's transformers) and the program fuzzer, in a second CPU process.
foreign=
want cpu && (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=4 python3 -P -m pytest -q -p no:cacheprovider --durations=5 \
  tests/test_foreign_towers.py tests/test_program_fuzz.py > "$OUT/foreign_tests.txt" 2>&1) &
want cpu && foreign=$!
# Runtime reliability (threads, weight changes, memory budget, bad inputs), in a third CPU process.
reliability=
want cpu && (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=4 python3 -P -m pytest -q -p no:cacheprovider --durations=5 \
  tests/test_reliability.py tests/test_split_video.py tests/test_options.py > "$OUT/reliability_tests.txt" 2>&1) &
want cpu && reliability=$!
# kimi_cg.testing and the debug dumps under this machine's torch, in a fourth CPU process.
testing=
want cpu && (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=4 python3 -P -m pytest -q -p no:cacheprovider --durations=5 \
  tests/test_testing.py tests/test_dumps.py > "$OUT/testing_dump_tests.txt" 2>&1) &
want cpu && testing=$!
gpu_tests() {  # name, then pytest arguments; the log goes to $OUT/gpu_tests_<name>.txt as it is written
  local name=$1; shift
  python3 -P -m pytest -v -p no:cacheprovider --durations=10 "$@" > "$OUT/gpu_tests_$name.txt" 2>&1 || status=1
  tail -15 "$OUT/gpu_tests_$name.txt"
}
want gpu && gpu_tests gpu tests/test_gpu.py -k "not real and not transformers_tower and not exact_size"
want kernels && gpu_tests kernels tests/test_kernels.py tests/test_varlen_attention.py tests/test_varlen_work_list.py \
  tests/test_linear_gelu.py tests/test_table_gather.py tests/test_unpack.py tests/test_data_parallel.py
# The runtime's CUDA cases (host block, fills skipped for kept values); the rest of test_runtime runs in the core suite
want kernels && gpu_tests runtime tests/test_runtime.py -k cuda
want towers && gpu_tests towers tests/test_gpu.py -k transformers_tower
want real && gpu_tests real tests/test_gpu.py -k "real or exact_size"
if want families; then
  (cd scripts && python3 -P family_bench.py --families "${KIMI_CG_FAMILIES:-kimi_k25,qwen2_5_vl,qwen2_vl,glm4v}" --systems none \
    --fuzz-examples "${KIMI_CG_FAMILY_FUZZ_EXAMPLES:-4}" --out "$OUT/family_fuzz.json" > "$OUT/family_fuzz.txt" 2>&1) || status=1
  grep -E "fuzz|Error" "$OUT/family_fuzz.txt" | tail -8
fi
if [ -n "$core" ]; then wait $core || status=1; tail -8 "$OUT/core_tests.txt"; fi
if [ -n "$foreign" ]; then wait $foreign || status=1; tail -8 "$OUT/foreign_tests.txt"; fi
if [ -n "$reliability" ]; then wait $reliability || status=1; tail -8 "$OUT/reliability_tests.txt"; fi
if [ -n "$testing" ]; then wait $testing || status=1; tail -8 "$OUT/testing_dump_tests.txt"; fi
{ want gpu || want kernels || want towers || want real; } && python3 - "$KIMI_CG_GPU_SUMMARY" <<'PY'
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except FileNotFoundError:
    sys.exit("no GPU summary written")
print(f"GPU summary ({data['device']}, torch {data['torch']}):")
for case, s in data["cases"].items():
    c = s["counters"]
    print(f"  {case}: {s['batches']} batches ({s['distinct_grids']} distinct grids, {s['distinct_item_counts']} item counts, "
          f"up to {s['max_patches_in_a_batch']} patches), worst rel err vs fp32 {s['worst_relative_error_vs_fp32']:.2e} "
          f"(<= {s['worst_error_ratio_vs_eager_bf16']:.2f}x eager bf16), dynamo graphs {c.get('dynamo_graphs')}, "
          f"device programs {c.get('device_programs_compiled')}, captures {c.get('captures', 0)}, "
          f"replays {c.get('graph_replays', 0)}, fallbacks {c.get('eager_fallbacks', 0)}, breaks {c.get('graph_breaks', 0)}")
PY
exit $status
