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


def write_lift_report(dump, lifted, host, device) -> None:
    """The host, device and post programs and the lift report, into the graph's dump (a GraphDump)."""
    if not dump.enabled:
        return
    for name, program in (("host", host.gm), ("post", lifted.post.gm)):
        dump.file(f"{name}_program.py", lambda program=program: program.print_readable(print_output=False))
    dump.shared_file("device_programs", device.key, lambda: lifted.device.gm.print_readable(print_output=False))
    report = dict(lifted.report)
    report["device_program_key"] = device.key
    report["item_values_cached"] = host.items_cached
    dump.file("lift_report.json", lambda: json.dumps(report, indent=2, default=str))
