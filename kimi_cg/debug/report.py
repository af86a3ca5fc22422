"""Graph-break reports and lift dumps."""

from __future__ import annotations

import json
import logging
import os

import torch

from kimi_cg.counters import counters

logger = logging.getLogger(__name__)

# Reasons dynamo gives, and the model-side rewrite that removes the break (design brief, section 3).
_FIXES = (
    ("data-dependent", "replace the Python assert/branch on grid values with torch._check(...) (one per condition; "
     "split chained comparisons such as 1 <= h <= m)"),
    ("guard on data-dependent", "replace the Python assert/branch on grid values with torch._check(...)"),
    ("tolist", "keep .tolist()/.item() (kimi_cg traces them) but avoid Python control flow on their values"),
)


def suggested_fix(reason: str) -> str:
    lowered = reason.lower()
    for needle, fix in _FIXES:
        if needle in lowered:
            return fix
    return "move the construct out of the traced forward or express it with torch ops"


def report_graph_break(gm: torch.fx.GraphModule) -> None:
    """Count and log a graph break that ended this graph (dynamo records why on the module)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return
    counters["graph_breaks"] += 1
    stack = getattr(reason, "user_stack", None) or []
    where = f"{stack[-1].filename}:{stack[-1].lineno}" if stack else "unknown location"
    text = str(reason.reason)
    summary = next((line.strip() for line in text.splitlines() if "data-dependent" in line), text.splitlines()[0] if text else "")
    logger.warning(
        "kimi_cg: graph break at %s: %s Fix: %s. Results stay correct (the rest of the frame runs eagerly).",
        where, summary[:300], suggested_fix(text),
    )


def write_lift_report(debug_dir: str, lifted, host, device) -> None:
    os.makedirs(debug_dir, exist_ok=True)
    for name, program in (("host", host.gm), ("device", lifted.device.gm), ("post", lifted.post.gm)):
        with open(os.path.join(debug_dir, f"{name}_program.py"), "w") as f:
            f.write(program.print_readable(print_output=False))
    report = dict(lifted.report)
    report["device_program_key"] = device.key
    report["item_values_cached"] = host.items_cached
    with open(os.path.join(debug_dir, "lift_report.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
