"""Dynamo's trace time per item count of a tower compiled with kimi_cg (the part of a warm-up that grows).

Each item count is a new dynamo trace (the grid's ``.tolist()`` loops unroll per item). This calls the
compiled tower with 1, 2, ... items, twice each, and reports per count the first call, the repeat, and
their difference (the trace and the host program's build; the device program is compiled at the first
count, so its difference includes that compile). One process, so A/B comparisons hold:

    python -P scripts/trace_bench.py --family moonvit --max-items 8 --out t.json                 # real size, CPU
    python -P scripts/trace_bench.py --family moonvit --max-items 8 --no-resize-by-shape --out t0.json
    python -P scripts/trace_bench.py --family moonvit --smoke-test-on-cpu --out t.json            # tiny tower

``--no-resize-by-shape`` puts torch's upsample kernels back (NOTE [resize traced by shape] in
kimi_cg/resize_shapes.py) to measure what that note saves. ``--blocks-as-regions`` calls
``kimi_cg.warmup.mark_repeated_blocks`` first (dynamo traces one block per count and reuses it for the others)
and compares the largest count's outputs with eager's. Families are family_bench.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also under python -P / PYTHONSAFEPATH

# item sizes (t, h, w) in patches, one frame each; count n takes the first n
SIZES = [[1, 8, 8], [1, 8, 10], [1, 10, 8], [1, 12, 8], [1, 8, 12], [1, 10, 10], [1, 12, 12], [1, 14, 8],
         [1, 8, 14], [1, 16, 8], [1, 8, 16], [1, 14, 10]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="moonvit")
    parser.add_argument("--max-items", type=int, default=8)
    parser.add_argument("--smoke-test-on-cpu", action="store_true", help="tiny tower")
    parser.add_argument("--no-resize-by-shape", action="store_true", help="torch's upsample kernels while tracing")
    parser.add_argument("--blocks-as-regions", action="store_true",
                        help="mark repeated blocks' classes as nested compile regions (measures that lever)")
    parser.add_argument("--commit", default=None, help="recorded in the report")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not 1 <= args.max_items <= len(SIZES):
        parser.error(f"--max-items must be in 1..{len(SIZES)}")

    import torch

    import family_bench
    import kimi_cg
    from kimi_cg.warmup import mark_repeated_blocks
    from kimi_cg import resize_shapes

    if args.no_resize_by_shape:
        resize_shapes.uninstall()
        resize_shapes.install = lambda: None  # kimi_cg.reset() and the backend re-install otherwise
    torch.manual_seed(0)
    model, config = family_bench.build(args.family, args.smoke_test_on_cpu, "cpu", torch.float32)
    make_inputs = family_bench.inputs_for(args.family, config, "cpu", torch.float32)
    regions = [cls.__qualname__ for cls in mark_repeated_blocks(model)] if args.blocks_as_regions else []
    compiled = torch.compile(model, backend="kimi_cg", options={"device_compiler": "inductor"})
    counts = []
    with torch.no_grad():
        for n in range(1, args.max_items + 1):
            inputs = make_inputs(SIZES[:n])
            started = time.perf_counter()
            compiled(*inputs)
            first = time.perf_counter() - started
            started = time.perf_counter()
            compiled(*inputs)
            repeat = time.perf_counter() - started
            counts.append({"items": n, "first_s": round(first, 3), "repeat_s": round(repeat, 3),
                           "trace_s": round(first - repeat, 3)})
            print(counts[-1], flush=True)
        outputs_vs_eager = _max_difference(compiled(*inputs), model(*inputs)) if regions else None
    report = {"family": args.family, "smoke_test_on_cpu": args.smoke_test_on_cpu,
              "resize_by_shape": not args.no_resize_by_shape, "blocks_as_regions": regions,
              "max_abs_difference_vs_eager_at_the_largest_count": outputs_vs_eager, "commit": args.commit, "torch": torch.__version__,
              "command": " ".join(sys.argv), "counts": counts,
              "trace_s_from_2_items": round(sum(c["trace_s"] for c in counts[1:]), 2),
              "counters": dict(kimi_cg.counters), "timings": dict(kimi_cg.timings)}
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)
    print("traces from 2 items on:", report["trace_s_from_2_items"], "s")


def _max_difference(got, want) -> float:
    import torch

    got = got if isinstance(got, (list, tuple)) else [got]
    want = want if isinstance(want, (list, tuple)) else [want]
    return max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want, strict=True)) if got else 0.0


if __name__ == "__main__":
    main()
