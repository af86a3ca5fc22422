"""Merge several scripts/bench.py JSONs into one report (docs/bench/latest.json).

    python scripts/merge_bench.py OUT LABEL=PATH [LABEL=PATH ...] [--note TEXT]

Earlier inputs win: an entry (workload, system) is taken from the first input that has it. Each
entry keeps where it came from ("source": LABEL) and, for same-process ratios, the mean of the
eager tower measured in that same process ("eager_same_process_mean_ms"): runs in different
processes (or beside other work) see different eager times, so speed-ups are only ever computed
against the eager of the same process.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> None:
    out, *rest = argv
    note = None
    if "--note" in rest:
        index = rest.index("--note")
        note = rest[index + 1]
        rest = rest[:index] + rest[index + 2:]
    merged: dict = {"machine": None, "torch": None, "date": None, "command": [], "runs": {}, "results": {}}
    if note:
        merged["note"] = note
    for item in rest:
        label, path = item.split("=", 1)
        report = json.load(open(path))
        for key in ("machine", "torch", "date"):
            merged[key] = merged[key] or report[key]
        merged["command"].append(report["command"])
        # the file relative to the merged report (plot_bench.py reads the W4 times from it)
        merged["runs"][label] = {"file": os.path.relpath(path, os.path.dirname(os.path.abspath(out))), "command": report["command"]}
        for workload, systems in report["results"].items():
            eager = systems.get("eager", {}).get("mean_ms")
            for system, entry in systems.items():
                if system in merged["results"].get(workload, {}):
                    continue
                entry = dict(entry, source=label)
                if eager is not None:
                    entry["eager_same_process_mean_ms"] = eager
                merged["results"].setdefault(workload, {})[system] = entry
    merged["command"] = " ; ".join(merged["command"])
    with open(out, "w") as f:
        json.dump(merged, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
