"""The host metadata program: grid -> position embeddings, RoPE factors, cu_seqlens, gather plans.

It is the HOST part of the dynamo graph (see lift.py), run as generated Python before the device
program, plus a per-item cache:

NOTE [per-item metadata cache]
Dynamo unrolls ``for h, w in grid.tolist()`` into one copy of the loop body per item. A host tensor
whose inputs are module state and the integers of a single grid row (the bicubic interpolation of
the position grid for that (h, w); that item's RoPE slice; a video chunk's time embedding) is an
*item value*. Each maximal item value (its users are not item values of the same row) is replaced
by a lookup in the process-wide metadata store (NOTE [metadata memory budget]) keyed by
  (the structure of the subgraph computing it, its integer inputs, the token of every state
   tensor it reads: NOTE [state tokens]),
so an image size seen before costs no interpolation, whichever position it has in the batch and
whichever dynamo graph (number of items) it comes through. The subgraph starts at the host
program's inputs: work on module state alone (a weight's view or cast, made anew each call) is
part of it, so the key names the weights themselves, never a per-call intermediate. Any change
to a weight (in place, through ``.data``, replaced, moved, freed and its address reused) changes
its token, so a stale value is never returned; stale entries age out of the LRU.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import warnings
import weakref
import operator
import re

import torch
import torch.fx

from kimi_cg.aliasing import Aliasing
from kimi_cg.capture import example_value
from kimi_cg.counters import counters
from kimi_cg.errors import InvalidInputError, UnsupportedGraphError
from kimi_cg.lift import Program, source_location
from kimi_cg.runtime import gather_plan
from kimi_cg.runtime.memory import metadata_store
from kimi_cg.runtime.staging import MovedBatch, read_only
from kimi_cg.runtime.state_tokens import state_tokens
from kimi_cg.runtime.table_rows import TABLE_ROWS, settled, table_source

logger = logging.getLogger(__name__)


_HOST_PROGRAM_SERIALS = itertools.count(1)


def _forget_batches(serial: int, keys: collections.OrderedDict, lock: threading.Lock) -> None:
    """A host program was freed: its cached batches go with it."""
    with lock:
        dropped = list(keys)
        keys.clear()
    for key in dropped:
        metadata_store.pop(("batch", serial, key))
        metadata_store.pop(("moved", serial, key))


def _input_key(value):
    """How one input of an item value enters its cache key."""
    if type(value) is int:  # noqa: E721 - the common case (a grid integer) first; bool is not int here
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", state_tokens.current(value))
    if isinstance(value, (int, float, bool, str, type(None))):
        return value
    return ("object", type(value).__qualname__, id(value))


class ItemValue(torch.nn.Module):
    """A cached item-value subgraph; called from the host program's generated code."""

    def __init__(self, gm: torch.fx.GraphModule, structure: tuple, owner: str, share: int):
        super().__init__()
        self.gm = gm
        self.structure = structure
        self.owner = owner  # whose metadata budget the entries count against
        self.share = share

    def forward(self, *inputs):
        key = ("item", self.structure, tuple(_input_key(value) for value in inputs))
        value = metadata_store.get(key)
        if value is not None:
            counters["metadata_cache_hits"] += 1
            return value
        counters["metadata_cache_misses"] += 1
        # the generated code itself (a GraphModule's call adds only hooks' overhead); kept with its
        # table-read plans made (NOTE [pairs kept by side])
        value = settled(self.gm.forward(*inputs))
        metadata_store.put(key, value, self.owner, self.share)
        return value


def _grid_rows(graph: torch.fx.Graph, grid_placeholders: set[torch.fx.Node]) -> dict[torch.fx.Node, frozenset]:
    """For each scalar node derived from grid integers: the set of grid rows it depends on."""

    rows: dict[torch.fx.Node, frozenset] = {}
    for node in graph.nodes:
        is_read = (node.op == "call_method" and node.target in ("item", "tolist")
                   or node.target is torch.ops.aten._local_scalar_dense.default)
        # NOTE [grid read once]: grid.tolist()[i][j] reads row i too
        is_list_read = (node.op == "call_function" and node.target is operator.getitem
                        and _grid_list_path(node, grid_placeholders))
        if is_read or is_list_read:
            path = _grid_list_path(node if is_list_read else node.args[0] if node.args else None, grid_placeholders,
                                   tensor_chain=not is_list_read)
            if path and isinstance(path[0], int):
                rows[node] = frozenset([path[0]])
    return rows


def _grid_list_path(node, grid_placeholders, tensor_chain: bool = False) -> list | None:
    """The indices [i, j] of ``grid[i][j]`` (``tensor_chain``: tensor indexing of the grid) or of
    ``grid.tolist()[i][j]`` (NOTE [grid read once]) at ``node``; None for anything else."""
    indices = []
    source = node
    while isinstance(source, torch.fx.Node) and source.op == "call_function" and source.target is operator.getitem:
        indices.append(source.args[1])
        source = source.args[0]
    if not tensor_chain:
        if not (isinstance(source, torch.fx.Node) and source.op == "call_method" and source.target == "tolist"):
            return None
        source = source.args[0]
    if source not in grid_placeholders or not indices:
        return None
    return list(reversed(indices))


def _structure(nodes: list[torch.fx.Node], inputs: list[torch.fx.Node]) -> tuple:
    """A key that equals for structurally identical subgraphs (names ignored)."""
    local = {node: f"i{i}" for i, node in enumerate(inputs)}
    local.update({node: f"n{i}" for i, node in enumerate(nodes)})
    mapper = lambda arg: local[arg] if isinstance(arg, torch.fx.Node) else arg  # noqa: E731
    return tuple(
        (node.op, str(node.target), repr(torch.fx.node.map_aggregate(node.args, mapper)), repr(torch.fx.node.map_aggregate(dict(node.kwargs), mapper)))
        for node in nodes
    )


def install_item_cache(gm: torch.fx.GraphModule, grid_placeholders: set[torch.fx.Node], const_nodes: set[torch.fx.Node],
                       owner: str = "default", share: int = 1 << 30) -> int:
    """Replace maximal item values in the host graph by ItemValue lookups; returns how many. Their
    entries count against ``owner``'s ``share`` of the metadata budget."""
    graph = gm.graph
    rows = _grid_rows(graph, grid_placeholders)
    # A cached value must never be written after the lookup returns it (NOTE [mutation and lifting]).
    mutated = Aliasing(graph).mutated
    item_tensor: dict[torch.fx.Node, frozenset] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "output", "get_attr") or node in rows or node in mutated:
            continue
        value = example_value(node)
        input_rows = set()
        ok = True
        for arg in node.all_input_nodes:
            if arg in rows:
                input_rows |= rows[arg]
            elif arg in item_tensor:
                input_rows |= item_tensor[arg]
            elif arg not in const_nodes:
                ok = False
        if not ok or not input_rows:
            continue
        if isinstance(value, torch.Tensor) or node.meta.get(TABLE_ROWS):  # NOTE [table gathers]
            item_tensor[node] = frozenset(input_rows)
        elif (isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)
              or node.target in (gather_plan.row_size, gather_plan.row_numel)):  # a stand-in's size (no meta)
            rows[node] = frozenset(input_rows)
    singles = {node: r for node, r in item_tensor.items() if len(r) == 1}
    frontier = [node for node in singles if any(singles.get(user) != singles[node] for user in node.users)]
    installed = 0
    for top in frontier:
        private, stack = [top], [top]
        while stack:
            for arg in stack.pop().all_input_nodes:
                if arg in singles and arg not in private:
                    private.append(arg)
                    stack.append(arg)
        private_set = set(private)
        if any(user not in private_set for node in private if node is not top for user in node.users):
            continue  # shared with other work: leave it uncached
        # Work on module state alone that feeds the value (a weight's view or cast) is copied into
        # the subgraph: its inputs are then the host program's inputs, whose tokens name the
        # weights (NOTE [per-item metadata cache]).
        copied, stack = [], [arg for node in private for arg in node.all_input_nodes if arg not in private_set]
        while stack:
            arg = stack.pop()
            if arg in const_nodes and arg.op in ("call_function", "call_method"):
                if arg not in copied:
                    copied.append(arg)
                    stack.extend(arg.all_input_nodes)
        order = {node: i for i, node in enumerate(graph.nodes)}
        body = sorted(private + copied, key=order.__getitem__)
        body_set = set(body)
        inputs = []
        for node in body:
            for arg in node.all_input_nodes:
                if arg not in body_set and arg not in inputs:
                    inputs.append(arg)
        sub_graph = torch.fx.Graph()
        env = {arg: sub_graph.placeholder(f"in{i}") for i, arg in enumerate(inputs)}
        for node in body:
            env[node] = sub_graph.node_copy(node, lambda arg: env[arg])
        sub_graph.output(env[top])
        sub_gm = torch.fx.GraphModule(torch.nn.Module(), sub_graph, class_name="KimiCGItemValue")
        name = f"item_value_{installed}"
        setattr(gm, name, ItemValue(sub_gm, _structure(body, inputs), owner, share))
        with graph.inserting_before(top):
            lookup = graph.call_module(name, tuple(inputs))
        lookup.meta = dict(top.meta)
        top.replace_all_uses_with(lookup)
        for node in sorted(private, key=order.__getitem__, reverse=True):
            graph.erase_node(node)
        for node in sorted(copied, key=order.__getitem__, reverse=True):
            if not node.users and not node.is_impure():
                graph.erase_node(node)
        installed += 1
    graph.lint()
    gm.recompile()
    return installed


def _host_functions() -> dict:
    from kimi_cg.ops import resize

    return {torch.ops.kimi_cg.bicubic_resize.default: resize.bicubic_resize_on_host}


def call_host_functions(gm: torch.fx.GraphModule) -> int:
    """NOTE [host calls skip the dispatcher]
    A host program runs its FX graph eagerly, once per call. A kimi_cg custom op called there goes
    through torch.library's Python dispatch (autograd wrapper, alias checks, the dynamo-disabled
    frame): on the H200's host, 0.41 ms per ``bicubic_resize`` call against 0.11 ms for the same
    computation called as a function, and a W4 request resizes the position table for each new
    image size. Host programs never need gradients or tracing, so their calls of these ops name the
    plain function the op itself runs (same inputs, same result). Returns how many calls changed."""
    functions = _host_functions()
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in functions:
            node.target = functions[node.target]
            changed += 1
    changed += _fuse_resize_into_rows(gm.graph)
    if changed:
        gm.recompile()
    return changed


_TABLE_CONSTANT = "kimi_cg_table_constant"
"""Node meta key: a get_attr node holding a table read made once, at build (``fold_table_constants``)."""


def fold_table_constants(gm: torch.fx.GraphModule) -> int:
    """NOTE [table constants folded]
    A table read starts with steps on the table's stand-in alone (``table_source`` takes only the
    table's shape): MoonViT permutes and unsqueezes its position grid before each item's resize.
    Those steps depend on nothing a call brings, yet ran inside every per-item value on each new
    size (they feed it, so the cache copies them in). They run once here, at build; the graph reads
    their result as an attribute (a stand-in is never written), and the per-item cache keys it by
    identity. So that an identity names one value for the process's life, a folded value is kept
    per derivation (its steps and their literal arguments) in ``_FOLDED`` and never freed: programs
    with the same steps share it, and no other value can take its address (a freed one's address
    could be reused, and a per-item entry keyed by it would then answer for another table). Kept
    values are few (one per table and chain) and small (the stand-in of a table's rows). A step
    that fails here is left in the graph, to fail at call time as it did. On the 2-core CPU host a
    new MoonViT image size's position chain went from ~39 to ~31 us. Returns how many values the
    graph now reads as attributes."""
    from kimi_cg.canonicalize.table_gather import stand_in_steps

    steps = stand_in_steps()
    values: dict[torch.fx.Node, object] = {}
    derivations: dict[torch.fx.Node, tuple] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in steps:
            continue
        inputs = node.all_input_nodes
        if (node.target is table_source) == bool(inputs) or not all(arg in values for arg in inputs):
            continue  # a source of a computed shape, or a step on something a call brings
        derivation = _literal((node.target.__qualname__, node.args, tuple(sorted(node.kwargs.items()))), derivations)
        if derivation is None:
            continue
        value = _FOLDED.get(derivation)
        if value is None:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
            try:
                made = node.target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - left in the graph: it raises at call time, as before
                continue
            value = _FOLDED.setdefault(derivation, made)  # two builds at once keep one value
        values[node], derivations[node] = value, derivation
    frontier = [node for node in values if any(user not in values for user in node.users)]
    for index, node in enumerate(frontier):
        name = f"table_constant_{index}"
        setattr(gm, name, values[node])
        with gm.graph.inserting_before(node), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")  # a plain attribute
            attribute = gm.graph.get_attr(name)
        attribute.meta = {**node.meta, _TABLE_CONSTANT: True}
        node.replace_all_uses_with(attribute, delete_user_cb=lambda user: user not in values)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in sorted(values, key=order.__getitem__, reverse=True):
        if not node.users:
            gm.graph.erase_node(node)
    if frontier:
        gm.graph.lint()
        gm.recompile()
    return len(frontier)


_FOLDED: dict[tuple, object] = {}  # NOTE [table constants folded]: one value per derivation, kept


def _literal(value, derivations: dict):
    """``value`` as a hashable key (a folded node as its derivation); None if it holds anything else."""
    if isinstance(value, torch.fx.Node):
        return derivations.get(value)
    if value is None or value is Ellipsis or type(value) in (int, bool, str, float):
        return value
    if type(value) is slice:
        parts = (value.start, value.stop, value.step)
    elif isinstance(value, (tuple, list)):
        parts = tuple(value)
    else:
        return None
    keys = tuple(_literal(part, derivations) for part in parts)
    if any(key is None and part is not None for key, part in zip(keys, parts)):
        return None
    return (type(value).__name__, *keys)


def _only_method_user(node: torch.fx.Node, method: str) -> torch.fx.Node | None:
    """node's single user if it is a ``node.<method>(...)`` call, else None."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    return user if user.op == "call_method" and user.target == method and user.args[:1] == (node,) else None


def _calls_with(user: torch.fx.Node | None, *args) -> bool:
    """Whether a method call passes exactly ``args`` after self (permute's dims as a list too)."""
    if user is None or user.kwargs:
        return False
    given = tuple(user.args[1:])
    if len(given) == 1 and isinstance(given[0], (list, tuple)):
        given = tuple(given[0])
    return given == args


def _flattens_first_two(user: torch.fx.Node | None) -> bool:
    """Whether a ``flatten`` call flattens dims 0 and 1 of a 3-d tensor, however spelled."""
    if user is None or len(user.args) > 3 or user.kwargs.keys() - {"start_dim", "end_dim"}:
        return False
    start = user.args[1] if len(user.args) > 1 else user.kwargs.get("start_dim", 0)
    end = user.args[2] if len(user.args) > 2 else user.kwargs.get("end_dim", -1)
    return start in (0, -3) and end in (1, -2)


def _fuse_resize_into_rows(graph: torch.fx.Graph) -> int:
    """A position grid resized and made into rows, ``resize(x).squeeze(0).permute(1, 2, 0).flatten(0, 1)``
    (MoonViT's and Kimi-K2.5's form), becomes one ``bicubic_resize_rows_on_host`` call: on CUDA its
    kernel writes the rows, where the chain made a copy after the resize. The intermediate tensors
    have no other users, so only the final rows are observable, and they are the same."""
    from kimi_cg.ops import resize

    fused = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not resize.bicubic_resize_on_host:
            continue
        squeezed = _only_method_user(node, "squeeze")
        permuted = _only_method_user(squeezed, "permute") if _calls_with(squeezed, 0) else None
        rows = _only_method_user(permuted, "flatten") if _calls_with(permuted, 1, 2, 0) else None
        if not _flattens_first_two(rows):
            continue
        with graph.inserting_before(node):
            fused_node = graph.call_function(resize.bicubic_resize_rows_on_host, node.args, node.kwargs)
        fused_node.meta = dict(rows.meta)
        rows.replace_all_uses_with(fused_node)
        for dead in (rows, permuted, squeezed, node):
            graph.erase_node(dead)
        fused += 1
    return fused


def check_scalar(condition, message: str) -> None:
    """``aten._assert_scalar`` for plain Python values: same error, no dispatcher round trip."""
    if not condition:
        raise RuntimeError(message)


def inline_scalar_asserts(gm: torch.fx.GraphModule) -> int:
    """Dynamo's runtime assertions on grid integers (hundreds per call for eight items) run as
    ``check_scalar``; a repeated assertion of one condition runs once. Returns how many remain."""
    seen = set()
    kept = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten._assert_scalar.default or node.users:
            continue
        condition = node.args[0]
        if isinstance(condition, torch.fx.Node):
            if condition in seen:  # the first assertion of this condition, earlier in the graph, raises
                gm.graph.erase_node(node)
                continue
            seen.add(condition)
        node.target = check_scalar
        kept += 1
    gm.graph.lint()
    gm.recompile()
    return kept


# NOTE [grid read once]
# Dynamo turns each ``for h, w in grid.tolist()`` of a tower into one ``grid[i][j].item()`` per
# integer, and a tower reads its grid in several loops (position embeddings, RoPE, cu_seqlens, the
# merger): on MoonViT 6 scalar reads per item and their tensor indexings, each a dispatcher call of
# microseconds, in every call that misses the batch cache. The host program instead reads each grid
# once as a Python list (``grid.tolist()``, one host read) and indexes the list. A read is rewritten
# only when its chain is grid[i][j] (or grid[i]) with literal indices; the indexing nodes that nothing
# else uses are dropped, the rest stay as they are. The values are the same Python ints (.item() and
# .tolist() convert alike), and an index out of range raises IndexError in both forms.
def read_grids_once(gm: torch.fx.GraphModule, grid_placeholders: set[torch.fx.Node]) -> int:
    """NOTE [grid read once]: rewrite scalar reads of grid integers; returns how many."""
    graph = gm.graph
    lists: dict[torch.fx.Node, torch.fx.Node] = {}
    rewritten = 0
    for node in list(graph.nodes):
        is_read = (node.op == "call_method" and node.target == "item"
                   or node.op == "call_function" and node.target is torch.ops.aten._local_scalar_dense.default)
        if not is_read or len(node.args) != 1:
            continue
        path = _grid_list_path(node.args[0], grid_placeholders, tensor_chain=True)  # [i] or [i, j]
        if not path or len(path) > 2 or not all(type(i) is int for i in path):
            continue
        chain = [node.args[0]]  # the indexing nodes, innermost first
        while len(chain) < len(path):
            chain.append(chain[-1].args[0])
        source = chain[-1].args[0]
        value = _list_read(graph, lists, source, path, before=node)
        value.meta.update(node.meta)  # the symbol it stands for, to name it in errors
        node.replace_all_uses_with(value)
        graph.erase_node(node)
        for link in chain:  # innermost first: drop indexings nothing else reads
            if not link.users:
                graph.erase_node(link)
        rewritten += 1
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten


def _list_read(graph: torch.fx.Graph, lists: dict, source: torch.fx.Node, path, before: torch.fx.Node) -> torch.fx.Node:
    """``source.tolist()[i][j]`` (the outer index first) inserted before ``before``; one ``tolist`` per
    grid, kept in ``lists`` (NOTE [grid read once])."""
    if source not in lists:
        with graph.inserting_after(source):
            lists[source] = graph.call_method("tolist", (source,))
    value = lists[source]
    with graph.inserting_before(before):
        for index in path:
            value = graph.call_function(operator.getitem, (value, index))
    return value


# NOTE [grid scalars by item]
# A tower may read a grid integer as a 0-dim tensor and keep computing with tensors: MoonViT3d's
# ``is_video = (grid_thws[i, 0] > 1).to(dtype)`` scales item i's time-table read. Indexing the grid
# tensor makes the value depend on the whole grid for the per-item cache, so the scaled read, its
# expand to the item's rows and its flatten ran in every call, seen sizes or not (with the cheaper
# repeats below, a W4_3d request of seen sizes in a new batch: ~4.5 -> ~2.9 ms of host pass on the
# 2-core CPU host, docs/benchmarks.md 2026-12-08). Such an indexing, ``grid[i, j]`` (or ``grid[i][j]``)
# with literal ints giving a 0-dim tensor of a grid nothing writes, becomes ``grid_scalar`` of the
# list read ``grid.tolist()[i][j]`` (NOTE [grid read once]): a new tensor of the same value, dtype and
# device, which depends on item i alone, so the work after it joins item i's cached value. An index
# out of range raises IndexError either way.
def grid_scalar(value: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """NOTE [grid scalars by item]: ``grid[i, j]`` made from the integer the list read gave."""
    return torch.tensor(value, dtype=dtype, device=device)


def grid_scalars_by_item(gm: torch.fx.GraphModule, grid_placeholders: set[torch.fx.Node]) -> int:
    """NOTE [grid scalars by item]: rewrite 0-dim tensor indexings of grids; returns how many."""
    graph = gm.graph
    mutated = Aliasing(graph).mutated
    lists: dict[torch.fx.Node, torch.fx.Node] = {}
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not operator.getitem or node in mutated:
            continue
        value = example_value(node)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            continue
        path = _grid_scalar_path(node, grid_placeholders)
        if path is None or path[0] in mutated:
            continue
        source, indices = path
        read = _list_read(graph, lists, source, indices, before=node)
        with graph.inserting_before(node):
            scalar = graph.call_function(grid_scalar, (read, value.dtype, value.device))
        scalar.meta.update(node.meta)
        node.replace_all_uses_with(scalar)
        chain = node
        while chain is not source and not chain.users:  # drop the indexings nothing else reads
            parent = chain.args[0]
            graph.erase_node(chain)
            chain = parent
        rewritten += 1
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten


def _grid_scalar_path(node: torch.fx.Node, grid_placeholders: set[torch.fx.Node]):
    """(grid, [i, j]) when ``node`` is grid[i, j] or grid[i][j] of a 2-D grid with literal ints; else None."""
    indices = []
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem:
        index = node.args[1]
        parts = list(index) if isinstance(index, tuple) else [index]
        if not all(type(part) is int for part in parts):
            return None
        indices[:0] = parts
        node = node.args[0]
    grid = example_value(node) if node in grid_placeholders else None
    if not isinstance(grid, torch.Tensor) or grid.dim() != 2 or len(indices) != 2:
        return None
    return node, indices


# NOTE [repeated host reads]
# Each layer of a tower re-reads the segment boundaries it was handed: MoonViT's flash path checks
# ``cu_seqlens[-1].item() == L`` and takes ``(cu_seqlens[1:] - cu_seqlens[:-1]).max().item()`` in
# every layer, 27 times per call, and the grid integers are read once per loop over the grid. Once
# lifted, these are host nodes computing the same value from the same inputs: identical nodes of a
# fixed set of side-effect-free operations (indexing, scalar reads, reductions, integer arithmetic
# and comparisons) are merged into their first occurrence, and the runtime checks on them then
# collapse into one per condition (``inline_scalar_asserts``). A node some user writes in place,
# and every operation outside that set (allocations, random numbers, in-place ops, module calls,
# checks), is never merged.
# Operations whose result is always a Python scalar, then the rest of the side-effect-free set.
_SCALAR_FUNCTIONS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.sym_size.int, torch.sym_not,
                               torch.sym_max, torch.sym_min, torch.sym_sum})
_SCALAR_METHODS = frozenset({"item", "size", "dim", "numel"})
_PURE_FUNCTIONS = _SCALAR_FUNCTIONS | {
    operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv,
    operator.mod, operator.neg, operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
    operator.and_, operator.or_, operator.not_,
}
_PURE_METHODS = _SCALAR_METHODS | {"tolist", "max", "min", "sum"}

_VIEW_METHODS = frozenset({"view", "reshape", "permute", "transpose", "flatten", "unflatten", "unsqueeze", "squeeze",
                           "expand", "narrow", "select", "t", "view_as"})
_CHECKS = (check_scalar, torch.ops.aten._assert_scalar.default)


def _is_scalar(node, memo: dict) -> bool:
    """Whether ``node`` is a Python scalar (an int, float or bool read from a tensor or a list, or
    arithmetic on such values): immutable, so any number of users may share it."""
    if not isinstance(node, torch.fx.Node):
        return not isinstance(node, (list, tuple, dict, torch.Tensor))
    if node not in memo:
        value = example_value(node)
        if isinstance(value, (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool)):
            memo[node] = True
        elif node.op == "call_method":
            memo[node] = node.target in _SCALAR_METHODS
        elif node.op == "call_function" and node.target in _SCALAR_FUNCTIONS:
            memo[node] = True
        elif node.op == "call_function" and node.target in _PURE_FUNCTIONS and node.target is not operator.getitem:
            memo[node] = all(_is_scalar(arg, memo) for arg in node.args)
        else:  # placeholders, indexing of tensors and lists, and the rest: not known to be scalars
            memo[node] = False
    return memo[node]


def _only_read(node: torch.fx.Node, scalars: dict) -> bool:
    """Whether every use of ``node`` (through views and indexing of it) reads it without writing:
    the side-effect-free operations of NOTE [repeated host reads], checks, and the program's outputs
    (the device program is functional). An index of it that is a scalar is a read, whoever uses it."""
    for user in node.users:
        if user.op == "output" or user.op == "call_function" and user.target in _CHECKS:
            continue
        if user.op == "call_function" and user.target in _PURE_FUNCTIONS:
            if user.target is operator.getitem and not (_is_scalar(user, scalars) or _only_read(user, scalars)):
                return False
            continue
        if user.op == "call_method" and (user.target in _PURE_METHODS
                                         or user.target in _VIEW_METHODS and _only_read(user, scalars)):
            continue
        return False
    return True


def _by_identity(arg):
    return ("node", id(arg)) if isinstance(arg, torch.fx.Node) else arg


def merge_repeated_reads(gm: torch.fx.GraphModule) -> int:
    """NOTE [repeated host reads]: merge identical side-effect-free nodes; returns how many went."""
    first: dict[tuple, torch.fx.Node] = {}
    scalars: dict = {}
    merged = 0
    for node in list(gm.graph.nodes):
        pure = (node.op == "call_function" and node.target in _PURE_FUNCTIONS
                or node.op == "call_method" and node.target in _PURE_METHODS)
        if not pure or not (_is_scalar(node, scalars) or _only_read(node, scalars)):
            continue
        constants = []
        torch.fx.node.map_aggregate((node.args, dict(node.kwargs)), constants.append)
        if any(isinstance(c, torch.Tensor) for c in constants):
            continue  # a tensor's repr elides its values: not a key
        # Nodes by identity, constants by repr (a slice is not hashable before Python 3.12).
        key = (node.op, node.target, repr(torch.fx.node.map_aggregate(node.args, _by_identity)),
               repr(torch.fx.node.map_aggregate(dict(node.kwargs), _by_identity)))
        kept = first.setdefault(key, node)
        if kept is not node:
            node.replace_all_uses_with(kept)
            gm.graph.erase_node(node)
            merged += 1
    if merged:
        gm.graph.lint()
        gm.recompile()
    return merged


def slice_offsets_from_integers(gm: torch.fx.GraphModule) -> int:
    """The merge gather's storage-offset reads (dynamo checks ``offset >= 0`` for every per-item slice
    of the packed rows) computed from the slice's integers instead of a reduction over its index
    (three tensor ops per item per call); returns how many."""
    graph = gm.graph
    changed = 0
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is gather_plan.row_storage_offset and len(node.args) == 1):
            continue
        piece = node.args[0]
        if not (isinstance(piece, torch.fx.Node) and piece.target is gather_plan.row_getitem and len(piece.args) == 2
                and not piece.kwargs):
            continue
        source, item = piece.args
        item = item[0] if isinstance(item, tuple) and len(item) == 1 else item
        if not (isinstance(source, torch.fx.Node) and source.target is gather_plan.row_source
                and len(source.args[0]) == 1 and isinstance(item, slice) and item.step in (None, 1)):
            continue
        with graph.inserting_before(node):
            offset = graph.call_function(gather_plan.row_slice_offset,
                                         (item.start, item.stop, source.args[0][0], source.args[1]))
        offset.meta.update(node.meta)
        node.replace_all_uses_with(offset)
        graph.erase_node(node)
        changed += 1
    if changed:
        gm.recompile()
    return changed


class HostProgram:
    """Runs the host program; maps failures to InvalidInputError naming the grid items involved."""

    def __init__(self, program: Program, grid_inputs: list[int], const_inputs: set[int], cache_bytes: int,
                 batch_cache_size: int = 16, owner: str = "default"):
        self.program = program
        self.gm = program.gm
        self.owner = owner  # whose share of the metadata budget this program's entries use
        self.share = cache_bytes
        self.table_constants = fold_table_constants(self.gm)
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        grid_nodes = {placeholders[i] for i, ref in enumerate(program.inputs) if ref.program == "arg" and ref.index in grid_inputs}
        const_nodes = {placeholders[i] for i, ref in enumerate(program.inputs) if ref.program == "arg" and ref.index in const_inputs}
        for node in self.gm.graph.nodes:  # CONST nodes (weight views) computed inside the host program
            if node.op == "call_function" and node.target is table_source:  # a table's shape only: a constant
                const_nodes.add(node)
            elif node.op == "get_attr" and node.meta.get(_TABLE_CONSTANT):  # NOTE [table constants folded]
                const_nodes.add(node)
            elif (node.op != "placeholder" and node.all_input_nodes
                  and all(a in const_nodes for a in node.all_input_nodes)):
                if not any(isinstance(a, torch.fx.Node) and a in grid_nodes for a in node.all_input_nodes):
                    const_nodes.add(node)
        self.direct_calls = call_host_functions(self.gm)
        self.slice_offsets = slice_offsets_from_integers(self.gm)
        self.grid_scalars = grid_scalars_by_item(self.gm, grid_nodes)
        self.items_cached = install_item_cache(self.gm, grid_nodes, const_nodes, owner, cache_bytes)
        self.grid_reads = read_grids_once(self.gm, grid_nodes)
        self.reads_merged = merge_repeated_reads(self.gm)
        self.asserts_inlined = inline_scalar_asserts(self.gm)
        self.grid_positions = [i for i, ref in enumerate(program.inputs) if ref.program == "arg" and ref.index in grid_inputs]
        self._grid_position_set = frozenset(self.grid_positions)
        self.state_positions = [i for i, ref in enumerate(program.inputs) if ref.program == "arg" and ref.index in const_inputs]
        self._state_position_set = frozenset(self.state_positions)
        self.batch_cache_size = batch_cache_size
        self.serial = next(_HOST_PROGRAM_SERIALS)
        self._batches: collections.OrderedDict = collections.OrderedDict()  # keys of this program's batches, LRU order
        self._batches_lock = threading.Lock()
        weakref.finalize(self, _forget_batches, self.serial, self._batches, self._batches_lock)
        counters["host_programs_built"] += 1

    def run(self, *inputs) -> tuple:
        """(the host outputs, the batch's cache key or None): the key names the batch for
        ``moved`` / ``keep_moved``."""
        # NOTE [batch metadata cache]: a batch whose grid and state tensors (by token: NOTE [state
        # tokens]) equal a recent one reuses that batch's host outputs (repeated requests of one
        # shape pay no host pass). Host outputs are read-only downstream: the device program is
        # functional. Entries live in the metadata store (NOTE [metadata memory budget]).
        tokens = self._state_tokens(inputs) if self.items_cached or self.batch_cache_size else ()
        key = self._batch_key(inputs, tokens)
        if key is not None:
            cached = metadata_store.get(("batch", self.serial, key))
            if cached is not None:
                with self._batches_lock:
                    if key in self._batches:
                        self._batches.move_to_end(key)
                counters["batch_cache_hits"] += 1
                return cached, key
        try:
            outputs = self.gm(*inputs)
        except (InvalidInputError, UnsupportedGraphError):
            raise
        except Exception as error:  # noqa: BLE001 - re-raised with the item named
            raise self._explain(error, inputs) from error
        if key is not None:
            for value in outputs:  # read-only from here on (NOTE [moved batches])
                if isinstance(value, torch.Tensor):
                    read_only.add(value)
            metadata_store.put(("batch", self.serial, key), outputs, self.owner, self.share, pool="batch")
            with self._batches_lock:
                self._batches[key] = None
                self._batches.move_to_end(key)
                dropped = self._batches.popitem(last=False)[0] if len(self._batches) > self.batch_cache_size else None
            if dropped is not None:
                metadata_store.pop(("batch", self.serial, dropped))
                metadata_store.pop(("moved", self.serial, dropped))
        return outputs, key

    def moved(self, key, positions, stream: tuple) -> dict | None:
        """NOTE [moved batches]: the device copies ``keep_moved`` kept for the batch ``key`` at these
        device-program ``positions``, made on ``stream`` (the device, the CUDA stream's handle: every
        device's default stream has handle 0); None if there are none."""
        if key is None:
            return None
        kept = metadata_store.get(("moved", self.serial, key))
        if kept is None or kept.stream != stream or not positions <= kept.values.keys():
            return None
        counters["moved_batch_hits"] += 1
        return kept.values

    def keep_moved(self, key, values: dict, stream: tuple) -> None:
        """Keep ``values`` (device-program position -> the device copy of a host output of the batch
        ``key``, made on ``stream``) for later calls of that batch (NOTE [moved batches])."""
        if key is None or not values:
            return
        for value in values.values():
            read_only.add(value)
        metadata_store.put(("moved", self.serial, key), MovedBatch(stream, dict(values)),
                           self.owner, self.share, pool="batch")

    def _state_tokens(self, inputs) -> tuple:
        """Validate the module state this program reads, once per call (NOTE [state tokens]): the
        item-value lookups of this call then read the tokens without comparing again."""
        tensors = [inputs[i] for i in self.state_positions if isinstance(inputs[i], torch.Tensor)]
        return state_tokens.validate(tensors) if tensors else ()

    def _batch_key(self, inputs, tokens: tuple):
        if self.batch_cache_size == 0:
            return None
        parts = [tokens]
        for position, value in enumerate(inputs):
            if position in self._grid_position_set:
                parts.append(tuple(map(tuple, value.tolist())) if value.dim() == 2 else tuple(value.tolist()))
            elif position in self._state_position_set and isinstance(value, torch.Tensor):
                continue  # in the tokens
            elif isinstance(value, torch.Tensor):
                if value.device.type != "cpu" or value.numel() > 64:
                    return None  # a per-call tensor the key cannot name cheaply: no batch reuse
                parts.append((value.dtype, tuple(value.shape), tuple(value.flatten().tolist())))
            elif isinstance(value, (int, float, bool, str, type(None))):
                parts.append(value)
            else:
                return None
        return tuple(parts)

    def _explain(self, error: Exception, inputs) -> InvalidInputError:
        failing = None
        interpreter = torch.fx.Interpreter(self.gm)
        original = interpreter.run_node

        def run_node(node):
            nonlocal failing
            failing = node
            return original(node)

        interpreter.run_node = run_node
        try:
            interpreter.run(*inputs)
        except Exception:  # noqa: BLE001 - we only want the node that fails
            pass
        grids = [inputs[i] for i in self.grid_positions]
        rows = set()
        if failing is not None:
            seen, stack = set(), [failing]
            while stack:
                node = stack.pop()
                for arg in node.all_input_nodes:
                    if arg not in seen:
                        seen.add(arg)
                        stack.append(arg)
            for row in _grid_rows(self.gm.graph, {n for n in self.gm.graph.nodes if n.op == "placeholder"}).items():
                if row[0] in seen or row[0] is failing:
                    rows |= row[1]
        described = []
        for grid in grids:
            values = grid.tolist()
            described += [f"item {r} {values[r]}" for r in sorted(rows) if r < len(values)]
        where = source_location(failing) if failing is not None else "the host metadata pass"
        items = ", ".join(described) if described else "the batch as a whole"
        message = self._name_symbols(str(error).splitlines()[0] if str(error) else repr(error), inputs)
        return InvalidInputError(f"kimi_cg: invalid input ({items}): {message}; raised at {where}")

    def _name_symbols(self, message: str, inputs) -> str:
        """Replace dynamo's symbol names (u3, s99) in a message by the grid entries they stand for."""
        names = {}
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        grids = {placeholders[i] for i in self.grid_positions}
        for node in self.gm.graph.nodes:
            value = example_value(node)
            if not isinstance(value, torch.SymInt):
                continue
            if node.op == "call_method" and node.target == "item":
                path, source = [], node.args[0]
                while isinstance(source, torch.fx.Node) and source.target is operator.getitem:
                    path.append(source.args[1])
                    source = source.args[0]
                names[str(value.node.expr)] = "grid" + "".join(f"[{i}]" for i in reversed(path))
            elif node.op == "call_function" and node.target is operator.getitem:  # NOTE [grid read once]
                path = _grid_list_path(node, grids)
                if path:
                    names[str(value.node.expr)] = "grid" + "".join(f"[{i}]" for i in path)
        for position, node in enumerate(placeholders):
            value = example_value(node)
            if isinstance(value, torch.SymInt):
                names[str(value.node.expr)] = f"{str(value.node.expr)}(={inputs[position]})"
        return re.sub(r"\b[us]\d+\b", lambda m: names.get(m.group(0), m.group(0)), message)
