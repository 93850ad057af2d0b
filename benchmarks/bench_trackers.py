"""What a tracker costs the training loop: ``Tracking.log`` with MLflow written in ``log()`` (as
before issue 46) against MLflow written from its own thread and queue (now), and the queued side
while the MLflow server is frozen.

Each side is a ``Tracking([JsonlSink, MLflowSink])`` logging the same steps of 100 metrics:

- local: MLflow's SQLite store in the run folder (``make_sinks``' default);
- server: a real ``mlflow server`` on loopback (its own SQLite store), as teams run it;
- frozen (full mode): the same server stopped with SIGSTOP while the queued side logs, let go
  before ``close()``.

Timed: N rounds (N = 300; ``--quick``: 30, no server) that log one step to each side in turn: the
median ms per ``log()`` of each side and the median over the rounds of the in-log / queued ratio of
neighbouring calls. Before reporting, every side's MLflow run is read back: every step, once.

Run: ``PYTHONPATH=src python benchmarks/bench_trackers.py [--quick] [--markdown PATH]``.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import report

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's root: the tests' server helper
from rlmetrics.sinks import JsonlSink, MLflowSink, Tracking  # noqa: E402
from tests.trackers import mlflow_server  # noqa: E402

NAMES = 100


class InLog(MLflowSink):
    """MLflow written in ``log()``, as every tracker was before issue 46."""

    background = False


def tracking(kind: type[MLflowSink], uri: str, folder: Path) -> Tracking:
    folder.mkdir(parents=True)
    return Tracking([JsonlSink(folder / "metrics.jsonl"), kind(uri, "bench")], health=None)


def logger(track: Tracking, start: int = 0):
    step = iter(range(start, 10**9))

    def log_next() -> None:
        s = next(step)
        track.log({f"actor/m{i}": s + i / NAMES for i in range(NAMES)}, s)

    return log_next


def steps_held(track: Tracking, uri: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    run_id = track.sinks[1].run_id
    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, "actor/m0"))


def measure(case: str, uri: str, folder: Path, n: int, freeze: int | None = None) -> list[object]:
    """One row: ``case``'s in-log and queued sides over ``n`` rounds (the server's process group
    ``freeze`` stopped while the queued side logs alone, after the rounds)."""
    sides = [tracking(InLog, uri, folder / "inlog"), tracking(MLflowSink, uri, folder / "queued")]
    inlog, queued = report.interleaved([logger(t) for t in sides], n)
    frozen_ms = None
    if freeze is not None:
        log_queued = logger(sides[1], start=n + 1)  # the steps after the rounds' (warm-up included)
        os.killpg(freeze, signal.SIGSTOP)
        try:
            frozen, _ = report.timed(log_queued, n)
        finally:
            os.killpg(freeze, signal.SIGCONT)
        frozen_ms = statistics.median(frozen) * 1e3
    for side in sides:
        side.close()
    held = [steps_held(side, uri) for side in sides]
    assert held[0] == list(range(n + 1)), f"{case}: the in-log side's MLflow run lacks steps"
    want = list(range(len(held[1])))
    assert held[1] == want and len(want) >= n + 1, f"{case}: the queued side's MLflow run lacks steps"
    ratios = [a / b for a, b in zip(inlog, queued)]
    med = statistics.median
    cells = [case, f"{med(inlog) * 1e3:.3f}", f"{med(queued) * 1e3:.3f}", f"{med(ratios):.1f}x"]
    return cells + ["—" if frozen_ms is None else f"{frozen_ms:.3f}"]


COLUMNS = (
    "MLflow store",
    "in log() ms/step (before)",
    "queued ms/step (now)",
    "in-log / queued (median of rounds)",
    "queued, server frozen ms/step",
)


def main(argv: list[str] | None = None) -> list[list[object]]:
    args = report.parse_args(__doc__, "30 steps, no MLflow server", argv)
    start = time.perf_counter()
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    n = 30 if args.quick else 300
    head = report.header("trackers")
    print(head, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        rows.append(measure("local sqlite", f"sqlite:///{out / 'mlflow.db'}", out / "local", n))
        if not args.quick:
            proc, uri = mlflow_server(out)
            try:
                rows.append(measure("mlflow server (loopback)", uri, out / "server", n, freeze=proc.pid))
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
    notes = [
        f"{n} steps of {NAMES} metrics per side, one step to each side in turn per round (after a warm-up "
        "step), the garbage collector paused; every side's MLflow run read back: every step once",
        "frozen: the server's processes stopped (SIGSTOP) while the queued side logs another "
        f"{n} steps alone, let go before close()",
        "queued ms/step is the caller's time in log(); the tracker's thread does MLflow's work beside it "
        "(it shares the GIL: Python code of the training loop running then waits for it at times)",
        f"total runtime: {time.perf_counter() - start:.1f} s",
    ]
    report.emit(head, report.table(COLUMNS, rows), notes, args.markdown)
    return rows


if __name__ == "__main__":
    main()
