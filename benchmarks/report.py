"""What every benchmark shares: the command line, the header line, markdown tables, verdicts; and
putting their reports into docs/benchmarks.md.

Every ``bench_*.py`` (and ``soak.py``, ``chaos.py``) takes ``--markdown PATH`` and writes its report
there: the header line (date, machine, versions), the command that ran, the tables and the notes.
``python benchmarks/report.py docs/benchmarks.md PATH ...`` puts each report into the page between
``<!-- NAME -->`` and ``<!-- /NAME -->``, NAME the report's file stem (``bench_merge``), so the
page's tables are always a run's output, never typed by hand.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def timed(fn: Callable[[], Any], reps: int) -> tuple[list[float], Any]:
    """Seconds of ``reps`` calls of ``fn`` after one warm-up call, the garbage collector paused, and
    the last call's output."""
    out = fn()
    gc.collect()
    gc.disable()
    try:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return times, out


def interleaved(fns: Sequence[Callable[[], Any]], reps: int) -> list[list[float]]:
    """Seconds of ``reps`` rounds that call each of ``fns`` once in turn, after one warm-up call of
    each, the garbage collector paused: ``times[i][k]`` is ``fns[i]`` in round ``k``. Calls of one
    round are neighbours, so their ratio is robust to a machine whose load changes."""
    for fn in fns:
        fn()
    gc.collect()
    gc.disable()
    times: list[list[float]] = [[] for _ in fns]
    try:
        for _ in range(reps):
            for fn, out in zip(fns, times):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return times


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` so far, every thread: the scheduler's nanosecond run times
    (``/proc/<pid>/task/*/schedstat``) where Linux has them, else psutil's user + system time (in
    clock ticks, 10 ms)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        import psutil  # a core dependency of rlmetrics

        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    total = 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended
            pass
    return total / 1e9


def actor_pid(handle: Any) -> int:
    """The process id of the Ray actor ``handle``, any actor class (Ray's ``__ray_call__``)."""
    import ray

    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))


def parser(doc: str, quick_help: str) -> argparse.ArgumentParser:
    """``--quick`` (a smoke run) and ``--markdown PATH`` (also write the report there)."""
    out = argparse.ArgumentParser(description=doc.splitlines()[0])
    out.add_argument("--quick", action="store_true", help=quick_help)
    out.add_argument("--markdown", type=Path, help="also write the report to this file")
    return out


def parse_args(doc: str, quick_help: str, argv: Sequence[str] | None) -> argparse.Namespace:
    return parser(doc, quick_help).parse_args(argv)


def header(title: str, *versions: str) -> str:
    """``rlmetrics <title> benchmark — date, machine, CPUs, load average (1 min), Python, <versions>``."""
    return ", ".join(
        [
            f"rlmetrics {title} benchmark — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"{platform.processor() or 'unknown'}/{platform.machine()}",
            f"{os.cpu_count()} CPUs",
            f"load average {os.getloadavg()[0]:.1f}",
            f"Python {platform.python_version()}",
            *versions,
        ]
    )


def table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table, numbers right-aligned."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def ratio_target(what: str, ratio: float | None, target: float, digits: int = 1) -> str:
    """``target >= {target}x {what}: {ratio}x — MET`` (or "not measured in this run" for None)."""
    got = "not measured in this run" if ratio is None else f"{ratio:.{digits}f}x — {verdict(ratio >= target)}"
    return f"target >= {target:g}x {what}: {got}"


def command(argv: Sequence[str] | None = None) -> str:
    """The command that ran this benchmark, without ``--markdown PATH`` (where the report went)."""
    script, *args = sys.argv if argv is None else argv
    kept, i = [], 0
    while i < len(args):
        if args[i] == "--markdown":
            i += 2
            continue
        if not args[i].startswith("--markdown="):
            kept.append(args[i])
        i += 1
    return " ".join(["python", f"benchmarks/{Path(script).name}", *kept])


def emit(head: str, body: str, notes: Sequence[str], markdown: Path | None) -> None:
    """Print the report (and write it to ``markdown`` when given, with the command that ran)."""
    text = body + "\n\n" + "\n".join(notes)
    print("\n" + text)
    if markdown:
        markdown.write_text(f"{head}\n\n`{command()}`\n\n{text}\n", encoding="utf-8")


def splice(doc: str, name: str, report: str) -> str:
    """``doc`` with ``report`` between its ``<!-- name -->`` and ``<!-- /name -->`` lines (each a
    line of its own); ValueError when ``doc`` has no such block."""
    block = re.compile(rf"^<!-- {re.escape(name)} -->\n.*?^<!-- /{re.escape(name)} -->$", re.S | re.M)
    if not block.search(doc):
        raise ValueError(f"no <!-- {name} --> ... <!-- /{name} --> block")
    return block.sub(lambda _: f"<!-- {name} -->\n{report.rstrip()}\n<!-- /{name} -->", doc, count=1)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Put benchmark reports (--markdown files) into a docs page.")
    p.add_argument("doc", type=Path, help="the page, e.g. docs/benchmarks.md")
    p.add_argument("reports", type=Path, nargs="+", help="reports named by benchmark (bench_merge.md)")
    args = p.parse_args(argv)
    doc = args.doc.read_text(encoding="utf-8")
    for report in args.reports:
        doc = splice(doc, report.stem, report.read_text(encoding="utf-8"))
    args.doc.write_text(doc, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
