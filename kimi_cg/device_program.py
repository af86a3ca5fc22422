"""The device program: compiled once per structure, shared by every dynamo graph that has it.

Dynamo hands kimi_cg one graph per number of items N. After lifting, the device programs of these
graphs are usually identical (the per-item work went to the host), so they are keyed by a
structural hash (ops, targets, constant args, input kinds; node names ignored) and compiled once.

NOTE [hints of a symbolic run]
A device program is run symbolically (fake tensors whose sizes are symbols) to derive its outputs'
shapes, and Inductor compiles it the same way. Each symbol has a hint: its size at the call that
triggered the run. Where an op asks a question the symbols cannot answer, torch answers with the hint
and records a guard. Broadcasting asks ``rows == 1`` (``guard_or_false`` in fake tensors' size
inference): at a call with one merged row the answer is yes, and the sum takes the other operand's
size, a literal 1. What the run derived (shape expressions, Inductor's code) holds only where its guards
and symbol replacements hold. So every run keeps them (``ShapeAssumptions``); a call whose sizes break
one gets a run of its own, at its own sizes (``device_program_respecializations``). Found on Qwen2-VL's
tower: its first symbolic call had one merged row, and every later call on the padded path returned
one row.
"""

from __future__ import annotations

import hashlib
import keyword
import logging
import os
import re
import threading
import time

import sympy

import torch
import torch.fx

from kimi_cg.capture import example_value, row_dim
from kimi_cg.counters import counters, timings
from kimi_cg.errors import UnsupportedGraphError

logger = logging.getLogger(__name__)

_PROGRAMS: dict[str, "DeviceProgram"] = {}


def clear_program_cache() -> None:
    """Forget every device program and every host-made value (``kimi_cg.reset()``)."""
    from kimi_cg.runtime.memory import metadata_store
    from kimi_cg.runtime.state_tokens import state_tokens

    _PROGRAMS.clear()
    metadata_store.clear()
    state_tokens.clear()


def programs() -> list["DeviceProgram"]:
    """Device programs built in this process (``kimi_cg.memory_report()``)."""
    return list(_PROGRAMS.values())


def structural_hash(gm: torch.fx.GraphModule, shape_free_inputs: frozenset[int] = frozenset(),
                    constants_by_content: bool = False) -> str:
    """Hash of the program's structure; inputs in ``shape_free_inputs`` (host metadata, whose sizes
    follow the number of items) contribute dtype and rank only. Inputs count by position, not by name:
    dynamo names a resumed piece's inputs after its own counters, which differ between traces.
    Constants count by content, except large ones by identity (within this process) unless
    ``constants_by_content`` (a key that outlives the process: NOTE [program cache])."""
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
            # The device with its index: a compile allocates on, and launches for, the device it was made for.
            if isinstance(value, torch.Tensor) and placeholder_index in shape_free_inputs:
                kind = f"{value.dtype}:{value.dim()}:{value.device}"
            elif isinstance(value, torch.Tensor):
                kind = (f"{value.dtype}:{value.dim()}:{[s if isinstance(s, int) else 'sym' for s in value.shape]}:"
                        f"{value.device}")
            else:
                kind = type(value).__name__
            args = ()
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__qualname__", str(node.target))
        if node.op == "placeholder":
            target = str(placeholder_index)
        elif node.op == "get_attr":  # a constant is part of the program: its values key it too
            kind = _constant_key(gm, node.target, constants_by_content)
        module = getattr(node.target, "__module__", "")
        lines.append(f"{node.op}|{module}.{target}|{args!r}|{kwargs!r}|{kind}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:20]


def _constant_key(gm: torch.fx.GraphModule, target: str, by_content: bool = False) -> str:
    value = gm
    for name in target.split("."):
        value = getattr(value, name, None)
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    if value.numel() > 1 << 20 and not by_content:  # a large constant: keyed by identity (correct, shares less)
        return f"{value.dtype}:{tuple(value.shape)}:id{id(value)}"
    data = value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return f"{value.dtype}:{tuple(value.shape)}:{hashlib.sha256(data).hexdigest()[:16]}"


class DeviceProgram:
    """One device program and its compiled callable."""

    def __init__(self, gm: torch.fx.GraphModule, key: str, compiler: str, host_inputs: frozenset[int] = frozenset(),
                 inductor_config: tuple | None = None):
        self.gm = gm
        self.key = key
        self.compiler = compiler
        self.host_inputs = host_inputs
        self.inductor_config = inductor_config  # KimiCGConfig.inductor_config: in force while it compiles
        self._compiled: list[tuple["ShapeAssumptions", object]] = []  # NOTE [hints of a symbolic run]
        self._compiled_by_shape: dict = {}
        self._compile_error: Exception | None = None  # a failed compile is not retried on every call
        self._compile_lock = threading.Lock()  # threads calling a new program compile it once
        self._shape_runs: list[SymbolicShapes] = []  # NOTE [hints of a symbolic run]
        self._size_positions: list[tuple[int, int | None]] | None = None
        self.output_shapes_by_signature: dict = {}
        self.bucketed_graphs: dict = {}  # runtime.graphs.BucketedGraphs per (configuration, weights)
        self.configurations: dict = {}  # runtime configuration -> its small id (see backend._bucketed_graphs)
        self.dumps: list = []  # debug dumps (GraphDump) of graphs using this program: get its Inductor code
        self.inductor_code: str | None = None
        self.ran = False  # NOTE [programs that ran]

    def __call__(self, *inputs):
        if not self.ran:
            self._first_run()
        if self.compiler == "eager":  # runs the real ops: nothing was assumed
            return self.gm(*inputs)
        signature = self._signature(inputs)
        compiled = self._compiled_by_shape.get(signature)
        if compiled is None:
            compiled = self._compile_once(inputs, signature)
        return compiled(*inputs)

    def _first_run(self) -> None:
        """NOTE [programs that ran]: a lifted graph's device program is built when the graph is lifted
        but compiled and run only at its first call, which some lifted graphs never get (a block traced
        on its own while its caller ran eagerly once: NOTE [calls inside a frame traced again] in
        kimi_cg/dynamo_settings.py). Those cost a lift, no compile and no capture. So counts of device
        programs that mean cost are of programs that ran: ``device_programs_run`` here, and per graph
        the debug dump's ``device_program_ran`` (set by the runner at the graph's first lifted call),
        which reports count per piece (kimi_cg.report.device_programs_per_frame)."""
        with self._compile_lock:
            if not self.ran:
                self.ran = True
                counters["device_programs_run"] += 1

    def _signature(self, inputs) -> tuple:
        """The call's symbolic sizes (the positions a symbolic run gives symbols of their own)."""
        if self._size_positions is None:
            self._size_positions = _symbolic_positions(self.gm, inputs, self.host_inputs)
        return tuple(int(inputs[i]) if d is None else inputs[i].shape[d] for i, d in self._size_positions)

    def _compile_once(self, inputs, signature):
        with self._compile_lock:
            compiled = self._compiled_by_shape.get(signature)
            if compiled is not None:
                return compiled
            compiled = next((c for assumptions, c in self._compiled if assumptions.hold(self._size_positions, signature)),
                            None)
            if compiled is None:
                if self._compile_error is not None:
                    raise UnsupportedGraphError(f"the device program failed to compile: {self._compile_error}",
                                                "device compile failed") from self._compile_error
                if self._compiled:
                    counters["device_program_respecializations"] += 1
                start = time.perf_counter()
                try:
                    assumptions, compiled = self._compile(inputs, signature)
                except Exception as error:
                    self._compile_error = error
                    raise
                finally:
                    timings["device_compile"] += time.perf_counter() - start
                self._compiled.append((assumptions, compiled))
            if len(self._compiled_by_shape) < 4096:
                self._compiled_by_shape[signature] = compiled
            return compiled

    def _compile(self, inputs, signature):
        if self.compiler == "inductor":
            import torch._inductor.config as inductor_config

            with inductor_config.patch(dict(self.inductor_config or ())):  # the program cache's key reads them too
                return self._inductor_compile(inputs, signature)
        raise ValueError(f"unknown device compiler {self.compiler!r}")

    def _inductor_compile(self, inputs, signature):
        """Inductor's compile of this program, or the program cache's entry for it (NOTE [program cache])."""
        from torch._inductor.codecache import PyCodeCache

        from kimi_cg import program_cache

        before = len(PyCodeCache.modules)
        root = program_cache.directory()  # NOTE [program cache]
        found = entry = None
        if root is not None:
            structure = structural_hash(self.gm, self.host_inputs, constants_by_content=True)
            entry = (root, program_cache.entry_key(structure, inputs, self.host_inputs))
            found = program_cache.find(*entry, lambda a: a.hold(self._size_positions, signature))
        if found is not None:
            assumptions, compiled = found
        else:
            assumptions, compiled = _compile_with_inductor(self.gm, inputs, self.host_inputs, entry)
        self.inductor_code = _source_of(PyCodeCache.modules[before:])
        for dump in self.dumps:
            dump.shared_file("device_programs", f"{self.key}.inductor", lambda: self.inductor_code or
                             "# Inductor's output code was not found (served from a cache without loading a module)",
                             field="inductor_code_file")
        self.dumps.clear()  # written: the program no longer needs to reach the graphs' dumps
        return assumptions, compiled

    def output_rows(self, inputs) -> list[int | None]:
        """The leading size each output has for these (unpadded) inputs (None: not a tensor of a dim
        or more)."""
        return [None if shape is None else shape[0] for shape in self.output_shapes(inputs)]

    def output_shapes(self, inputs) -> list[tuple[int, ...] | None]:
        """The shape each output has for these (unpadded) inputs, from the program's symbolic shapes:
        the CUDA-graph runtime slices a bucket's padded outputs back to these (on every dim that holds
        rows: NOTE [rows on dim 1] in kimi_cg/capture.py). None: not a tensor of a dim or more."""
        signature = self._signature(inputs)
        shapes = self.output_shapes_by_signature.get(signature)
        if shapes is None:
            run = next((r for r in self._shape_runs if r.assumptions.hold(self._size_positions, signature)), None)
            if run is None:  # NOTE [hints of a symbolic run]: a run at these sizes
                if self._shape_runs:
                    counters["device_program_respecializations"] += 1
                try:
                    run = _output_shape_expressions(self.gm, inputs, self.host_inputs)
                except Exception as error:  # noqa: BLE001 - see below
                    # A graph with literal sizes (dynamo's static first trace) need not run with symbolic
                    # ones (on the H200, torch 2.11, Qwen2.5-VL's static block graph failed its literal
                    # reshape [3740, 3, 16, -1] on 3840*s rows when split parts asked for their rows; the
                    # split itself was the cause, BucketedGraphs.split). The shapes at this call's own sizes
                    # are all a call needs: a fake run at those sizes, kept for them only.
                    logger.debug("kimi_cg: symbolic run of %s failed (%s); shapes at this call's sizes", self.key, error)
                    counters["device_program_concrete_row_runs"] += 1
                    shapes = _concrete_output_shapes(self.gm, inputs)
                    if len(self.output_shapes_by_signature) < 4096:
                        self.output_shapes_by_signature[signature] = shapes
                    return shapes
                if len(self._shape_runs) < 64:
                    self._shape_runs.append(run)
            shapes = run.at(self._size_positions, signature)
            if len(self.output_shapes_by_signature) < 4096:
                self.output_shapes_by_signature[signature] = shapes
        return shapes


def _symbolic_fakes(inputs, fake_mode, host_inputs: frozenset[int], traced):
    """Fake inputs whose sizes are symbols (no duck sizing, no 0/1 specialisation), so the compiled
    program is valid for every patch count; dims that must agree (pixels and position embeddings
    both have L rows) are unified by the guards the ops themselves add while tracing. Activations
    vary in their row dim (dim 0, or after a literal batch of one: NOTE [rows on dim 1] in
    kimi_cg/capture.py), and in every later dim that dynamo traced as symbolic (``traced``: the
    placeholders' example values; a frame called with tensors of two widths); host metadata (gather
    plans: rows and frames) in every dim; module state not."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    fakes = []
    for position, value in enumerate(inputs):
        if isinstance(value, torch.Tensor):
            if position in host_inputs:
                dynamic = [DimDynamic.DYNAMIC] * value.dim()
            elif isinstance(value, torch.nn.Parameter) or value.dim() == 0:
                dynamic = [DimDynamic.STATIC] * value.dim()
            else:
                example = traced[position] if position < len(traced) else None
                traced_here = isinstance(example, torch.Tensor) and example.dim() == value.dim()
                shape = example.shape if traced_here else value.shape
                rows = row_dim(example) if traced_here else 0
                dynamic = [DimDynamic.STATIC] * rows + [DimDynamic.DYNAMIC] + [
                    DimDynamic.DYNAMIC if isinstance(size, torch.SymInt) else DimDynamic.STATIC for size in shape[rows + 1:]]
            context = StatelessSymbolicContext(dynamic_sizes=dynamic)
            fakes.append(fake_mode.from_tensor(value, symbolic_context=context))
        else:
            fakes.append(value)
    return fakes


def _fake_inputs(gm: torch.fx.GraphModule, inputs, host_inputs: frozenset[int]):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv(duck_shape=False, specialize_zero_one=False)
    fake_mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=False)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = _symbolic_fakes(inputs, fake_mode, host_inputs, [example_value(node) for node in placeholders])
    # A SymInt input (dynamo's s0) is the leading size of the tensor input that dynamo traced with
    # that same symbol (the pixel values); bind it to that fake's symbol.
    for position, node in enumerate(placeholders):
        symbol = example_value(node)
        if not isinstance(symbol, torch.SymInt):
            continue
        for other, fake in zip(placeholders, fakes):
            traced = example_value(other)
            if isinstance(traced, torch.Tensor) and traced.dim() and isinstance(traced.shape[0], torch.SymInt):
                if traced.shape[0].node.expr == symbol.node.expr and isinstance(fake.shape[0], torch.SymInt):
                    fakes[position] = fake.shape[0]
                    break
        else:
            # A size passed on its own (transformers' ``seq_len`` argument): a symbol of its own, related
            # to the tensors' sizes by the guards the ops add while tracing, as the tensor sizes are;
            # output_shapes reads its value from the input itself. (The bucketed path pads it only when it
            # is the call's row count: BucketedGraphs.choose.)
            fakes[position] = _own_symbol(shape_env, inputs[position], node.name)
    return fake_mode, fakes


def _own_symbol(shape_env, value, name: str):
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    if not isinstance(value, int):
        raise UnsupportedGraphError(f"device program input {name}={value!r} is not an int", "device input size not an int")
    source = ConstantSource(f"kimi_cg_size_{name}")
    symbol = shape_env.create_symbol(value, source, dynamic_dim=DimDynamic.DYNAMIC)
    return shape_env.create_symintnode(symbol, hint=value, source=source)


def _source_of(modules) -> str | None:
    """The source of the Python modules Inductor loaded while compiling (its output code)."""
    parts = []
    for module in modules:
        path = getattr(module, "__file__", None)
        if path and os.path.exists(path):
            with open(path) as f:
                parts.append(f"# {path}\n{f.read()}")
    return "\n\n".join(parts) or None


def compile_with_inductor(gm: torch.fx.GraphModule, inputs, host_inputs: frozenset[int] = frozenset()):
    """Compile the device program with Inductor once, for symbolic input sizes (see _symbolic_fakes).

    Without Inductor's FX graph and AOT autograd caches: an entry's guards cover the graph's SymInt
    inputs only, on the assumption that each symbolic tensor size has one (dynamo's graphs do). A device
    program's fakes hold symbols of their own, so a guard relating a size input to a tensor size names
    a tensor the cache cannot bind, and the next process's lookup raised NameError (that program then
    never ran lifted)."""
    return _compile_with_inductor(gm, inputs, host_inputs)[1]


def _compile_with_inductor(gm: torch.fx.GraphModule, inputs, host_inputs: frozenset[int] = frozenset(), store=None):
    """compile_with_inductor, and what its compile assumed (NOTE [hints of a symbolic run]); with
    ``store`` (a program cache directory and entry key), compiled to be stored there (NOTE [program
    cache])."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    fake_mode, fakes = _fake_inputs(gm, inputs, host_inputs)
    symbols = _input_symbols(fakes)  # before the compile (see _output_shape_expressions)
    if store is not None:
        try:
            return _compile_to_store(gm, inputs, fake_mode, fakes, symbols, *store)
        except Exception as error:  # noqa: BLE001 - the cache is an optimisation: compile as without it
            counters["program_cache_errors"] += 1
            logger.warning("kimi_cg: compiling a device program for the program cache failed (%s: %s); "
                           "compiling it without the cache", type(error).__name__, error)
            fake_mode, fakes = _fake_inputs(gm, inputs, host_inputs)  # without the failed compile's guards
            symbols = _input_symbols(fakes)
    no_inductor_cache = {key: False for key in ("fx_graph_cache", "fx_graph_remote_cache") if hasattr(inductor_config, key)}
    no_autograd_cache = {key: False for key in ("enable_autograd_cache",) if hasattr(functorch_config, key)}
    with fake_mode, inductor_config.patch(no_inductor_cache), functorch_config.patch(no_autograd_cache):
        compiled = compile_fx(gm, fakes)
    return ShapeAssumptions(fake_mode.shape_env, symbols), compiled


def _compile_to_store(gm: torch.fx.GraphModule, inputs, fake_mode, fakes, symbols, root: str, key: str):
    """Inductor's compile through ``standalone_compile``, whose result can be saved, stored as an entry
    of the program cache (NOTE [program cache]). Its cacheability check wants every method call's
    tensor to hold dynamo's ``example_value``; kimi_cg's own nodes do not, so a copy of the graph gets
    them from a fake run first (the program's own graph is left as it is)."""
    from torch._inductor import standalone_compile
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from kimi_cg import program_cache

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # nodes' meta copied shallowly: the originals keep theirs
    copy = torch.fx.GraphModule(gm, graph)
    with fake_mode:
        FakeTensorProp(copy, fake_mode).propagate_dont_convert_inputs(*fakes)
    for node in copy.graph.nodes:
        if "example_value" not in node.meta and "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]
    device_index = next((value.device.index or 0 for value in inputs
                         if isinstance(value, torch.Tensor) and value.device.type == "cuda"), 0)
    with program_cache.private_inductor_cache(root, device_index):
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)), fake_mode:
            artifact = standalone_compile(copy, fakes, dynamic_shapes="from_tracing_context")
    assumptions = ShapeAssumptions(fake_mode.shape_env, symbols)
    program_cache.store(root, key, assumptions, artifact, device_index)
    return assumptions, artifact


def _input_symbols(fakes) -> dict:
    """symbol -> (input index, dim) for each size of the fakes that is a symbol of its own; dim None
    for a size input (its value)."""
    symbols = {}
    for position, fake in enumerate(fakes):
        if isinstance(fake, torch.Tensor):
            for dim, size in enumerate(fake.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    symbols.setdefault(size.node.expr, (position, dim))
    for position, fake in enumerate(fakes):
        if isinstance(fake, torch.SymInt) and fake.node.expr.is_Symbol:
            symbols.setdefault(fake.node.expr, (position, None))
    return symbols


def _symbolic_positions(gm: torch.fx.GraphModule, inputs, host_inputs: frozenset[int]) -> list:
    """The (input index, dim) positions a symbolic run gives symbols: a call's signature."""
    _fake_mode, fakes = _fake_inputs(gm, inputs, host_inputs)
    return sorted(set(_input_symbols(fakes).values()), key=lambda p: (p[0], -1 if p[1] is None else p[1]))


class ShapeAssumptions:
    """What one symbolic run assumed about its input sizes (NOTE [hints of a symbolic run]): its guards
    and the replacements of input symbols, as conditions over (input index, dim) positions."""

    def __init__(self, shape_env, symbols: dict):
        self.symbols = symbols  # symbol -> (input index, dim)
        conditions = {}
        for symbol, target in shape_env.replacements.items():
            if symbol in symbols:
                conditions[str(symbol)] = sympy.Eq(symbol, target, evaluate=False)
        for guard in shape_env.guards:
            conditions.setdefault(str(guard.expr), guard.expr)
        self.conditions = list(conditions.values())
        self.order = list(symbols)  # the compiled functions' argument order
        self._test = python_function(self.conditions, self.order)  # NOTE [size expressions as Python]

    def to_record(self) -> dict:
        """A JSON-able form (NOTE [program cache] in program_cache.py): sympy ``srepr`` text."""
        from kimi_cg.program_cache import expression_to_text

        return {"symbols": [[expression_to_text(symbol), position, dim] for symbol, (position, dim) in self.symbols.items()],
                "order": [expression_to_text(symbol) for symbol in self.order],
                "conditions": [expression_to_text(condition) for condition in self.conditions]}

    @classmethod
    def from_record(cls, record: dict) -> "ShapeAssumptions":
        from kimi_cg.program_cache import expression_from_text

        assumptions = cls.__new__(cls)
        assumptions.symbols = {expression_from_text(text): (position, dim) for text, position, dim in record["symbols"]}
        assumptions.order = [expression_from_text(text) for text in record["order"]]
        assumptions.conditions = [expression_from_text(text) for text in record["conditions"]]
        if set(assumptions.order) != set(assumptions.symbols):
            raise ValueError("a record's symbol order does not list its symbols")
        assumptions._test = python_function(assumptions.conditions, assumptions.order)
        return assumptions

    def sizes(self, positions, signature) -> list[int] | None:
        """The call's size for each input symbol, in the compiled functions' order (None as in values)."""
        by_position = dict(zip(positions, signature))
        try:
            return [by_position[self.symbols[symbol]] for symbol in self.order]
        except KeyError:
            return None

    def values(self, positions, signature) -> dict | None:
        """symbol -> the call's size, or None when the call lacks one of the run's positions."""
        sizes = self.sizes(positions, signature)
        return None if sizes is None else {symbol: sympy.Integer(size) for symbol, size in zip(self.order, sizes)}

    def hold(self, positions, signature) -> bool:
        """Whether a call with these sizes meets every condition (False when one cannot be evaluated)."""
        if self._test is not None:
            sizes = self.sizes(positions, signature)
            if sizes is None:
                return False
            try:
                return all(result is True for result in self._test(*sizes))
            except Exception:  # noqa: BLE001 - as below: not known to hold
                return False
        values = self.values(positions, signature)
        if values is None:
            return False
        for condition in self.conditions:
            try:
                result = condition.xreplace(values)  # integers for every input symbol: evaluates at once
            except Exception:  # noqa: BLE001 - an expression sympy cannot evaluate: not known to hold
                return False
            if result is not sympy.true:  # false, or over a symbol no input gives: a run of its own
                return False
        return True


class SymbolicShapes:
    """One symbolic run's output shapes, as expressions over its input symbols (a call's sizes
    evaluate them where ``assumptions`` hold)."""

    def __init__(self, shapes: list, assumptions: ShapeAssumptions):
        self.shapes, self.assumptions = shapes, assumptions  # per output: a tuple of expressions, or None
        self._flat = [expression for shape in shapes if shape is not None for expression in shape]
        self._sizes = python_function(self._flat, assumptions.order)  # NOTE [size expressions as Python]

    def at(self, positions, signature) -> list[tuple[int, ...] | None]:
        sizes = self.assumptions.sizes(positions, signature) if self._sizes is not None else None
        if sizes is not None:
            flat = iter(self._sizes(*sizes))
        else:
            values = self.assumptions.values(positions, signature)
            flat = iter([int(expression.xreplace(values)) for expression in self._flat])
        return [None if shape is None else tuple(int(next(flat)) for _ in shape) for shape in self.shapes]


def python_function(expressions: list, symbols: list):
    """NOTE [size expressions as Python]
    A call with sizes no earlier call had evaluates its run's conditions and output rows. Substituting
    integers into sympy expressions (``xreplace``) costs ~0.5 ms per W4 request on the H200's host (a
    new patch count each request), so each run prints its expressions once as Python source, with
    torch's own printer for sizes (the one that prints dynamo's shape guards: ``//`` for FloorDiv, ``%``
    for Mod, ``==`` for Eq), and evaluates that with the sizes as ints. Only integer arithmetic is
    accepted: a true division, a float literal, a name the printer does not map to Python, or a symbol
    no input gives leaves that run on ``xreplace`` (returns None). None entries of ``expressions``
    stay None. Returns a function of the sizes (in ``symbols``' order) giving a tuple, or None."""
    from torch.utils._sympy.printers import PythonPrinter

    names = [str(symbol) for symbol in symbols]
    functions = {"max": max, "min": min, "abs": abs}
    if (not all(name.isidentifier() and not keyword.iskeyword(name) and name not in functions for name in names)
            or len(set(names)) != len(names)):
        return None  # not usable as argument names (or would hide a function the text calls)
    printer = PythonPrinter()
    texts = []
    for expression in expressions:
        if expression is None:
            texts.append("None")
            continue
        if not isinstance(expression, sympy.Basic) or not expression.free_symbols <= set(symbols):
            return None
        try:
            text = printer.doprint(expression)
        except Exception:  # noqa: BLE001 - an expression the printer cannot write: xreplace
            return None
        if "/" in text.replace("//", "") or "." in text:  # a true division or a float: not integers
            return None
        allowed = set(names) | set(functions) | {"and", "or", "not", "True", "False"}
        if not set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text)) <= allowed:
            return None
        texts.append(f"({text})")
    source = f"lambda {', '.join(names)}: ({''.join(t + ', ' for t in texts)})"
    try:
        return eval(source, {"__builtins__": {}, **functions})  # noqa: S307 - printed here
    except Exception:  # noqa: BLE001 - not valid Python after all: xreplace
        return None


def _output_shape_expressions(gm: torch.fx.GraphModule, inputs, host_inputs: frozenset[int]) -> SymbolicShapes:
    """Run the program on symbolic fakes once: each output's shape as expressions over (input index,
    dim) symbols, valid where the run's assumptions hold."""
    fake_mode, fakes = _fake_inputs(gm, inputs, host_inputs)
    symbols = _input_symbols(fakes)  # before the run: a size's expression reads through the run's replacements
    with fake_mode:
        outputs = gm(*fakes)
    shape_env = fake_mode.shape_env

    def expression(size):
        return shape_env.replace(size.node.expr) if isinstance(size, torch.SymInt) else sympy.Integer(size)

    shapes = [tuple(map(expression, output.shape)) if isinstance(output, torch.Tensor) and output.dim() else None
              for output in outputs]
    return SymbolicShapes(shapes, ShapeAssumptions(shape_env, symbols))


def _concrete_output_shapes(gm: torch.fx.GraphModule, inputs) -> list[tuple[int, ...] | None]:
    """Each output's shape for exactly these inputs (a fake run at their own sizes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    fakes = [fake_mode.from_tensor(value) if isinstance(value, torch.Tensor) else value for value in inputs]
    with fake_mode:
        outputs = gm(*fakes)
    return [tuple(map(int, output.shape)) if isinstance(output, torch.Tensor) and output.dim() else None for output in outputs]


def get_device_program(gm: torch.fx.GraphModule, compiler: str, host_inputs: frozenset[int] = frozenset(),
                       inductor_config: tuple | None = None) -> DeviceProgram:
    if compiler != "inductor":
        inductor_config = None
    settings = "" if not inductor_config else ":" + hashlib.sha256(repr(inductor_config).encode()).hexdigest()[:8]
    key = f"{compiler}{settings}:{structural_hash(gm, host_inputs)}"
    program = _PROGRAMS.get(key)
    if program is None:
        program = DeviceProgram(gm, key, compiler, host_inputs, inductor_config)
        _PROGRAMS[key] = program
        counters["device_programs_compiled"] += 1
        logger.info("kimi_cg: new device program %s (%d nodes)", key, len(gm.graph.nodes))
    else:
        counters["device_program_cache_hits"] += 1
    return program
