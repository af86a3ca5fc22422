"""Reading kimi_cg's debug dumps in tests, through the dump's own index (as a user would)."""

from __future__ import annotations

from pathlib import Path

import torch

from kimi_cg.debug.dump import read_index
from kimi_cg.errors import UnsupportedGraphError


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


def inject_call_error(item_row: list[int]) -> None:
    """Like inject_call_limit, but a plain RuntimeError (as a bug inside kimi_cg would raise) from
    fail_inside_the_lifted_program below."""
    from kimi_cg.runtime.runner import LiftedRunner

    run_lifted = LiftedRunner._run_lifted

    def failing(self, args, record=None):
        if any(isinstance(a, torch.Tensor) and a.dim() == 2 and not a.is_floating_point() and item_row in a.tolist()
               for a in args):
            fail_inside_the_lifted_program()
        return run_lifted(self, args, record)

    LiftedRunner._run_lifted = failing


def fail_inside_the_lifted_program():
    raise RuntimeError("an injected internal error")


def inject_call_limit(item_row: list[int]) -> None:
    """Make kimi_cg's lifted programs raise a call-time limit ("injected limit") for any call whose grid
    holds ``item_row`` (other calls run as usual): a stand-in for a kimi_cg limit found at call time.
    Also used by the test that runs a dump's call_repro.py under the same condition."""
    from kimi_cg.runtime.runner import LiftedRunner

    run_lifted = LiftedRunner._run_lifted

    def failing(self, args, record=None):
        if any(isinstance(a, torch.Tensor) and a.dim() == 2 and not a.is_floating_point() and item_row in a.tolist()
               for a in args):
            raise UnsupportedGraphError("an injected call-time limit", reason="injected limit", where="dumps.py:1")
        return run_lifted(self, args, record)

    LiftedRunner._run_lifted = failing
