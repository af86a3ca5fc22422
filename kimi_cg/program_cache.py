"""Inductor-compiled device programs kept on disk: a new process loads what an earlier one compiled.

NOTE [program cache]
Inductor's compile of a device program is the largest single part of a cold warm-up (~34 s for the
27-layer Kimi-VL program on an H200 host), and every process pays it again: each serving restart,
each data-parallel rank. So each Inductor compile of a device program is stored on disk, and a process
that builds the same program later loads it instead (3 s for that program on the H200). Where:
``KIMI_CG_PROGRAM_CACHE=<directory>``; unset or empty, ``kimi_cg_programs`` under Inductor's own cache
directory (``TORCHINDUCTOR_CACHE_DIR``, by default ``/tmp/torchinductor_<user>``), the place whose
entries torch already loads by default; ``KIMI_CG_PROGRAM_CACHE=0`` turns it off.

An entry is two files: the compiled program as ``torch._inductor.standalone_compile`` saves it (its
AOT-autograd and Inductor cache entries, with their kernels), and what that compile assumed about its
input sizes (``ShapeAssumptions``: guards and symbol replacements over (input, dim) positions, NOTE
[hints of a symbolic run] in device_program.py) as sympy ``srepr`` text, written only when it reads
back identical. A call takes an entry only where those assumptions hold at its sizes, as it would take
a compile of its own process; otherwise it compiles and adds an entry.

The key is everything that must be equal for a stored program to be this call's: the program's
structure with every constant by content, each input's dtype, device (with its index), rank, fixed
sizes and stride order, kimi_cg's own source, the torch, Triton and Python versions, the accelerator (name and
compute capability) and Inductor's and AOT autograd's configuration. An entry that does not load (a
torch build of another source, a truncated file) is counted (``program_cache_errors``) and passed
over: the program compiles, as without the cache.

Inductor's own FX-graph and AOT-autograd caches stay off for device programs (NOTE in
``device_program.compile_with_inductor``: their lookup evaluates guards that name tensors it cannot
bind). A compile or load for this cache runs with Inductor's cache directory pointed at a private,
empty one under the entry directory, so no lookup finds an old entry and nothing is written into
the user's Inductor cache; Triton's kernel cache stays where it was.

Trust: loading an entry runs code from the directory (Inductor's generated modules and pickles), as
Inductor's own cache directory does: use a directory that only you can write.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading

import sympy

import torch

from kimi_cg.counters import counters

logger = logging.getLogger(__name__)

ENVIRONMENT_VARIABLE = "KIMI_CG_PROGRAM_CACHE"
OFF_VALUES = ("0", "off", "false", "no")  # values of ENVIRONMENT_VARIABLE that turn the cache off
FORMAT = 1
_LOCK = threading.Lock()  # the Inductor cache directory is process-wide: one compile or load at a time


def directory() -> str | None:
    """The cache directory, or None when the cache is off: ``KIMI_CG_PROGRAM_CACHE`` names it; unset
    or empty, ``kimi_cg_programs`` under Inductor's cache directory (where Inductor keeps its own
    compiles); one of OFF_VALUES turns it off. Off as well under Inductor's ``freezing``, which may fold
    the weights (inputs of a device program, not part of the key) into the compiled code."""
    value = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    if value.lower() in OFF_VALUES:
        return None
    import torch._inductor.config as inductor_config

    if getattr(inductor_config, "freezing", False):
        return None
    if not value:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        value = os.path.join(cache_dir(), "kimi_cg_programs")
    return value


def entry_key(structure: str, inputs, host_inputs: frozenset[int]) -> str:
    """The key of a device program's entries: ``structure`` (its structural hash with every constant
    by content) and what else decides Inductor's output (see NOTE [program cache])."""
    parts = [f"format {FORMAT}", f"structure {structure}", f"host inputs {sorted(host_inputs)}"]
    for position, value in enumerate(inputs):
        parts.append(f"input {position} {_describe_input(value)}")
    parts.extend(_environment())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _describe_input(value) -> str:
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    order = sorted(range(value.dim()), key=lambda d: (-value.stride(d), d))
    # The device with its index: Inductor's code names the device it was compiled for (its guards, streams).
    text = f"{value.dtype} {value.device} rank {value.dim()} order {order} contiguous {value.is_contiguous()}"
    if isinstance(value, torch.nn.Parameter) or value.dim() == 0:  # module state: fixed sizes (see _symbolic_fakes)
        text += f" sizes {tuple(value.shape)} strides {value.stride()}"
    return text


def _environment() -> list[str]:
    parts = [f"kimi_cg source {_source_hash()}", f"torch {torch.__version__} {torch.version.git_version}",
             f"cuda {torch.version.cuda} hip {getattr(torch.version, 'hip', None)}",
             f"python {sys.version_info[:3]}", f"triton {_triton_version()}",
             f"float32 matmul precision {torch.get_float32_matmul_precision()}"]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            parts.append(f"device {index} {properties.name} {properties.major}.{properties.minor}")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    for name, config in (("inductor", inductor_config), ("functorch", functorch_config)):
        try:
            settings = config.save_config_portable()
        except Exception:  # noqa: BLE001 - a config that cannot be listed: keyed by nothing stable
            settings = {"unlisted": os.urandom(8).hex()}  # never equal: no entry is shared
        parts.append(f"{name} config {sorted((key, repr(value)) for key, value in settings.items())}")
    return parts


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """Hash of kimi_cg's Python source (the package and its kernels): any change is another key."""
    import importlib.util

    roots = []
    for name in ("kimi_cg", "kimi_cg.kernels"):
        spec = importlib.util.find_spec(name)
        if spec is not None:
            roots.extend(spec.submodule_search_locations or [])
    digest = hashlib.sha256()
    for root in sorted(set(roots)):
        for folder, subfolders, files in sorted(os.walk(root)):
            subfolders.sort()
            for file in sorted(files):
                if file.endswith(".py"):
                    path = os.path.join(folder, file)
                    digest.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as handle:
                        digest.update(handle.read())
    return digest.hexdigest()[:32]


@contextlib.contextmanager
def private_inductor_cache(root: str, device_index: int):
    """Inductor's cache directory moved to a new empty one under ``root`` for the block (see NOTE
    [program cache]); Triton's kernel cache stays where it was. The directory holds the modules
    Inductor generated or loaded (read for debug dumps): removed when the process exits."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir

    with _LOCK:
        triton_directory = triton_cache_dir(device_index)  # before the move: where it is now
        cache_dir()  # sets TORCHINDUCTOR_CACHE_DIR if it was unset, so that restoring it restores that place
        saved = {name: os.environ.get(name) for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
        os.makedirs(root, exist_ok=True)
        private = tempfile.mkdtemp(prefix="inductor-", dir=root)
        atexit.register(shutil.rmtree, private, True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = private
        os.environ["TRITON_CACHE_DIR"] = triton_directory
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def find(root: str, key: str, accepts):
    """The first stored (assumptions, compiled) for ``key`` whose assumptions ``accepts``; None when
    there is none (or none loads)."""
    from kimi_cg.device_program import ShapeAssumptions

    folder = os.path.join(root, key)
    if not os.path.isdir(folder):
        return None
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(folder, name)
        try:
            with open(path) as handle:
                record = json.load(handle)
            if record.get("format") != FORMAT or record.get("key") != key:
                continue
            assumptions = ShapeAssumptions.from_record(record["assumptions"])
        except Exception as error:  # noqa: BLE001 - an unreadable entry is passed over
            counters["program_cache_errors"] += 1
            logger.warning("kimi_cg: program cache entry %s is unreadable (%s); passed over", path, error)
            continue
        if not accepts(assumptions):
            continue
        artifact = path[: -len(".json")] + ".bin"
        try:
            compiled = _load(root, artifact, record.get("device_index", 0))
        except Exception as error:  # noqa: BLE001 - e.g. another torch build's entry: compile instead
            counters["program_cache_errors"] += 1
            logger.warning("kimi_cg: program cache entry %s did not load (%s: %s); compiling",
                           artifact, type(error).__name__, error)
            continue
        counters["program_cache_hits"] += 1
        return assumptions, compiled
    return None


def _load(root: str, path: str, device_index: int):
    from torch._inductor import CompiledArtifact

    with private_inductor_cache(root, device_index):
        return CompiledArtifact.load(path=path, format="binary")


def store(root: str, key: str, assumptions, artifact, device_index: int) -> bool:
    """Write one entry; False (counted) when the compile is not storable or the assumptions would not
    read back identical."""
    try:
        record = {"format": FORMAT, "key": key, "device_index": device_index, "assumptions": assumptions.to_record()}
        from kimi_cg.device_program import ShapeAssumptions

        if ShapeAssumptions.from_record(record["assumptions"]).to_record() != record["assumptions"]:
            raise ValueError("the compile's size assumptions do not read back identical")
        folder = os.path.join(root, key)
        os.makedirs(folder, exist_ok=True)
        stem = os.path.join(folder, f"{os.getpid()}-{threading.get_ident()}-{os.urandom(4).hex()}")
        artifact.save(path=stem + ".bin", format="binary")
        text = json.dumps(record, indent=1)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as handle:
            handle.write(text)
        os.replace(handle.name, stem + ".json")  # the record last: an entry is complete once it shows
    except Exception as error:  # noqa: BLE001 - the compile still serves this process
        counters["program_cache_errors"] += 1
        logger.warning("kimi_cg: device program not stored in the program cache (%s: %s)", type(error).__name__, error)
        return False
    counters["program_cache_stores"] += 1
    return True


def expression_to_text(expression) -> str:
    return sympy.srepr(expression)


def expression_from_text(text: str):
    """The sympy expression ``srepr`` wrote: sympy's names, with torch's size functions (FloorDiv,
    Mod, ...) over them."""
    return eval(text, _namespace())  # noqa: S307 - text written by expression_to_text (see Trust above)


@functools.lru_cache(maxsize=1)
def _namespace() -> dict:
    import torch.utils._sympy.functions as size_functions

    namespace = {"__builtins__": {}}
    namespace.update({name: getattr(sympy, name) for name in dir(sympy) if not name.startswith("_")})
    namespace.update({name: value for name, value in vars(size_functions).items()
                      if isinstance(value, type) and issubclass(value, sympy.Basic)})
    return namespace
