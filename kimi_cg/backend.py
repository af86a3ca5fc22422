"""The torch.compile entry point: ``torch.compile(model, backend="kimi_cg")``.

Runs the stages in order and nothing else: capture (inputs' roles), canonicalise (one pass per
module), lift (split into host / device / post programs), host program (with the per-item
metadata cache), device program (shared by structure), runner.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
import weakref

import torch

from kimi_cg import capture, dynamo_settings
from kimi_cg.canonicalize import (EmbeddingReadsPass, FuseGatherLayerNormPass, GatherReducePass, InlineRegionsPass,
                                  LinearGeluPass, MergeGatherPass, PatchConvPass, RealRopePass, ScatterMergePass,
                                  SegmentAttentionPass, SeparableResizePass, TableGatherPass)
from kimi_cg.canonicalize.compile_regions import has_regions
from kimi_cg.config import KimiCGConfig
from kimi_cg.counters import counters, timings
from kimi_cg.device_program import get_device_program
from kimi_cg.errors import InvalidInputError, UnsupportedGraphError
from kimi_cg.host_program import HostProgram
from kimi_cg.fallback import record_fallback
from kimi_cg.lift import source_location, split
from kimi_cg.runtime.graphs import BucketedGraphs, input_rules
from kimi_cg.runtime.runner import LiftedRunner
from kimi_cg.debug import report_graph_break, write_lift_report
from kimi_cg.debug.dump import GraphDump, frame_of, start_graph, tensor_op_count
from kimi_cg.debug.repro import placeholder_sources, repro_source

logger = logging.getLogger(__name__)

def _resolve_compiler(config: KimiCGConfig, example_inputs) -> str:
    if config.device_compiler != "auto":
        return config.device_compiler
    on_cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
    return "inductor" if on_cuda else "eager"


def kimi_cg_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None, **_):
    start = time.perf_counter()
    try:
        try:
            config = KimiCGConfig.from_options(options)
        except ValueError as error:
            return _raise_when_called(error)  # the caller's mistake, in its own class (not BackendCompilerFailed)
        return _compile_graph(gm, example_inputs, config)
    finally:
        timings["backend"] += time.perf_counter() - start


def _compile_graph(gm: torch.fx.GraphModule, example_inputs, config: KimiCGConfig):
    if not dynamo_settings.installed():
        logger.warning("kimi_cg: this graph was traced without kimi_cg's dynamo settings (torch._dynamo.reset() "
                       "drops compile callbacks; call kimi_cg.reset() after it); installed again for later compiles")
        dynamo_settings.install()
    if dynamo_settings.flash_path_taken():
        from kimi_cg.attention_substitutes import check_flash_path_graph

        check_flash_path_graph(gm)  # raises FlashPathRefused: NOTE [flash path]
    counters["dynamo_graphs"] += 1
    graph_id = counters["dynamo_graphs"]
    report_graph_break(gm)
    inputs = capture.classify_inputs(gm)
    dump = start_graph(config.debug_dir, gm, frame_of(gm), _grid_at_trace(inputs, example_inputs))
    activations = [item.index for item in inputs if item.role is capture.InputRole.ACTIVATION]
    if not activations or not any(item.role is capture.InputRole.GRID for item in inputs):
        logger.info("kimi_cg: graph %d has no activation/grid inputs; running it unchanged", graph_id)
        dump.update(status="runs unchanged (no activation and grid inputs)")
        return _run_captured(gm, dump, "no activation and grid inputs")
    try:
        # The passes rewrite a copy: dynamo's graph stays pristine, to run when lifting fails.
        return _lift(capture.working_copy(gm), gm, inputs, activations, example_inputs, config, dump)
    except Exception as error:  # noqa: BLE001 - NOTE [errors by who must act]: never a crash where eager runs
        return _unlifted(gm, error, config, dump, inputs, example_inputs)


def _lift(work: torch.fx.GraphModule, pristine: torch.fx.GraphModule, inputs, activations, example_inputs,
          config: KimiCGConfig, dump: GraphDump):
    if has_regions(work):  # NOTE [compile regions inlined]: first, so every other pass sees plain ops
        InlineRegionsPass(dump)(work)
    SeparableResizePass(dump)(work)
    SegmentAttentionPass(dump)(work)
    ScatterMergePass(dump)(work)
    GatherReducePass(dump)(work)
    MergeGatherPass(dump)(work)
    FuseGatherLayerNormPass(dump)(work)
    RealRopePass(dump)(work)
    if config.table_gathers:
        TableGatherPass(dump)(work)
        EmbeddingReadsPass(dump)(work)
    PatchConvPass(dump)(work)
    if config.linear_gelu_epilogue:
        LinearGeluPass(dump)(work)
    inputs = capture.classify_inputs(work)
    lifted = split(work, inputs)
    grid_inputs = [item.index for item in inputs if item.role is capture.InputRole.GRID]
    const_inputs = {item.index for item in inputs if item.role is capture.InputRole.MODULE_STATE}
    host = HostProgram(lifted.host, grid_inputs, const_inputs, config.metadata_cache_bytes, config.batch_cache_size,
                       owner=f"options {config.compute_hash()}")
    host_inputs = frozenset(i for i, ref in enumerate(lifted.device.inputs) if ref.program == "host")
    compiler = _resolve_compiler(config, example_inputs)
    builds_state = _builds_module_state(work)
    if not _has_dynamic_patch_count(inputs) or builds_state:
        compiler = "eager"  # dynamo's first, static-shape trace serves one L: not worth an Inductor compile
    device = get_device_program(lifted.device.gm, compiler, host_inputs, config.inductor_config)
    try:
        write_lift_report(dump, lifted, host, device, inputs, device_input_kinds(lifted, inputs))
    except Exception:  # noqa: BLE001 - a debugging aid must never change what runs
        logger.warning("kimi_cg: writing the lift report failed (the graph is lifted regardless)", exc_info=True)
    dump.update(status="lifted", device_program=device.key,
                device_ops=tensor_op_count(lifted.device.gm) if dump.enabled else None,
                device_program_ran=False)  # NOTE [programs that ran] in kimi_cg/device_program.py
    if dump.enabled and device.compiler == "inductor":  # its Inductor code is written when it compiles
        if device.inductor_code is not None:
            dump.shared_file("device_programs", f"{device.key}.inductor", lambda: device.inductor_code,
                             field="inductor_code_file")
        else:
            device.dumps.append(dump)
    graphs = None if builds_state else _bucketed_graphs(config, lifted, inputs, device, example_inputs)
    runner = LiftedRunner(lifted, host, device, activations[0], graphs, fallback=pristine.forward, strict=config.strict,
                          dump=dump, repro=_call_repro(pristine, inputs, config))
    if builds_state:
        runner.plain_reason = "builds module state (runs once)"  # NOTE [a graph that builds module state]
    return runner


def _call_repro(pristine: torch.fx.GraphModule, inputs, config: KimiCGConfig):
    """(call args, title) -> call_repro.py text, for a call the lifted program cannot run; the
    placeholders' dynamo sources are taken now, while dynamo's metadata is still on the graph."""
    sources = placeholder_sources(pristine)
    return lambda args, title: repro_source(pristine, inputs, args, config, title, sources=sources)


def _unlifted(gm: torch.fx.GraphModule, error: Exception, config: KimiCGConfig, dump: GraphDump, inputs=(),
              example_inputs=()):
    """What runs when a graph cannot be lifted: the captured graph unchanged, or (strict) an error
    raised when the graph is called, so that the caller sees kimi_cg's own error class."""
    if isinstance(error, UnsupportedGraphError):
        reason, detail = error.reason, str(error)
    else:
        reason, detail = f"internal error ({type(error).__name__})", f"{type(error).__name__}: {error}"
        logger.debug("kimi_cg: internal error while lifting", exc_info=True)
    where = getattr(error, "where", None) or _first_user_location(gm)
    record = dump.failed(error, reason, where, repro=lambda: repro_source(
        gm, inputs, example_inputs, config, f"Reproduces kimi_cg's lift failure of graph [{dump.entry['compile_id']}]: "
        f"{reason} at {where}"))
    if record is not None:
        detail += f" (dump: {record})"
    if config.strict:
        if not isinstance(error, UnsupportedGraphError) or record is not None:
            message = detail if isinstance(error, UnsupportedGraphError) else f"kimi_cg could not lift this graph: {detail}"
            unsupported = UnsupportedGraphError(message, reason, getattr(error, "where", None))
            unsupported.__cause__ = error
            error = unsupported
        return _raise_when_called(error)
    counters["lift_fallbacks"] += 1
    record_fallback(reason, where, detail, "this graph runs unlifted")
    return _run_captured(gm, dump, reason)


def _run_captured(gm: torch.fx.GraphModule, dump: GraphDump | None = None, reason: str | None = None):
    """The captured graph as the call's program. A runtime assertion dynamo put into it (a check on
    a data-dependent size, failing before the op eager would fail in) is the caller's error:
    InvalidInputError, still the RuntimeError it was (NOTE [errors by who must act]). When dumping,
    each call is recorded as an unlifted run (NOTE [call records])."""
    forward = gm.forward
    if dump is not None and dump.records_calls:
        def forward(*args, _run=gm.forward):
            start = time.perf_counter()
            try:
                return _run(*args)
            finally:
                dump.record_call({"path": "unlifted graph", "reason": reason,
                                  "total_ms": round((time.perf_counter() - start) * 1e3, 3)})

    def run(*args):
        try:
            return forward(*args)
        except RuntimeError as error:
            if "Runtime assertion failed" not in str(error) or isinstance(error, InvalidInputError):
                raise
            counters["invalid_inputs"] += 1
            raise InvalidInputError.like(f"kimi_cg: invalid input: {error}", error) from error

    return run


def _raise_when_called(error: Exception):
    """A compiled graph that raises ``error`` when called: dynamo would wrap an error raised by the
    backend in BackendCompilerFailed, hiding kimi_cg's class from the caller."""

    def raise_error(*args):
        raise error

    return raise_error


def _first_user_location(gm: torch.fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        if node.meta.get("stack_trace"):
            return source_location(node)
    return "an unknown location"


def _grid_at_trace(inputs, example_inputs) -> list | None:
    """The grid values of the call dynamo traced this graph for (when its grid input is a real tensor)."""
    for item in inputs:
        if item.role is capture.InputRole.GRID and item.index < len(example_inputs):
            value = example_inputs[item.index]
            if isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor) and value.numel() <= 1024:
                return value.tolist()
    return None


def _activation_rows(inputs) -> list:
    """The row count of each activation input (a SymInt when dynamo made it dynamic): its size at its
    row dim (NOTE [rows on dim 1] in kimi_cg/capture.py)."""
    values = [capture.example_value(item.node) for item in inputs if item.role is capture.InputRole.ACTIVATION]
    return [value.shape[capture.row_dim(value)] for value in values if isinstance(value, torch.Tensor) and value.dim() >= 1]


def _builds_module_state(gm: torch.fx.GraphModule) -> bool:
    """NOTE [a graph that builds module state]
    A tower that makes a table on its first call (MoonViT's RoPE table: ``if self.freqs_cis is None:
    self.freqs_cis = ...``) has dynamo return the new tensor from that call's graph, computed from
    literals alone, and store it on the module; the guards of that graph then fail for every later
    call (the attribute is no longer None), so the graph runs once. Such a graph reads the table as
    its own intermediate where later graphs read it as module state (NOTE [table gathers]): its
    device program differs from theirs. It runs the plain program (no Inductor compile, no buckets
    captured: 17 bucket captures and a compile for one call, on an H100 at 63ed8db)."""
    output = next((node for node in gm.graph.nodes if node.op == "output"), None)
    if output is None:
        return False
    free: dict[torch.fx.Node, bool] = {}
    for node in gm.graph.nodes:  # True: computed without any graph input
        free[node] = node.op not in ("placeholder", "output") and all(free[arg] for arg in node.all_input_nodes)
    return any(free.get(node) and isinstance(capture.example_value(node), torch.Tensor) for node in output.all_input_nodes)


def _has_dynamic_patch_count(inputs) -> bool:
    # Any activation: a resumed piece may take a fixed-shape table before the packed patches.
    return any(isinstance(rows, torch.SymInt) for rows in _activation_rows(inputs))


def device_input_kinds(lifted, inputs) -> list[str]:
    """Where each device-program input comes from: "activation", "state" (module state), "size",
    "grid" (a call's integer tensor handed to the device as is) or "host" (made by the host program).
    A grid is per-call data: never "state", whose captured graphs read the capture-time address."""
    roles = {item.index: item.role for item in inputs}
    kinds = []
    for ref in lifted.device.inputs:
        if ref.program != "arg":
            kinds.append("host")
        else:
            kinds.append({capture.InputRole.ACTIVATION: "activation", capture.InputRole.SIZE: "size",
                          capture.InputRole.GRID: "grid"}.get(roles[ref.index], "state"))
    return kinds


def _bucketed_graphs(config: KimiCGConfig, lifted, inputs, device, example_inputs):
    """A function from a call's device inputs to its BucketedGraphs, or None (no CUDA graphs)."""
    on_cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
    enabled = on_cuda if config.cuda_graphs is None else config.cuda_graphs
    if not enabled:
        return None
    buckets = config.buckets()
    exact_rows = not _has_dynamic_patch_count(inputs)
    if exact_rows:
        # Dynamo's first trace of a frame has static shapes: that program serves one exact L (its
        # guards send only that L here), so it gets one graph of exactly that size.
        buckets = (max(int(rows) for rows in _activation_rows(inputs)),)
    rules = input_rules(device, device_input_kinds(lifted, inputs))
    key = (tuple(rules), buckets, config.max_items, config.max_frames, on_cuda, config.poison_graph_pool,
           config.exact_size_graphs, config.attention_length_classes, config.host_block)
    # The key holds one rule per device input (hundreds: the weights), and a tuple rehashes its
    # items on every lookup: equal keys get one small int per device program, once, here.
    key = device.configurations.setdefault(key, len(device.configurations))

    static_positions = [i for i, rule in enumerate(rules) if rule.kind == "static"]
    take_static = operator.itemgetter(*static_positions) if len(static_positions) > 1 else None

    def graphs_for(device_args) -> BucketedGraphs:
        # NOTE [graphs and weights]: dynamo graphs of one model (one per number of items) share a
        # structurally equal device program and its captured graphs. A capture bakes in the
        # addresses of the weights, so graphs are keyed by them: another model instance with the
        # same structure gets its own graphs. The graphs hold no reference to the weights; when
        # any of them is freed the graphs go too (a new model at the same addresses captures
        # anew), and weights that moved (``.to(dtype)`` keeps the Parameter objects) replace the
        # graphs of their old addresses.
        weights = take_static(device_args) if take_static is not None else tuple(device_args[i] for i in static_positions)
        addresses = tuple(map(torch.Tensor.data_ptr, weights))
        graphs = device.bucketed_graphs.get((key, addresses))
        if graphs is None:
            graphs = _new_graphs(device, (key, addresses), weights, lambda: BucketedGraphs(
                device, rules, buckets, config.max_items, config.max_frames, capture=on_cuda,
                poison_pool=config.poison_graph_pool, exact_rows=exact_rows, exact_graphs=config.exact_size_graphs,
                length_classes=config.attention_length_classes, host_block=config.host_block))
        return graphs

    return graphs_for


_GRAPHS_LOCK = threading.Lock()


def _new_graphs(device, entry_key, weights, make) -> BucketedGraphs:
    """Register a graph set for these weights (NOTE [graphs and weights])."""
    with _GRAPHS_LOCK:
        graphs = device.bucketed_graphs.get(entry_key)
        if graphs is not None:
            return graphs
        identities = frozenset(map(id, weights))
        for other_key, other in list(device.bucketed_graphs.items()):
            if other_key[0] == entry_key[0] and other.weight_identities == identities:
                del device.bucketed_graphs[other_key]  # the same tensors, moved: old addresses are stale
        graphs = make()
        graphs.weight_identities = identities
        device.bucketed_graphs[entry_key] = graphs
        table = weakref.ref(device)
        for weight in weights:
            weakref.finalize(weight, _drop_graphs, table, entry_key, weakref.ref(graphs))
        return graphs


def _drop_graphs(device_ref, entry_key, graphs_ref) -> None:
    device = device_ref()
    if device is not None and device.bucketed_graphs.get(entry_key) is graphs_ref() is not None:
        device.bucketed_graphs.pop(entry_key, None)


dynamo_settings.install(kimi_cg_backend)  # NOTE [dynamo settings]: kimi_cg's only import-time effect
