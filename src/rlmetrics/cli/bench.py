"""rlmetrics bench: run the benchmark suite of a source checkout and print its tables.

Each benchmarks/bench_*.py runs in its own process and prints a table with ratios against a
baseline measured in the same run (see docs/benchmarks.md). bench_peers needs siiRL 0.2.0
(make bench-peers installs it).

    rlmetrics bench --quick
    rlmetrics bench merge data
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import rlmetrics


def bench_dir() -> Path:
    """``benchmarks/`` of the checkout this package runs from (an editable install)."""
    return Path(rlmetrics.__file__).resolve().parents[2] / "benchmarks"


def scripts(only: list[str]) -> list[Path]:
    """The benchmark scripts, all or those named (``merge`` or ``bench_merge``)."""
    found = sorted(bench_dir().glob("bench_*.py"))
    if not found:
        raise SystemExit(
            f"rlmetrics bench: no benchmarks at {bench_dir()}; they ship with the source "
            "checkout: git clone, then `make bench`"
        )
    by_name = {p.stem.removeprefix("bench_"): p for p in found}
    unknown = [n for n in only if n.removeprefix("bench_") not in by_name]
    if unknown:
        raise SystemExit(f"rlmetrics bench: unknown benchmark(s) {unknown}; choose from {sorted(by_name)}")
    return [by_name[n.removeprefix("bench_")] for n in only] if only else found


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run the benchmark suite and print its tables", description=__doc__)
    p.add_argument("names", nargs="*", help="benchmarks to run (default: all), e.g. merge ray data")
    p.add_argument("--quick", action="store_true", help="small sizes: a check that each one runs")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    failed = []
    for script in scripts(args.names):
        print(f"## {script.stem}", flush=True)
        cmd = [sys.executable, str(script), *(["--quick"] if args.quick else [])]
        if subprocess.run(cmd, cwd=script.parent.parent).returncode:
            failed.append(script.stem)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
