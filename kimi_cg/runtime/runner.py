"""One call end to end: host metadata pass, device program, post views, eager's output structure.

NOTE [moved batches]
A batch whose host pass is reused (NOTE [batch metadata cache]) has the same host outputs as before,
and moving them to the GPU again cost a cached W4 request 0.57 ms of host CPU on an H200 host (pinned
staging of its plans; 2026-12-07 profile) and W1 seven small copies. So the runner keeps the moved
copies of a batch's host outputs in the metadata store beside the batch (pool "batch", counted as
device bytes, evicted with it), per device and CUDA stream: a call of that batch on the stream that
made them takes them as they are (the stream orders their copies before every later read on it;
another stream, or another device, moves afresh). Cached host outputs and their copies are
read-only (the device program is functional, and a written host value is computed in one program:
NOTE [mutation and lifting]); both are registered in ``staging.read_only``. A bucket remembers which
read-only value each static input was last filled from (``_Bucket.sources``, with the patch count
the padding of a boundary table depends on), and ``_fill`` skips an input still holding it: a
repeated single image's replay copies only its pixels. A host-block write (NOTE [host block])
forgets its positions' sources. With the host block on (the default), a replay takes the inputs its
bucket's block holds from the host directly: moved copies serve the others, and calls no graph runs.
"""

from __future__ import annotations

import logging
import time
import traceback
import weakref

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from kimi_cg import dynamo_settings
from kimi_cg.counters import counters
from kimi_cg.errors import InvalidInputError, UnsupportedGraphError
from kimi_cg.fallback import record_fallback
from kimi_cg.device_program import DeviceProgram
from kimi_cg.host_program import HostProgram
from kimi_cg.lift import LiftedGraph, ValueRef
from kimi_cg.runtime.graphs import BucketedGraphs
from kimi_cg.runtime.staging import current_stream, pinned_staging

logger = logging.getLogger(__name__)


_LIVE_RUNNERS: "weakref.WeakSet[LiftedRunner]" = weakref.WeakSet()


def live_runners() -> list["LiftedRunner"]:
    """Runners of graphs compiled in this process (benchmarks read their buckets and memory)."""
    return list(_LIVE_RUNNERS)


class LiftedRunner:
    """The callable kimi_cg returns to dynamo for one graph."""

    def __init__(self, lifted: LiftedGraph, host: HostProgram, device: DeviceProgram, activation_index: int | None,
                 graphs_for=None, fallback=None, strict: bool = False, dump=None, repro=None):
        self.lifted = lifted
        self.dump = dump  # kimi_cg.debug.dump.GraphDump: per-call records (NOTE [call records])
        self.repro = repro  # (call args, title) -> repro.py text or None (debug/repro.py)
        self.fallback = fallback  # the captured graph, unchanged (NOTE [errors by who must act])
        self.strict = strict
        self.host = host
        self.device = device
        # Host tensors consumed by the device program move to the activations' device.
        self.activation_index = activation_index
        self.host_refs = lifted.host.inputs
        self.device_refs = lifted.device.inputs
        if any(ref.program not in ("arg", "host", "literal") for ref in self.device_refs):
            raise ValueError("device program inputs come from the call, the host program or literals")
        self.device_plan = [(ref.program, ref.index) for ref in self.device_refs]
        self.host_positions = [i for i, ref in enumerate(self.device_refs) if ref.program == "host"]
        self.post_refs = lifted.post.inputs
        self.output_refs = lifted.outputs
        self.graphs_for = graphs_for  # device inputs -> BucketedGraphs (shared by equal programs)
        self.plain_reason = "CUDA graphs off"  # why calls run the plain program when graphs_for is None
        self.copied_outputs = _host_outputs_to_copy(lifted, host)
        self.graphs: BucketedGraphs | None = None
        self.device_ran = False  # whether a call of this graph ran its device program
        _LIVE_RUNNERS.add(self)

    @staticmethod
    def _resolve(ref: ValueRef, args, results):
        if ref.program == "arg":
            return args[ref.index]
        if ref.program == "literal":
            return ref.index
        return results[ref.program][ref.index]

    def __call__(self, *args):
        # NOTE [call records]: what each call did (replay of which bucket, split, plain program, the
        # captured graph and why), at DEBUG level and into the dump's calls.jsonl; timed on the host only.
        start = time.perf_counter()
        recording = logger.isEnabledFor(logging.DEBUG) or (self.dump is not None and self.dump.records_calls)
        record = {"start": start} if recording else None
        try:
            if torch.is_grad_enabled() and self.fallback is not None and self._needs_gradients(args):
                _note(record, path="captured graph", reason="gradients needed")
                return self._run_for_autograd(args)
            if self.fallback is not None and dynamo_settings.inside_a_frame_traced_again():
                return self._run_inside_a_frame_traced_again(args, record)
            if self.fallback is None:
                return self._run_lifted(args, record)
            try:
                return self._run_lifted(args, record)
            except Exception as error:  # noqa: BLE001 - decided below: the caller's error or a compiler limit
                _note(record, path="captured graph", reason=f"lifted program failed: {type(error).__name__}")
                return self._after_failure(error, args)
        finally:
            if record is not None:
                del record["start"]
                record["total_ms"] = round((time.perf_counter() - start) * 1e3, 3)
                logger.debug("kimi_cg call [%s]: %s", self.dump.entry["compile_id"] if self.dump else "?", record)
                if self.dump is not None:
                    self.dump.record_call(record)

    def _run_inside_a_frame_traced_again(self, args, record):
        """NOTE [calls inside a frame traced again]: a frame up the stack runs eagerly in this call and
        is traced whole at its next; this graph, a piece of it, runs as dynamo captured it instead of
        compiling its device program and capturing its buckets for this call's use. Its calls from
        anywhere else run lifted."""
        counters["calls_inside_frames_traced_again"] += 1
        _note(record, path="captured graph", reason="inside a frame that runs eagerly and is traced again at its next call")
        return self.fallback(*args)

    @staticmethod
    def _needs_gradients(args) -> bool:
        return any(isinstance(value, torch.Tensor) and value.requires_grad for value in args)

    def _run_for_autograd(self, args):
        """kimi_cg's programs are inference-only (replays and cached metadata have no autograd
        graph): a call that needs gradients runs the captured graph, which autograd sees whole."""
        counters["call_fallbacks"] += 1
        record_fallback("gradients needed (kimi_cg runs inference only)", "call time",
                        "a tensor input requires grad and grad mode is on",
                        "this call ran the captured graph; run inference under torch.inference_mode() or torch.no_grad()")
        try:
            return self.fallback(*args)
        except RuntimeError as error:  # dynamo's runtime assertions: the caller's error (NOTE [errors by who must act])
            if "Runtime assertion failed" not in str(error) or isinstance(error, InvalidInputError):
                raise
            counters["invalid_inputs"] += 1
            raise InvalidInputError.like(f"kimi_cg: invalid input: {error}", error) from error

    def _after_failure(self, error: Exception, args):
        """NOTE [errors by who must act]: the captured graph, run unchanged on the same inputs, tells
        whether the inputs are invalid (it fails too: the caller's error) or kimi_cg hit a limit (it
        runs: its result is returned, counted as a fallback, or strict raises)."""
        try:
            result = self.fallback(*args)
        except torch.OutOfMemoryError:
            raise  # not the inputs' fault, and not kimi_cg's limit
        except Exception as eager_error:  # noqa: BLE001 - re-raised as the caller's error
            counters["invalid_inputs"] += 1
            message = str(error) if isinstance(error, InvalidInputError) else f"kimi_cg: invalid input: {eager_error}"
            raise InvalidInputError.like(message, eager_error) from eager_error
        if isinstance(error, UnsupportedGraphError):
            reason = error.reason
        elif isinstance(error, InvalidInputError):  # the host program failed where the captured graph runs
            reason = "lifted program rejects a valid input"
        else:
            reason = f"lifted program failed ({type(error).__name__})"
        detail = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        where = getattr(error, "where", None) or _raised_at(error)
        record = self._record_call_failure(error, reason, where, args)
        if record:
            detail += f" (dump: {record})"
        if self.strict:
            raise UnsupportedGraphError(f"kimi_cg could not run this call lifted ({detail}); the captured graph runs it",
                                        reason) from error
        counters["call_fallbacks"] += 1
        record_fallback(reason, where, detail, "this call ran the captured graph")
        return result

    def _record_call_failure(self, error: Exception, reason: str, where: str, args) -> str | None:
        """The dump's record of a call the lifted program could not run (and, for the first, a
        call_repro.py over this call's inputs); None when not dumping."""
        if self.dump is None:
            return None
        repro = None
        if self.repro is not None:
            title = (f"Reproduces a call that kimi_cg's lifted program of graph [{self.dump.entry['compile_id']}] "
                     f"could not run: {reason} at {where}")
            repro = lambda: self.repro(args, title)  # noqa: E731
        try:
            return self.dump.call_failed(error, reason, where, grid=_grids_of(args), repro=repro)
        except Exception:  # noqa: BLE001 - a debugging aid must never change what runs
            logger.debug("kimi_cg: recording a call fallback in the dump failed", exc_info=True)
            return None

    def _run_lifted(self, args, record=None):
        # NOTE [the activations' device is current]: captures, side streams, graph pools, memory
        # accounting and Triton launches all use the current CUDA device, while ATen ops follow their
        # tensors. A tower on cuda:1 called with cuda:0 current would capture on one device what runs
        # on the other; so a call runs with its activations' device current (ATen's own rule).
        if self.activation_index is not None:
            activations = args[self.activation_index]
            if (isinstance(activations, torch.Tensor) and activations.is_cuda
                    and activations.device.index != torch.cuda.current_device()):
                with torch.cuda.device(activations.device):
                    return self._run_lifted_here(args, record)
        return self._run_lifted_here(args, record)

    def _run_lifted_here(self, args, record=None):
        results = {}
        host, batch = self.host.run(*(self._resolve(ref, args, results) for ref in self.host_refs))
        results["host"] = host
        if record is not None:
            record["host_ms"] = round((time.perf_counter() - record["start"]) * 1e3, 3)
        # Most device inputs are the call's own arguments (the weights): a list comprehension over
        # precomputed (program, index) pairs keeps this loop cheap (hundreds of inputs per call).
        device_args = [args[i] if program == "arg" else host[i] if program == "host" else i
                       for program, i in self.device_plan]
        host_side = {}  # host values moved to the activations' device, as the host pass made them
        graphs, left, target = None, {}, None
        if self.activation_index is not None:
            target = args[self.activation_index].device
            for position in self.host_positions:
                value = device_args[position]
                if isinstance(value, torch.Tensor) and value.device != target:
                    host_side[position] = value
            if host_side and self.graphs_for is not None:
                # NOTE [host block]: a replay takes these from the host itself; moved only if none runs
                graphs = self.graphs_for(device_args)
                left = {position: value for position, value in host_side.items()
                        if position in graphs.host_block_positions and value.device.type == "cpu"}
            moving = {position: value for position, value in host_side.items() if position not in left}
            if moving:  # NOTE [moved batches]
                stream = (target, current_stream(target).cuda_stream if target.type == "cuda" else 0)
                kept = self.host.moved(batch, moving.keys(), stream)
                if kept is not None:
                    for position in moving:
                        device_args[position] = kept[position]
                else:
                    self.host.keep_moved(batch, _move(device_args, moving, target), stream)
        results["device"] = self._run_device(device_args, record, host_side, graphs, left, target)
        if not self.device_ran:  # NOTE [programs that ran] in kimi_cg/device_program.py
            self.device_ran = True
            if self.dump is not None:
                self.dump.update(device_program_ran=True)
        if self.post_refs or self.lifted.post.outputs:
            results["post"] = self.lifted.post.gm(*(self._resolve(ref, args, results) for ref in self.post_refs))
        outputs = [self._resolve(ref, args, results) for ref in self.output_refs]
        if self.copied_outputs:
            _copy_keeping_aliases(outputs, self.copied_outputs)
        return tuple(outputs)

    def _run_device(self, device_args, record=None, host_side=None, graphs=None, left=None, target=None):
        """``left``: host-made values still on the host (NOTE [host block]), moved here unless a replay runs."""
        if self.graphs_for is not None:
            # Looked up per call: dynamo shares one compiled graph between instances of a module
            # class (weights are inputs), while captured graphs belong to one set of weights.
            self.graphs = graphs = graphs if graphs is not None else self.graphs_for(device_args)  # the latest, for reports
            result = self._replay(graphs, device_args, record, host_side)
            if result is not None:
                return result
            if left:
                _move(device_args, left, target)
            split = self._run_split(graphs, device_args, record)
            if split is not None:
                return split
            if graphs.make_tables_dense(device_args):  # NOTE [segment tables] in runtime/graphs.py
                result = self._replay(graphs, device_args, record)
                if result is not None:
                    return result
            counters["eager_fallbacks"] += 1
            _note(record, path="plain program", reason="padding could reach real rows" if graphs.hazard else "no bucket fits", rows=graphs.patch_rows(device_args) if record is not None else None)
            logger.debug("kimi_cg: call does not fit a bucket; running the non-graphed device program")
        else:
            _note(record, path="plain program", reason=self.plain_reason)
        return self.device(*device_args)

    def _replay(self, graphs, device_args, record=None, host_side=None):
        """The call replayed in its exact-size graph (NOTE [exact-size graphs] in runtime/graphs.py) or
        in the smallest bucket that holds it, or None."""
        rows = graphs.choose_exact(device_args, host_side)
        result = graphs.run(device_args, rows, exact=True) if rows is not None else None
        if result is not None:
            _note(record, path="replay", bucket=rows, exact=True, rows=rows, padding=0)
            self._report_graphs(graphs)
            return result
        capacity = graphs.choose(device_args)
        if capacity is None:
            return None
        result = graphs.run(device_args, capacity, host_side=host_side)
        if result is None:  # that bucket was dropped for memory: choose among the rest
            capacity = graphs.choose(device_args)
            result = graphs.run(device_args, capacity, host_side=host_side) if capacity is not None else None
        if result is not None and record is not None:
            rows = graphs.patch_rows(device_args)
            record.update(path="replay", bucket=capacity, rows=rows, padding=capacity - rows)
            self._report_graphs(graphs)
        return result

    def _report_graphs(self, graphs) -> None:
        """The dump's index entry learns this graph's buckets, how many were captured, and the graph
        memory, once per graph set (captures happen at the first call that fits a bucket)."""
        if self.dump is None or not self.dump.records_calls or self.dump.entry.get("graph_set") == id(graphs):
            return
        device, graph_bytes, static_bytes = graphs.memory()
        self.dump.update(graph_set=id(graphs), buckets=list(graphs.capacities),
                         captured_buckets=sum(1 for bucket in graphs.buckets.values() if bucket.graph is not None),
                         graph_memory_mb=round((graph_bytes + static_bytes) / 2**20, 1), graph_device=device)

    def _run_split(self, graphs, device_args, record=None):
        """NOTE [splitting] in runtime/graphs.py: several replays of whole items, outputs put back in
        call order. Parts out of call order need every output to be row-wise over items, each item's
        rows adding up to every part's; otherwise the call is packed in call order."""
        plan = graphs.split(device_args)
        if plan is None or len(plan.pieces) < 2:
            return None
        full_rows = self.device.output_rows(device_args)
        part_rows = [self.device.output_rows(piece) for piece in plan.pieces]
        per_item = None if plan.in_call_order else self._rows_per_item(graphs, plan, device_args, full_rows)
        consistent = per_item is not None and all(
            sum(per_item[j][i] for i in part) == rows[j] for part, rows in zip(plan.parts, part_rows) for j in range(len(rows)))
        if not consistent and not plan.in_call_order:
            plan = graphs.split(device_args, sort=False)
            if plan is None or len(plan.pieces) < 2:
                return None
            part_rows = [self.device.output_rows(piece) for piece in plan.pieces]
        for j, rows in enumerate(full_rows):  # outputs must be row-wise over items to concatenate
            if rows is None or sum(p[j] for p in part_rows) != rows:
                return None
        counters["split_calls"] += 1
        results, buckets = [], []
        for piece in plan.pieces:
            capacity = graphs.choose(piece)
            result = graphs.run(piece, capacity) if capacity is not None else None
            if result is None:
                counters["eager_fallbacks"] += 1  # one item larger than the largest bucket (or it was dropped)
                result = tuple(self.device(*piece))
            results.append(result)
            buckets.append(capacity if result is not None and capacity is not None else "plain")
        _note(record, path="split", parts=buckets, rows=graphs.patch_rows(device_args) if record is not None else None,
              in_call_order=plan.in_call_order)
        if plan.in_call_order:
            return tuple(torch.cat(pieces) for pieces in zip(*results))
        outputs = []
        for j in range(len(full_rows)):
            chunks = {}
            for part, result in zip(plan.parts, results):
                for item, chunk in zip(part, torch.split(result[j], [per_item[j][i] for i in part])):
                    chunks[item] = chunk
            outputs.append(torch.cat([chunks[i] for i in range(len(chunks))]))
        return tuple(outputs)

    def _rows_per_item(self, graphs, plan, device_args, full_rows) -> list[list[int]] | None:
        """Per output, each item's rows: the device program's output sizes for a call of that item
        alone (its own patch rows, gather-plan rows and segments). A ratio of the call's rows would
        guess: a video chunk's merged rows are its plan rows / 4 (frames averaged), not its patch
        rows / 4, and both ratios can be whole numbers with different answers. None when an output
        is not row-wise over items (the items' rows do not add up to the call's)."""
        if any(rows is None for rows in full_rows):
            return None
        bounds, plan_blocks = [0], []  # the call's rows of each item, as split() found them
        for patches, plan_rows in zip(plan.patch_rows, plan.plan_rows):
            bounds.append(bounds[-1] + patches)
            start = plan_blocks[-1][1] if plan_blocks else 0
            plan_blocks.append((start, start + plan_rows))
        by_size: dict[tuple[int, int], list] = {}  # a one-item call's shapes follow from these two sizes
        for item, size in enumerate(zip(plan.patch_rows, plan.plan_rows)):
            if size not in by_size:
                by_size[size] = self.device.output_rows(graphs._part_inputs(device_args, [item], bounds, plan_blocks))
        result = [list(rows) for rows in zip(*(by_size[size] for size in zip(plan.patch_rows, plan.plan_rows)))]
        for rows, total in zip(result, full_rows):
            if any(r is None for r in rows) or sum(rows) != total:
                return None
        return result


def _move(device_args: list, values: dict, target: torch.device) -> dict:
    """Host-made values (position -> tensor) to the activations' device, in place in ``device_args``;
    the moved values by position."""
    if not values:
        return {}
    moved = (pinned_staging.move(values, target) if target.type == "cuda"  # NOTE [pinned staging]
             else {position: value.to(target, non_blocking=True) for position, value in values.items()})
    for position, value in moved.items():
        device_args[position] = value
    return moved


def _note(record: dict | None, **fields) -> None:
    if record is not None:
        record.update({key: value for key, value in fields.items() if value is not None})


def _storage_of(node: torch.fx.Node):
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None
    return StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else None


def _host_outputs_to_copy(lifted: LiftedGraph, host: HostProgram) -> list[int]:
    """NOTE [host outputs]: host values are cached across calls (NOTE [batch metadata cache], NOTE
    [per-item metadata cache]), so a host tensor the graph returns is copied for the caller, who may
    write it without changing a later call. A returned view of a call input (the grid) is returned
    as the view it is, and then the batch cache is off for this program: a cached view would show
    an earlier call's input."""
    input_storages = {_storage_of(node) for node in lifted.categories if node.op == "placeholder"} - {None}
    copied = []
    for position, ref in enumerate(lifted.outputs):
        if ref.program != "host":
            continue
        if _storage_of(lifted.host.outputs[ref.index]) in input_storages:
            host.batch_cache_size = 0
        else:
            copied.append(position)
    return copied


def _copy_keeping_aliases(outputs: list, positions: list[int]) -> None:
    """Copy outputs[i] for i in positions; outputs sharing a storage (a tensor and views of it, which
    code after a graph break may write and read) get one copy of that storage, viewed as before."""
    by_storage: dict = {}
    for i in positions:
        if isinstance(outputs[i], torch.Tensor):
            by_storage.setdefault(outputs[i].untyped_storage().data_ptr(), []).append(i)
    for group in by_storage.values():
        if len(group) == 1:
            outputs[group[0]] = outputs[group[0]].clone()
            continue
        storage = outputs[group[0]].untyped_storage().clone()
        for i in group:
            value = outputs[i]
            outputs[i] = torch.empty(0, dtype=value.dtype, device=value.device).set_(
                storage, value.storage_offset(), value.shape, value.stride())


def _raised_at(error: BaseException) -> str:
    """``path:line (function)`` of the line that raised ``error`` (the innermost frame of its traceback),
    for an error that names no model line (an internal error, not a named compiler limit)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "call time"
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} ({frame.name})"


def _grids_of(args) -> list:
    """The call's small integer tensors (its grids) as lists, for a failure record."""
    return [value.tolist() for value in args if isinstance(value, torch.Tensor) and not value.is_floating_point()
            and value.numel() <= 4096]
