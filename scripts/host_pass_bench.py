"""Host pass time per call on the CPU: the host metadata program of a deep MoonViT (issue 14).

    python scripts/host_pass_bench.py [--layers 27] [--requests 12] [--save-outputs out.pt]

The tower has the tiny config's widths and ``--layers`` layers (the host program's size follows the
layers and the items, not the widths), compiled with ``cuda_graphs=True`` (the padded path runs
without capture on the CPU) and the batch cache off, so that every call runs its host program. One
pass over W4-like requests (bench.py's stream, seed 4) caches every item's metadata; then three
passes are timed and the best mean host pass per call is printed, with the host program's node
count. ``--save-outputs`` writes the first pass's outputs, to compare two versions bitwise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (the W4 stream)

from kimi_cg.host_program import HostProgram  # noqa: E402
from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--save-outputs", default=None)
    args = parser.parse_args()
    bench.DEVICE = "cpu"
    seconds, programs = [], []
    original_call, original_init = HostProgram.__call__, HostProgram.__init__

    def timed_call(self, *inputs):
        start = time.perf_counter()
        try:
            return original_call(self, *inputs)
        finally:
            seconds.append(time.perf_counter() - start)

    def recorded_init(self, *a, **k):
        original_init(self, *a, **k)
        programs.append(self)

    HostProgram.__call__, HostProgram.__init__ = timed_call, recorded_init
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny(num_hidden_layers=args.layers)).eval()
    compiled = torch.compile(model, backend="kimi_cg", options={"cuda_graphs": True, "batch_cache_size": 0})
    stream = bench.request_stream(seed=4, count=args.requests)
    inputs = [bench.make_inputs(grid, i, dtype=torch.float32) for i, grid in enumerate(stream)]
    with torch.no_grad():
        outputs = [[tensor.detach() for tensor in compiled(*call)] for call in inputs]
        passes = []
        for _ in range(3):
            seconds.clear()
            for call in inputs:
                compiled(*call)
            passes.append(statistics.fmean(seconds) * 1e3)
    nodes = {len(program.gm.graph.nodes) for program in programs}
    items = statistics.fmean(len(call[1]) for call in inputs)
    print(f"host pass per call: {min(passes):.3f} ms (passes {[round(p, 3) for p in passes]}), "
          f"{items:.1f} items per call, {args.layers} layers, host program nodes {sorted(nodes)}")
    if args.save_outputs:
        torch.save(outputs, args.save_outputs)


if __name__ == "__main__":
    main()
