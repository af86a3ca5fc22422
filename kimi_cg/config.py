"""Backend options, validated once and hashed: ``torch.compile(m, backend="kimi_cg", options={...})``.

Every option is checked for its type and range when the config is built, so that a typo fails with
a ValueError naming the option instead of a TypeError (or a huge allocation) at the first call.
``validate_options`` runs the same checks before a model is compiled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

MAX_BUCKET_TOKENS = 1 << 22
"""Largest bucket capacity in patches (token_budgets, min_tokens, max_tokens). Each bucket allocates
its static input buffers at its capacity, on the activations' device, at the first call; 4M patches
is 16x a 4-frame 256x256-patch video chunk, so a larger value is a mistake (10**9 patches asked a
CPU model for 157 GB at the first call)."""

MAX_ITEMS = 4096
"""Most items one replay may take. Each bucket's segment table has max_items + 2 entries, and dynamo
traces the tower once per item count, so a replay of thousands of items is never warm."""

MAX_FRAMES = 64
"""Most frames merged into one output row: every bucket's gather plan is [capacity, max_frames]
(2 GB of int64 at MAX_BUCKET_TOKENS and 64 frames)."""

MAX_BUCKETS_PER_DOUBLING = 64
"""Each bucket is captured separately (capture time, graph memory); 64 steps per doubling is a ratio
of 1.011 between buckets, finer than padding ever needs."""

MAX_EXACT_SIZE_GRAPHS = 1024
"""Each exact-size graph keeps its input and output buffers alive."""

MAX_LENGTH_CLASSES = 8
"""Bounds down to C / 128: below that a bound is one flash query block for most buckets."""

MAX_BATCH_CACHE_SIZE = 1024
"""Each cached batch keeps its whole host pass (metadata for every item) alive."""

MAX_METADATA_CACHE_BYTES = 1 << 40
"""1 TiB: more than any host has; a larger budget is a unit mistake, not a wish."""


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
    programs, the lift report) under this folder. Also read from the env var KIMI_CG_DEBUG_DIR.
    An os.PathLike is accepted and stored as its str."""

    cuda_graphs: bool | None = None
    """Replay the device program as CUDA graphs per token bucket. None: on when the activations are
    on CUDA. Setting it on a CPU model runs the same bucketed, padded path without capture (tests)."""

    token_budgets: tuple[int, ...] | None = None
    """Bucket capacities in patches (L rows). None: the geometric ladder from ``min_tokens`` to
    ``max_tokens`` with ``buckets_per_doubling`` steps per doubling. A list or tuple of ints, each at
    most MAX_BUCKET_TOKENS; stored sorted, without duplicates."""

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

    exact_size_graphs: int = 8
    """One-item sizes (one image, one segment) kept as CUDA graphs of their exact row count, made at
    a size's third call and dropped least recently used first; their attention runs cuDNN's dense
    kernel (NOTE [exact-size graphs] in runtime/graphs.py). 0 disables. Each holds its own input and
    output buffers (a 128x128-patch image: ~60 MB in bf16); intermediates share the buckets' pool."""

    attention_length_classes: int = 3
    """Graphs per bucket by the call's longest segment: a bucket of C rows is also captured with its
    attention bounded to C / 2, C / 4, ... (this many graphs in all), and a call replays the smallest
    that holds its longest segment, so flash launches fewer empty query blocks (NOTE [segment-length
    classes] in runtime/graphs.py). 1 disables. Each class costs a capture per bucket (warm-up time);
    its intermediates share the buckets' pool and it writes the bucket's own output buffers."""

    linear_gelu_epilogue: bool = True
    """Trace a linear layer whose only use is a tanh GELU as one op that CUDA runs as a cuBLASLt GEMM
    with bias and GELU in its epilogue, in bf16 / fp16 (NOTE [linear + GELU epilogue] in
    canonicalize/linear_gelu.py). False keeps the linear and the GELU as written."""

    table_gathers: bool = True
    """Per-item reads of a module-state table (MoonViT's position grid resized per image, its RoPE table
    sliced per image) run on the device as one gather of the table with a plan the host makes from
    the grid's integers (NOTE [table gathers] in runtime/table_rows.py): no call checks those tables'
    content (no host sync), so a serving loop's host work overlaps the device's. On an H100 host
    (2026-12-06, b7cb732): W1 -0.14 ms, W4 new sizes even, repeated sizes -0.9 ms, W4 back to back
    21.4 against 23.4 ms per request. False: the host computes the tables' per-item values on the
    device and checks the tables' content every call (NOTE [state tokens])."""

    host_block: bool = True
    """A bucket's host-made inputs (plans, segment boundaries) packed unpadded into one pinned copy per
    call and padded on the device by a kernel inside the bucket's graphs, instead of a copy and padding
    kernels each (NOTE [host block] in runtime/graphs.py). On by default since 2026-12-07: on an H100
    host (3c0fc12, one process) a new W4 request's rest fell 1.97 -> 1.73 ms, seen sizes and a repeated
    single image (W1) within 0.06 ms of the plain fill (0.96 ms less for new sizes on a slower host at
    e2e7acb). False: each host-made input takes its own copy and padding (``_fill``), and a repeated
    batch keeps its device copies (NOTE [moved batches]); ``scripts/host_phases.py --no-host-block``,
    bench.py's ``kimi_cg_no_host_block`` for A/B runs."""

    poison_graph_pool: bool = False
    """Testing aid: fill the CUDA-graph memory pool with NaN before capturing, so that any read of
    memory the graphs did not write shows up as NaN in the outputs (NOTE [padding rules])."""

    inductor_config: Any = None
    """Inductor settings for compiling device programs, e.g. ``{"max_autotune": True}``: names from
    ``torch._inductor.config`` (dotted for nested ones, ``"triton.cudagraphs"``), each value a bool, int,
    float, str or None. In force only while kimi_cg compiles a device program with Inductor (never for
    other compiles, nor for the "eager" device compiler); part of the device program's identity and of its
    program cache entry, so programs compiled with other settings are not shared. Stored as sorted
    (name, value) pairs; None or an empty mapping: Inductor's settings as they are."""

    strict: bool = False
    """False (default): a graph or call kimi_cg cannot lift runs the captured graph unchanged (correct,
    with its host syncs), counted in ``kimi_cg.fallbacks`` by reason and warned once per source
    location. True: it raises UnsupportedGraphError instead (for model authors and CI proving that a
    tower is fully lifted). NOTE [errors by who must act] in errors.py."""

    def __post_init__(self):
        if self.device_compiler not in ("auto", "eager", "inductor"):
            _reject("device_compiler", self.device_compiler, '"auto", "eager" or "inductor"')
        _check_int("metadata_cache_bytes", self.metadata_cache_bytes, 0, MAX_METADATA_CACHE_BYTES)
        _check_int("batch_cache_size", self.batch_cache_size, 0, MAX_BATCH_CACHE_SIZE)
        if self.debug_dir is not None:
            debug_dir = os.fspath(self.debug_dir) if isinstance(self.debug_dir, os.PathLike) else self.debug_dir
            if not isinstance(debug_dir, str):
                _reject("debug_dir", self.debug_dir, "None or a folder path (str or os.PathLike of str)")
            object.__setattr__(self, "debug_dir", debug_dir)  # a str, so that compute_hash can encode it
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            _reject("cuda_graphs", self.cuda_graphs, "None, True or False")
        if self.token_budgets is not None:
            expected = f"a non-empty list or tuple of ints in [1, {MAX_BUCKET_TOKENS}] (MAX_BUCKET_TOKENS)"
            if not isinstance(self.token_budgets, (list, tuple)) or not self.token_budgets:
                _reject("token_budgets", self.token_budgets, expected)
            if not all(_is_int(b) and 1 <= b <= MAX_BUCKET_TOKENS for b in self.token_budgets):
                _reject("token_budgets", self.token_budgets, expected)
            object.__setattr__(self, "token_budgets", tuple(sorted(set(self.token_budgets))))
        _check_int("min_tokens", self.min_tokens, 1, MAX_BUCKET_TOKENS, "MAX_BUCKET_TOKENS")
        _check_int("max_tokens", self.max_tokens, 1, MAX_BUCKET_TOKENS, "MAX_BUCKET_TOKENS")
        if self.min_tokens > self.max_tokens:
            _reject("min_tokens", self.min_tokens, f"at most max_tokens ({self.max_tokens})")
        _check_int("buckets_per_doubling", self.buckets_per_doubling, 1, MAX_BUCKETS_PER_DOUBLING)
        _check_int("max_items", self.max_items, 1, MAX_ITEMS)
        _check_int("max_frames", self.max_frames, 1, MAX_FRAMES)
        _check_int("exact_size_graphs", self.exact_size_graphs, 0, MAX_EXACT_SIZE_GRAPHS)
        _check_int("attention_length_classes", self.attention_length_classes, 1, MAX_LENGTH_CLASSES)
        object.__setattr__(self, "inductor_config", _inductor_settings(self.inductor_config))
        for name in ("linear_gelu_epilogue", "table_gathers", "host_block", "poison_graph_pool", "strict"):
            if not isinstance(getattr(self, name), bool):
                _reject(name, getattr(self, name), "True or False")

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
    def from_options(cls, options: Mapping[str, Any] | None) -> "KimiCGConfig":
        """The config for ``torch.compile(..., options=options)``; a ValueError names an unknown or
        invalid option, the value given and what is expected."""
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"kimi_cg options: expected a dict of options, got {options!r}")
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


def validate_options(options: Mapping[str, Any] | None) -> KimiCGConfig:
    """Check ``options`` as ``torch.compile(m, backend="kimi_cg", options=options)`` will, and return
    the resulting config. torch.compile defers the backend until the compiled model is first called,
    so a bad option otherwise surfaces only then; this raises the same ValueError now."""
    return KimiCGConfig.from_options(options)


_PLAIN_SETTING = (bool, int, float, str, type(None))


def _inductor_settings(value: Any) -> tuple | None:
    """``inductor_config`` as sorted (name, value) pairs, each checked against Inductor's settings."""
    expected = "None or a dict of torch._inductor.config settings to bool / int / float / str / None values"
    if value is None:
        return None
    if isinstance(value, tuple) and all(isinstance(pair, tuple) and len(pair) == 2 for pair in value):
        value = dict(value)  # a config's own stored form
    if not isinstance(value, Mapping):
        _reject("inductor_config", value, expected)
    if not value:
        return None
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    for name, setting in value.items():
        if not isinstance(name, str) or name not in known:
            _reject("inductor_config", value, f"names of torch._inductor.config settings ({name!r} is not one)")
        if not isinstance(setting, _PLAIN_SETTING):
            _reject("inductor_config", value, f"bool / int / float / str / None values ({name} is not)")
    return tuple(sorted(value.items()))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not to us


def _check_int(name: str, value: Any, low: int, high: int, high_name: str | None = None):
    if not _is_int(value) or not low <= value <= high:
        bound = f"{high} ({high_name})" if high_name else str(high)
        _reject(name, value, f"an int in [{low}, {bound}]")


def _reject(name: str, value: Any, expected: str):
    raise ValueError(f"kimi_cg option {name}: expected {expected}, got {value!r} ({type(value).__name__})")
