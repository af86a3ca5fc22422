"""kimi_cg demo: compile a MoonViT tower with backend="kimi_cg" and compare it with eager.

    python scripts/demo.py                     # tiny config on CPU, real Kimi-VL config in bf16 on a GPU
    python scripts/demo.py --tower moonvit3d   # Kimi-K2.5's tower, with video chunks

Prints, per grid batch, the compiled-vs-eager error and median times, then kimi_cg's counters.
Random weights: the point is the compiler, not the model's answers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kimi_cg
from kimi_cg.models import MoonViT3dConfig, MoonViT3dPretrainedModel, MoonVitConfig, MoonVitPretrainedModel

IMAGE_GRIDS = [[[32, 32]], [[16, 24], [40, 12]], [[8, 8], [64, 2], [20, 30]], [[24, 16], [12, 40]], [[32, 32]]]
CHUNK_GRIDS = [[[1, 32, 32]], [[4, 16, 24], [1, 40, 12]], [[2, 8, 8], [1, 64, 2], [3, 20, 10]], [[1, 32, 32]]]


def timed(fn, repeats: int, device: torch.device) -> tuple[object, float]:
    times = []
    result = None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return result, statistics.median(times)


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((g.float() - w.float()).norm() ** 2) for g, w in zip(got, want)) ** 0.5
    den = sum(float(w.float().norm() ** 2) for w in want) ** 0.5
    return num / den


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tower", choices=["moonvit", "moonvit3d"], default="moonvit")
    parser.add_argument("--config", choices=["tiny", "real"], default=None, help="default: real on CUDA, tiny on CPU")
    parser.add_argument("--attn", choices=["flash_attention_2", "sdpa"], default="flash_attention_2")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = args.config or ("real" if device.type == "cuda" else "tiny")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config_class, model_class = (
        (MoonVitConfig, MoonVitPretrainedModel) if args.tower == "moonvit" else (MoonViT3dConfig, MoonViT3dPretrainedModel)
    )
    config = config_class.tiny(attn_implementation=args.attn) if size == "tiny" else config_class(attn_implementation=args.attn)
    grids = IMAGE_GRIDS if args.tower == "moonvit" else CHUNK_GRIDS
    torch.manual_seed(0)
    model = model_class(config).to(device=device, dtype=dtype).eval()
    compiled = torch.compile(model, backend="kimi_cg")
    print(f"kimi_cg demo: {args.tower} ({size}: {config.num_hidden_layers} layers, hidden {config.hidden_size}), "
          f"{args.attn}, {dtype}, {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), torch {torch.__version__}")
    print(f"{'grid':<34} {'patches':>7} {'rel err':>9} {'eager ms':>9} {'kimi_cg ms':>10} {'first call s':>12}")
    worst = 0.0
    with torch.no_grad():
        for step, grid in enumerate(grids):
            grid_tensor = torch.tensor(grid, device=device)
            rows = int(grid_tensor.prod(dim=-1).sum())
            generator = torch.Generator(device=device).manual_seed(step)
            pixel_values = torch.randn(rows, 3, 14, 14, device=device, dtype=dtype, generator=generator)
            start = time.perf_counter()
            compiled(pixel_values, grid_tensor)
            first = time.perf_counter() - start
            want, eager_ms = timed(lambda: model(pixel_values, grid_tensor), args.repeats, device)
            got, compiled_ms = timed(lambda: compiled(pixel_values, grid_tensor), args.repeats, device)
            error = relative_error(got, want)
            if any(torch.isnan(g).any() for g in got):
                raise SystemExit(f"NaN in the compiled output for grid {grid}")
            worst = max(worst, error)
            print(f"{str(grid):<34} {rows:>7} {error:>9.2e} {eager_ms:>9.2f} {compiled_ms:>10.2f} {first:>12.2f}")
    counts = {key: value for key, value in sorted(kimi_cg.counters.items())}
    print(f"worst relative error {worst:.2e}; counters {counts}")


if __name__ == "__main__":
    main()
