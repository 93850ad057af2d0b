"""rlmetrics against the real peer, siiRL 0.2.0 (``pip install --no-deps siirl==0.2.0``), in one run.

Three tables, each side measured right after the other on the same inputs, results asserted equal:

1. **Ray step** (the harness of ``bench_ray.py``: 4 rank-host processes simulating W ranks, a
   thread per rank, each rank submitting one dict of M scalar floats per step; not in ``--quick``,
   whose start-ups of siiRL's actor and of a host importing siiRL cost half a minute, while
   ``bench_ray.py --quick`` runs the same harness). Baseline: siiRL's own
   ``MetricWorker`` actor (``siirl.execution.metric_worker.metric_worker``), started with
   ``worker.start``, one siiRL ``MetricClient`` per simulated rank calling ``submit_metric(d, W)``
   then ``wait_submit()``; once every host has returned, the driver calls
   ``MetricClient.wait_final_res()``. rlmetrics in the same seed mode (``wait_submit()`` returns once
   the aggregator holds the step; the driver reads with ``wait_final_res()``), and beside it with
   ``blocking=False`` clients whose rank 0 waits for ``result(step)``. Timed per step: from telling
   the hosts to go until the result is in.
2. **compute_data_metric** on ``bench_data.make_batch`` as one ``TensorDict``, both sides on the same
   object; ``__num_turns__`` is float32 here because siiRL raises on integer turns. rlmetrics runs
   eagerly and with ``torch_compile=True`` (compiled by one call before any timing, reported apart).
   Best of 3 medians of N calls, the sides alternating; at torch's default thread count (the targets)
   and one thread, for a large batch (B=256, prompt 1024, response 2048: target 2x) and a small one
   (B=64, prompt 256, response 512: target 1x, where fixed costs weigh; the only one in ``--quick``),
   then once more at the end of the run after telling glibc to keep freed memory (``mallopt``): siiRL
   allocates fresh temporaries in every call, whose page faults come and go with the allocator's
   state (rlmetrics reuses scratch memory), and that row shows siiRL without them.
   The device→host synchronisations of one call are counted for both sides too, on an accelerator
   emulated on the CPU (``tests/syncs.py``: scalar reads, blocking copies, data-dependent shapes;
   what a GPU would wait for), with the batch as device tensors.
3. **process_validation_metrics** on ``bench_validation.make_batch`` (P prompts x 16). rlmetrics:
   median of N calls on the full batch. siiRL (a Python bootstrap loop, about a quarter second per
   prompt): one call on the first ``m`` prompts, scaled by P/m (prompts are independent, so its cost
   is linear in P); ``m`` is in the table (``--siirl-prompts`` changes it).

Run: ``python benchmarks/bench_peers.py [--quick] [--markdown PATH] [--siirl-prompts M]`` (needs the
``ray`` and ``torch`` extras and siiRL 0.2.0 with pandas, scipy, loguru, psutil, packaging).
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from types import ModuleType
from typing import Any

import bench_data
import bench_ray
import bench_validation
import numpy as np
import ray
import report
import torch
from tensordict import TensorDict

import rlmetrics
from rlmetrics.metrics.data import compute_data_metric
from rlmetrics.metrics.validation import process_validation_metrics

SIIRL_VERSION = version("siirl")
# importing siirl creates $SIIRL_LOG_DIRECTORY (default ./siirl_logs) and a log file in it: keep it out of
# the checkout, in the driver and in every Ray worker
SIIRL_LOG_DIRECTORY = str(Path(tempfile.gettempdir()) / "rlmetrics-bench-siirl-logs")
RAY_CPUS = 8  # logical: 4 rank hosts (num_cpus=1 each) + siiRL's MetricWorker (num_cpus=1)
RAY_CELLS = [(w, m) for w in bench_ray.WORLD_SIZES for m in bench_ray.METRIC_COUNTS]
RAY_STEPS = 5
RAY_TARGET_CELL, RAY_TARGET = (256, 1000), 20.0

DATA_SHAPE = (256, 1024, 2048)
SMALL_DATA_SHAPE = QUICK_DATA_SHAPE = (64, 256, 512)
DATA_SHAPES = (DATA_SHAPE, SMALL_DATA_SHAPE)  # the full run's
DATA_REPS = {DATA_SHAPE: 15, SMALL_DATA_SHAPE: 100}
QUICK_DATA_REPS = 5
DATA_TARGETS = {DATA_SHAPE: 2.0, SMALL_DATA_SHAPE: 1.0}  # eager speed-up over siiRL, default threads

VAL_CELLS = ((128, 16), (512, 16))
QUICK_VAL_CELLS = ((32, 16),)
VAL_REPS, QUICK_VAL_REPS = 5, 3
SIIRL_PROMPTS, QUICK_SIIRL_PROMPTS = 128, 2
VAL_TARGET_CELL, VAL_TARGET = (512, 16), 100.0


def siirl_modules() -> tuple[ModuleType, ModuleType]:
    """siiRL's ``metric_worker`` and ``metric_utils`` modules, imported with its log directory set."""
    os.environ.setdefault("SIIRL_LOG_DIRECTORY", SIIRL_LOG_DIRECTORY)
    import siirl.execution.metric_worker.metric_worker as mw
    import siirl.utils.metrics.metric_utils as metric_utils

    return mw, metric_utils


# ------------------------------------------------------------------------------------ 1. Ray step
def _siirl_client(worker: Any) -> Any:
    """A siiRL ``MetricClient`` of ``worker``, made inside a ``bench_ray.RankHost``."""
    mw, _ = siirl_modules()
    return mw.MetricClient(worker)


def _start_siirl() -> tuple[Any, Any]:
    """siiRL's MetricWorker, started; its driver reads with ``MetricClient.wait_final_res``."""
    mw, _ = siirl_modules()
    peer = mw.MetricWorker.remote()
    ray.get(peer.start.remote())
    return peer, mw.MetricClient(peer).wait_final_res


SIIRL = bench_ray.Baseline("siiRL MetricWorker", _start_siirl, _siirl_client)


def measure_ray(world_size: int, m: int, steps: int) -> bench_ray.Row:
    return bench_ray.measure(world_size, m, steps, SIIRL, kinds=("seed", "posted"))


def render_ray(rows: list[bench_ray.Row]) -> str:
    return bench_ray.render(rows, SIIRL.name)


def target_ray(rows: list[bench_ray.Row]) -> str:
    return bench_ray.target(rows, RAY_TARGET_CELL, RAY_TARGET, "siiRL's MetricWorker")


# ------------------------------------------------------------------------- 2. compute_data_metric
@dataclass
class DataRow:
    shape: tuple[int, int, int]
    threads: int
    ours_s: float
    compiled_s: float  # rlmetrics with torch_compile=True (NaN: not measured, in --quick)
    siirl_s: float
    checked: int
    malloc: str = "default"

    @property
    def ratio(self) -> float:
        return self.siirl_s / self.ours_s

    @property
    def compiled_ratio(self) -> float:
        return self.siirl_s / self.compiled_s


def make_tensordict(b: int, p: int, r: int) -> TensorDict:
    """``bench_data.make_batch`` as a TensorDict, turns as float32 (siiRL's ``.mean()`` raises on ints)."""
    batch = bench_data.make_batch(b, p, r, seed=b + p + r)
    batch["__num_turns__"] = torch.as_tensor(batch["__num_turns__"]).float()
    return TensorDict(batch, batch_size=[b])


KEPT_MEMORY = "keeps freed memory"


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory in the process: no trimming, and blocks up to 32 MiB from the heap
    rather than fresh mappings, so that fresh temporaries reuse pages instead of page-faulting. For
    the rest of the process; False without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters
    return bool(libc.mallopt(m_trim_threshold, 2**30)) and bool(libc.mallopt(m_mmap_threshold, 32 * 2**20))


def compile_data_metric(shape: tuple[int, int, int]) -> float:
    """Seconds of the first ``compute_data_metric(..., torch_compile=True)`` call (it compiles)."""
    start = time.perf_counter()
    compute_data_metric(make_tensordict(*shape), torch_compile=True)
    return time.perf_counter() - start


def measure_data(
    shape: tuple[int, int, int], reps: int, threads: int, malloc: str = "default", compiled: bool = True
) -> DataRow:
    """siiRL's and our ``compute_data_metric`` (eager, and compiled unless ``compiled=False``)."""
    _, siirl_metrics = siirl_modules()
    data = make_tensordict(*shape)
    siirl_out = {k: float(v) for k, v in siirl_metrics.compute_data_metric(data).items()}
    checked = bench_data.check_same(compute_data_metric(data), siirl_out)
    if compiled:
        bench_data.check_same(compute_data_metric(data, torch_compile=True), siirl_out)
    torch.set_num_threads(threads)
    try:  # alternate the sides so that a noisy neighbour slows all alike
        ours, comp, peer = [], [math.nan], []
        for _ in range(3):
            ours.append(bench_data._median_time(lambda: compute_data_metric(data), reps))
            if compiled:
                run = lambda: compute_data_metric(data, torch_compile=True)  # noqa: E731
                comp.append(bench_data._median_time(run, reps))
            peer.append(bench_data._median_time(lambda: siirl_metrics.compute_data_metric(data), reps))
    finally:
        torch.set_num_threads(bench_data.DEFAULT_THREADS)
    return DataRow(shape, threads, min(ours), min(comp[1:], default=math.nan), min(peer), checked, malloc)


def render_data(rows: list[DataRow]) -> str:
    return report.table(
        ["B", "prompt", "response", "torch threads", "glibc malloc", "siiRL ms", "rlmetrics ms", "speed-up",
         "rlmetrics torch_compile ms", "speed-up", "names checked"],
        [
            [*r.shape, r.threads, r.malloc, f"{r.siirl_s * 1e3:.2f}", f"{r.ours_s * 1e3:.2f}",
             f"{r.ratio:.1f}x", f"{r.compiled_s * 1e3:.2f}" if r.compiled_s == r.compiled_s else "–",
             f"{r.compiled_ratio:.1f}x" if r.compiled_s == r.compiled_s else "–", r.checked]
            for r in rows
        ],
    )  # fmt: skip


def target_data(rows: list[DataRow]) -> list[str]:
    """The targets of :data:`DATA_TARGETS` at torch's default thread count, eager and with
    ``torch_compile=True``, as the process runs and, if measured, with glibc keeping freed memory
    (siiRL without page faults); one sentence per shape."""
    out = []
    for shape, target in DATA_TARGETS.items():
        b, p, r = shape
        cells = {
            row.malloc: row
            for row in rows
            if row.shape == shape and row.threads == bench_data.DEFAULT_THREADS
        }
        what = (
            f"siiRL's compute_data_metric at B={b}, prompt {p}, response {r} "
            f"(torch's default {bench_data.DEFAULT_THREADS} threads)"
        )
        if "default" not in cells:
            out.append(report.ratio_target(what, None, target))
            continue
        parts = []
        for malloc, row in cells.items():
            where = "" if malloc == "default" else ", glibc keeping freed memory"
            for label, ratio in (("eager", row.ratio), ("torch_compile=True", row.compiled_ratio)):
                if ratio == ratio:  # not NaN: measured
                    parts.append(f"{label}{where}: {ratio:.1f}x — {report.verdict(ratio >= target)}")
        out.append(f"target >= {target:g}x {what}: " + "; ".join(parts))
    return out


def sync_counter() -> ModuleType:
    """``tests/syncs.py`` (the emulated accelerator and its sync counter), loaded from its file."""
    path = Path(__file__).resolve().parents[1] / "tests" / "syncs.py"
    spec = importlib.util.spec_from_file_location("rlmetrics_bench_syncs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class SyncRow:
    side: str
    syncs: int
    kinds: dict[str, int]


def measure_syncs(shape: tuple[int, int, int]) -> list[SyncRow]:
    """Device→host syncs of one ``compute_data_metric`` call of each side on the emulated device."""
    syncs = sync_counter()
    _, siirl_metrics = siirl_modules()
    batch = bench_data.make_batch(*shape, seed=sum(shape))
    batch["__num_turns__"] = torch.as_tensor(batch["__num_turns__"]).float()
    device_batch = syncs.on_device(batch)
    rows = []
    for side, fn in (("siiRL", siirl_metrics.compute_data_metric), ("rlmetrics", compute_data_metric)):
        with syncs.SyncCounter() as counter:
            fn(device_batch)
        kinds = collections.Counter(event.split(":")[0] for event in counter.events)
        rows.append(SyncRow(side, counter.syncs, dict(kinds)))
    return rows


def render_syncs(rows: list[SyncRow]) -> str:
    kinds = sorted({k for r in rows for k in r.kinds})
    return report.table(
        ["compute_data_metric", "device→host syncs per call", *kinds],
        [[r.side, r.syncs, *(r.kinds.get(k, 0) for k in kinds)] for r in rows],
    )


# ------------------------------------------------------------------- 3. process_validation_metrics
@dataclass
class ValRow:
    prompts: int
    samples: int
    ours_s: float
    siirl_prompts: int
    siirl_sub_s: float  # seconds of siiRL on the first siirl_prompts prompts
    checked: int

    @property
    def siirl_s(self) -> float:
        return self.siirl_sub_s * self.prompts / self.siirl_prompts

    @property
    def ratio(self) -> float:
        return self.siirl_s / self.ours_s


def measure_validation(prompts: int, samples: int, reps: int, siirl_prompts: int) -> ValRow:
    _, siirl_metrics = siirl_modules()
    batch = bench_validation.make_batch(prompts, samples, seed=prompts * 131 + samples)
    ours_s = statistics.median(report.timed(lambda: process_validation_metrics(*batch), reps)[0])
    m = min(prompts, siirl_prompts)
    sub = bench_validation.first_prompts(batch, samples, m)
    t0 = time.perf_counter()
    peer = siirl_metrics.process_validation_metrics(*sub, [], seed=42)
    siirl_sub_s = time.perf_counter() - t0
    ours = process_validation_metrics(*sub)
    assert set(ours) == set(peer), sorted(set(ours) ^ set(peer))[:5]
    for name, value in peer.items():
        assert math.isclose(ours[name], value, rel_tol=1e-12, abs_tol=1e-12), (name, ours[name], value)
    return ValRow(prompts, samples, ours_s, m, siirl_sub_s, len(peer))


def render_validation(rows: list[ValRow]) -> str:
    return report.table(
        ["prompts x samples", "siiRL s", "siiRL timed on", "rlmetrics s", "speed-up", "keys checked"],
        [
            [f"{r.prompts} x {r.samples}", f"{r.siirl_s:.1f}", f"{r.siirl_prompts} prompts",
             f"{r.ours_s:.3f}", f"{r.ratio:.0f}x", r.checked]
            for r in rows
        ],
    )  # fmt: skip


def target_validation(rows: list[ValRow]) -> str:
    p, n = VAL_TARGET_CELL
    cell = next((r for r in rows if (r.prompts, r.samples) == VAL_TARGET_CELL), None)
    ratio = None if cell is None else cell.ratio
    return report.ratio_target(f"siiRL's process_validation_metrics at {p} x {n}", ratio, VAL_TARGET, 0)


# ------------------------------------------------------------------------------------------- main
def _ray_runtime_env() -> dict[str, Any]:
    """Workers import ``bench_ray`` (its actor class is pickled by reference): put benchmarks/ on
    their path; and siiRL's log directory."""
    paths = [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p), "SIIRL_LOG_DIRECTORY": SIIRL_LOG_DIRECTORY}
    return {"env_vars": env}


def main(argv: list[str] | None = None) -> tuple[list[bench_ray.Row], list[DataRow], list[ValRow]]:
    parser = report.parser(
        __doc__,
        "no Ray step (bench_ray.py --quick runs its harness); a small batch; 32 prompts (siiRL timed on 2), "
        "eager only",
    )
    parser.add_argument("--siirl-prompts", type=int, help="prompts siiRL's validation is timed on")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    q = args.quick
    ray_cells = () if q else RAY_CELLS
    data_shapes = (QUICK_DATA_SHAPE,) if q else DATA_SHAPES
    data_reps = {shape: QUICK_DATA_REPS if q else DATA_REPS[shape] for shape in data_shapes}
    val_cells, val_reps = (QUICK_VAL_CELLS, QUICK_VAL_REPS) if q else (VAL_CELLS, VAL_REPS)
    siirl_prompts = args.siirl_prompts or (QUICK_SIIRL_PROMPTS if q else SIIRL_PROMPTS)
    head = report.header(
        "siiRL peer",
        f"siiRL {SIIRL_VERSION}",
        f"rlmetrics {rlmetrics.__version__}",
        f"ray {ray.__version__}",
        f"torch {torch.__version__} ({bench_data.DEFAULT_THREADS} threads)",
        f"numpy {np.__version__}",
    )
    print(head, flush=True)

    ray_rows = []
    if ray_cells:
        ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, runtime_env=_ray_runtime_env())
        try:
            ray_rows = [measure_ray(w, m, RAY_STEPS) for w, m in ray_cells]
        finally:
            ray.shutdown()
    threads = sorted({bench_data.DEFAULT_THREADS, 1}, reverse=True)
    compile_s = None if q else compile_data_metric(data_shapes[0])  # compiling takes ~20 s: not in --quick
    data_rows = [
        measure_data(shape, data_reps[shape], t, compiled=not q) for shape in data_shapes for t in threads
    ]
    sync_rows = measure_syncs(data_shapes[0])
    val_rows = [measure_validation(p, n, val_reps, siirl_prompts) for p, n in val_cells]
    if keep_freed_memory():  # last: it changes the allocator for the rest of the process
        shape = data_shapes[0]
        data_rows.append(
            measure_data(shape, data_reps[shape], bench_data.DEFAULT_THREADS, KEPT_MEMORY, not q)
        )

    ray_part = (
        ["Ray step: siiRL's MetricWorker vs rlmetrics (seed mode, and non-blocking)", render_ray(ray_rows)]
        if ray_rows
        else []
    )
    body = "\n\n".join(
        [
            *ray_part,
            "compute_data_metric: siiRL vs rlmetrics",
            render_data(data_rows),
            "compute_data_metric: device→host synchronisations of one call (B={}, prompt {}, response {}; "
            "emulated accelerator, tests/syncs.py)".format(*data_shapes[0]),
            render_syncs(sync_rows),
            "process_validation_metrics: siiRL vs rlmetrics",
            render_validation(val_rows),
        ]
    )
    ray_note = (
        f"Ray: {bench_ray.HOSTS} rank-host processes, Ray with {RAY_CPUS} logical CPUs; "
        f"median of {RAY_STEPS} steps after {bench_ray.WARMUP_STEPS} warm-up; siiRL first in every step; "
        "results asserted per step (.../mean names = numpy mean over ranks, all names = siiRL's, rel 1e-9)"
    )
    notes = [
        *([ray_note] if ray_rows else []),
        "compute_data_metric: best of 3 medians of "
        + ", ".join(f"{n} calls (B={shape[0]})" for shape, n in data_reps.items())
        + " per side, alternating; CPU tensors; "
        f"{data_rows[0].checked} names asserted equal (rel 1e-5), eager{'' if q else ' and compiled'}; "
        "__num_turns__ float32 (siiRL raises on int); "
        + (
            "torch_compile=True not measured in --quick"
            if compile_s is None
            else f"the first torch_compile=True call took {compile_s:.1f} s (compiling; not in the medians)"
        ),
        f"process_validation_metrics: rlmetrics median of {val_reps} calls; siiRL one call on the first "
        f"prompts, scaled linearly to all; {sum(r.checked for r in val_rows)} keys asserted equal (1e-12)",
        target_ray(ray_rows),
        *target_data(data_rows),
        target_validation(val_rows),
        f"total runtime: {time.perf_counter() - start:.1f} s",
    ]
    report.emit(head, body, notes, args.markdown)
    return ray_rows, data_rows, val_rows


if __name__ == "__main__":
    main()
