"""Probe: why torch.compile(mode="reduce-overhead") fails on the MoonViT tower (W1, H200)."""
import sys, traceback, time
import torch
from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel

def attempt(label, fn):
    try:
        t = time.perf_counter(); out = fn(); torch.cuda.synchronize()
        print(f"[{label}] ok in {time.perf_counter()-t:.1f}s", flush=True); return out
    except Exception as e:
        print(f"[{label}] FAILED: {type(e).__name__}: {str(e)[:1500]}", flush=True)
        traceback.print_exc(limit=-6)

grid = torch.tensor([[32, 32]])
x = torch.randn(1024, 3, 14, 14, device="cuda").bfloat16()
for impl in ("flash_attention_2", "sdpa"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = MoonVitConfig(); cfg.attn_implementation = impl
    m = MoonVitPretrainedModel(cfg).cuda().bfloat16().eval()
    with torch.no_grad():
        ref = m(x, grid)
        c = torch.compile(m, mode="reduce-overhead")
        for i in range(4):
            out = attempt(f"{impl} call {i}", lambda: c(x, grid))
        if out is not None:
            print(impl, "max abs diff", max(float((a.float()-b.float()).abs().max()) for a, b in zip(out, ref)))
# the custom op alone
from kimi_cg.ops.varlen_attention import varlen_attention
def f(q, cu):
    return torch.ops.kimi_cg.varlen_attention(q * 2, q, q, cu, 1024) + 1
torch._dynamo.reset()
q = torch.randn(1024, 16, 72, device="cuda", dtype=torch.bfloat16); cu = torch.tensor([0, 1024], device="cuda", dtype=torch.int32)
cf = torch.compile(f, mode="reduce-overhead")
for i in range(3):
    attempt(f"op alone {i}", lambda: cf(q, cu))
