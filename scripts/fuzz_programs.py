"""Differential program fuzzing of kimi_cg against eager, for as long as you like.

Generates tower-like programs (tests/program_fuzz.py), runs each in eager and through
``torch.compile(..., backend="kimi_cg")`` on two or three grids, and checks that kimi_cg returns
eager's numbers (relative 1e-5, NaN never passes) or, where eager raises, raises an instance of
eager's exception class. Prints a summary by failure kind, minimises one failure per distinct
signature to a smaller program and grid, and writes every failing case to a folder:

    OUT/0007-wrong-output/tower.py      the program (its first line: the input needs)
    OUT/0007-wrong-output/case.json     grids, dynamic, weight update, seeds, the failure
    OUT/0007-wrong-output/report.txt    the message and kimi_cg's traceback
    OUT/minimised/0007-wrong-output/    the same for the minimised case

Examples:
    python scripts/fuzz_programs.py --time-budget 300                 # 5 minutes, 2 processes
    python scripts/fuzz_programs.py --count 200 --seed 3 --out /tmp/fuzz
    python scripts/fuzz_programs.py --rerun /tmp/fuzz/minimised/0007-wrong-output
    python scripts/fuzz_programs.py --minimise /tmp/fuzz/0007-wrong-output --minimise-budget 200
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import program_fuzz as fuzz  # noqa: E402


def _slug(kind: str) -> str:
    return re.sub(r"[^a-z]+", "-", kind.lower()).strip("-")[:40]


def _statement_kinds(failure: fuzz.Failure) -> tuple:
    spec = failure.case.spec
    return () if spec is None else tuple(sorted({statement.kind for statement in spec.statements})) + (spec.returns.kind,)


def _rerun(folder: str, directory: str, internal_errors: bool) -> int:
    import logging

    logging.disable(logging.WARNING)
    case = fuzz.load_case(folder)
    failure = fuzz.run_case(case, directory, internal_errors)
    if failure is None:
        print(f"{folder}: passes (kimi_cg matches eager on every grid)")
        return 0
    print(failure.message())
    if failure.compiled_traceback:
        print(failure.compiled_traceback)
    return 1


def _minimise_saved(folder: str, directory: str, budget: int, internal_errors: bool) -> int:
    import logging

    logging.disable(logging.WARNING)
    failure = fuzz.run_case(fuzz.load_case(folder), directory, internal_errors)
    if failure is None:
        print(f"{folder}: passes; nothing to minimise")
        return 0
    small = fuzz.minimise(failure, directory, budget=budget, log=print, internal_errors=internal_errors)
    target = folder.rstrip("/") + "-minimised"
    fuzz.save_failure(small, target)
    print(f"\n=== {target}\n{small.message()}")
    return 1


def _print_coverage(report: fuzz.FuzzReport) -> None:
    coverage = report.coverage
    lifted = {key: value for key, value in coverage.items() if key.startswith("kimi_cg ")}
    print("what kimi_cg did: " + ", ".join(f"{key[8:]} {value}" for key, value in sorted(lifted.items())))
    fallbacks = {key[9:]: value for key, value in coverage.items() if key.startswith("fallback ")}
    if fallbacks:
        print(
            "kimi_cg fallbacks (graphs or calls run unlifted), by reason: "
            + ", ".join(f"{key} {value}" for key, value in sorted(fallbacks.items(), key=lambda item: -item[1]))
        )
    statements = {key[10:]: value for key, value in coverage.items() if key.startswith("statement ")}
    print("statements drawn: " + ", ".join(f"{key} {value}" for key, value in sorted(statements.items())))
    returns = {key[7:]: value for key, value in coverage.items() if key.startswith("return ")}
    print("returns drawn:    " + ", ".join(f"{key} {value}" for key, value in sorted(returns.items())))
    missing = [
        f"{kind}.{name}={choice}"
        for kind, options in fuzz.STATEMENT_OPTIONS.items()
        for name, choices in options.items()
        for choice in choices
        if coverage.get(f"option {kind}.{name}={choice}", 0) == 0
    ]
    if missing:
        print(f"options never drawn ({len(missing)}): " + ", ".join(missing[:20]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=10000, help="programs to run (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="the stream of programs: case i of seed s is always the same")
    parser.add_argument("--time-budget", type=float, default=None, help="stop starting new programs after this many seconds")
    parser.add_argument(
        "--workers", type=int, default=min(2, os.cpu_count() or 1), help="processes (default: 2, or 1 on one core)"
    )
    parser.add_argument("--max-statements", type=int, default=4, help="statements per program, at most (default 4)")
    parser.add_argument("--out", default=None, help="folder for failing cases (default: a new folder under the system temp dir)")
    parser.add_argument(
        "--minimise-budget",
        type=int,
        default=80,
        help="case runs spent minimising each distinct failure signature (0: no minimising)",
    )
    parser.add_argument("--minimise-time", type=float, default=600, help="seconds spent minimising in all, at most")
    parser.add_argument(
        "--minimise-each",
        type=int,
        default=2,
        help="failures minimised per signature, each with another set of statements (default 2)",
    )
    parser.add_argument("--rerun", metavar="FOLDER", help="run one saved case (a folder with tower.py and case.json) and exit")
    parser.add_argument("--minimise", metavar="FOLDER", help="minimise one saved case into FOLDER-minimised and exit")
    parser.add_argument(
        "--internal-errors",
        action="store_true",
        help="also fail programs that pass only because kimi_cg fell back after an error in its own code",
    )
    parser.add_argument("--verbose", action="store_true", help="a line per failure and every 25 programs")
    args = parser.parse_args(argv)

    directory = tempfile.mkdtemp(prefix="kimi_cg_fuzz_programs_")
    try:
        if args.rerun:
            return _rerun(args.rerun, directory, args.internal_errors)
        if args.minimise:
            return _minimise_saved(args.minimise, directory, args.minimise_budget, args.internal_errors)
        print(
            f"fuzzing up to {args.count} programs (seed {args.seed}, {args.workers} processes"
            + (f", {args.time_budget:.0f} s budget" if args.time_budget else "")
            + ")",
            flush=True,
        )
        report = fuzz.fuzz_in_processes(
            args.count,
            args.seed,
            directory,
            args.workers,
            args.time_budget,
            args.max_statements,
            verbose=args.verbose,
            internal_errors=args.internal_errors,
        )
        seconds = sorted(report.case_seconds) or [0.0]
        print(
            f"\n{report.cases} programs in {report.seconds:.0f} s wall; per program: mean {sum(seconds) / len(seconds):.2f} s, "
            f"median {seconds[len(seconds) // 2]:.2f} s, p90 {seconds[int(len(seconds) * 0.9)]:.2f} s, max {seconds[-1]:.2f} s"
        )
        passed = report.cases - len(report.failures)
        print(f"passed {passed}, failed {len(report.failures)}")
        for kind in fuzz.FAILURE_KINDS:
            count = sum(1 for failure in report.failures if failure.kind == kind)
            if count:
                print(f"  {count:5d}  {kind}")
        _print_coverage(report)
        if not report.failures:
            return 0

        args.out = args.out or tempfile.mkdtemp(prefix="kimi_cg_fuzz_failures_")
        os.makedirs(args.out, exist_ok=True)
        for index, failure in enumerate(report.failures):
            fuzz.save_failure(failure, os.path.join(args.out, f"{index:04d}-{_slug(failure.kind)}"))
        print(f"\nfailing cases written to {args.out}/ (re-run one: --rerun {args.out}/0000-...)")

        groups: dict[tuple, list[tuple[int, fuzz.Failure]]] = {}
        for index, failure in enumerate(report.failures):
            groups.setdefault(failure.signature(), []).append((index, failure))
        print(f"\n{len(groups)} distinct signatures (kind, kimi_cg's exception with numbers blanked):")
        for (kind, error), members in sorted(groups.items(), key=lambda item: -len(item[1])):
            print(f"  {len(members):5d}  {kind}{': ' + error if error else ''}")

        if args.minimise_budget > 0:
            import logging

            logging.disable(logging.WARNING)
            print(f"\nminimising up to {args.minimise_each} failures per signature:", flush=True)
            deadline = time.perf_counter() + args.minimise_time
            seen: set[str] = set()
            # Per signature, up to --minimise-each failures with distinct sets of statement kinds;
            # round robin over signatures (most frequent first), so that time runs out on repeats.
            picks = []
            for _, members in sorted(groups.items(), key=lambda item: -len(item[1])):
                chosen, kinds = [], set()
                for index, failure in sorted(members, key=lambda member: len(member[1].case.source)):
                    if len(chosen) < args.minimise_each and _statement_kinds(failure) not in kinds:
                        kinds.add(_statement_kinds(failure))
                        chosen.append((index, failure))
                picks.append(chosen)
            for round_index in range(args.minimise_each):
                for chosen in picks:
                    if round_index >= len(chosen) or time.perf_counter() > deadline:
                        continue
                    index, failure = chosen[round_index]
                    small = fuzz.minimise(failure, directory, budget=args.minimise_budget, internal_errors=args.internal_errors)
                    if small.case.source in seen:
                        continue
                    seen.add(small.case.source)
                    folder = os.path.join(args.out, "minimised", f"{index:04d}-{_slug(small.kind)}")
                    fuzz.save_failure(small, folder)
                    print(f"\n=== {folder}\n{small.message()}", flush=True)
            if time.perf_counter() > deadline:
                print("  (minimising time spent; the other failures are left as found)")
        return 1
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
