"""Why torch.compile(mode="reduce-overhead") fails on the MoonViT tower (a GPU diagnostic).

    python scripts/probe_reduce_overhead.py

Runs W1 (one 32x32-patch image, real Kimi-VL config, bf16) under mode="reduce-overhead" with the
tower's two attention implementations, then ``kimi_cg::varlen_attention`` alone, and prints which
calls fail and how. On the H200 (torch 2.11, 2026-11-30): the flash tower's first call works and
every later call fails in cudagraph trees' recording ("storage data ptrs are not allocated in
pool"); the sdpa tower and the op alone work (docs/benchmarks.md).
"""

from __future__ import annotations

import time
import traceback

import torch

from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel


def attempt(label: str, function):
    try:
        start = time.perf_counter()
        out = function()
        torch.cuda.synchronize()
        print(f"[{label}] ok in {time.perf_counter() - start:.1f} s", flush=True)
        return out
    except Exception as error:  # noqa: BLE001 - the failure is what this script reports
        print(f"[{label}] FAILED: {type(error).__name__}: {str(error)[:1500]}", flush=True)
        traceback.print_exc(limit=-6)
        return None


def probe_tower(attn_implementation: str, calls: int = 4) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = MoonVitConfig(attn_implementation=attn_implementation)
    model = MoonVitPretrainedModel(config).to("cuda", torch.bfloat16).eval()
    grid = torch.tensor([[32, 32]])
    pixels = torch.randn(1024, 3, 14, 14, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        reference = model(pixels, grid)
        compiled = torch.compile(model, mode="reduce-overhead")
        out = None
        for call in range(calls):
            out = attempt(f"{attn_implementation} call {call}", lambda: compiled(pixels, grid))
    if out is not None:
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(out, reference))
        print(f"{attn_implementation}: max abs difference to eager {diff:.3g} (bf16)", flush=True)


def probe_op_alone(calls: int = 3) -> None:
    import kimi_cg.ops.varlen_attention  # noqa: F401  (registers the op)

    def attention(q, cu_seqlens):
        return torch.ops.kimi_cg.varlen_attention(q * 2, q, q, cu_seqlens, 1024) + 1

    torch._dynamo.reset()
    q = torch.randn(1024, 16, 72, device="cuda", dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, 1024], device="cuda", dtype=torch.int32)
    compiled = torch.compile(attention, mode="reduce-overhead")
    for call in range(calls):
        attempt(f"varlen_attention alone, call {call}", lambda: compiled(q, cu_seqlens))


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("probe_reduce_overhead.py needs a GPU")
    for attn_implementation in ("flash_attention_2", "sdpa"):
        probe_tower(attn_implementation)
    probe_op_alone()


if __name__ == "__main__":
    main()
