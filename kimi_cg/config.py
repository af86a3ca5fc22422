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

    debug_dir: str | None = None
    """When set, each compiled graph writes its stages (before/after each pass, host and device
    programs, the lift report) under this folder. Also read from the env var KIMI_CG_DEBUG_DIR."""

    strict: bool = True
    """Raise UnsupportedGraphError when a graph cannot be lifted; when False, log the reason and run
    the captured graph unchanged (correct, but with host syncs)."""

    def __post_init__(self):
        if self.device_compiler not in ("auto", "eager", "inductor"):
            raise ValueError(f"device_compiler must be auto, eager or inductor; got {self.device_compiler!r}")
        if not isinstance(self.metadata_cache_bytes, int) or self.metadata_cache_bytes < 0:
            raise ValueError(f"metadata_cache_bytes must be a non-negative int; got {self.metadata_cache_bytes!r}")

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
