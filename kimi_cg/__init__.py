"""kimi_cg: compile vision-transformer encoders of multimodal LLMs into grid-independent programs.

``torch.compile(model, backend="kimi_cg")`` finds the backend through the ``torch_dynamo_backends``
entry point; importing this package is not required. ``kimi_cg.counters``, ``kimi_cg.fallbacks``, ``kimi_cg.timings`` and ``kimi_cg.reset()``
are the public observability surface; ``kimi_cg.warm_up`` traces every item count before serving;
``kimi_cg.validate_options`` checks backend options before the first call; ``kimi_cg.memory_report()``
says what kimi_cg holds and ``kimi_cg.set_memory_budget`` bounds its host metadata per process;
``kimi_cg.data_parallel`` spreads each request's items over the ranks of a torch.distributed group;
``kimi_cg.register_varlen_attention`` declares a varlen attention op's upper-bound arguments. See README.md and docs/design.md.
"""

from kimi_cg.config import validate_options
from kimi_cg.counters import counters, reset, timings
from kimi_cg.distributed import DataParallelError, data_parallel
from kimi_cg.errors import InvalidInputError, KimiCGError, UnsupportedGraphError
from kimi_cg.fallback import fallbacks
from kimi_cg.runtime.memory import memory_report, set_memory_budget
from kimi_cg.varlen_registry import register_varlen_attention
from kimi_cg.warmup import warm_up

__version__ = "0.1.0"
__all__ = ["register_varlen_attention", "data_parallel", "DataParallelError", "counters", "fallbacks", "timings", "reset", "warm_up", "validate_options", "memory_report", "set_memory_budget", "InvalidInputError", "KimiCGError", "UnsupportedGraphError"]
