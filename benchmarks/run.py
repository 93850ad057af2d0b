"""Run the benchmark suite of this checkout, or some of it, and print its tables.

Each benchmarks/bench_*.py runs in its own process and prints a table with ratios against a
baseline measured in the same run (see docs/benchmarks.md). bench_peers and bench_verl need siiRL
0.2.0 and verl 0.9.1 (make bench-peers installs them). The benchmarks ship with the source
checkout, not with the package (so this is no `rlmetrics` command).

    python benchmarks/run.py --quick
    python benchmarks/run.py merge data
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def scripts(only: list[str]) -> list[Path]:
    """The benchmark scripts, all or those named (``merge`` or ``bench_merge``)."""
    by_name = {p.stem.removeprefix("bench_"): p for p in sorted(HERE.glob("bench_*.py"))}
    unknown = [n for n in only if n.removeprefix("bench_") not in by_name]
    if unknown:
        raise SystemExit(f"benchmarks/run.py: unknown benchmark(s) {unknown}; choose from {sorted(by_name)}")
    return [by_name[n.removeprefix("bench_")] for n in only] if only else list(by_name.values())


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all), e.g. merge ray data")
    parser.add_argument("--quick", action="store_true", help="small sizes: a check that each one runs")
    args = parser.parse_args()
    failed = []
    for script in scripts(args.names):
        print(f"## {script.stem}", flush=True)
        cmd = [sys.executable, str(script), *(["--quick"] if args.quick else [])]
        if subprocess.run(cmd, cwd=script.parent.parent).returncode:
            failed.append(script.stem)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
