"""The torch.compile entry point: ``torch.compile(model, backend="kimi_cg")``.

Runs the stages in order and nothing else: capture (inputs' roles), canonicalise (one pass per
module), lift (split into host / device / post programs), host program (with the per-item
metadata cache), device program (shared by structure), runner.
"""

from __future__ import annotations

import logging
import operator
import os
import time

import torch

from kimi_cg import capture
from kimi_cg.canonicalize import FuseGatherLayerNormPass, MergeGatherPass, RealRopePass, SegmentAttentionPass, SeparableResizePass
from kimi_cg.config import KimiCGConfig
from kimi_cg.counters import counters, timings
from kimi_cg.device_program import get_device_program
from kimi_cg.errors import UnsupportedGraphError
from kimi_cg.host_program import HostProgram
from kimi_cg.lift import split
from kimi_cg.runtime.graphs import BucketedGraphs, input_rules
from kimi_cg.runtime.runner import LiftedRunner
from kimi_cg.debug import report_graph_break, write_lift_report

logger = logging.getLogger(__name__)

capture.configure_dynamo()  # NOTE [dynamo settings] in capture.py: the one global side effect.


def _resolve_compiler(config: KimiCGConfig, example_inputs) -> str:
    if config.device_compiler != "auto":
        return config.device_compiler
    on_cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
    return "inductor" if on_cuda else "eager"


def kimi_cg_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None, **_):
    start = time.perf_counter()
    try:
        return _compile_graph(gm, example_inputs, KimiCGConfig.from_options(options))
    finally:
        timings["backend"] += time.perf_counter() - start


def _compile_graph(gm: torch.fx.GraphModule, example_inputs, config: KimiCGConfig):
    counters["dynamo_graphs"] += 1
    graph_id = counters["dynamo_graphs"]
    debug_dir = os.path.join(config.debug_dir, f"graph_{graph_id:03d}") if config.debug_dir else None
    report_graph_break(gm)
    inputs = capture.classify_inputs(gm)
    activations = [item.index for item in inputs if item.role is capture.InputRole.ACTIVATION]
    if not activations or not any(item.role is capture.InputRole.GRID for item in inputs):
        logger.info("kimi_cg: graph %d has no activation/grid inputs; running it unchanged", graph_id)
        return gm.forward
    try:
        SeparableResizePass(debug_dir)(gm)
        SegmentAttentionPass(debug_dir)(gm)
        MergeGatherPass(debug_dir)(gm)
        FuseGatherLayerNormPass(debug_dir)(gm)
        RealRopePass(debug_dir)(gm)
        lifted = split(gm, inputs)
    except UnsupportedGraphError:
        if config.strict:
            raise
        logger.warning("kimi_cg: graph %d could not be lifted; running it unchanged", graph_id, exc_info=True)
        return gm.forward
    grid_inputs = [item.index for item in inputs if item.role is capture.InputRole.GRID]
    const_inputs = {item.index for item in inputs if item.role is capture.InputRole.MODULE_STATE}
    host = HostProgram(lifted.host, grid_inputs, const_inputs, config.metadata_cache_bytes, config.batch_cache_size)
    host_inputs = frozenset(i for i, ref in enumerate(lifted.device.inputs) if ref.program == "host")
    compiler = _resolve_compiler(config, example_inputs)
    if not _has_dynamic_patch_count(inputs):
        compiler = "eager"  # dynamo's first, static-shape trace serves one L: not worth an Inductor compile
    device = get_device_program(lifted.device.gm, compiler, host_inputs)
    if debug_dir:
        write_lift_report(debug_dir, lifted, host, device)
    return LiftedRunner(lifted, host, device, activations[0], _bucketed_graphs(config, lifted, inputs, device, example_inputs))


def _has_dynamic_patch_count(inputs) -> bool:
    activation = next(item for item in inputs if item.role is capture.InputRole.ACTIVATION)
    return isinstance(capture.example_value(activation.node).shape[0], torch.SymInt)


def _bucketed_graphs(config: KimiCGConfig, lifted, inputs, device, example_inputs):
    """A function from a call's device inputs to its BucketedGraphs, or None (no CUDA graphs)."""
    on_cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
    enabled = on_cuda if config.cuda_graphs is None else config.cuda_graphs
    if not enabled:
        return None
    buckets = config.buckets()
    if not _has_dynamic_patch_count(inputs):
        # Dynamo's first trace of a frame has static shapes: that program serves one exact L (its
        # guards send only that L here), so it gets one graph of exactly that size.
        activation = next(item for item in inputs if item.role is capture.InputRole.ACTIVATION)
        buckets = (int(capture.example_value(activation.node).shape[0]),)
    roles = {item.index: item.role for item in inputs}
    kinds = []
    for ref in lifted.device.inputs:
        if ref.program != "arg":
            kinds.append("host")
        else:
            kinds.append({capture.InputRole.ACTIVATION: "activation", capture.InputRole.SIZE: "size"}.get(roles[ref.index], "state"))
    rules = input_rules(device, kinds)
    key = (tuple(rules), buckets, config.max_items, config.max_frames, on_cuda, config.poison_graph_pool)
    # The key holds one rule per device input (hundreds: the weights), and a tuple rehashes its
    # items on every lookup: equal keys get one small int per device program, once, here.
    key = device.configurations.setdefault(key, len(device.configurations))

    static_positions = [i for i, rule in enumerate(rules) if rule.kind == "static"]
    take_static = operator.itemgetter(*static_positions) if len(static_positions) > 1 else None

    def graphs_for(device_args) -> BucketedGraphs:
        # Dynamo graphs of one model (one per number of items) share a structurally equal device
        # program and its captured graphs. A capture bakes in the addresses of the weights, so
        # another model instance with the same structure gets its own graphs.
        if take_static is not None:
            weights = tuple(map(torch.Tensor.data_ptr, take_static(device_args)))
        else:
            weights = tuple(device_args[i].data_ptr() for i in static_positions)
        graphs = device.bucketed_graphs.get((key, weights))
        if graphs is None:
            graphs = BucketedGraphs(device, rules, buckets, config.max_items, config.max_frames, capture=on_cuda,
                                    poison_pool=config.poison_graph_pool)
            device.bucketed_graphs[(key, weights)] = graphs
        return graphs

    return graphs_for
