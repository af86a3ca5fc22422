"""``repro.py`` for a graph kimi_cg could not lift (and ``call_repro.py`` for a call its lifted program
could not run, over that call's inputs): a standalone script that raises the same error.

The script holds the dynamo graph's code (as received), a module whose parameters stand for the
graph's module state (random values of the recorded shapes and dtypes; integer state keeps its
values), the call's other inputs (activations random of the recorded shapes, grids with their
recorded values, plain int arguments with theirs), and kimi_cg's options with ``strict=True``;
running it compiles that module with ``backend="kimi_cg"`` (``dynamic=True`` when the graph was
dynamic) and calls it once. Input roles follow from types and sources (module state, integer grid,
float activation), as kimi_cg assigns them, so the lift sees the same graph structure. A graph that
cannot be written down (a global no script can import, an input that is neither a tensor nor an int
nor a size of one) raises ReproUnavailable saying which; the dump writes that in place of the script.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from kimi_cg.capture import InputRole, source_name

_SMALL = 1 << 16  # integer tensors up to this many elements keep their values


def placeholder_sources(gm: torch.fx.GraphModule) -> list[str | None]:
    """Dynamo's source name of each placeholder, read while dynamo's metadata is on the graph (it is
    dropped after compiling, so a repro written at call time needs them taken at lift time)."""
    return [source_name(node) for node in gm.graph.nodes if node.op == "placeholder"]


class ReproUnavailable(Exception):
    """Why no repro script could be written; the dump records the message in place of the script."""


def repro_source(gm: torch.fx.GraphModule, inputs, example_inputs, config, title: str,
                 sources: list[str | None] | None = None) -> str:
    """The script's text; raises ReproUnavailable (saying which input or global) when the graph cannot
    be written down. ``sources``: ``placeholder_sources(gm)`` taken earlier (default: read now)."""
    code = gm.graph.python_code(root_module="self")
    header = _imports(code.globals)
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    sources = sources if sources is not None else placeholder_sources(gm)
    values = [example_inputs[item.index] if item.index < len(example_inputs) else None for item in inputs]
    # Which placeholders the script passes as call inputs (input_0, input_1, ...), in graph order: the
    # activations and grids, and plain int arguments (dynamo's source ``L['name']``).
    call_positions: dict[int, int] = {}
    for position, (item, source) in enumerate(zip(inputs, sources)):
        if item.role in (InputRole.ACTIVATION, InputRole.GRID) or (
                item.role is InputRole.SIZE and re.fullmatch(r"L\['\w+'\]", source or "")):
            call_positions[position] = len(call_positions)
    call_args, state, call_inputs = [], [], []
    dynamic = False
    for position, (item, node, value) in enumerate(zip(inputs, placeholders, values)):
        source = sources[position]
        if item.role is InputRole.SIZE:
            dynamic = True
            if position in call_positions:
                call_inputs.append(repr(_int_value(value, node)))
                call_args.append(f"input_{call_positions[position]}")
            else:
                call_args.append(_size_expression(source, node, sources, call_positions))
        elif not isinstance(value, torch.Tensor):
            raise ReproUnavailable(f"graph input {node.target} ({source or 'no source'}) is a {type(value).__name__}, "
                                   "not a tensor or an int")
        elif item.role is InputRole.MODULE_STATE:
            state.append(_tensor_literal(value))
            call_args.append(f"self.state_{len(state) - 1}")
        else:
            call_inputs.append(_tensor_literal(value, keep_values=item.role is InputRole.GRID))
            call_args.append(f"input_{call_positions[position]}")
    options = {**dataclasses.asdict(config), "strict": True, "debug_dir": None}
    options = {key: list(value) if isinstance(value, tuple) else value for key, value in options.items()}
    parameters = "\n".join(f"        self.state_{i} = torch.nn.Parameter({literal}, requires_grad=False)"
                           for i, literal in enumerate(state)) or "        pass"
    arguments = ", ".join(f"input_{i}" for i in range(len(call_inputs)))
    graph_code = code.src.replace("def forward(self,", "def graph_forward(self,", 1)
    return f'''"""{title}

Run: python repro.py   (compiles the graph below with backend="kimi_cg", strict=True, and calls it once)
"""
{header}
import torch
import kimi_cg  # noqa: F401 - the backend


{graph_code.strip()}


class Repro(torch.nn.Module):
    def __init__(self):
        super().__init__()
{parameters}

    def forward(self, {arguments}):
        return graph_forward(self, {", ".join(call_args)})


def make_inputs():
    return [{", ".join(call_inputs)}]


OPTIONS = {options!r}

if __name__ == "__main__":
    torch.manual_seed(0)
    compiled = torch.compile(Repro(), backend="kimi_cg", options=OPTIONS, dynamic={dynamic})
    with torch.no_grad():
        compiled(*make_inputs())
    print("kimi_cg compiled and ran this graph without an error")
'''


def _imports(globals_: dict) -> str:
    lines = []
    for name, value in sorted(globals_.items()):
        if name in ("torch", "__builtins__"):
            continue
        if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
            lines.append(f"{name} = float({str(value)!r})")
        elif value is type(None):
            lines.append(f"{name} = type(None)")
        elif type(value).__name__ == "module":
            lines.append(f"import {value.__name__} as {name}")
        elif getattr(value, "__module__", None) and getattr(value, "__qualname__", None) and "<" not in value.__qualname__:
            lines.append(f"import {value.__module__} as _module_{name}")
            lines.append(f"{name} = _module_{name}.{value.__qualname__}")
        else:
            described = getattr(value, "__qualname__", None) or type(value).__name__
            raise ReproUnavailable(f"the graph calls {name} ({described}), which cannot be imported by name "
                                   "(a local function or class, or an object without a module)")
    return "\n".join(lines)


def _size_expression(source: str | None, node: torch.fx.Node, sources: list[str | None],
                     call_positions: dict[int, int]) -> str:
    """``input_i.size(d)`` for a size placeholder whose dynamo source is ``<source of input i>.size()[d]``."""
    match = re.fullmatch(r"(.+)\.size\(\)\[(\d+)\]", source or "")
    if match is not None:
        base, dim = match.groups()
        for position, other in enumerate(sources):
            if other == base and position in call_positions:
                return f"input_{call_positions[position]}.size({dim})"
    raise ReproUnavailable(f"size input {node.target} ({source or 'no source'}) is not a size of a call input")


def _int_value(value, node: torch.fx.Node) -> int:
    """The int an int argument had: the call's own, or the hint of the traced SymInt."""
    if isinstance(value, int):
        return value
    hint = getattr(getattr(value, "node", None), "hint", None)
    if isinstance(hint, int):
        return hint
    raise ReproUnavailable(f"int input {node.target} has no known value ({value!r})")


def _tensor_literal(value: torch.Tensor, keep_values: bool = False) -> str:
    shape, dtype = list(value.shape), str(value.dtype)
    if not (value.is_floating_point() or value.is_complex()):
        if (keep_values or value.numel() <= _SMALL) and not isinstance(value, torch._subclasses.FakeTensor):
            return f"torch.tensor({value.cpu().tolist()!r}, dtype={dtype})"
        return f"torch.zeros({shape}, dtype={dtype})"
    return f"torch.randn({shape}).to({dtype})"
