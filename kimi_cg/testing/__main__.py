"""``python -m kimi_cg.testing MODULE:FACTORY``: fuzz a tower's compile against eager and print a summary.

MODULE is an importable module (``kimi_cg.testing.targets``) or a file path (``scripts/fuzz_tower.py``);
FACTORY returns a ``kimi_cg.testing.Target`` (or ``(model, make_inputs)``). Exit status: 0 when every
example matched, 1 on a mismatch (the shrunk grid and a reproduction are printed), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kimi_cg.testing", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="MODULE:FACTORY, e.g. kimi_cg.testing.targets:moonvit")
    parser.add_argument("--examples", type=int, default=50, help="grid batches hypothesis draws (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis and input seed (default 0)")
    parser.add_argument("--device", help="passed to the factory as device=")
    parser.add_argument("--dtype", help="passed to the factory as dtype= (float32, bfloat16, float16)")
    parser.add_argument("--options", type=json.loads, help="kimi_cg options as JSON, over the target's")
    parser.add_argument("--no-shrink", action="store_true", help="report the first failing grid unshrunk")
    parser.add_argument("--poison-graph-pool", action="store_true", help="fill the CUDA-graph pool with NaN first")
    parser.add_argument("--strict-counters", action="store_true",
                        help="also fail on graph breaks and fallbacks within the buckets")
    args = parser.parse_args(argv)

    import torch

    from kimi_cg.testing import MismatchError, Target, assert_matches_eager

    try:
        factory = _load(args.target)
        keywords = {name: value for name, value in (("device", args.device), ("dtype", args.dtype)) if value}
        unknown = [name for name in keywords if name not in inspect.signature(factory).parameters]
        if unknown:
            raise ValueError(f"{args.target} takes no {', '.join(unknown)} argument")
        target = Target.of(factory(**keywords))
    except (ValueError, TypeError, ImportError, AttributeError, FileNotFoundError) as error:
        print(f"python -m kimi_cg.testing: {error}", file=sys.stderr)
        return 2
    options = {**(target.options or {}), **(args.options or {})}
    try:
        report = assert_matches_eager(
            target.model, None, target.make_inputs, target.grids, max_examples=args.examples, seed=args.seed,
            shrink=not args.no_shrink, outputs=target.outputs, options=options or None,
            poison_graph_pool=args.poison_graph_pool and torch.cuda.is_available(),
            no_fallbacks=args.strict_counters, no_graph_breaks=args.strict_counters)
    except MismatchError as failure:
        print(failure, file=sys.stderr)
        print(f"kimi_cg.testing: FAILED ({args.target}, seed {args.seed})", file=sys.stderr)
        return 1
    print(f"{args.target}: {report.summary()}")
    return 0


def _load(spec: str):
    module_name, _, factory_name = spec.partition(":")
    if not module_name or not factory_name:
        raise ValueError(f"expected MODULE:FACTORY, got {spec!r}")
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name)
        if not path.is_file():
            raise FileNotFoundError(f"no file {module_name}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    factory = getattr(module, factory_name)
    if not callable(factory):
        raise TypeError(f"{spec} is not callable")
    return factory


if __name__ == "__main__":
    sys.exit(main())
