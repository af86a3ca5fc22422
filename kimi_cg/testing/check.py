"""``assert_matches_eager``: fuzz a compiled tower against its eager self, on grids hypothesis draws.

Each example is one grid batch: ``make_inputs(grid)`` (with torch seeded, so an example's inputs
are a function of the grid and the seed) gives the positional inputs; eager runs first (an input
eager rejects is the strategy's fault, reported as such), then the compiled model; the outputs must
have eager's structure, no NaN or inf eager does not have, and meet the dtype's rule (compare.py).
Counter expectations, when asked, are checked per example against ``kimi_cg.counters``.

A failure is a :class:`MismatchError` (an AssertionError) after hypothesis has shrunk the batch: it
names the grid, the worst item (or rows), both errors, and a one-line call that reproduces it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Any, Callable, Sequence

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from kimi_cg.config import KimiCGConfig
from kimi_cg.counters import counters
from kimi_cg.fallback import fallbacks
from kimi_cg.testing import compare
from kimi_cg.testing.strategies import grids as default_grids
from kimi_cg.testing.strategies import patches

# Counters that say a graph, call or frame did not run lifted; eager_fallbacks (a call outside the
# buckets) is judged separately, against the buckets.
FALLBACK_COUNTERS = ("lift_fallbacks", "call_fallbacks", "frames_skipped", "dynamo_trace_failures",
                     "dynamo_setting_fallbacks")
COMPILE_COUNTERS = ("device_programs_compiled", "captures")


class MismatchError(AssertionError):
    """The compiled model disagreed with eager (or broke a counter expectation) on ``grid``."""

    def __init__(self, message: str, grid: list[list[int]], seed: int, details: dict):
        super().__init__(message)
        self.grid, self.seed, self.details = grid, seed, details


class EagerRejectedInput(ValueError):
    """The eager model itself raised on a drawn grid: the strategy makes inputs the model does not take."""


@dataclasses.dataclass
class FuzzReport:
    """What a passing run covered: every grid in order, the worst error, counters during the run."""

    rule: str
    grids: list[list[list[int]]]
    seconds: float
    worst: dict
    counters: dict

    @property
    def examples(self) -> int:
        return len(self.grids)

    @property
    def distinct_grids(self) -> int:
        return len({str(grid) for grid in self.grids})

    @property
    def item_counts(self) -> list[int]:
        return sorted({len(grid) for grid in self.grids})

    def summary(self) -> str:
        largest = max((patches(grid) for grid in self.grids), default=0)
        changed = {key: value for key, value in sorted(self.counters.items()) if value}
        return "\n".join([
            f"kimi_cg.testing: {self.examples} examples passed in {self.seconds:.1f} s ({self.rule})",
            f"  grids: {self.distinct_grids} distinct, item counts {self.item_counts}, up to {largest} patches",
            f"  worst: {self.worst.get('where', '-')} ({self.worst.get('text', 'no tensor outputs')})",
            f"  kimi_cg.counters during the run: {changed}",
        ])


def assert_matches_eager(
    model: torch.nn.Module,
    compiled: Callable | None,
    make_inputs: Callable[[list[list[int]]], Any],
    grids: st.SearchStrategy | Sequence[Sequence[Sequence[int]]] | None = None,
    *,
    dtype: torch.dtype | None = None,
    max_examples: int = 50,
    seed: int = 0,
    shrink: bool = True,
    reference: torch.nn.Module | None = None,
    outputs: Callable[[Any], Any] | None = None,
    options: dict | None = None,
    poison_graph_pool: bool = False,
    warm_up: Sequence[Sequence[Sequence[int]]] | None = None,
    no_compiles_after_warm_up: bool = False,
    no_fallbacks: bool = False,
    no_graph_breaks: bool = False,
    expect: Callable[[list[list[int]], dict], None] | None = None,
    relative_tolerance: float | None = None,
    rounding_floor: float | None = None,
) -> FuzzReport:
    """Assert that ``compiled`` equals ``model`` (eager) on every grid batch of ``grids``.

    - ``compiled``: the model compiled with ``backend="kimi_cg"`` (or any callable); None compiles
      ``model`` here with ``options`` (with ``poison_graph_pool``: the CUDA-graph pool is filled with
      NaN before capture, so a read of memory no graph wrote shows as NaN).
    - ``make_inputs(grid)``: the model's positional inputs for one batch (a tuple, or a dict of keyword
      inputs); torch is seeded with ``seed`` before each call, inside a forked RNG state.
    - ``grids``: a hypothesis strategy (default ``kimi_cg.testing.grids()``), run for ``max_examples``
      examples from ``seed`` and shrunk on failure (``shrink=False`` skips it); or a list of grid
      batches, run in order (how a failure's one-line reproduction runs).
    - ``dtype``: the rule (compare.py); default: the dtype of the model's first floating parameter.
      Low precision compares against ``reference`` (default: an fp32 copy of ``model``) on the inputs
      with floating tensors cast to fp32. ``relative_tolerance`` / ``rounding_floor`` override the rule.
    - ``outputs``: maps a return value to what is compared (default: all of it).
    - Counter expectations: ``no_graph_breaks``; ``no_fallbacks`` (no lift, call or frame fallback on
      any example, and no eager fallback on an example within the buckets of ``options``, by default
      the options ``compiled`` was compiled with);
      ``no_compiles_after_warm_up`` (no device compile and no bucket capture after the ``warm_up``
      batches, which run first and are checked like the rest; exact-size graphs of repeated one-item
      sizes are made later by design and counted apart, ``exact_size_captures``); ``expect(grid, changes)``: your own check, given
      the grid and the ``kimi_cg.counters`` changes of its compiled call (an AssertionError it raises
      fails the example like a mismatch, shrunk and reported with the grid).
    Returns a :class:`FuzzReport`; raises :class:`MismatchError` on the first (shrunk) failure.
    """
    if not isinstance(max_examples, int) or max_examples < 1:
        raise ValueError(f"max_examples must be a positive int; got {max_examples!r}")
    if no_compiles_after_warm_up and not warm_up:
        raise ValueError("no_compiles_after_warm_up needs warm_up batches (a list of grids run first)")
    config = KimiCGConfig.from_options(options if options is not None or compiled is None else _options_of(compiled))
    if compiled is None:
        compile_options = {**(options or {}), **({"poison_graph_pool": True} if poison_graph_pool else {})}
        compiled = torch.compile(model, backend="kimi_cg", options=compile_options)
    elif poison_graph_pool:
        raise ValueError("poison_graph_pool applies when assert_matches_eager compiles the model (compiled=None); "
                         "for your own compile pass options={'poison_graph_pool': True} to torch.compile")
    rule = compare.rule_for(dtype or _model_dtype(model), relative_tolerance, rounding_floor)
    if rule.needs_reference and reference is None:
        reference = copy.deepcopy(model).float()
    checker = _Checker(model, compiled, make_inputs, rule, reference, outputs or (lambda value: value), seed,
                       config, no_fallbacks, no_graph_breaks, expect)
    start = time.perf_counter()
    for grid in warm_up or ():
        checker.check(grid)
    if no_compiles_after_warm_up:
        checker.expect_no_compiles()
    if grids is None:
        grids = default_grids()
    if isinstance(grids, st.SearchStrategy):
        _run_hypothesis(checker, grids, max_examples, seed, shrink)
    else:
        for grid in grids:
            checker.check(grid)
    return FuzzReport(rule.describe(), checker.grids, time.perf_counter() - start, checker.worst, checker.counter_changes())


def _run_hypothesis(checker: "_Checker", strategy, max_examples: int, seed: int, shrink: bool) -> None:
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])

    @hypothesis_seed(seed)
    @settings(max_examples=max_examples, deadline=None, database=None, phases=phases, derandomize=False,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(strategy)
    def run(grid):
        checker.check(grid)

    try:
        run()
    except Flaky as error:  # a compiled model keeps state: a failure may not repeat on a re-run
        first = checker.failures[0] if checker.failures else None
        if first is None:
            raise
        raise MismatchError(f"{first}\n  (hypothesis re-ran this grid and it passed: the failure depends on what ran "
                            "before it, e.g. a first compile)", first.grid, first.seed, first.details) from error


class _Checker:
    def __init__(self, model, compiled, make_inputs, rule, reference, outputs, seed, config, no_fallbacks, no_graph_breaks,
                 expect):
        self.model, self.compiled, self.make_inputs, self.rule = model, compiled, make_inputs, rule
        self.reference, self.outputs, self.seed, self.config = reference, outputs, seed, config
        self.no_fallbacks, self.no_graph_breaks, self.expect = no_fallbacks, no_graph_breaks, expect
        self.no_compiles_from: dict | None = None
        self.start_counters = dict(counters)
        self.grids: list[list[list[int]]] = []
        self.failures: list[MismatchError] = []
        self.worst: dict = {"score": -1.0}

    def expect_no_compiles(self) -> None:
        self.no_compiles_from = {key: counters[key] for key in COMPILE_COUNTERS}

    def counter_changes(self) -> dict:
        return {key: value - self.start_counters.get(key, 0) for key, value in counters.items()
                if value != self.start_counters.get(key, 0)}

    def check(self, grid) -> None:
        grid = [list(map(int, row)) for row in grid]
        try:
            self._check(grid)
        except MismatchError as failure:
            self.failures.append(failure)
            raise

    def _call(self, function, inputs):
        with torch.no_grad():
            return self.outputs(function(**inputs) if isinstance(inputs, dict) else function(*inputs))

    def _check(self, grid: list[list[int]]) -> None:
        inputs = self._inputs(grid)
        try:
            want = self._call(self.model, inputs)
        except Exception as error:  # noqa: BLE001 - the strategy's fault, not the compiler's
            raise EagerRejectedInput(f"the eager model raised on grid {grid} ({type(error).__name__}: {error}); "
                                     "narrow the grid strategy to inputs the model takes") from error
        before = dict(counters)
        try:
            got = self._call(self.compiled, inputs)
        except Exception as error:  # noqa: BLE001 - a crash where eager runs is a failure
            self._fail(grid, f"the compiled model raised {type(error).__name__} where eager ran: {error}", {})
        self._check_counters(grid, before)
        why = compare.structure_difference(got, want)
        if why is not None:
            self._fail(grid, f"output structure differs from eager: output{why}", {})
        got_leaves, want_leaves = compare.flatten(got), compare.flatten(want)
        tensors = [(path, g, w) for (path, g), (_, w) in zip(got_leaves, want_leaves) if isinstance(w, torch.Tensor)]
        spans = compare.item_spans(grid, [w for _, _, w in tensors])
        for (path, g, w), owned in zip(tensors, spans):
            bad = compare.new_non_finite(g, w)
            if bad:
                self._fail(grid, f"{path} has {bad} NaN/inf values where eager's output is finite",
                           {"path": path, **self._worst_item(grid, owned, g, w, None)})
        references = None
        if self.rule.needs_reference:
            cast = _to_float32(inputs)
            references = [leaf for _, leaf in compare.flatten(self._call(self.reference, cast))]
            references = [r for r, (_, w) in zip(references, want_leaves) if isinstance(w, torch.Tensor)]
            if len(references) != len(tensors):
                raise ValueError("the fp32 reference model returns a different structure than the model")
        for index, ((path, g, w), owned) in enumerate(zip(tensors, spans)):
            if not (g.is_floating_point() or g.is_complex()):
                if not torch.equal(g, w):
                    self._fail(grid, f"{path} ({g.dtype}) differs from eager", {"path": path})
                continue
            r = references[index] if references is not None else None
            error, allowed, text = self._error(g, w, r)
            score = error / allowed if allowed > 0 else (math.inf if error > 0 else 0.0)
            if score > self.worst["score"]:
                self.worst = {"score": score, "where": f"grid {grid} {path}", "text": text, "error": error,
                              "allowed": allowed}
                if self.rule.needs_reference:
                    self.worst["eager_error"] = (allowed - self.rule.floor) / self.rule.factor
            if error > allowed:
                detail = self._worst_item(grid, owned, g, w, r)
                self._fail(grid, f"{path}: {text} ({self.rule.describe()})", {"path": path, **detail})
        self.grids.append(grid)

    def _inputs(self, grid):
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed)
            return self.make_inputs(grid)

    def _error(self, got, want, reference) -> tuple[float, float, str]:
        if reference is None:
            error = compare.max_relative_error(got, want)
            return error, self.rule.relative, f"relative error {error:.3e}"
        error = compare.norm_relative_error(got, reference)
        eager = compare.norm_relative_error(want, reference)
        allowed = self.rule.factor * eager + self.rule.floor
        return error, allowed, f"compiled error vs fp32 {error:.3e}, eager's {eager:.3e}, allowed {allowed:.3e}"

    def _worst_item(self, grid, owned, got, want, reference) -> dict:
        """The item (or, when rows do not map to items, the row) where compiled is furthest from eager."""
        def badness(g, w, r):
            if not torch.isfinite(g[torch.isfinite(w)]).all():
                return math.inf
            if r is not None:
                return compare.norm_relative_error(g, r) - self.rule.factor * compare.norm_relative_error(w, r)
            return compare.max_relative_error(g, w, scale=want)

        if owned:
            scored = [(badness(got[span], want[span], reference[span] if reference is not None else None), index)
                      for index, span in owned]
            score, index = max(scored)
            return {"item": index, "item_grid": grid[index], "item_text": f"worst item {index} {grid[index]}"}
        if got.dim() == 0:
            return {}
        difference = (got.double() - want.double()).abs().nan_to_num(math.inf).reshape(got.shape[0], -1).amax(dim=1)
        row = int(difference.argmax())
        return {"row": row, "item_text": f"worst row {row} (rows do not map to items one way)"}

    def _check_counters(self, grid, before) -> None:
        changed = {key: counters[key] - before.get(key, 0) for key in counters if counters[key] != before.get(key, 0)}
        if self.no_graph_breaks and changed.get("graph_breaks"):
            self._fail(grid, f"{changed['graph_breaks']} graph break(s) (kimi_cg.fallbacks: {dict(fallbacks)})", {})
        if self.no_fallbacks:
            fell_back = {key: changed[key] for key in FALLBACK_COUNTERS if changed.get(key)}
            if changed.get("eager_fallbacks") and self._within_buckets(grid):
                fell_back["eager_fallbacks"] = changed["eager_fallbacks"]
            if fell_back:
                self._fail(grid, f"fell back: {fell_back} (kimi_cg.fallbacks: {dict(fallbacks)})", {})
        if self.expect is not None:
            try:
                self.expect(grid, changed)
            except AssertionError as error:
                self._fail(grid, f"expect({grid}, counter changes) failed: {error} (changes: {changed})", {})
        if self.no_compiles_from is not None:
            compiled = {key: counters[key] - value for key, value in self.no_compiles_from.items() if counters[key] != value}
            if compiled:
                self._fail(grid, f"compiled or captured after the warm-up: {compiled}", {})

    def _within_buckets(self, grid) -> bool:
        frames = max((row[0] for row in grid if len(row) == 3), default=1)
        return (patches(grid) <= max(self.config.buckets()) and len(grid) <= self.config.max_items
                and frames <= self.config.max_frames)

    def _fail(self, grid, what: str, detail: dict):
        lines = [f"kimi_cg.testing: compiled differs from eager: {what}",
                 f"  grid: {grid} ({len(grid)} items, {patches(grid)} patches)"]
        if detail.get("item_text"):
            lines.append(f"  {detail['item_text']}")
        lines.append(f"  reproduce: kimi_cg.testing.assert_matches_eager(model, compiled, make_inputs, grids=[{grid}], "
                     f"seed={self.seed})")
        raise MismatchError("\n".join(lines), grid, self.seed, {"what": what, **detail})


def _options_of(compiled) -> dict | None:
    """The ``options=`` a ``torch.compile`` result was made with: torch.compile keeps them in the
    ``kwargs`` of its backend wrappers (found by walking them; None when the layout is not that)."""
    wrapper = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None)
    for _ in range(8):
        if wrapper is None:
            return None
        options = (getattr(wrapper, "kwargs", None) or {}).get("options")
        if options is not None:
            return dict(options)
        wrapper = getattr(wrapper, "_torchdynamo_orig_backend", None) or getattr(wrapper, "compiler_fn", None)
    return None


def _model_dtype(model) -> torch.dtype:
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def _to_float32(value):
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, dict):
        return {key: _to_float32(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_float32(item) for item in value)
    return value
