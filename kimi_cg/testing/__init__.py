"""kimi_cg.testing: prove ``compiled == eager`` for your own tower, on grids hypothesis draws.

    from kimi_cg.testing import assert_matches_eager, grids

    compiled = torch.compile(tower, backend="kimi_cg")
    assert_matches_eager(tower, compiled, make_inputs, grids=grids(max_items=8, max_side=64))

- ``grids(...)``: strategies of grid batches (strategies.py: uniform, realistic and adversarial items,
  video chunks, bucket edges, repeats).
- ``assert_matches_eager(...)``: the dtype rules of compare.py, structure, NaN, counter expectations;
  a failure is shrunk and names its grid, worst item and a one-line reproduction (check.py).
- A pytest fixture ``kimi_cg_fuzz`` (``pytest_plugins = ["kimi_cg.testing.pytest_plugin"]``) and a
  command line, ``python -m kimi_cg.testing MODULE:FACTORY`` (``__main__.py``; targets.py has ours).
Needs hypothesis (``pip install kimi_cg[test]``).
"""

try:
    import hypothesis  # noqa: F401 - a clear error before the submodules fail on it
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("kimi_cg.testing needs hypothesis: pip install 'kimi_cg[test]' (or pip install hypothesis)") from error

from kimi_cg.testing.check import EagerRejectedInput, FuzzReport, MismatchError, assert_matches_eager
from kimi_cg.testing.compare import Rule, rule_for
from kimi_cg.testing.strategies import grids, patches
from kimi_cg.testing.targets import Target

__all__ = ["assert_matches_eager", "grids", "patches", "FuzzReport", "MismatchError", "EagerRejectedInput",
           "Rule", "rule_for", "Target"]
