"""Debug dumps: a run folder per process, a folder per dynamo graph named by dynamo's compile id, an index.

With ``debug_dir`` (option or ``KIMI_CG_DEBUG_DIR``)::

    <debug_dir>/run_<UTC yyyymmdd-hhmmss>_pid<pid>/     one per process: a second run never mixes in
        index.md, index.json                           every graph: compile id, frame, grid, status,
                                                       fallback reason, device program, files
        compile_<frame>_<compile>/                     dynamo's compile id [frame/compile]
            00_dynamo_graph.py                         the graph kimi_cg received
            NN_<pass>.diff                             what each pass that changed the graph changed
                                                       (a unified diff against the stage before)
            host_program.py, post_program.py, lift_report.json
            error.txt                                  why lifting failed (with the traceback)
            repro.py                                   `python repro.py` raises that error again (when
                                                       the graph cannot be written down: why not, in
                                                       error.txt)
            call_error.txt, call_repro.py              the same for the first call the lifted program
                                                       could not run (the captured graph ran it)
        calls.jsonl                                    one record per call (NOTE [call records]): the
                                                       graph's compile id, replay of which bucket with
                                                       how much padding (``exact``: an exact-size graph
                                                       of ``bucket`` rows), split parts, plain program or
                                                       captured graph and why, host and total ms
        device_programs/<key>.py                       each device program once (graphs share them)

Every stage is also a ``torch._logging.trace_structured`` artifact (``kimi_cg_<stage>``), so a run under
``TORCH_TRACE=<dir>`` shows kimi_cg's graphs in tlparse beside dynamo's and Inductor's, with or without
``debug_dir``. Payloads are formatted only when a dump folder or a trace wants them.
"""

from __future__ import annotations

import datetime
import difflib
import json
import os
import re
import threading
import time
import traceback
from typing import Any, Callable

import torch

from kimi_cg.debug.repro import ReproUnavailable

MAX_CALL_RECORDS = 10_000
_runs: dict[str, "_Run"] = {}  # debug root -> this process's run folder
_emitted_shared: dict[int, set] = {}  # id(run) (None: trace only) -> shared files already written
_lock = threading.Lock()


class _Run:
    def __init__(self, root: str):
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        self.folder = os.path.join(root, f"run_{stamp}_pid{os.getpid()}")
        os.makedirs(self.folder, exist_ok=True)
        self.entries: list[dict] = []
        self.calls_recorded = self.calls_dropped = 0
        self.calls_lock = threading.Lock()

    def append_call(self, record: dict) -> None:
        """NOTE [call records]: one JSON line per call in calls.jsonl, at most MAX_CALL_RECORDS per run
        (a serving process would otherwise fill the disk); later calls are counted, not written."""
        with self.calls_lock:
            if self.calls_recorded >= MAX_CALL_RECORDS:
                self.calls_dropped += 1
                return
            self.calls_recorded += 1
            with open(os.path.join(self.folder, "calls.jsonl"), "a") as f:
                f.write(json.dumps(record, default=str) + "\n")

    def write_index(self) -> None:
        with _lock:
            entries = [dict(entry) for entry in self.entries]
        _write_atomically(os.path.join(self.folder, "index.json"), json.dumps({"graphs": entries}, indent=2, default=str))
        models = sorted({entry["model"] for entry in entries if entry.get("model")})
        lines = ["# kimi_cg debug dump", "", f"Process {os.getpid()}, torch {torch.__version__}. One row per dynamo graph "
                 "kimi_cg received, in compile order.", "", f"Models: {', '.join(models) or 'unknown'}", "",
                 "| compile id | model | frame | grid at trace | status | device program | buckets (captured), graph MB | folder |",
                 "|---|---|---|---|---|---|---|---|"]
        for entry in entries:
            status = entry["status"]
            if entry.get("reason"):
                status += f": {entry['reason']} at {entry.get('where', '?')}"
            if entry.get("graph_break"):
                status += f" (ends at a graph break: {entry['graph_break']})"
            if entry.get("call_fallbacks"):
                status += "; calls run by the captured graph: " + ", ".join(
                    f"{reason} x{count}" for reason, count in entry["call_fallbacks"].items())
            graphs = "-"
            if entry.get("buckets"):
                graphs = (f"{len(entry['buckets'])} up to {max(entry['buckets'])} ({entry.get('captured_buckets', 0)}), "
                          f"{entry.get('graph_memory_mb', 0)} MB")
            model = (entry.get("model") or "?").rsplit(".", 1)[-1]
            lines.append(f"| [{entry['compile_id']}] | {model} | {entry['frame']} | {entry.get('grid', '-')} | {status} | "
                         f"{entry.get('device_program', '-')} | {graphs} | [{entry['folder']}]({entry['folder']}/) |")
        lines += ["", "Per graph folder: 00_dynamo_graph.py (as received), NN_<pass>.diff (what each pass that changed "
                  "the graph changed), host and post programs, lift_report.json, error.txt when lifting failed, "
                  "call_error.txt for the first call the lifted program could not run. "
                  "device_programs/: each device program once."]
        _write_atomically(os.path.join(self.folder, "index.md"), "\n".join(lines) + "\n")


class GraphDump:
    """The dump of one dynamo graph: files in its folder (when dumping), artifacts in TORCH_TRACE."""

    def __init__(self, run: _Run | None, gm: torch.fx.GraphModule, compile_id: str, frame: str):
        self.run, self.stage_count, self.previous = run, 0, None
        self.folder = None
        self.entry = {"compile_id": compile_id, "frame": frame, "status": "compiling", "files": []}
        if run is not None:
            name = "compile_" + compile_id.replace("/", "_").replace(" ", "")
            with _lock:
                taken = {entry["folder"] for entry in run.entries}
                folder, suffix = name, 1
                while folder in taken:  # a second backend call within one compile id
                    suffix += 1
                    folder = f"{name}_graph{suffix}"
                self.entry["folder"] = folder
                run.entries.append(self.entry)
            self.folder = os.path.join(run.folder, folder)
            os.makedirs(self.folder, exist_ok=True)

    @property
    def records_calls(self) -> bool:
        return self.run is not None

    def record_call(self, record: dict) -> None:
        if self.run is not None:
            self.run.append_call({"time": round(time.time(), 6), "compile_id": self.entry["compile_id"], **record})

    @property
    def enabled(self) -> bool:
        return self.folder is not None or _tracing()

    def stage(self, name: str, text: Callable[[], str]) -> None:
        """Record one stage, numbered in order: the first in full (``00_name.py``), later ones as a
        unified diff against the stage before (``NN_name.diff``: graphs of unrolled towers are large
        and a pass changes a few lines per layer), and a trace artifact of the same."""
        if not self.enabled:
            return
        current = text()
        if self.previous is None:
            file_name, payload = f"{self.stage_count:02d}_{name}.py", current
        else:
            file_name = f"{self.stage_count:02d}_{name}.diff"
            payload = "".join(difflib.unified_diff(self.previous.splitlines(keepends=True), current.splitlines(keepends=True),
                                                   fromfile=self.previous_name, tofile=name))
        self.previous, self.previous_name = current, name
        self.stage_count += 1
        self._emit(file_name, name, payload)

    def shared_file(self, kind: str, key: str, text: Callable[[], str], field: str | None = None) -> str | None:
        """Record a file that several graphs share (a device program) once per run, under ``kind/``;
        the index names it for this graph. Returns its path relative to the run folder."""
        if not self.enabled:
            return None
        safe_key = re.sub(r"[^A-Za-z0-9_.-]", "_", key)  # a file name here and in tlparse's output
        relative = os.path.join(kind, safe_key + ".py")
        with _lock:
            first = relative not in _emitted_shared.setdefault(id(self.run), set())
            _emitted_shared[id(self.run)].add(relative)
        if first:
            payload = text()
            torch._logging.trace_structured("artifact", metadata_fn=lambda: {"name": f"kimi_cg_{kind}_{safe_key}", "encoding": "string"},
                                            payload_fn=lambda: payload)
            if self.run is not None:
                os.makedirs(os.path.join(self.run.folder, kind), exist_ok=True)
                with open(os.path.join(self.run.folder, relative), "w") as f:
                    f.write(payload)
        self.entry[field or f"{kind}_file"] = relative
        if field is not None and self.run is not None:
            self.run.write_index()  # written after the graph's entry was (e.g. at the program's first call)
        return relative

    def file(self, file_name: str, text: Callable[[], str]) -> None:
        """Record an unnumbered file (programs, reports) and its trace artifact."""
        if self.enabled:
            self._emit(file_name, file_name.rsplit(".", 1)[0], text())

    def update(self, **fields: Any) -> None:
        self.entry.update({key: value for key, value in fields.items() if value is not None})
        if self.run is not None:
            self.run.write_index()

    def failed(self, error: BaseException, reason: str, where: str, repro: Callable[[], str] | None = None) -> str | None:
        """Record why lifting failed (error.txt) and a repro.py that raises the same error (when the
        graph cannot be written down, error.txt ends with why not); returns the path of the error
        record (None when not dumping)."""
        path = self._error_record("error.txt", f"{reason} at {where}\n\n", error, "repro.py", repro)
        self.update(status="fell back (runs unlifted)", reason=reason, where=where)
        return path

    def call_failed(self, error: BaseException, reason: str, where: str, grid: Any = None,
                    repro: Callable[[], str] | None = None) -> str | None:
        """A call the lifted program could not run (the captured graph ran it): counted by reason in
        the index (``call_fallbacks``); the first such call's error and grid go to call_error.txt and
        call_repro.py (this call's inputs, strict=True: it raises the same error; or, when the graph
        cannot be written down, why not at the end of call_error.txt). Returns the path of the error
        record (None when not dumping)."""
        with _lock:
            fallbacks = self.entry.setdefault("call_fallbacks", {})
            first = not fallbacks
            fallbacks[reason] = fallbacks.get(reason, 0) + 1
        path = os.path.join(self.folder, "call_error.txt") if self.folder else None
        if first:
            path = self._error_record("call_error.txt", f"{reason} at {where}\ngrid of the call: {grid}\n\n", error,
                                      "call_repro.py", repro)
        if self.run is not None:
            self.run.write_index()
        return path

    def _error_record(self, file_name: str, heading: str, error: BaseException, repro_name: str,
                      repro: Callable[[], str] | None) -> str | None:
        """``file_name``: the heading and the error's traceback; ``repro_name``: the script ``repro``
        writes, when it can (why not, otherwise, at the end of the error record). Returns the error
        record's path (None when not dumping)."""
        text = heading + "".join(traceback.format_exception(type(error), error, error.__traceback__))
        if repro is not None and self.folder is not None:
            try:
                script = repro()
            except ReproUnavailable as why:
                script = None
                text += f"\n(no {repro_name}: {why})"
            except Exception as repro_error:  # noqa: BLE001 - a debugging aid must never change what runs
                script = None
                text += f"\n(no {repro_name}: writing it failed: {type(repro_error).__name__}: {repro_error})"
            if script is not None:
                self.file(repro_name, lambda: script)
        self.file(file_name, lambda: text)
        return os.path.join(self.folder, file_name) if self.folder else None

    def _emit(self, file_name: str, name: str, payload: str) -> None:
        torch._logging.trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"kimi_cg_{name}", "encoding": "string"},
            payload_fn=lambda: payload,
        )
        if self.folder is not None:
            with open(os.path.join(self.folder, file_name), "w") as f:
                f.write(payload)
            self.entry["files"].append(file_name)


def tensor_op_count(gm: torch.fx.GraphModule) -> int:
    """Ops of ``gm`` that produce tensors: the device work of a graph run as captured (kimi_cg.report
    compares the ops calls ran inside replayed graphs with those they ran outside)."""
    from kimi_cg.capture import example_value

    return sum(1 for node in gm.graph.nodes if node.op in ("call_function", "call_method", "call_module")
               and _makes_a_tensor(node, example_value(node)))


def _makes_a_tensor(node: torch.fx.Node, value) -> bool:
    import operator

    from kimi_cg.lift import is_size_query

    if value is None:  # a node a rewrite created has no example value: a tensor op unless it reads a size
        return not (is_size_query(node) or (node.op == "call_function" and node.target is operator.getitem))
    return isinstance(value, torch.Tensor) or (isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value))


def start_graph(debug_dir: str | None, gm: torch.fx.GraphModule, frame: str, grid: Any = None) -> GraphDump:
    """The dump of the graph dynamo is compiling now (a no-op object without debug_dir or TORCH_TRACE)."""
    run = None
    if debug_dir:
        with _lock:
            run = _runs.get(debug_dir)
            if run is None or not os.path.isdir(run.folder):
                run = _runs[debug_dir] = _Run(debug_dir)
    dump = GraphDump(run, gm, current_compile_id(), frame)
    dump.update(model=model_of(), grid=grid, graph_break=_graph_break_reason(gm), tensor_ops=tensor_op_count(gm) if dump.enabled else None)
    dump.stage("dynamo_graph", lambda: gm.print_readable(print_output=False))
    return dump


def run_folder(debug_dir: str) -> str | None:
    """This process's run folder under ``debug_dir`` (None before the first graph was dumped)."""
    run = _runs.get(debug_dir)
    return run.folder if run is not None else None


def read_index(debug_dir: str, run: str | None = None) -> list[dict]:
    """The graphs of a dump's latest run folder (or of ``run``), in compile order, each with ``path``:
    its folder's absolute path."""
    if run is None:
        runs = sorted(name for name in os.listdir(debug_dir) if name.startswith("run_"))
        if not runs:
            raise FileNotFoundError(f"no kimi_cg run folder in {debug_dir}")
        run = runs[-1]
    folder = os.path.join(debug_dir, run)
    with open(os.path.join(folder, "index.json")) as f:
        graphs = json.load(f)["graphs"]
    for graph in graphs:
        graph["path"] = os.path.join(folder, graph["folder"])
    return graphs


def frame_of(gm: torch.fx.GraphModule) -> str:
    """``path:line (function)`` of the frame dynamo traced into ``gm``: the outermost entry of its
    first node's stack trace (dynamo's traces start at the traced frame)."""
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace")
        match = re.search(r'File "([^"]+)", line (\d+), in (\S+)', trace or "")
        if match:
            return f"{match.group(1)}:{match.group(2)} ({match.group(3)})"
    return "unknown frame"


def model_of() -> str | None:
    """The class of the module whose frame dynamo is tracing (``self`` of the traced frame), else the
    frame's qualified function name; None outside a dynamo trace. Read from dynamo's current
    instruction translator, which is live while it calls the backend."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        module = tx.f_locals.get("self") if tx is not None else None
    except Exception:  # noqa: BLE001 - a debugging aid: dynamo internals differ between versions
        return None
    if isinstance(module, torch.nn.Module):
        return f"{type(module).__module__}.{type(module).__qualname__}"
    return getattr(tx.f_code, "co_qualname", tx.f_code.co_name)


def current_compile_id() -> str:
    """Dynamo's id of the compile in progress, as its logs print it: ``frame/compile`` (``0/3``)."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    if compile_id is None:
        return "none"
    frame, count = getattr(compile_id, "frame_id", None), getattr(compile_id, "frame_compile_id", None)
    return f"{frame}/{count}" if frame is not None else str(compile_id)


def _graph_break_reason(gm) -> str | None:
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    text = str(reason.reason)
    return text.splitlines()[0][:200] if text else "graph break"


def _tracing() -> bool:
    return bool(torch._logging._internal.trace_log.handlers)


def _write_atomically(path: str, text: str) -> None:
    temporary = f"{path}.tmp{os.getpid()}_{threading.get_ident()}"
    with open(temporary, "w") as f:
        f.write(text)
    os.replace(temporary, path)
