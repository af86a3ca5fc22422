"""Backend options, validated once and hashed: ``torch.compile(m, backend="kimi_cg", options={...})``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class KimiCGConfig:
    device_compiler: str = "auto"
    """How the device program is compiled: "eager" runs the FX graph as is, "inductor" compiles it
    once with Inductor (dynamic in the patch count), "auto" picks inductor on CUDA, eager on CPU."""

    metadata_cache_bytes: int = 1 << 30
    """Budget of the per-item host metadata cache (position embeddings, RoPE slices); LRU beyond."""

    batch_cache_size: int = 16
    """Recent batches (same grid, same weights) whose whole host pass is reused; 0 disables."""

    debug_dir: str | None = None
    """When set, each compiled graph writes its stages (before/after each pass, host and device
    programs, the lift report) under this folder. Also read from the env var KIMI_CG_DEBUG_DIR."""

    cuda_graphs: bool | None = None
    """Replay the device program as CUDA graphs per token bucket. None: on when the activations are
    on CUDA. Setting it on a CPU model runs the same bucketed, padded path without capture (tests)."""

    token_budgets: tuple[int, ...] | None = None
    """Bucket capacities in patches (L rows). None: the geometric ladder from ``min_tokens`` to
    ``max_tokens`` with ``buckets_per_doubling`` steps per doubling."""

    min_tokens: int = 1024
    """Smallest bucket of the default ladder."""

    max_tokens: int = 16384
    """Largest bucket of the default ladder (a 128x128-patch image fits)."""

    buckets_per_doubling: int = 4
    """Steps of the default ladder per doubling, each rounded up to a multiple of 256 patches. With 4
    (ratio <= 1.25) padding is at most 20% of a bucket, about 10% on average; with doubling buckets
    (up to 50% padding) W4 took 37.6 ms per request on the H200, with 4 steps 28.1 ms (graph memory
    283 MB -> 888 MB; the buckets share one pool). More buckets cost capture time."""

    max_items: int = 32
    """Most items (images, video chunks) one replay takes; more run the non-graphed program."""

    max_frames: int = 4
    """Most frames merged into one output row (the temporal-mean width of the gather plan)."""

    poison_graph_pool: bool = False
    """Testing aid: fill the CUDA-graph memory pool with NaN before capturing, so that any read of
    memory the graphs did not write shows up as NaN in the outputs (NOTE [padding rules])."""

    strict: bool = False
    """False (default): a graph or call kimi_cg cannot lift runs the captured graph unchanged (correct,
    with its host syncs), counted in ``kimi_cg.fallbacks`` by reason and warned once per source
    location. True: it raises UnsupportedGraphError instead (for model authors and CI proving that a
    tower is fully lifted). NOTE [errors by who must act] in errors.py."""

    def __post_init__(self):
        if self.device_compiler not in ("auto", "eager", "inductor"):
            raise ValueError(f"device_compiler must be auto, eager or inductor; got {self.device_compiler!r}")
        if not isinstance(self.metadata_cache_bytes, int) or self.metadata_cache_bytes < 0:
            raise ValueError(f"metadata_cache_bytes must be a non-negative int; got {self.metadata_cache_bytes!r}")
        if self.token_budgets is not None:
            budgets = tuple(self.token_budgets)
            if not budgets or any(not isinstance(b, int) or b <= 0 for b in budgets):
                raise ValueError(f"token_budgets must be positive ints; got {self.token_budgets!r}")
            object.__setattr__(self, "token_budgets", tuple(sorted(set(budgets))))
        for name in ("min_tokens", "max_tokens", "buckets_per_doubling", "max_items", "max_frames"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive int; got {getattr(self, name)!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} > max_tokens {self.max_tokens}")

    def buckets(self) -> tuple[int, ...]:
        """Bucket capacities, ascending: the user's, or the geometric ladder from min_tokens to
        max_tokens (buckets_per_doubling steps per doubling, rounded up to multiples of 256)."""
        if self.token_budgets is not None:
            return self.token_budgets
        ladder = [self.min_tokens]
        step = 1
        while ladder[-1] < self.max_tokens:
            size = round(self.min_tokens * 2 ** (step / self.buckets_per_doubling))
            size = min(self.max_tokens, -(-size // 256) * 256)  # rounded up to a multiple of 256
            if size > ladder[-1]:
                ladder.append(size)
            step += 1
        return tuple(ladder)

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> "KimiCGConfig":
        import os

        values = dict(options or {})
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown kimi_cg options {unknown}; known: {sorted(known)}")
        if values.get("debug_dir") is None and os.environ.get("KIMI_CG_DEBUG_DIR"):
            values["debug_dir"] = os.environ["KIMI_CG_DEBUG_DIR"]
        return cls(**values)

    def compute_hash(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]
