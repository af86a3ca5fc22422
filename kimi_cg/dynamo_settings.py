"""The dynamo settings kimi_cg traces with, in force only while dynamo traces a frame for kimi_cg.

NOTE [dynamo settings]
kimi_cg needs two dynamo settings while dynamo traces a frame compiled with ``backend="kimi_cg"``:

- ``capture_scalar_outputs = True``: ``grid.tolist()`` / ``.item()`` become unbacked SymInts inside
  one graph instead of graph breaks that specialise (and recompile) on every image size;
- ``capture_dynamic_output_shape_ops = True``: ops whose output size depends on data stay in the
  graph too.

They must not reach any other compile in the process: with them, dynamo raises
``GuardOnDataDependentSymNode`` on code it otherwise traces with graph breaks. A backend cannot set
them through ``torch.compile`` (it drops ``backend_ctx_ctor``; config is read at trace time and is not
part of guards), so kimi_cg scopes them itself:

1. ``install()`` (run when the backend module is imported, again by ``kimi_cg.reset()`` and whenever
   the backend finds them missing: ``torch._dynamo.reset()`` drops every compile callback) registers
   a start and an end callback with dynamo's ``callback_handler``. Dynamo runs them around every
   frame it compiles, in the compiling thread, one compile at a time (its compile lock).
2. The start callback asks which backend this compile is for: the ``compiler_fn`` argument of
   dynamo's ``convert_frame._compile`` on the Python stack, unwrapped through torch.compile's
   wrappers. Only for kimi_cg does it enter ``torch._dynamo.config.patch(...)``; the end callback
   exits it. So every thread that calls a kimi_cg model traces it with these settings (config
   overrides are per thread from torch 2.13 on), and no other compile ever sees them.
3. If dynamo fails on a kimi_cg frame (an error other than a graph break or a frame skip), the call
   runs the frame eagerly (``suppress_errors`` for that one error, restored when the next compile
   starts): the caller gets eager's result or eager's own error, never a dynamo crash. If the error
   comes from a data-dependent value it may come from these settings, or from the call's inputs
   (an item with a zero side makes empty tensors whose sizes dynamo cannot reason about; eager
   fails on them too). A frame whose code once traced with the settings has shown that they work
   for it: its failure is the call's, and only that call runs eagerly. A code that never traced
   with them steps down a ladder (NOTE [settings ladder]) and, after ``DEMOTE_AFTER_FAILURES``
   failures, is traced with dynamo's own settings from then on (one invalid first request does not
   demote a tower for the life of the process). All are counted (``dynamo_trace_failures``,
   ``dynamic_shape_op_breaks``, ``dynamo_setting_fallbacks``, ``kimi_cg.fallbacks``).
4. One setting does persist, per thread, once a kimi_cg frame was compiled in it:
   ``recompile_limit`` is raised to at least 64. Dynamo keeps one graph per number of items N
   (plus the static first trace and the RoPE table's retrace); with the default 8 a serving mix of
   1..8+ images exhausts it and later calls silently run eager (seen on the H200). Dynamo checks this
   limit before any callback runs, so it cannot be scoped to one compile; it changes no trace, only
   how many graphs a frame may keep.

NOTE [regions fall back]
A block marked as a nested compile region (NOTE [compile regions inlined]) that dynamo cannot trace whole
(a graph break inside it, e.g. a branch on a tensor's value) makes dynamo raise
``UncapturedHigherOrderOpError``, which it never suppresses: the call would fail where eager runs. Dynamo
treats most other higher-order ops' failures as graph breaks (their variable class has
``_ALLOW_FALLBACK_TO_EAGER``); while it traces a kimi_cg frame, the start callback sets that flag on
``invoke_subgraph``'s variable class too and the end callback restores it, so such a block becomes a graph
break at its call (it runs outside the graph, as dynamo's own fallback runs it) and no other compile
sees the change.

NOTE [settings ladder]
An op whose output size depends on data (``repeat_interleave`` by a tensor, ``nonzero``) gives a
tensor of unbacked length. Code that then needs that length as a Python int fails under the full
settings, e.g. transformers' Qwen2-VL / Qwen2.5-VL / GLM-4V towers: one attention segment per frame,
``cu_seqlens = repeat_interleave(h * w, t).cumsum(0)`` and in every layer
``torch.split(q, lengths.tolist())``: the number of pieces is a data value. With
``capture_scalar_outputs`` alone dynamo breaks the graph at such an op instead: the op runs in
dynamo's resume glue and the rest of the frame is one graph that takes its result as an input, so
the segment count becomes an input size (guarded per count, as the item count already is). So a
code that fails under the full settings for a data-dependent reason and never traced with them
is traced with ``SCALAR_SETTINGS`` from its next call (``dynamic_shape_op_breaks``); only when that
fails too, ``DEMOTE_AFTER_FAILURES`` failures in all, does it get dynamo's defaults.

NOTE [calls inside a frame traced again]
While a frame runs eagerly for one call because it fails to trace now and is traced again at its
next call (a ladder step, a demotion, a refused flash branch), dynamo compiles the frames it calls as
frames of their own (its blocks, its helpers): pieces that the next call, which traces the whole frame,
no longer uses. Lifted as usual, each would compile a device program and capture every bucket on its
first call (Qwen2.5-VL's blocks: up to 55 s each on an H100, 2026-12-05) for one call's use. So the
end callback records the failed code with the frame that called it, and a lifted graph called while
that code runs on the stack under that same caller (``inside_a_frame_traced_again``) runs as dynamo
captured it (``calls_inside_frames_traced_again``). The record goes at the code's next compile, at
the first lifted call of its thread made with the caller off the stack (the eager run is over), or at
``kimi_cg.reset()``; it holds the caller frame, not its id, since an id can be reused by a later frame.
The same code run eagerly by another caller, or the nested graph called from anywhere else, runs
lifted. Only failures that happen once per code record it: a frame failing at every call (an invalid
input) leaves its nested pieces lifted, as they serve every call.

If the stack lookup of step 2 ever fails (a torch release that renames ``_compile``), kimi_cg
frames trace with dynamo's defaults: correct, with graph breaks; ``kimi_cg.counters["graph_breaks"]``
and a warning say so.

NOTE [dynamic first trace]
Dynamo's first trace of a frame has static shapes: left alone, the first image size a process sees
gets a program of its own with literal sizes (an eager device program, one CUDA graph of exactly its
rows: slower than the shared Inductor program), and the second size traces the frame again with the
rows symbolic. A later trace (a new item count, the RoPE table built at the first call) whose call
happens to have the rows of the first is static again. So whenever dynamo traces a kimi_cg frame
that looks like a tower's entry (its tensor arguments, also inside ``*args`` / ``**kwargs`` and the
tuples in them, not parameters: float tensors of one row count, the packed rows, and integer
grids of shape [N, 2] or [N, 3]), the start callback marks the rows' dim with
``maybe_mark_dynamic`` (dim 0, or dim 1 after a batch of one: NOTE [rows on dim 1] in
kimi_cg/capture.py): what automatic dynamic would mark once the rows changed, from the first
trace on. Other frames are left to dynamo: a resumed piece's stack or a nested frame given indices
and tables (Qwen2.5-VL's window permutation over groups of 4 rows, Kimi-K2.5's per-frame index into
its time table) would need each integer tensor's relation to the rows guessed, and a wrong guess
gave those pieces programs that cannot run padded (measured: a padding hazard for Kimi-K2.5 on the
H200, fewer replays for Qwen2.5-VL). "Maybe": a dim the code fixes is specialised with a guard, no
error; sizes 0 and 1 stay specialised. The marks are removed when the trace ends (dynamo guards on
them: left on the caller's tensors they would fail another compile's guards); the caller's own marks
are kept. ``torch.compile(dynamic=False)`` gets no marks. Counted in
``counters["traces_with_dynamic_rows"]``. The exact-size path (``exact_rows``) stays for a trace
whose rows still came out static.

NOTE [list vs torch.Size]: dynamo before torch 2.13 compares ``[h, w] == weight.shape[:-1]``
(upstream MoonViT's position-embedding check, always False in Python) element by element, so with
unbacked h, w it guards on ``h != 64`` and graph-breaks. ``install()`` makes its polyfill
``list_cmp`` type-aware, as Python and torch >= 2.13 are: a compatibility shim for that one bug, a
no-op on torch >= 2.13. The other process-wide changes: NOTE [attention substitutes]
(attention_substitutes.py), a dynamo polyfill for transformers' SDPA attention function that only
takes another path in kimi_cg frames; NOTE [grid sampler] (grid_sampler.py), a Python kernel of
``aten::grid_sampler`` that only skips a question dynamo cannot answer in kimi_cg frames; NOTE
[asserts with a computed message] (asserts.py), wrappers of dynamo's assert detector and its
jump-if-false handlers that only act in kimi_cg frames; NOTE [int of a grid comparison]
(grid_comparisons.py), dynamo's ``sym_int`` wrapped to give an integer expression for an undecidable
comparison in kimi_cg frames; NOTE [resize traced by shape] (resize_shapes.py), the upsample ops'
Python kernels wrapped to give only the output's metadata to dynamo's fake propagation in kimi_cg frames;
NOTE [repeat by a grid value] (repeat_by_grid_value.py), a Python kernel of ``repeat_interleave`` by an
integer that checks an unbacked count at run time instead of asking dynamo to decide it in kimi_cg frames.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import operator
import sys
import threading
import weakref

import torch

from kimi_cg.counters import counters
from kimi_cg.fallback import record_fallback

logger = logging.getLogger(__name__)

DYNAMO_SETTINGS = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True}
TORCH_2_13 = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
"""Whether this torch is 2.13 or newer (per-thread config, no list_cmp patch, nested compile regions reused)."""

SCALAR_SETTINGS = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": False}  # NOTE [settings ladder]
MIN_RECOMPILE_LIMIT = 64

DEMOTE_AFTER_FAILURES = 3

_backends: list = []  # the kimi_cg backend function(s) whose compiles get the settings
_traced_with_defaults: "weakref.WeakSet" = weakref.WeakSet()  # code objects that failed under the settings
_traced_with_scalars: "weakref.WeakSet" = weakref.WeakSet()  # code objects on SCALAR_SETTINGS (NOTE [settings ladder])
_traced_with_settings: "weakref.WeakSet" = weakref.WeakSet()  # code objects traced with them at least once
_failures_with_settings: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # code -> data-dependent failures
_codes_to_trace_again: "weakref.WeakSet" = weakref.WeakSet()  # failed codes dynamo marked SKIP
_codes_without_flash_path: "weakref.WeakSet" = weakref.WeakSet()  # NOTE [flash path] refused for these
# NOTE [calls inside a frame traced again]: code -> the frame that called it when its trace failed
_eager_runs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_state = threading.local()


def install(backend=None) -> None:
    """Scope DYNAMO_SETTINGS to compiles for ``backend`` (NOTE [dynamo settings]); idempotent. Without
    an argument, re-registers the callbacks for the backends installed before."""
    if backend is not None and backend not in _backends:
        _backends.append(backend)
    handler = torch._dynamo.callback_handler
    if _on_compile_start not in handler.start_callbacks:
        handler.register_start_callback(_on_compile_start)
    if _on_compile_end not in handler.end_callbacks:
        handler.register_end_callback(_on_compile_end)
    _patch_list_compare()
    from kimi_cg import asserts

    asserts.install()  # NOTE [asserts with a computed message]: acts only while a kimi_cg frame traces
    from kimi_cg import grid_comparisons

    grid_comparisons.install()  # NOTE [int of a grid comparison]: acts only while a kimi_cg frame traces
    from kimi_cg import grid_sampler

    grid_sampler.install()  # NOTE [grid sampler]
    from kimi_cg import resize_shapes

    resize_shapes.install()  # NOTE [resize traced by shape]: acts only while a kimi_cg frame traces
    from kimi_cg import repeat_by_grid_value

    repeat_by_grid_value.install()  # NOTE [repeat by a grid value]: acts only while a kimi_cg frame traces


def installed() -> bool:
    return _on_compile_start in torch._dynamo.callback_handler.start_callbacks


def active() -> bool:
    """Whether the current thread is tracing a kimi_cg frame with DYNAMO_SETTINGS in force."""
    return getattr(_state, "patch", None) is not None


def flash_path_allowed() -> bool:
    """Whether the frame being traced may take transformers' flash branch (NOTE [flash path])."""
    return active() and _state.code not in _codes_without_flash_path


def note_flash_path() -> None:
    if active() and not _state.flash_path_taken:
        _state.flash_path_taken = True
        counters["flash_path_traces"] += 1


def flash_path_taken() -> bool:
    return active() and _state.flash_path_taken


def _convert_frame_file():
    return getattr(sys.modules.get("torch._dynamo.convert_frame"), "__file__", None)


def _compile_frame():
    """The frame of dynamo's ``convert_frame._compile`` running below us, or None."""
    filename = _convert_frame_file()
    frame = sys._getframe(2)
    while frame is not None and not (frame.f_code.co_name == "_compile" and frame.f_code.co_filename == filename):
        frame = frame.f_back
    return frame


def _compile_frame_locals():
    """The locals of dynamo's ``convert_frame._compile`` running below us, or None."""
    frame = _compile_frame()
    return None if frame is None else frame.f_locals


def _is_kimi_cg(compiler_fn) -> bool:
    seen = 0
    while compiler_fn is not None and seen < 16:
        if any(compiler_fn is backend for backend in _backends):
            return True
        # torch.compile's wrappers: WrapBackendDebug -> _TorchCompileWrapper -> the backend.
        compiler_fn = (getattr(compiler_fn, "_torchdynamo_orig_backend", None)
                       or getattr(compiler_fn, "compiler_fn", None) or getattr(compiler_fn, "func", None))
        seen += 1
    return False


def _on_compile_start(_args) -> None:
    _restore_suppress_errors()
    _reset_skipped_codes()
    local_vars = _compile_frame_locals()
    if local_vars is None or not _is_kimi_cg(local_vars.get("compiler_fn")):
        return
    if _eager_runs:
        _eager_runs.pop(local_vars.get("code"), None)  # its eager run is over: it is being traced again
    if torch._dynamo.config.recompile_limit < MIN_RECOMPILE_LIMIT:
        logger.info("kimi_cg raises torch._dynamo.config.recompile_limit to %d in this thread", MIN_RECOMPILE_LIMIT)
        torch._dynamo.config.recompile_limit = MIN_RECOMPILE_LIMIT
    code = local_vars.get("code")
    if code is not None and code in _traced_with_defaults:
        return
    patch = torch._dynamo.config.patch(**(SCALAR_SETTINGS if code is not None and code in _traced_with_scalars else DYNAMO_SETTINGS))
    patch.__enter__()
    _state.patch, _state.code, _state.error_at_start = patch, code, sys.exc_info()[1]
    _state.region_fallback = _let_regions_fall_back()  # NOTE [regions fall back]
    _state.marked = _mark_leading_dims_dynamic(code, local_vars.get("locals"))
    _state.flash_path_taken = False
    from kimi_cg import attention_substitutes

    attention_substitutes.install()  # NOTE [attention substitutes]


def _on_compile_end(_args) -> None:
    patch = getattr(_state, "patch", None)
    if patch is None:
        return
    _state.patch = None
    patch.__exit__(None, None, None)
    _restore_region_fallback(getattr(_state, "region_fallback", None))
    _state.region_fallback = None
    _unmark(_state.marked)
    error = sys.exc_info()[1]  # the compile's own error, when it is propagating (the callback runs in a finally)
    code = _state.code
    if error is None or error is _state.error_at_start:
        if code is not None:
            _traced_with_settings.add(code)
        return
    where = f"{code.co_filename}:{code.co_firstlineno} ({code.co_name})" if code is not None else "a frame"
    refusal = _flash_path_refusal(error)
    if refusal is not None:  # NOTE [flash path]: this call runs eagerly, the next traces the sdpa branch
        if code is not None:
            _codes_without_flash_path.add(code)
        counters["flash_path_refusals"] += 1
        record_fallback("kimi_cg refused transformers' flash branch", where, str(refusal),
                        "this call runs the frame eagerly; from the next call it is traced on its sdpa branch")
        _note_eager_run(code)
        _suppress_errors_once()
        _trace_again_next_call(error, code)
        return
    if _is_graph_break(error):
        if "No ops traced" not in str(error):  # dynamo skips frames without tensor work: nothing lost
            from kimi_cg.debug import report_skipped_frame

            report_skipped_frame(where, error)
        return
    summary = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
    failures = 0
    if code is not None and code not in _traced_with_settings and _caused_by_unbacked_values(error):
        failures = _failures_with_settings[code] = _failures_with_settings.get(code, 0) + 1
    if failures == 1 and code not in _traced_with_scalars:  # NOTE [settings ladder]: one step down
        _traced_with_scalars.add(code)
        counters["dynamic_shape_op_breaks"] += 1
        counters["dynamo_trace_failures"] += 1
        record_fallback("dynamo failed to trace this call", where, summary,
                        "this call runs the frame eagerly; from the next call ops with data-dependent output sizes "
                        "break its graph (NOTE [settings ladder])")
        _note_eager_run(code)
    elif failures >= DEMOTE_AFTER_FAILURES:
        _traced_with_scalars.discard(code)
        _traced_with_defaults.add(code)
        counters["dynamo_setting_fallbacks"] += 1
        record_fallback("dynamo failed with kimi_cg's settings", where, summary,
                        "this frame runs eagerly now and is traced with dynamo's default settings from the next call")
        _note_eager_run(code)
    else:
        # An op failing on these inputs (eager fails the same way, e.g. an empty batch): the frame
        # runs eagerly so that the caller sees eager's own error; the next call traces it again.
        counters["dynamo_trace_failures"] += 1
        record_fallback("dynamo failed to trace this call", where, summary, "this call runs the frame eagerly")
    _suppress_errors_once()
    _trace_again_next_call(error, code)


def _note_eager_run(code) -> None:
    """NOTE [calls inside a frame traced again]: ``code`` runs eagerly in this call and is traced
    again at its next; remembers which frame called it (the frame above dynamo's callback)."""
    if code is None:
        return
    frame, filename = _compile_frame(), _convert_frame_file()
    while frame is not None and frame.f_code.co_filename == filename:  # _compile and dynamo's callback above it
        frame = frame.f_back
    if frame is not None:
        _eager_runs[code] = (frame, threading.get_ident())


def inside_a_frame_traced_again() -> bool:
    """NOTE [calls inside a frame traced again]: whether this thread is inside the eager run of a
    frame whose trace failed in this call and that is traced again at its next call."""
    if not _eager_runs:
        return False
    frame, on_stack = sys._getframe(1), set()
    while frame is not None:
        try:
            entry = _eager_runs.get(frame.f_code)
        except TypeError:  # code dynamo generated can hold unhashable constants: never a recorded code
            entry = None
        if entry is not None and entry[0] is frame.f_back:
            return True
        on_stack.add(id(frame))
        frame = frame.f_back
    # A record of this thread whose caller is not on the stack: that eager run is over (the caller is
    # held, so its id is no other frame's). Dropping it early only lifts the nested graphs, as before.
    thread = threading.get_ident()
    try:
        finished = [code for code, (caller, owner) in _eager_runs.items() if owner == thread and id(caller) not in on_stack]
    except RuntimeError:  # another thread changed the records meanwhile: look again at the next call
        return False
    for code in finished:
        _eager_runs.pop(code, None)
    return False


def _mark_leading_dims_dynamic(code, frame_locals) -> list:
    """NOTE [dynamic first trace]: marks the row dim of a tower entry's packed rows maybe-dynamic.
    Returns [(tensor, its marks before)] for ``_unmark``."""
    if code is None or not isinstance(frame_locals, dict):
        return []
    if not torch._dynamo.config.automatic_dynamic_shapes or torch._dynamo.config.assume_static_by_default is False:
        return []  # torch.compile(dynamic=False) asked for static shapes; dynamic=True needs no marks
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount
                             + bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)]
    values = [frame_locals.get(name) for name in names]
    for _ in range(2):  # *args, **kwargs, and the tuples in them (position_embeddings=(cos, sin))
        values = [part for value in values for part in (
            value if isinstance(value, (tuple, list)) else value.values() if isinstance(value, dict) else (value,))]
    # Parameters are module state; sizes 0 and 1 are specialised whatever the marks say.
    tensors = [v for v in values if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and v.dim() >= 1]
    floats = list({id(t): t for t in tensors if t.is_floating_point()}.values())  # one tensor passed twice: once
    # A tower's entry: its packed rows (float, one row count) and grids ([N, 2] or [N, 3] integers).
    # Anything else (a resumed piece's stack, a nested frame given indices or tables) is left to dynamo.
    if code.co_name.startswith("torch_dynamo_resume_in_") or len({t.shape[_rows_dim(t)] for t in floats}) != 1:
        return []
    grids_only = all(t.is_floating_point() or (t.dim() == 2 and t.shape[1] in (2, 3)) for t in tensors)
    if not grids_only or floats[0].shape[_rows_dim(floats[0])] < 2:
        return []
    marked = [(value, {name: set(getattr(value, name)) if name == _WEAK else getattr(value, name)
                       for name in _MARKS if hasattr(value, name)}) for value in floats]
    for value in floats:
        torch._dynamo.maybe_mark_dynamic(value, _rows_dim(value))
    counters["traces_with_dynamic_rows"] += 1
    return marked


def _rows_dim(tensor: torch.Tensor) -> int:
    """Where a tower entry's float argument holds its rows: dim 0, or dim 1 of a [1, L, ...] tensor of
    three dims or more (a batch of one kept in front of the rows, NOTE [rows on dim 1] in
    kimi_cg/capture.py: PaddleOCR-VL's patches)."""
    return 1 if tensor.dim() >= 3 and tensor.shape[0] == 1 and tensor.shape[1] >= 2 else 0


_WEAK = "_dynamo_weak_dynamic_indices"
_MARKS = (_WEAK, "_has_dynamo_dim_marking")  # what maybe_mark_dynamic sets; dynamo guards on both


def _unmark(marked: list) -> None:
    for tensor, previous in marked:
        for name in _MARKS:
            if name in previous:
                setattr(tensor, name, previous[name])
            elif hasattr(tensor, name):
                delattr(tensor, name)


def _trace_again_next_call(error: BaseException, code) -> None:
    """NOTE [dynamo settings], step 3: a frame whose trace failed with suppress_errors is skipped by
    dynamo for the rest of the process (its code is marked SKIP), so one invalid request would leave
    a tower eager forever. kimi_cg asks for "run eagerly now, trace again at the next call": on the
    error, from which dynamo reads a strategy when it is a TorchDynamoException (a data-dependent
    failure such as GuardOnDataDependentSymNode reaches dynamo unwrapped: its class gains that base,
    _as_dynamo_exception), else by resetting the code's strategy when the next compile starts."""
    strategy = _trace_again_strategy()
    if strategy is None:
        return
    from torch._dynamo import exc

    if not isinstance(error, exc.TorchDynamoException):
        error = _as_dynamo_exception(error)
    if isinstance(error, exc.TorchDynamoException):  # a torch with frame strategies reads this attribute
        error.frame_exec_strategy = strategy
    elif code is not None:
        _codes_to_trace_again.add(code)


def _as_dynamo_exception(error: BaseException) -> BaseException:
    """The same exception object, also a TorchDynamoException (its class gains that base), so that dynamo
    reads the frame strategy from it. A data-dependent failure (GuardOnDataDependentSymNode) reaches
    dynamo unwrapped; left as it is, dynamo marks the frame's code SKIP and only a later compile start
    could undo that: a model whose eager run traces no nested frame would stay eager for good."""
    from torch._dynamo import exc

    if not isinstance(error, RuntimeError):
        return error
    cls = type(error)
    subclass = _DYNAMO_VIEWS.get(cls)
    if subclass is None:
        try:
            subclass = type(cls.__name__, (cls, exc.TorchDynamoException), {"__module__": cls.__module__})
        except TypeError:  # an incompatible layout: keep the exception as it is
            return error
        _DYNAMO_VIEWS[cls] = subclass
    try:
        error.__class__ = subclass
    except TypeError:
        return error
    return error


_DYNAMO_VIEWS: dict = {}


def _trace_again_strategy():
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy
    except ImportError:  # a torch without frame strategies: the frame stays skipped (eager, correct)
        return None
    return _FrameExecStrategy(_FrameAction.DEFAULT, _FrameAction.DEFAULT)


def _reset_skipped_codes() -> None:
    if not _codes_to_trace_again:
        return
    strategy = _trace_again_strategy()
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
    except ImportError:
        return
    for code in list(_codes_to_trace_again):
        set_code_exec_strategy(code, strategy)
    _codes_to_trace_again.clear()


def _error_chain(error: BaseException):
    """The error and the errors it was raised from or during (dynamo wraps what it catches)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _flash_path_refusal(error: BaseException):
    """The FlashPathRefused in the error's chain, or None."""
    from kimi_cg.attention_substitutes import FlashPathRefused

    return next((link for link in _error_chain(error) if isinstance(link, FlashPathRefused)), None)


def _caused_by_unbacked_values(error: BaseException) -> bool:
    """Whether dynamo failed on a data-dependent size or value, i.e. because of DYNAMO_SETTINGS."""
    return any(type(link).__name__ in _UNBACKED_ERRORS or "data-dependent" in str(link) for link in _error_chain(error))


_UNBACKED_ERRORS = {"GuardOnDataDependentSymNode", "DataDependentOutputException", "DynamicOutputShapeException",
                    "PendingUnbackedSymbolNotFound"}

# NOTE [dynamo settings], step 3: dynamo reads suppress_errors after the end callback, to decide
# whether the failed frame crashes the call or runs eagerly. It is set for that one read and put back
# when the next compile starts (or by kimi_cg.reset()). Before torch 2.13 config is process-wide, so
# any thread's next compile puts it back; from 2.13 on it is per thread, and the thread that set it
# puts its own value back.
_CONFIG_IS_PER_THREAD = TORCH_2_13
_suppressed: dict[int, bool] = {}  # thread id -> suppress_errors before kimi_cg set it
_suppressed_lock = threading.Lock()


def _suppress_errors_once() -> None:
    with _suppressed_lock:
        _suppressed.setdefault(threading.get_ident(), torch._dynamo.config.suppress_errors)
    torch._dynamo.config.suppress_errors = True


def _restore_suppress_errors() -> None:
    if not _suppressed:
        return
    with _suppressed_lock:
        thread = threading.get_ident()
        if thread in _suppressed:
            torch._dynamo.config.suppress_errors = _suppressed.pop(thread)
        elif not _CONFIG_IS_PER_THREAD:
            torch._dynamo.config.suppress_errors = next(iter(_suppressed.values()))
            _suppressed.clear()


def clear() -> None:
    """Forget frames demoted to dynamo's defaults and restore suppress_errors (kimi_cg.reset())."""
    _traced_with_defaults.clear()
    _traced_with_scalars.clear()
    _traced_with_settings.clear()
    _failures_with_settings.clear()
    _codes_without_flash_path.clear()
    _eager_runs.clear()
    _restore_suppress_errors()


def _region_variable_class():
    """Dynamo's variable class for ``invoke_subgraph`` calls (its module moved after torch 2.11), or None."""
    for module in ("torch._dynamo.variables.invoke_subgraph", "torch._dynamo.variables.higher_order_ops"):
        try:
            cls = getattr(importlib.import_module(module), "InvokeSubgraphHigherOrderVariable", None)
        except ImportError:
            cls = None
        if cls is not None and isinstance(getattr(cls, "_ALLOW_FALLBACK_TO_EAGER", None), bool):
            return cls
    return None


def _let_regions_fall_back():
    """NOTE [regions fall back]: (class, its flag before) when the flag was set, else None."""
    cls = _region_variable_class()
    if cls is None:
        return None
    before = cls.__dict__.get("_ALLOW_FALLBACK_TO_EAGER")
    cls._ALLOW_FALLBACK_TO_EAGER = True
    return cls, before


def _restore_region_fallback(saved) -> None:
    if saved is None:
        return
    cls, before = saved
    if before is None:
        del cls._ALLOW_FALLBACK_TO_EAGER  # inherited before
    else:
        cls._ALLOW_FALLBACK_TO_EAGER = before


def _is_graph_break(error: BaseException) -> bool:
    """Dynamo's own soft failures (a graph break it cannot resume from, a frame it skips)."""
    from torch._dynamo import exc

    soft = tuple(getattr(exc, name) for name in ("Unsupported", "UserError", "SkipFrame") if hasattr(exc, name))
    return isinstance(error, soft)


def _list_vs_tuple_aware(original):
    def list_cmp(op, left, right):
        # Python: a list never equals a tuple (or torch.Size); compare element-wise only when both
        # sides are lists or both are tuples.
        if op in (operator.eq, operator.ne) and isinstance(left, list) != isinstance(right, list):
            return op is operator.ne
        if op is operator.eq and len(left) == len(right):
            # Element-wise equality as one symbolic condition (no guard per element), so that
            # torch._check(x.shape[:-2] == y.shape[:-1]) traces with unbacked sizes.
            # Constants decide at once; symbolic conditions are joined with & (SymBool & SymBool). Elements
            # whose == is neither (tensors, objects) go to dynamo's own polyfill.
            result = True
            for a, b in zip(left, right):
                same = a == b
                if same is False:
                    return False
                if same is True:
                    continue
                # Dynamo reports a traced SymBool's type as bool (isinstance(same, torch.SymBool) is
                # False while tracing, on torch 2.11 and 2.13 alike): accept both.
                if not isinstance(same, (bool, torch.SymBool)):
                    return original(op, left, right)
                result = same if result is True else result & same
            return result
        return original(op, left, right)

    list_cmp.__kimi_cg_original__ = original
    return list_cmp


def _patch_list_compare() -> None:
    """NOTE [list vs torch.Size]."""
    if TORCH_2_13:
        return
    polyfills = importlib.import_module("torch._dynamo.polyfills")
    original = getattr(polyfills, "list_cmp", None)
    if original is None or hasattr(original, "__kimi_cg_original__"):
        return
    patched = _list_vs_tuple_aware(original)
    for name, module in list(sys.modules.items()):
        if name.startswith("torch._dynamo") and getattr(module, "list_cmp", None) is original:
            setattr(module, "list_cmp", patched)
    logger.info("kimi_cg: made dynamo's list_cmp polyfill list/tuple aware (torch %s)", torch.__version__)
