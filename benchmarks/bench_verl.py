"""rlmetrics.integrations.verl against the real peer, verl 0.9.1 (``make install-peers``), in one run.

Two tables, each side measured in this process on the same inputs, results asserted equal:

1. **process_validation_metrics** on ``bench_validation.make_batch`` (P prompts x 16 samples, 4 data
   sources, ``acc``, ``reward``, ``pred``), and once more with every 37th ``acc`` value None (verl
   drops it from its prompt, so ``acc`` and ``reward`` no longer share their bootstrap rows).
   rlmetrics: median of N calls on the full batch. verl (a Python bootstrap loop, about a tenth of a
   second per prompt): one call on the first ``m`` prompts, scaled by P/m (prompts are independent,
   so its cost is linear in P); ``m`` is in the table (``--verl-prompts`` changes it). Every key of
   verl's nested result on those ``m`` prompts is asserted equal (1e-9).
2. **compute_data_metrics** on ``bench_data.make_batch`` as a verl ``DataProto`` (``prompts`` added,
   every tenth response empty), both sides on the same object: best of 3 medians of N calls, the
   sides alternating, at torch's default thread count and one thread; every key asserted equal (verl
   sums in float32: 1e-5).

Run: ``python benchmarks/bench_verl.py [--quick] [--markdown PATH] [--verl-prompts M]`` (needs the
``torch`` extra and verl 0.9.1 with omegaconf and transformers: ``make install-peers``).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from importlib.metadata import version

import bench_data
import bench_validation
import numpy as np
import report
import torch

import rlmetrics
from rlmetrics.integrations import verl as ours

VERL_VERSION = version("verl")

VAL_CELLS = ((512, 16, False), (4096, 16, False), (512, 16, True))  # prompts, samples, with None values
QUICK_VAL_CELLS = ((64, 16, True),)
TARGET_CELLS = ((512, 16), (4096, 16))
VAL_REPS, QUICK_VAL_REPS = 5, 3
VERL_PROMPTS, QUICK_VERL_PROMPTS = 24, 1
VAL_TARGET = 1000.0
NONE_EVERY = 37  # every 37th acc value is None in the rows "with None"

DATA_SHAPE = (256, 1024, 2048)
QUICK_DATA_SHAPE = (64, 256, 512)
DATA_REPS, QUICK_DATA_REPS = 10, 3


def verl_modules():
    import verl.trainer.ppo.metric_utils as metric_utils
    from verl import DataProto

    return metric_utils, DataProto


# ------------------------------------------------------------------- 1. process_validation_metrics
@dataclass
class ValRow:
    prompts: int
    samples: int
    nones: bool
    ours_s: float
    verl_prompts: int
    verl_sub_s: float  # seconds of verl on the first verl_prompts prompts
    checked: int

    @property
    def verl_s(self) -> float:
        return self.verl_sub_s * self.prompts / self.verl_prompts

    @property
    def ratio(self) -> float:
        return self.verl_s / self.ours_s


def validation_batch(prompts: int, samples: int, nones: bool) -> tuple:
    sources, uids, infos = bench_validation.make_batch(prompts, samples, seed=prompts * 131 + samples)
    if nones:
        infos["acc"] = [None if i % NONE_EVERY == 5 else v for i, v in enumerate(infos["acc"])]
    return sources, uids, infos


def assert_nested_same(mine: dict, theirs: dict) -> int:
    checked = 0
    assert set(mine) == set(theirs)
    for source, by_var in theirs.items():
        assert set(mine[source]) == set(by_var), source
        for var, metrics in by_var.items():
            assert set(mine[source][var]) == set(metrics), (source, var)
            for name, value in metrics.items():
                assert math.isclose(mine[source][var][name], value, rel_tol=1e-9, abs_tol=1e-9), (
                    source,
                    var,
                    name,
                )
                checked += 1
    return checked


def measure_validation(prompts: int, samples: int, nones: bool, reps: int, verl_prompts: int) -> ValRow:
    metric_utils, _ = verl_modules()
    batch = validation_batch(prompts, samples, nones)
    ours_s = statistics.median(report.timed(lambda: ours.process_validation_metrics(*batch), reps)[0])
    m = min(prompts, verl_prompts)
    sub = bench_validation.first_prompts(batch, samples, m)
    t0 = time.perf_counter()
    theirs = metric_utils.process_validation_metrics(*sub)
    verl_sub_s = time.perf_counter() - t0
    checked = assert_nested_same(ours.process_validation_metrics(*sub), theirs)
    return ValRow(prompts, samples, nones, ours_s, m, verl_sub_s, checked)


def render_validation(rows: list[ValRow]) -> str:
    return report.table(
        ["prompts x samples", "None values", "verl s", "verl timed on", "rlmetrics s", "speed-up",
         "keys checked"],
        [
            [f"{r.prompts} x {r.samples}", f"1 in {NONE_EVERY} acc" if r.nones else "none", f"{r.verl_s:.1f}",
             f"{r.verl_prompts} prompts", f"{r.ours_s:.3f}", f"{r.ratio:.0f}x", r.checked]
            for r in rows
        ],
    )  # fmt: skip


def target_validation(rows: list[ValRow]) -> list[str]:
    out = []
    for p, n in TARGET_CELLS:
        cell = next((r for r in rows if (r.prompts, r.samples, r.nones) == (p, n, False)), None)
        ratio = None if cell is None else cell.ratio
        out.append(
            report.ratio_target(f"verl's process_validation_metrics at {p} x {n}", ratio, VAL_TARGET, 0)
        )
    return out


# ------------------------------------------------------------------------- 2. compute_data_metrics
@dataclass
class DataRow:
    shape: tuple[int, int, int]
    threads: int
    ours_s: float
    verl_s: float
    checked: int

    @property
    def ratio(self) -> float:
        return self.verl_s / self.ours_s


def data_proto(b: int, p: int, r: int):
    """``bench_data.make_batch`` as a DataProto: ``prompts`` added, every tenth response empty."""
    _, DataProto = verl_modules()
    batch = bench_data.make_batch(b, p, r, seed=b + p + r)
    empty = torch.arange(b) % 10 == 3
    batch["attention_mask"][empty, p:] = 0
    batch["response_mask"][empty] = 0
    turns = batch.pop("__num_turns__")
    tensors = {**batch, "prompts": torch.zeros(b, p, dtype=torch.long)}
    return DataProto.from_dict(tensors=tensors, non_tensors={"__num_turns__": turns})


def measure_data(shape: tuple[int, int, int], reps: int, threads: int) -> DataRow:
    metric_utils, _ = verl_modules()
    data = data_proto(*shape)
    theirs = metric_utils.compute_data_metrics(data)
    mine = ours.compute_data_metrics(data)
    assert set(mine) == set(theirs), sorted(set(mine) ^ set(theirs))
    for name, value in theirs.items():
        assert math.isclose(mine[name], float(value), rel_tol=1e-5, abs_tol=1e-5), (name, mine[name], value)
    torch.set_num_threads(threads)
    try:  # alternate the sides so that a noisy neighbour slows both alike
        mine_s, verl_s = [], []
        for _ in range(3):
            mine_s.append(bench_data._median_time(lambda: ours.compute_data_metrics(data), reps))
            verl_s.append(bench_data._median_time(lambda: metric_utils.compute_data_metrics(data), reps))
    finally:
        torch.set_num_threads(bench_data.DEFAULT_THREADS)
    return DataRow(shape, threads, min(mine_s), min(verl_s), len(theirs))


def render_data(rows: list[DataRow]) -> str:
    return report.table(
        ["B", "prompt", "response", "torch threads", "verl ms", "rlmetrics ms", "speed-up", "keys checked"],
        [
            [
                *r.shape,
                r.threads,
                f"{r.verl_s * 1e3:.2f}",
                f"{r.ours_s * 1e3:.2f}",
                f"{r.ratio:.1f}x",
                r.checked,
            ]
            for r in rows
        ],
    )


# ------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> tuple[list[ValRow], list[DataRow]]:
    parser = report.parser(__doc__, "64 prompts with None values (verl timed on 1); a small batch")
    parser.add_argument("--verl-prompts", type=int, help="prompts verl's validation is timed on")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    q = args.quick
    val_cells, val_reps = (QUICK_VAL_CELLS, QUICK_VAL_REPS) if q else (VAL_CELLS, VAL_REPS)
    verl_prompts = args.verl_prompts or (QUICK_VERL_PROMPTS if q else VERL_PROMPTS)
    data_shape, data_reps = (QUICK_DATA_SHAPE, QUICK_DATA_REPS) if q else (DATA_SHAPE, DATA_REPS)
    head = report.header(
        "verl peer",
        f"verl {VERL_VERSION}",
        f"rlmetrics {rlmetrics.__version__}",
        f"torch {torch.__version__} ({bench_data.DEFAULT_THREADS} threads)",
        f"numpy {np.__version__}",
    )
    print(head, flush=True)
    val_rows = [measure_validation(p, n, nones, val_reps, verl_prompts) for p, n, nones in val_cells]
    threads = sorted({bench_data.DEFAULT_THREADS, 1}, reverse=True)
    data_rows = [measure_data(data_shape, data_reps, t) for t in threads]

    body = "\n\n".join(
        [
            "process_validation_metrics: verl vs rlmetrics",
            render_validation(val_rows),
            "compute_data_metrics: verl vs rlmetrics",
            render_data(data_rows),
        ]
    )
    notes = [
        f"process_validation_metrics: rlmetrics median of {val_reps} calls; verl one call on the first "
        f"prompts, scaled linearly to all; {sum(r.checked for r in val_rows)} keys asserted equal (1e-9)",
        f"compute_data_metrics: best of 3 medians of {data_reps} calls per side, alternating; CPU tensors "
        f"in a DataProto; {data_rows[0].checked} keys asserted equal (1e-5)",
        *target_validation(val_rows),
        f"total runtime: {time.perf_counter() - start:.1f} s",
    ]
    report.emit(head, body, notes, args.markdown)
    return val_rows, data_rows


if __name__ == "__main__":
    main()
