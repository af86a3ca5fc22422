"""kimi_cg: compile vision-transformer encoders of multimodal LLMs into grid-independent programs.

``torch.compile(model, backend="kimi_cg")`` finds the backend through the ``torch_dynamo_backends``
entry point; importing this package is not required. ``kimi_cg.counters`` and ``kimi_cg.reset()``
are the public observability surface. See README.md and docs/design.md.
"""

from kimi_cg.counters import counters, reset
from kimi_cg.errors import InvalidInputError, KimiCGError, UnsupportedGraphError

__version__ = "0.1.0"
__all__ = ["counters", "reset", "InvalidInputError", "KimiCGError", "UnsupportedGraphError"]
