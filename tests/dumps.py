"""Reading kimi_cg's debug dumps in tests, through the dump's own index (as a user would)."""

from __future__ import annotations

from pathlib import Path

from kimi_cg.debug.dump import read_index


def last_lifted_graph(debug_dir) -> Path:
    """The folder of the last graph kimi_cg lifted in the latest run under ``debug_dir``."""
    return Path(_last_lifted(debug_dir)["path"])


def last_device_program(debug_dir) -> Path:
    """The device program file of the last graph kimi_cg lifted (device programs are shared, kept once)."""
    entry = _last_lifted(debug_dir)
    return Path(entry["path"]).parent / entry["device_programs_file"]


def _last_lifted(debug_dir) -> dict:
    lifted = [graph for graph in read_index(str(debug_dir)) if graph["status"] == "lifted"]
    assert lifted, f"no lifted graph in the index of {debug_dir}"
    return lifted[-1]
