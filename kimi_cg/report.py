"""``python -m kimi_cg.report DIR``: a terminal summary of a kimi_cg debug dump.

DIR is a ``debug_dir`` (its latest run folder is read) or one run folder. Prints what was compiled
(graphs by compile id and frame), what was lifted, what fell back and why (file:line, the error
record), how calls ran (replays by bucket with padding, splits, plain program, captured graph, by
reason), how many tensor ops ran inside replayed graphs and outside, and the slowest calls.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys


def device_programs_per_frame(graphs: list[dict]) -> dict[str, set[str]]:
    """Each frame's (a piece's) distinct device programs that ran, from a dump's index entries (NOTE
    [programs that ran] in kimi_cg/device_program.py; an entry without the field counts)."""
    programs: dict[str, set[str]] = collections.defaultdict(set)
    for graph in graphs:
        if graph.get("device_program") and graph.get("device_program_ran", True):
            programs[graph["frame"]].add(graph["device_program"])
    return programs


def summarize(folder: str, slowest: int = 5) -> str:
    """The summary of one run folder (index.json and calls.jsonl), as text."""
    with open(os.path.join(folder, "index.json")) as f:
        graphs = json.load(f)["graphs"]
    calls = []
    calls_path = os.path.join(folder, "calls.jsonl")
    if os.path.exists(calls_path):
        with open(calls_path) as f:
            calls = [json.loads(line) for line in f if line.strip()]
    lines = [f"kimi_cg dump {folder}"]
    statuses = collections.Counter(graph["status"].split(" (")[0].split(":")[0] for graph in graphs)
    frames = collections.Counter(graph["frame"] for graph in graphs)
    lines.append(f"graphs: {len(graphs)} ({', '.join(f'{n} {s}' for s, n in statuses.most_common())}) "
                 f"in {len(frames)} frame(s); device programs: {len({g.get('device_program') for g in graphs} - {None})} "
                 f"built, {len(set().union(*device_programs_per_frame(graphs).values()))} ran")
    programs = device_programs_per_frame(graphs)
    for frame, count in frames.most_common():
        lines.append(f"  {count:4d} x {frame}: {len(programs[frame])} device program(s) ran")
    failed = [graph for graph in graphs if graph["status"].startswith("fell back")]
    if failed:
        lines.append("fell back (runs unlifted):")
        for graph in failed:
            record = os.path.join(folder, graph["folder"], "error.txt")
            lines.append(f"  [{graph['compile_id']}] {graph.get('reason')} at {graph.get('where')}\n      error record: {record}")
    broken = [graph for graph in graphs if graph.get("graph_break")]
    if broken:
        lines.append(f"graphs ending at a graph break: {len(broken)} (e.g. [{broken[0]['compile_id']}]: {broken[0]['graph_break']})")
    if calls:
        paths = collections.Counter(_describe_path(call) for call in calls)
        lines.append(f"calls: {len(calls)} recorded")
        for path, count in paths.most_common():
            lines.append(f"  {count:6d}  {path}")
        replays = [call for call in calls if call.get("path") == "replay"]
        if replays:
            padding = sum(call["padding"] for call in replays) / max(1, sum(call["bucket"] for call in replays))
            lines.append(f"  padding in replays: {100 * padding:.1f}% of bucket rows")
        lines.extend(_device_ops(graphs, calls))
        lines.append(f"slowest {min(slowest, len(calls))} calls (host wall clock, ms):")
        for call in sorted(calls, key=lambda call: -call.get("total_ms", 0))[:slowest]:
            rows = "" if call.get("rows") is None else f", {call['rows']} rows"
            lines.append(f"  {call.get('total_ms', 0):9.2f}  [{call.get('compile_id')}] {_describe_path(call)}{rows}")
    else:
        lines.append("calls: none recorded")
    return "\n".join(lines)


def _device_ops(graphs: list, calls: list) -> list[str]:
    """Tensor ops the recorded calls ran inside replayed CUDA graphs vs outside (unlifted graphs,
    plain device programs, captured graphs), from each graph's op counts in the index."""
    by_id = {graph["compile_id"]: graph for graph in graphs}
    inside, outside = 0, collections.Counter()
    for call in calls:
        graph = by_id.get(call.get("compile_id"), {})
        lifted_ops = graph.get("device_ops", graph.get("tensor_ops", 0))
        if call.get("path") in ("replay", "split"):
            inside += lifted_ops
        elif call.get("path") == "plain program":
            outside[call.get("compile_id")] += lifted_ops
        else:  # the graph as dynamo captured it
            outside[call.get("compile_id")] += graph.get("tensor_ops", 0)
    total = inside + sum(outside.values())
    if not total:
        return []
    lines = [f"  device ops: {inside} inside replayed graphs, {sum(outside.values())} outside "
             f"({100 * inside / total:.1f}% inside)"]
    if outside:
        worst = ", ".join(f"[{cid}] {n}" for cid, n in outside.most_common(3))
        lines.append(f"    outside, most by graph: {worst}")
    return lines


def _describe_path(call: dict) -> str:
    path = call.get("path", "?")
    if path == "replay" and call.get("exact"):
        return f"replay of the exact-size graph of {call.get('bucket')} rows"
    if path == "replay":
        return f"replay of bucket {call.get('bucket')}"
    if path == "split":
        return f"split into {len(call.get('parts', []))} parts"
    if call.get("reason"):
        return f"{path} ({call['reason']})"
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kimi_cg.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a debug_dir (its latest run) or a run_* folder")
    parser.add_argument("--slowest", type=int, default=5, help="how many of the slowest calls to list")
    args = parser.parse_args(argv)
    folder = args.folder
    if not os.path.exists(os.path.join(folder, "index.json")):
        runs = sorted(name for name in os.listdir(folder) if name.startswith("run_")) if os.path.isdir(folder) else []
        if not runs:
            print(f"python -m kimi_cg.report: no kimi_cg dump in {folder} (no index.json, no run_* folder)", file=sys.stderr)
            return 2
        folder = os.path.join(folder, runs[-1])
    print(summarize(folder, args.slowest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
