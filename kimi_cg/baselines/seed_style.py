"""A hand-written, graph-safe Kimi-VL tower in the way serving engines did it by hand (the baseline).

What the seeds do, rewritten for this project from the published facts (design brief, section 2):
- per call, the grid metadata is recomputed *outside* the graph: per-image bicubic position
  embeddings (no cache), RoPE slices, padded cu_seqlens, max_seqlen, the merger gather index;
- the graph body (patch embedding + 27 blocks + final LayerNorm + packed merger by index_select)
  depends only on the budget: one CUDA graph per token budget (output tokens, doubling from 64),
  captured largest first into one pool; a batch replays the smallest budget that fits, otherwise
  it runs eagerly;
- padding follows the seeds' *fixed* behaviour: buffers zeroed, one trailing cu_seqlens segment
  over the padding rows, and max_seqlen = the budget in patches (budget * 4), so the baseline is not
  handicapped by the bugs kimi_cg is meant to avoid.
It exists for scripts/bench.py (system "seed_style"); tests check it against the eager tower.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kimi_cg.ops  # noqa: F401  (registers torch.ops.kimi_cg.*)
from kimi_cg.models.moonvit import MoonVitPretrainedModel, apply_rope


class SeedStyleMoonVit:
    def __init__(self, tower: MoonVitPretrainedModel, max_output_tokens: int = 4096, max_items: int = 32,
                 capture: bool | None = None):
        self.tower = tower
        self.kernel = tower.merge_kernel_size
        self.window = self.kernel[0] * self.kernel[1]
        budgets, size = [], 64
        while size < max_output_tokens:
            budgets.append(size)
            size *= 2
        self.budgets = budgets + [max_output_tokens]
        self.max_items = max_items
        self.capture = capture
        self.graphs: dict[int, tuple] = {}
        self.pool = None

    # -- metadata, recomputed every call (host side) ---------------------------------------------
    def prepare_metadata(self, grid_hws: torch.Tensor, device: torch.device, dtype: torch.dtype):
        shapes = grid_hws.tolist()
        pos_weight = self.tower.patch_embed.pos_emb.weight
        grid = pos_weight.permute(2, 0, 1).unsqueeze(0)
        pos = torch.cat([
            F.interpolate(grid, size=(h, w), mode="bicubic").squeeze(0).permute(1, 2, 0).flatten(end_dim=1)
            for h, w in shapes
        ]).to(dtype)
        rope = self.tower.encoder.rope_2d
        if rope.freqs_cis is None:
            rope.freqs_cis = rope._precompute_freqs_cis(device)
        freqs = torch.cat([rope.freqs_cis[:h, :w].reshape(-1, rope.dim // 2) for h, w in shapes])
        lengths = [h * w for h, w in shapes]
        index, start = [], 0
        kh, kw = self.kernel
        for h, w in shapes:
            rows = torch.arange(start, start + h * w, device=device).view(h // kh, kh, w // kw, kw)
            index.append(rows.permute(0, 2, 1, 3).reshape(-1))
            start += h * w
        return pos, freqs, lengths, torch.cat(index)

    # -- the graph body ---------------------------------------------------------------------------
    def _body(self, pixels, pos, freqs, cu_seqlens, index, max_seqlen: int):
        tower = self.tower
        x = tower.patch_embed.proj(pixels).view(pixels.size(0), -1) + pos
        for block in tower.encoder.blocks:
            qkv = block.wqkv(block.norm0(x)).view(x.size(0), 3, block.num_heads, block.head_dim)
            q, k, v = qkv.unbind(dim=1)
            q, k = apply_rope(q, k, freqs)
            attn = torch.ops.kimi_cg.varlen_attention(q, k, v, cu_seqlens, max_seqlen).flatten(-2)
            x = x + block.wo(attn)
            x = x + block.mlp(block.norm1(x))
        x = tower.encoder.final_layernorm(x)
        return x.index_select(0, index).view(-1, self.window, x.size(-1))

    def _buffers(self, budget: int, pixels, pos, freqs):
        patches = budget * self.window
        return (
            pixels.new_zeros((patches, *pixels.shape[1:])),
            pos.new_zeros((patches, pos.shape[1])),
            freqs.new_zeros((patches, freqs.shape[1])),
            torch.full((self.max_items + 2,), patches, dtype=torch.int32, device=pixels.device),
            torch.zeros(patches, dtype=torch.long, device=pixels.device),
        )

    def _capture(self, budget: int, buffers):
        patches = budget * self.window
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        buffers[3][0] = 0
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._body(*buffers, patches)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._body(*buffers, patches)
        return graph, out

    def capture_all(self, pixels, pos, freqs) -> None:
        for budget in sorted(self.budgets, reverse=True):
            if budget not in self.graphs:
                buffers = self._buffers(budget, pixels, pos, freqs)
                graph, out = self._capture(budget, buffers) if self._capturing(pixels) else (None, None)
                self.graphs[budget] = (buffers, graph, out)

    def _capturing(self, pixels) -> bool:
        return pixels.is_cuda if self.capture is None else self.capture

    @torch.no_grad()
    def __call__(self, pixel_values: torch.Tensor, grid_hws: torch.Tensor) -> list[torch.Tensor]:
        pos, freqs, lengths, index = self.prepare_metadata(grid_hws, pixel_values.device, pixel_values.dtype)
        total = sum(lengths)
        outputs_per_item = [n // self.window for n in lengths]
        needed = total // self.window
        budget = next((b for b in self.budgets if b >= needed), None)
        if budget is None or len(lengths) > self.max_items:
            cu = torch.tensor([0] + lengths, device=pixel_values.device).cumsum(0).to(torch.int32)
            merged = self._body(pixel_values, pos, freqs, cu, index, max(lengths))
            return list(merged.split(outputs_per_item))
        self.capture_all(pixel_values, pos, freqs)
        buffers, graph, out = self.graphs[budget]
        static_pixels, static_pos, static_freqs, static_cu, static_index = buffers
        for static, value in ((static_pixels, pixel_values), (static_pos, pos), (static_freqs, freqs)):
            static.zero_()
            static[: value.shape[0]].copy_(value)
        bounds = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        static_cu.fill_(budget * self.window)  # trailing segment over the padding, then empty ones
        static_cu[: bounds.numel()].copy_(bounds)
        static_index.zero_()  # padded gather rows read row 0 (a real, finite row); they are sliced off
        static_index[: index.numel()].copy_(index)
        if graph is None:
            out = self._body(*buffers, budget * self.window)
        else:
            graph.replay()
        return list(out[:needed].clone().split(outputs_per_item))
