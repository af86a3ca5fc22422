"""Fuzz a transformers vision tower's kimi_cg compile against eager with kimi_cg.testing.

The example uses Qwen2-VL's vision tower, tiny and with random weights (nothing is downloaded); swap in
your own tower by changing ``qwen2_vl()``. Three ways to run it:

    python scripts/fuzz_transformers_tower.py --examples 20            # this file's main()
    python -m kimi_cg.testing scripts/fuzz_transformers_tower.py:qwen2_vl --examples 20
    # or in pytest, with pytest_plugins = ["kimi_cg.testing.pytest_plugin"] in conftest.py:
    #   def test_qwen2_vl(kimi_cg_fuzz): kimi_cg_fuzz(*qwen2_vl_parts())

Qwen2-VL takes (hidden_states [L, 3 * 2 * 14 * 14], grid_thw [N, 3]): each row is one patch of two frames
(t counts temporal patches), h and w are multiples of the 2 x 2 merger, L = sum of t * h * w.
"""

from __future__ import annotations

import argparse
import sys

import torch

import kimi_cg.testing


def qwen2_vl(device: str = "cpu", dtype: str = "float32") -> kimi_cg.testing.Target:
    """Qwen2-VL's vision tower (2 layers, width 64) as a fuzz target: model, inputs per grid, grids."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    config = Qwen2VLVisionConfig(depth=2, embed_dim=64, hidden_size=48, mlp_ratio=2, num_heads=4, in_channels=3,
                                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(0)  # the same random weights on every run, so a failure reproduces
    model = Qwen2VisionTransformerPretrainedModel._from_config(config, attn_implementation="sdpa")
    model = model.eval().to(device=device, dtype=getattr(torch, dtype))
    row_width = config.in_channels * config.temporal_patch_size * config.patch_size**2

    def make_inputs(grid):
        grid_thw = torch.tensor(grid, dtype=torch.int64)  # on the host, as a processor returns it
        rows = int(grid_thw.prod(dim=-1).sum())
        return torch.randn(rows, row_width).to(device=device, dtype=model.dtype), grid_thw

    # Images and videos of 1..2 temporal patches, up to 3 items, sides up to 16 patches: small enough
    # that every item count traces in seconds on a CPU.
    grids = kimi_cg.testing.grids(dims=3, max_items=3, max_side=16, max_patches=768, max_frames=2)
    # The tower returns the merged features (a BaseModelOutputWithPooling in recent transformers).
    return kimi_cg.testing.Target(model, make_inputs, grids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", help="float32 (1e-5 rule) or bfloat16 (2x-eager rule)")
    args = parser.parse_args(argv)
    target = qwen2_vl(args.device, args.dtype)
    compiled = torch.compile(target.model, backend="kimi_cg")
    try:
        report = kimi_cg.testing.assert_matches_eager(target.model, compiled, target.make_inputs, target.grids,
                                                      max_examples=args.examples)
    except kimi_cg.testing.MismatchError as failure:
        print(failure, file=sys.stderr)
        return 1
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
