"""The device program: compiled once per structure, shared by every dynamo graph that has it.

Dynamo hands kimi_cg one graph per number of items N. After lifting, the device programs of these
graphs are usually identical (the per-item work went to the host), so they are keyed by a
structural hash (ops, targets, constant args, input kinds; node names ignored) and compiled once.
"""

from __future__ import annotations

import hashlib
import logging

import torch
import torch.fx

from kimi_cg.capture import example_value
from kimi_cg.counters import counters

logger = logging.getLogger(__name__)

_PROGRAMS: dict[str, "DeviceProgram"] = {}


def clear_program_cache() -> None:
    _PROGRAMS.clear()
    from kimi_cg.host_program import item_cache

    item_cache().clear()


def structural_hash(gm: torch.fx.GraphModule, shape_free_inputs: frozenset[int] = frozenset()) -> str:
    """Hash of the program's structure; inputs in ``shape_free_inputs`` (host metadata, whose sizes
    follow the number of items) contribute dtype and rank only."""
    local = {}
    lines = []
    placeholder_index = -1
    for i, node in enumerate(gm.graph.nodes):
        local[node] = f"%{i}"
        mapper = lambda arg: local[arg] if isinstance(arg, torch.fx.Node) else arg  # noqa: E731
        args = torch.fx.node.map_aggregate(node.args, mapper)
        kwargs = torch.fx.node.map_aggregate(dict(node.kwargs), mapper)
        kind = ""
        if node.op == "placeholder":
            placeholder_index += 1
            value = example_value(node)
            if isinstance(value, torch.Tensor) and placeholder_index in shape_free_inputs:
                kind = f"{value.dtype}:{value.dim()}"
            elif isinstance(value, torch.Tensor):
                kind = f"{value.dtype}:{value.dim()}:{[s if isinstance(s, int) else 'sym' for s in value.shape]}"
            else:
                kind = type(value).__name__
            args = ()
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__qualname__", str(node.target))
        module = getattr(node.target, "__module__", "")
        lines.append(f"{node.op}|{module}.{target}|{args!r}|{kwargs!r}|{kind}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:20]


class DeviceProgram:
    """One device program and its compiled callable."""

    def __init__(self, gm: torch.fx.GraphModule, key: str, compiler: str):
        self.gm = gm
        self.key = key
        self.compiler = compiler
        self._compiled = None

    def __call__(self, *inputs):
        if self._compiled is None:
            self._compiled = self._compile()
        return self._compiled(*inputs)

    def _compile(self):
        if self.compiler == "eager":
            return self.gm
        if self.compiler == "inductor":
            # Dynamic in every size so one compilation serves all patch counts (see docs/design.md).
            return torch.compile(self.gm, backend="inductor", dynamic=True, fullgraph=True)
        raise ValueError(f"unknown device compiler {self.compiler!r}")


def get_device_program(gm: torch.fx.GraphModule, compiler: str, host_inputs: frozenset[int] = frozenset()) -> DeviceProgram:
    key = f"{compiler}:{structural_hash(gm, host_inputs)}"
    program = _PROGRAMS.get(key)
    if program is None:
        program = DeviceProgram(gm, key, compiler)
        _PROGRAMS[key] = program
        counters["device_programs_compiled"] += 1
        logger.info("kimi_cg: new device program %s (%d nodes)", key, len(gm.graph.nodes))
    else:
        counters["device_program_cache_hits"] += 1
    return program
