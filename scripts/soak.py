"""Reliability soak: serve a long, mixed request stream through one compiled vision tower.

    python scripts/soak.py --tower kimi_vl --config real --device cuda --dtype bf16 --requests 10000 \
        --threads 2 --side-stream --out docs/bench/soak_kimi_vl.json
    python scripts/soak.py --tower moonvit3d --config tiny --device cpu --requests 300   # a quick check

One tower per run (kimi_vl: KimiVLVisionEncoder; moonvit3d: KimiK25VisionEncoder, tower plus
projector as a serving engine runs them), random weights from --seed, compiled with
backend="kimi_cg" and warmed up with ``kimi_cg.warm_up`` (item counts 1..--max-items). On a CPU the
bucketed runtime runs without capture (``cuda_graphs=True`` and a small token ladder), so it shares
the static buffers, caches and padding of the CUDA-graph path.

The stream is deterministic (--seed). A request is a grid (1..--max-items items, even sides; for
moonvit3d about 20% of the items are video chunks of 2..4 frames) and the seed of its pixel values:
  fresh       a (grid, pixel seed) pair not seen before; --eager-check-fraction of them are compared
              with the eager tower on the same inputs
  repeat      an earlier fresh pair again (--repeat-fraction of the valid requests), compared with a
              digest of the first compiled result of that pair
  invalid_*   --invalid-fraction of the requests, built so that eager raises too, one item broken:
                odd_side         an odd h or w (the patch merger needs even sides)
                pixel_rows       one pixel row more or less than the grid has
                zero_side        a zero h or w in a request of 2 or more items (it still has pixels)
                no_pixels        a single item with a zero side: no pixel rows at all
                too_many_frames  moonvit3d: t above the time table's frame limit
              (--invalid-kinds picks some). At start-up eager runs the first request of each kind
              and must raise (otherwise this script's generator is wrong).
--threads Python threads pull the requests from one queue, each under ``torch.inference_mode()``
(serving engines run encoders under it; the warm-up runs under it too). With --side-stream (CUDA)
the last thread issues its calls on its own CUDA stream.

What counts (each valid request's outputs are checked for NaN/inf; eager never makes them here):
  wrong       an output whose relative Frobenius error against eager, ||c - e|| / ||e||, is above
              the dtype's tolerance (fp32 1e-4, bf16 2e-2; rows of another request give ~1.0), or
              a repeat whose digest (shapes, float64 sum and abs-sum per output) drifts from the
              first result by more than the dtype's digest tolerance; bitwise-identical repeats are
              counted for information
  failure     any exception on a valid request; on an invalid request anything but
              ``kimi_cg.InvalidInputError`` or eager's own error (same class and message: the
              frame ran eagerly) counts as mishandled and is a failure too, as is an answer where
              eager raises
  after an invalid request, the same thread's next valid request is always checked (against
  eager when fresh, against its digest when a repeat) and counted separately.
Every ~N/20 requests a sample records CUDA memory allocated and reserved, host RSS,
``kimi_cg.memory_report()`` (when kimi_cg has it) and the kimi_cg counters moved since the warm-up.
The stream is served in two halves with a quiet point between them (every request of the first
half answered), so memory at 50% and at the end are read with nothing in flight.

Targets (exit code 1 when one fails; "skipped" ones do not fail):
  0 wrong outputs, 0 NaN/inf outputs, 0 mishandled invalid requests, 0 failures;
  memory growth <= 5%: (allocated at end - allocated at 50%) / allocated at 50%, on CUDA (host RSS
  growth is reported alike on every device, not a target: the CPU allocator keeps freed pages);
  0 device-program compiles and 0 captures after the warm-up;
  0 lift fallbacks over the whole run (a graph kimi_cg could not lift runs unlifted: the soak would
  then not be measuring kimi_cg's runtime at all).
Dynamo graphs traced after the warm-up are reported, not a target: invalid requests may retrace
(a zero-sized item, say, breaks a size specialisation).

``main(argv)`` returns the summary (tests/test_soak.py runs a tiny configuration on the CPU).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import queue
import random
import resource
import statistics
import sys
import threading
import time
import traceback

import torch

import kimi_cg
from kimi_cg.models import KimiK25VisionEncoder, KimiVLVisionEncoder, MoonViT3dConfig, MoonVitConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

EAGER_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}
"""Largest relative Frobenius error ||compiled - eager|| / ||eager|| of a right output. A compiled
program reorders float sums, so it is not bitwise eager; a wrong-data bug (another request's rows,
a stale buffer) gives an error near 1.0, far above either tolerance."""

DIGEST_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3}
"""Largest drift of a repeat's digest from the first result of its (grid, seed) pair, relative to
that result's abs-sum. The same grid replays the same bucket, so repeats are normally bitwise
identical; the tolerance allows a reduction order that varies between calls (CPU threads)."""

MEMORY_GROWTH_TARGET = 0.05

CPU_TOKEN_BUDGETS = [256, 512, 1024]
"""Bucket capacities on the CPU: small enough to be quick, and some tiny requests (four 24x24
images, video chunks) exceed the largest, so the split and non-graphed paths are exercised too."""

COUNTER_KEYS = ("dynamo_graphs", "device_programs_compiled", "captures", "graph_replays", "eager_fallbacks",
                "split_calls", "call_fallbacks", "lift_fallbacks", "invalid_inputs")

COMPILE_COUNTERS = ("dynamo_graphs", "device_programs_compiled", "captures")
"""A request that moved one of these compiled after the warm-up (with several threads the counters
are process-wide, so a request listed may have run beside the one that compiled)."""

VIDEO_FRACTION = 0.2
"""Share of moonvit3d items that are video chunks (t in 2..4), as in bench.py's W4_3d."""

INVALID_KINDS_2D = ("invalid_odd_side", "invalid_pixel_rows", "invalid_zero_side", "invalid_no_pixels")
INVALID_KINDS_3D = INVALID_KINDS_2D + ("invalid_too_many_frames",)

LISTED_FAILURES = 50
"""Failures and wrong outputs listed in the summary (all are counted)."""


# -- the tower -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Sizes:
    """Where item sides are drawn from (all even: the patch merger groups 2x2 windows)."""

    min_side: int
    max_side: int
    large_fraction: float = 0.0
    """Share of images drawn larger, up to ``large_max_patches`` patches (h * w)."""
    large_max_patches: int = 0


TINY_SIZES = Sizes(min_side=2, max_side=24)
REAL_SIZES = Sizes(min_side=4, max_side=64, large_fraction=0.05, large_max_patches=16384)  # the default max bucket


def build_tower(tower: str, config: str, seed: int):
    """The eager tower with seeded random weights, and its frame limit (None for 2D towers)."""
    torch.manual_seed(seed)
    if tower == "kimi_vl":
        return KimiVLVisionEncoder(MoonVitConfig.tiny() if config == "tiny" else MoonVitConfig()), None
    vision_config = MoonViT3dConfig.tiny() if config == "tiny" else MoonViT3dConfig()
    return KimiK25VisionEncoder(vision_config), vision_config.num_frames_pos_emb


def compile_options(device: str, max_items: int) -> dict:
    if device == "cpu":
        return {"cuda_graphs": True, "token_budgets": CPU_TOKEN_BUDGETS, "max_items": max_items}
    return {"max_items": max_items}


# -- the request stream ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Request:
    index: int
    kind: str
    """"fresh", "repeat" or one of INVALID_KINDS_3D."""
    grid: tuple[tuple[int, ...], ...]
    seed: int
    """Seed of the pixel values."""
    row_delta: int = 0
    """Pixel rows added to (negative: removed from) the grid's count (invalid_pixel_rows)."""
    eager_check: bool = False
    """Compare with eager (fresh requests chosen by --eager-check-fraction)."""
    repeated_later: bool = False
    """A later request repeats this (grid, seed) pair: keep a digest of the first result."""

    @property
    def valid(self) -> bool:
        return not self.kind.startswith("invalid")

    @property
    def pair(self) -> tuple:
        return self.grid, self.seed

    def describe(self) -> dict:
        described = {"index": self.index, "kind": self.kind, "grid": [list(item) for item in self.grid], "seed": self.seed}
        if self.row_delta:
            described["row_delta"] = self.row_delta
        return described


def draw_item(rng: random.Random, sizes: Sizes, frame_limit: int | None) -> tuple[int, ...]:
    """(h, w), or (t, h, w) when the tower has a frame limit; a large item is an image (t = 1)."""
    large = rng.random() < sizes.large_fraction
    if large:  # taller than max_side, at most large_max_patches patches
        h = 2 * rng.randint(sizes.max_side // 2 + 1, sizes.large_max_patches // sizes.max_side // 2)
        w = 2 * rng.randint(sizes.min_side // 2, min(sizes.max_side, sizes.large_max_patches // h) // 2)
    else:
        h = 2 * rng.randint(sizes.min_side // 2, sizes.max_side // 2)
        w = 2 * rng.randint(sizes.min_side // 2, sizes.max_side // 2)
    if frame_limit is None:
        return h, w
    video = not large and frame_limit >= 2 and rng.random() < VIDEO_FRACTION
    return (rng.randint(2, min(4, frame_limit)) if video else 1), h, w


def draw_grid(rng: random.Random, sizes: Sizes, frame_limit: int | None, min_items: int, max_items: int) -> tuple:
    return tuple(draw_item(rng, sizes, frame_limit) for _ in range(rng.randint(min_items, max_items)))


def draw_invalid(kind: str, rng: random.Random, sizes: Sizes, frame_limit: int | None,
                 max_items: int) -> tuple[tuple, int]:
    """(grid, row_delta) of an invalid request: a valid grid with one item broken."""
    # zero_side keeps pixel rows (another item has some); no_pixels is the request with none at all
    min_items = 2 if kind == "invalid_zero_side" else 1
    items_at_most = 1 if kind == "invalid_no_pixels" else max(min_items, max_items)
    items = [list(item) for item in draw_grid(rng, sizes, frame_limit, min_items, items_at_most)]
    broken = items[rng.randrange(len(items))]
    side = len(broken) - rng.randint(1, 2)  # h or w: the last two entries
    row_delta = 0
    if kind == "invalid_odd_side":
        broken[side] += 1
    elif kind in ("invalid_zero_side", "invalid_no_pixels"):
        broken[side] = 0
    elif kind == "invalid_too_many_frames":
        broken[0] = frame_limit + rng.randint(1, 2)
    elif kind == "invalid_pixel_rows":
        row_delta = rng.choice([-1, 1])
    else:
        raise ValueError(kind)
    return tuple(tuple(item) for item in items), row_delta


def request_stream(count: int, seed: int, sizes: Sizes, frame_limit: int | None, max_items: int,
                   invalid_fraction: float, invalid_kinds: tuple[str, ...], repeat_fraction: float,
                   eager_check_fraction: float) -> list[Request]:
    rng = random.Random(seed)
    requests: list[Request] = []
    fresh: list[Request] = []
    repeated: set[tuple] = set()
    for index in range(count):
        pixel_seed = seed * 1_000_003 + index
        if rng.random() < invalid_fraction:
            kind = rng.choice(invalid_kinds)
            grid, row_delta = draw_invalid(kind, rng, sizes, frame_limit, max_items)
            requests.append(Request(index, kind, grid, pixel_seed, row_delta=row_delta))
        elif fresh and rng.random() < repeat_fraction:
            original = rng.choice(fresh)
            repeated.add(original.pair)
            requests.append(Request(index, "repeat", original.grid, original.seed))
        else:
            grid = draw_grid(rng, sizes, frame_limit, 1, max_items)
            request = Request(index, "fresh", grid, pixel_seed, eager_check=rng.random() < eager_check_fraction)
            requests.append(request)
            fresh.append(request)
    return [dataclasses.replace(r, repeated_later=True) if r.kind == "fresh" and r.pair in repeated else r
            for r in requests]


def make_inputs(request: Request, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(request.grid)
    rows = max(0, sum(math.prod(item) for item in request.grid) + request.row_delta)
    generator = torch.Generator(device).manual_seed(request.seed)
    pixels = torch.randn(rows, 3, 14, 14, device=device, generator=generator)
    return pixels.to(dtype), grid


# -- checks ----------------------------------------------------------------------------------------

def worse(worst: float, error: float) -> float:
    """The larger error, a NaN counting as the worst and staying (max() keeps a number before a NaN)."""
    if math.isnan(worst) or error <= worst:
        return worst
    return error


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest ||got - want|| / ||want|| over the outputs (inf when counts or shapes differ)."""
    if len(got) != len(want):
        return math.inf
    worst = 0.0
    for g, w in zip(got, want):
        if g.shape != w.shape:
            return math.inf
        w64 = w.double()
        worst = worse(worst, float((g.double() - w64).norm() / w64.norm().clamp_min(1e-30)))
    return worst


@dataclasses.dataclass(frozen=True)
class Digest:
    """What a repeat is compared with: per output its shape, float64 sum and abs-sum, and a hash of
    its bytes (for counting bitwise-identical repeats)."""

    shapes: tuple
    sums: tuple[float, ...]
    abs_sums: tuple[float, ...]
    content_hash: str

    @classmethod
    def of(cls, outputs: list[torch.Tensor]) -> "Digest":
        content = hashlib.blake2b(digest_size=16)
        for output in outputs:
            content.update(output.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
        return cls(tuple(tuple(o.shape) for o in outputs), tuple(float(o.double().sum()) for o in outputs),
                   tuple(float(o.double().abs().sum()) for o in outputs), content.hexdigest())

    def drift(self, other: "Digest") -> float:
        """Largest difference of sum or abs-sum relative to this digest's abs-sum (inf on a shape change)."""
        if self.shapes != other.shapes:
            return math.inf
        worst = 0.0
        for sum_a, abs_a, sum_b, abs_b in zip(self.sums, self.abs_sums, other.sums, other.abs_sums):
            scale = max(abs_a, 1e-30)
            worst = worse(worse(worst, abs(sum_a - sum_b) / scale), abs(abs_a - abs_b) / scale)
        return worst


def host_rss_bytes() -> int:
    """Resident set size now (peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- serving ---------------------------------------------------------------------------------------

class Soak:
    """Serves the stream from worker threads and keeps every count; its lock guards all of them."""

    def __init__(self, args, model, compiled, requests: list[Request], counters_after_warm_up: dict):
        self.args = args
        self.model = model
        self.compiled = compiled
        self.requests = requests
        self.dtype = DTYPES[args.dtype]
        self.tolerance = EAGER_TOLERANCE[args.dtype]
        self.digest_tolerance = DIGEST_TOLERANCE[args.dtype]
        self.counters_after_warm_up = counters_after_warm_up
        self.sample_every = max(1, len(requests) // 20)
        self.lock = threading.Lock()
        self.queue: queue.Queue = queue.Queue()
        self.digests: dict[tuple, Digest] = {}
        self.completed = 0
        self.kinds: dict[str, int] = {}
        self.checked = {"against_eager": 0, "against_digest": 0, "after_invalid": 0}
        self.wrong = 0
        self.wrong_after_invalid = 0
        self.worst_error = 0.0
        self.worst_drift = 0.0
        self.bitwise_identical_repeats = 0
        self.nan = 0
        self.invalid_handled = 0
        self.invalid_mishandled = 0
        self.invalid_answered_by_eager_error = 0
        self.invalid_by_kind: dict[str, dict] = {}
        self.failure_count = 0
        self.failures: list[dict] = []
        self.wrong_examples: list[dict] = []
        self.call_seconds: list[float] = []
        self.compiling_requests = 0
        self.compiling_examples: list[dict] = []
        self.samples: list[dict] = []
        self.start = time.perf_counter()

    def serve(self, side_stream) -> None:
        """One worker thread: requests from the queue until its None. Every thread enters inference
        mode itself (grad mode is per thread)."""
        stream_context = torch.cuda.stream(side_stream) if side_stream is not None else contextlib.nullcontext()
        after_invalid = False
        with torch.inference_mode(), stream_context:
            while True:
                request = self.queue.get()
                if request is None:
                    self.queue.task_done()
                    return
                try:
                    if request.valid:
                        self.serve_valid(request, check_always=after_invalid)
                        after_invalid = False
                    else:
                        self.serve_invalid(request)
                        after_invalid = True
                except Exception as error:  # a bug of this script: counted as a failure, serving goes on
                    self.fail(request, error, "soak script error")
                finally:
                    self.finish(request)
                    self.queue.task_done()

    def call(self, request: Request) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        pixels, grid = make_inputs(request, self.args.device, self.dtype)
        self.synchronize()
        before = counter_snapshot()
        start = time.perf_counter()
        try:
            outputs = self.compiled(pixels, grid)
            self.synchronize()
        finally:
            seconds = time.perf_counter() - start
            compiled = {key: value for key, value in counters_since(before).items()
                        if key in COMPILE_COUNTERS and value}
            with self.lock:
                if request.valid:  # an invalid call also runs the captured graph to confirm: not a latency
                    self.call_seconds.append(seconds)
                if compiled:
                    self.compiling_requests += 1
                    if len(self.compiling_examples) < LISTED_FAILURES:
                        self.compiling_examples.append({**request.describe(), "seconds": seconds, **compiled})
        return outputs, pixels, grid

    def serve_valid(self, request: Request, check_always: bool) -> None:
        try:
            outputs, pixels, grid = self.call(request)
        except Exception as error:
            self.fail(request, error, "exception on a valid request")
            return
        finite = all(bool(torch.isfinite(o).all()) for o in outputs)
        error = drift = None
        if request.kind == "fresh" and (request.eager_check or check_always):
            error = relative_error(outputs, self.model(pixels, grid))
        digest = Digest.of(outputs) if request.kind == "repeat" or request.repeated_later else None
        with self.lock:
            if not finite:
                self.nan += 1
            if digest is not None:
                first = self.digests.setdefault(request.pair, digest)
                if first is not digest:
                    drift = first.drift(digest)
                    self.checked["against_digest"] += 1
                    self.worst_drift = worse(self.worst_drift, drift)
                    self.bitwise_identical_repeats += first.content_hash == digest.content_hash
            if error is not None:
                self.checked["against_eager"] += 1
                self.worst_error = worse(self.worst_error, error)
            is_wrong = (error is not None and not error <= self.tolerance) or (
                drift is not None and not drift <= self.digest_tolerance)
            if check_always and (error is not None or drift is not None):
                self.checked["after_invalid"] += 1
                self.wrong_after_invalid += is_wrong
            if is_wrong:
                self.wrong += 1
                if len(self.wrong_examples) < LISTED_FAILURES:
                    self.wrong_examples.append({**request.describe(), "error_vs_eager": error, "digest_drift": drift,
                                                "after_invalid": check_always})

    def serve_invalid(self, request: Request) -> None:
        try:
            self.call(request)
        except kimi_cg.InvalidInputError:
            self.count_invalid(request, "handled")
            return
        except Exception as error:
            eager = self.eager_outcome(request, error)
            if eager["same_as_eager"]:  # the frame ran eagerly: the caller got eager's own error
                self.count_invalid(request, "handled")
                with self.lock:
                    self.invalid_answered_by_eager_error += 1
                return
            self.count_invalid(request, "mishandled")
            self.fail(request, error, "invalid request raised another error than InvalidInputError or eager's own",
                      eager=eager)
            return
        self.count_invalid(request, "mishandled")
        self.fail(request, None, "invalid request answered (eager raises)", eager=self.eager_outcome(request, None))

    def count_invalid(self, request: Request, outcome: str) -> None:
        with self.lock:
            if outcome == "handled":
                self.invalid_handled += 1
            else:
                self.invalid_mishandled += 1
            by_kind = self.invalid_by_kind.setdefault(request.kind, {"handled": 0, "mishandled": 0})
            by_kind[outcome] += 1

    def eager_outcome(self, request: Request, error: BaseException | None) -> dict:
        """What eager does with a mishandled request, to tell "kimi_cg let eager's own error through"
        (the frame ran eagerly) from an error kimi_cg made."""
        try:
            self.model(*make_inputs(request, self.args.device, self.dtype))
        except Exception as eager_error:
            same = error is not None and type(error) is type(eager_error) and str(error) == str(eager_error)
            return {"eager_exception": f"{type(eager_error).__name__}: {str(eager_error)[:300]}",
                    "same_as_eager": same}
        return {"eager_exception": None, "same_as_eager": False}

    def fail(self, request: Request, error: BaseException | None, what: str, eager: dict | None = None) -> None:
        with self.lock:
            self.failure_count += 1
            if len(self.failures) < LISTED_FAILURES:
                entry = {**request.describe(), "what": what, **(eager or {})}
                if error is not None:
                    entry["exception"] = f"{type(error).__name__}: {str(error)[:500]}"
                    entry["traceback"] = "".join(traceback.format_exception(error)[-3:])[-2000:]
                self.failures.append(entry)

    def finish(self, request: Request) -> None:
        with self.lock:
            self.completed += 1
            self.kinds[request.kind] = self.kinds.get(request.kind, 0) + 1
            due = self.completed % self.sample_every == 0
        if due:
            self.sample("periodic")

    def synchronize(self) -> None:
        if self.args.device == "cuda":
            torch.cuda.current_stream().synchronize()

    def sample(self, label: str) -> dict:
        """Memory and counters now; `label` says whether requests were in flight ("periodic")."""
        sample = {"label": label, "completed": self.completed, "seconds": time.perf_counter() - self.start,
                  "host_rss_bytes": host_rss_bytes(), "counters_since_warm_up": counters_since(self.counters_after_warm_up)}
        if self.args.device == "cuda":
            sample["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
            sample["cuda_reserved_bytes"] = torch.cuda.memory_reserved()
        memory_report = getattr(kimi_cg, "memory_report", None)
        if memory_report is not None:
            try:
                sample["kimi_cg"] = memory_report()
            except Exception as error:
                sample["kimi_cg"] = {"error": repr(error)}
                with self.lock:
                    self.failure_count += 1
                    self.failures.append({"what": "kimi_cg.memory_report raised", "exception": repr(error)})
        with self.lock:
            self.samples.append(sample)
            wrong, nan, failures = self.wrong, self.nan, self.failure_count
        allocated = sample.get("cuda_allocated_bytes")
        print(f"[{sample['completed']:>6}/{len(self.requests)}] {sample['seconds']:8.1f} s  "
              f"allocated {megabytes(allocated)}  rss {megabytes(sample['host_rss_bytes'])}  "
              f"wrong {wrong}  nan {nan}  failures {failures}", flush=True)
        return sample

    def run(self) -> tuple[dict, dict, float]:
        """Serve the stream in two halves; returns the quiet samples at 50% and at the end, and the seconds."""
        args = self.args
        side_stream = torch.cuda.Stream() if args.side_stream else None
        self.start = time.perf_counter()
        half = len(self.requests) // 2
        with concurrent.futures.ThreadPoolExecutor(args.threads, thread_name_prefix="soak") as pool:
            # the last worker issues its calls on the side stream (when there is one)
            workers = [pool.submit(self.serve, side_stream if worker == args.threads - 1 else None)
                       for worker in range(args.threads)]
            for request in self.requests[:half]:
                self.queue.put(request)
            self.queue.join()  # nothing in flight: memory at 50% is the steady state, not a peak
            self.synchronize_device()
            middle = self.sample("50%")
            for request in self.requests[half:]:
                self.queue.put(request)
            for _ in workers:
                self.queue.put(None)
            for worker in workers:
                worker.result()
        self.synchronize_device()
        seconds = time.perf_counter() - self.start
        return middle, self.sample("end"), seconds

    def synchronize_device(self) -> None:
        if self.args.device == "cuda":
            torch.cuda.synchronize()


def megabytes(value) -> str:
    return "-" if value is None else f"{value / 2**20:.0f} MB"


def counter_snapshot() -> dict:
    return {key: kimi_cg.counters[key] for key in COUNTER_KEYS}


def counters_since(before: dict) -> dict:
    return {key: kimi_cg.counters[key] - before[key] for key in COUNTER_KEYS}


def growth(before, after) -> float | None:
    if before is None or after is None or before <= 0:
        return None
    return (after - before) / before


# -- start-up checks -------------------------------------------------------------------------------

def eager_rejections(model, requests: list[Request], device: str, dtype: torch.dtype) -> dict:
    """Eager on the first request of each invalid kind: {kind: its exception}. An invalid request
    eager answers is a bug of this script's generator, not of kimi_cg: stop at once."""
    rejected = {}
    with torch.inference_mode():
        for request in requests:
            if request.valid or request.kind in rejected:
                continue
            try:
                model(*make_inputs(request, device, dtype))
            except Exception as error:
                rejected[request.kind] = f"{type(error).__name__}: {str(error)[:200]}"
                continue
            raise RuntimeError(f"soak: eager accepts the {request.kind} request {request.describe()}")
    return rejected


# -- summary ---------------------------------------------------------------------------------------

def target(name: str, value, passed: bool | None, note: str = "") -> dict:
    return {"name": name, "value": value, "passed": passed, **({"note": note} if note else {})}


def summarize(args, soak: Soak, warm_up: dict, eager_errors: dict, middle: dict, end: dict, seconds: float) -> dict:
    after_warm_up = counters_since(soak.counters_after_warm_up)
    memory_growth = growth(middle.get("cuda_allocated_bytes"), end.get("cuda_allocated_bytes"))
    rss_growth = growth(middle["host_rss_bytes"], end["host_rss_bytes"])
    times = sorted(soak.call_seconds)
    call_ms = {}
    if times:
        call_ms = {"mean": statistics.fmean(times) * 1e3, "p50": statistics.median(times) * 1e3,
                   "p99": times[min(len(times) - 1, round(0.99 * (len(times) - 1)))] * 1e3}
    targets = [
        target("0 wrong outputs", soak.wrong, soak.wrong == 0),
        target("0 NaN/inf outputs", soak.nan, soak.nan == 0),
        target("0 mishandled invalid requests", soak.invalid_mishandled, soak.invalid_mishandled == 0),
        target("0 failures", soak.failure_count, soak.failure_count == 0),
        target(f"memory growth <= {MEMORY_GROWTH_TARGET:.0%} (CUDA allocated, 50% -> end)", memory_growth,
               None if memory_growth is None else memory_growth <= MEMORY_GROWTH_TARGET,
               "" if memory_growth is not None else "skipped: no CUDA allocator on this device"),
        target("0 device-program compiles after warm-up", after_warm_up["device_programs_compiled"],
               after_warm_up["device_programs_compiled"] == 0),
        target("0 captures after warm-up", after_warm_up["captures"], after_warm_up["captures"] == 0),
        target("0 lift fallbacks (whole run)", kimi_cg.counters["lift_fallbacks"], kimi_cg.counters["lift_fallbacks"] == 0,
               "a graph kimi_cg could not lift runs unlifted: the soak would not test kimi_cg's runtime"),
    ]
    return {
        "command": "python scripts/soak.py " + " ".join(args.argv),
        "machine": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "options": {key: value for key, value in vars(args).items() if key != "argv"},
        "compile_options": compile_options(args.device, args.max_items),
        "warm_up": {key: warm_up[key] for key in ("seconds", "calls", "dynamo_graphs")},
        "requests": len(soak.requests),
        "kinds": dict(sorted(soak.kinds.items())),
        "checked": dict(soak.checked),
        "wrong": soak.wrong,
        "wrong_after_invalid": soak.wrong_after_invalid,
        "wrong_examples": soak.wrong_examples,
        "worst_error": soak.worst_error,
        "tolerance": soak.tolerance,
        "worst_repeat_drift": soak.worst_drift,
        "digest_tolerance": soak.digest_tolerance,
        "bitwise_identical_repeats": soak.bitwise_identical_repeats,
        "nan": soak.nan,
        "invalid": {"handled": soak.invalid_handled, "mishandled": soak.invalid_mishandled,
                    "answered_by_eager_error": soak.invalid_answered_by_eager_error,
                    "by_kind": dict(sorted(soak.invalid_by_kind.items())), "eager_raises": eager_errors},
        "failure_count": soak.failure_count,
        "failures": soak.failures,
        "throughput": {"seconds": seconds, "requests_per_s": len(soak.requests) / seconds, "call_ms": call_ms,
                       "note": "the serving threads also run the eager checks: requests_per_s is not kimi_cg's throughput"},
        "memory": {"memory_growth": memory_growth, "rss_growth": rss_growth,
                   "cuda_allocated_bytes": {"at_50_percent": middle.get("cuda_allocated_bytes"),
                                            "end": end.get("cuda_allocated_bytes")},
                   "host_rss_bytes": {"at_50_percent": middle["host_rss_bytes"], "end": end["host_rss_bytes"]},
                   "samples": soak.samples},
        "after_warm_up": after_warm_up,
        "compiling_requests": soak.compiling_requests,
        "compiling_examples": soak.compiling_examples,
        "after_warm_up_note": "dynamo graphs after warm-up are not a target: invalid requests may retrace "
                              "(a zero-sized item breaks a size specialisation)",
        "fallbacks": dict(kimi_cg.fallbacks),
        "targets": targets,
        "passed": all(t["passed"] is not False for t in targets),
    }


def print_summary(summary: dict) -> None:
    print(f"\nrequests {summary['requests']}  kinds {summary['kinds']}")
    print(f"checked {summary['checked']}  worst error vs eager {summary['worst_error']:.3g} "
          f"(tolerance {summary['tolerance']:g})  worst repeat drift {summary['worst_repeat_drift']:.3g}  "
          f"bitwise-identical repeats {summary['bitwise_identical_repeats']}")
    print(f"invalid {summary['invalid']['handled']} handled, {summary['invalid']['mishandled']} mishandled; "
          f"eager raises {summary['invalid']['eager_raises']}")
    throughput = summary["throughput"]
    print(f"{throughput['requests_per_s']:.1f} requests/s over {throughput['seconds']:.1f} s; compiled call ms "
          + ", ".join(f"{k} {v:.2f}" for k, v in throughput["call_ms"].items()))
    print(f"counters after warm-up {summary['after_warm_up']}; fallbacks {summary['fallbacks']}")
    for failure in summary["failures"][:10]:
        same = "  (eager raises the same)" if failure.get("same_as_eager") else ""
        print(f"  failure: {failure.get('what')} {failure.get('grid')} {failure.get('exception', '')[:200]}{same}")
    for wrong in summary["wrong_examples"][:10]:
        print(f"  wrong: {wrong}")
    for t in summary["targets"]:
        verdict = {True: "pass", False: "FAIL", None: "skipped"}[t["passed"]]
        print(f"  {verdict:<7} {t['name']}: {t['value']}" + (f"  ({t['note']})" if "note" in t and t["passed"] is not True else ""))
    print("PASSED" if summary["passed"] else "FAILED", flush=True)


# -- entry -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tower", choices=["kimi_vl", "moonvit3d"], default="kimi_vl")
    parser.add_argument("--config", choices=["tiny", "real"], default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--side-stream", action="store_true", help="CUDA only: the last thread calls on its own stream")
    parser.add_argument("--invalid-fraction", type=float, default=0.03)
    parser.add_argument("--repeat-fraction", type=float, default=0.5)
    parser.add_argument("--max-items", type=int, default=4, help="items per request; the warm-up traces 1..max_items")
    parser.add_argument("--eager-check-fraction", type=float, default=None,
                        help="fresh requests compared with eager (default 1.0 on tiny, 0.1 on real)")
    parser.add_argument("--invalid-kinds", default=None,
                        help="comma-separated invalid kinds to draw (default: all of the tower's: "
                             + ", ".join(kind.removeprefix("invalid_") for kind in INVALID_KINDS_3D) + ")")
    parser.add_argument("--metadata-budget-mb", type=int, default=None,
                        help="process budget of kimi_cg's host metadata (kimi_cg.set_memory_budget); a budget the "
                             "stream fills makes 'flat once caches are full' measurable (default: kimi_cg's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the summary as JSON here")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.side_stream and args.device != "cuda":
        parser.error("--side-stream needs --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    if args.requests < 2 or args.threads < 1 or args.max_items < 1:
        parser.error("--requests >= 2, --threads >= 1 and --max-items >= 1")
    for name in ("invalid_fraction", "repeat_fraction", "eager_check_fraction"):
        value = getattr(args, name)
        if value is not None and not 0.0 <= value <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    known_kinds = INVALID_KINDS_2D if args.tower == "kimi_vl" else INVALID_KINDS_3D
    if args.invalid_kinds is None:
        args.invalid_kinds = known_kinds
    else:
        args.invalid_kinds = tuple(f"invalid_{kind.strip()}" for kind in args.invalid_kinds.split(","))
        unknown = sorted(set(args.invalid_kinds) - set(known_kinds))
        if unknown or not args.invalid_kinds:
            parser.error(f"--invalid-kinds: unknown {unknown} for {args.tower}; known: {known_kinds}")
    if args.eager_check_fraction is None:
        args.eager_check_fraction = 1.0 if args.config == "tiny" else 0.1
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    torch._dynamo.reset()
    kimi_cg.reset()
    kimi_cg.set_memory_budget(metadata_bytes=None if args.metadata_budget_mb is None else args.metadata_budget_mb << 20)
    model, frame_limit = build_tower(args.tower, args.config, args.seed)
    model = model.to(args.device, dtype).eval()
    compiled = torch.compile(model, backend="kimi_cg", options=compile_options(args.device, args.max_items))
    requests = request_stream(args.requests, args.seed, TINY_SIZES if args.config == "tiny" else REAL_SIZES,
                              frame_limit, args.max_items, args.invalid_fraction, args.invalid_kinds,
                              args.repeat_fraction, args.eager_check_fraction)
    eager_errors = eager_rejections(model, requests, args.device, dtype)

    example = Request(-1, "fresh", ((16, 16),) if frame_limit is None else ((1, 16, 16),), seed=args.seed)
    with torch.inference_mode():
        warm_up = kimi_cg.warm_up(compiled, *make_inputs(example, args.device, dtype), max_items=args.max_items)
    print(f"warm-up: {warm_up['seconds']:.1f} s, {warm_up['calls']} calls, {warm_up['dynamo_graphs']} dynamo graphs",
          flush=True)

    soak = Soak(args, model, compiled, requests, counter_snapshot())
    middle, end, seconds = soak.run()
    summary = summarize(args, soak, warm_up, eager_errors, middle, end, seconds)
    print_summary(summary)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
