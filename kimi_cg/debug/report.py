"""Graph-break reports and lift dumps."""

from __future__ import annotations

import json
import linecache
import logging

import torch

from kimi_cg.counters import counters

logger = logging.getLogger(__name__)

_ASSERT_FIX = ("write the assert as torch._check(...), one call per condition (split chained comparisons such as "
               "1 <= h <= m into two); dynamo traces torch._check on grid values without a break")
_BRANCH_FIX = ("a Python branch on a grid value picks the code path per image; compute both sides and select with "
               "torch.where, or use torch.cond (torch._check would change what the program means)")
_TOLIST_FIX = "keep .tolist()/.item() (kimi_cg traces them) but avoid Python control flow on their values"
_OTHER_FIX = "move the construct out of the traced forward or express it with torch ops"

_reported: set[str] = set()  # locations already warned about (dynamo retraces a frame per item count)


def suggested_fix(reason: str, source_line: str = "") -> str:
    """The model-side rewrite that removes a graph break, from dynamo's reason and the user's line."""
    code = source_line.strip()
    lowered = reason.lower()
    if code.startswith("assert ") or code.startswith("assert("):
        return _ASSERT_FIX
    if "data-dependent" in lowered or "data dependent" in lowered:
        return _BRANCH_FIX
    if "tolist" in lowered or "item()" in lowered:
        return _TOLIST_FIX
    return _OTHER_FIX


def report_graph_break(gm: torch.fx.GraphModule) -> None:
    """Count a graph break that ended this graph (dynamo records why on the module); warn once per
    source location, with the rewrite that removes it."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return
    counters["graph_breaks"] += 1
    stack = getattr(reason, "user_stack", None) or []
    where = f"{stack[-1].filename}:{stack[-1].lineno}" if stack else "unknown location"
    source_line = linecache.getline(stack[-1].filename, stack[-1].lineno) if stack else ""
    text = str(reason.reason)
    summary = next((line.strip() for line in text.splitlines() if "data-dependent" in line), text.splitlines()[0] if text else "")
    if where in _reported:
        logger.debug("kimi_cg: graph break at %s again (a retrace): %s", where, summary[:300])
        return
    _reported.add(where)
    logger.warning(
        "kimi_cg: graph break at %s (%s): %s Fix: %s. Results stay correct (the rest of the frame runs as a "
        "separate graph, specialised on the values before the break).",
        where, source_line.strip()[:120], summary[:300], suggested_fix(text, source_line),
    )


def report_skipped_frame(where: str, error: BaseException) -> None:
    """Dynamo gave up on a whole kimi_cg frame (a graph break it cannot resume from, e.g. inside a loop)."""
    counters["frames_skipped"] += 1
    text = str(error)
    if where in _reported:
        return
    _reported.add(where)
    stack = getattr(error, "real_stack", None) or []
    at, line = (f"{stack[-1].filename}:{stack[-1].lineno}", linecache.getline(stack[-1].filename, stack[-1].lineno)) if stack else ("", "")
    logger.warning(
        "kimi_cg: dynamo skipped the frame %s: it runs eagerly, unlifted (%s: %s, at %s: %s). Fix: %s.",
        where, type(error).__name__, text.splitlines()[0][:300] if text else "", at or "an unknown line",
        line.strip()[:120], suggested_fix(text, line),
    )


def clear_reports() -> None:
    _reported.clear()


def write_lift_report(dump, lifted, host, device, inputs, kinds) -> None:
    """Into the graph's dump (a GraphDump): the host program with the per-item subgraphs it caches
    printed after it, the post program, the device program (once per run), and the lift report: node
    counts by category, each non-weight device input (where it comes from, its padding rule, shape,
    source line) and each host node (what it computes, the grid input it depends on, its source line)."""
    if not dump.enabled:
        return
    from kimi_cg.host_program import ItemValue
    from kimi_cg.lift import source_location
    from kimi_cg.runtime.graphs import input_rules

    def host_code() -> str:
        parts = [host.gm.print_readable(print_output=False)]
        for name, module in host.gm.named_modules():
            if isinstance(module, ItemValue):
                parts.append(f"\n# {name}: computed once per item size and cached (NOTE [per-item metadata cache])\n"
                             + module.gm.print_readable(print_output=False))
        return "\n".join(parts)

    dump.file("host_program.py", host_code)
    dump.file("post_program.py", lambda: lifted.post.gm.print_readable(print_output=False))
    dump.shared_file("device_programs", device.key, lambda: lifted.device.gm.print_readable(print_output=False))

    def report_text() -> str:
        report = {"node_categories": lifted.report["node_categories"], "device_program_key": device.key,
                  "item_values_cached": host.items_cached}
        rules = input_rules(device, kinds)
        placeholders = [n for n in lifted.device.gm.graph.nodes if n.op == "placeholder"]
        host_outputs = lifted.host.outputs
        described = []
        for position, (ref, kind, rule, node) in enumerate(zip(lifted.device.inputs, kinds, rules, placeholders)):
            if kind == "state":
                continue
            value = node.meta.get("example_value", node.meta.get("val"))
            entry = {"position": position, "placeholder": node.name, "kind": kind, "padding_rule": rule.kind,
                     "shape": list(value.shape) if isinstance(value, torch.Tensor) else None,
                     "dtype": str(value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__}
            if ref.program == "host":
                made_by = host_outputs[ref.index]
                entry["made_by_host_node"] = made_by.name
                entry["source"] = source_location(made_by)
            described.append({key: str(value) if key == "shape" and value is not None else value
                              for key, value in entry.items()})
        report["device_inputs"] = described
        report["weight_inputs"] = kinds.count("state")
        grid_of = _grid_ancestors(lifted.categories, inputs)
        report["host_nodes"] = [{"name": node.name, "target": _target_name(node), "depends_on": grid_of.get(node),
                                 "source": source_location(node)}
                                for node in _nodes_named(lifted.categories, lifted.report["host_nodes"])]
        report["post_nodes"] = lifted.report["post_nodes"]
        return json.dumps(report, indent=1, default=str)

    dump.file("lift_report.json", report_text)


def _nodes_named(nodes, names) -> list:
    wanted = set(names)
    return [node for node in nodes if node.name in wanted]


def _target_name(node) -> str:
    target = node.target
    return getattr(target, "__name__", None) or str(target)


def _grid_ancestors(categories, inputs) -> dict:
    """Each node's grid input (by dynamo's source name, e.g. L['grid_hws']), if it depends on one."""
    from kimi_cg.capture import InputRole, source_name

    names = {}
    for item in inputs:
        if item.role is InputRole.GRID:
            names[item.node] = source_name(item.node) or item.node.name
    found: dict = {}
    for node in categories:  # graph order: inputs come first
        if node in names:
            found[node] = names[node]
            continue
        for arg in node.all_input_nodes:
            if found.get(arg):
                found[node] = found[arg]
                break
    return found
