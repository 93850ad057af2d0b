"""A rank's slips on torch.distributed, with 3 real gloo processes: a rank that skips one
``wait_submit`` after a caught ``MetricValueError``, a rank that calls it twice for one step, and a
rank whose process is SIGKILLed mid-run. Every value the ranks get is compared with numpy on the
data that was sent; no rank hangs (each run has a 60 s gloo timeout and the test a 240 s one).

Each run is one subprocess that runs this file as a script (``torch.multiprocessing``, fresh
interpreters as torchrun's); each rank pickles what it saw.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORLD = 3
STEPS = 5
SLIP_STEP = 1  # the step rank 1 skips (or closes twice)
KILLED, KILL_STEP = 2, 2


def data(rank: int, step: int, run: str) -> np.ndarray:
    return np.random.default_rng([len(run), rank, step]).normal(step, 1 + rank, size=3 + 5 * rank + step)


def metrics(x: np.ndarray) -> dict:
    return {"x/mean": x, "x/std": x, "x/max": x, "x/median": x}


def expected(step: int, run: str, ranks=range(WORLD)) -> dict[str, float]:
    x = np.concatenate([data(r, step, run) for r in ranks])
    return {"x/mean": x.mean(), "x/std": x.std(), "x/max": x.max(), "x/median": np.sort(x)[(x.size - 1) // 2]}


# ----------------------------------------------------------------------------- the spawned workers
def _skip(rank: int) -> dict:
    """Rank 1's metrics code raises at step 1; it catches the error and goes on without wait_submit."""
    import rlmetrics

    client = rlmetrics.connect("torch")
    out: dict = {}
    for step in range(STEPS):
        values = metrics(data(rank, step, "skip"))
        try:
            if rank == 1 and step == SLIP_STEP:
                values["bad/mean"] = "n/a"  # the other names are queued, then it raises
            client.submit_metric(values, step=step)  # the trainer's step, in both calls
            client.wait_submit(step=step)
        except rlmetrics.MetricValueError as exc:
            out["error"] = str(exc)
    out["results"] = {s: client.result(s) for s in range(STEPS)}
    return out


def _counted(rank: int) -> dict:
    """As _skip, with the trainer's step passed to wait_submit only: rank 1's data queued at its
    counter may hold two steps' data, so it is dropped (told), never merged into a wrong step."""
    import rlmetrics

    client = rlmetrics.connect("torch")
    for step in range(STEPS):
        values = metrics(data(rank, step, "counted"))
        try:
            if rank == 1 and step == SLIP_STEP:
                values["bad/mean"] = "n/a"
            client.submit_metric(values)
            client.wait_submit(step=step)
        except rlmetrics.MetricValueError:
            pass
    return {"results": {s: client.result(s) for s in range(STEPS)}}


def _slow(rank: int) -> dict:
    """Rank 1 is alive but slow (longer than a dead rank takes to be named): the others wait for it."""
    import rlmetrics

    client = rlmetrics.connect("torch")
    client.submit_metric(metrics(data(rank, 0, "slow")), step=0)
    if rank == 1:
        from rlmetrics.backends.torch_dist import GONE_AFTER

        time.sleep(3 * GONE_AFTER)
    client.wait_submit(step=0)
    return {"results": {0: client.result(0)}}


def _double(rank: int) -> dict:
    """Rank 1 calls wait_submit twice for one step (a retried loop iteration)."""
    import rlmetrics

    client = rlmetrics.connect("torch")
    for step in range(STEPS):
        client.submit_metric(metrics(data(rank, step, "double")), step=step)
        client.wait_submit(step=step)
        if rank == 1 and step == SLIP_STEP:
            client.wait_submit(step=step)
    return {"results": {s: client.result(s) for s in range(STEPS)}}


def _kill(rank: int) -> dict:
    """Rank 2's process is SIGKILLed before it closes step 2; the others go on with their loop."""
    import rlmetrics

    client = rlmetrics.connect("torch")
    out: dict = {"results": {}, "seconds": {}}
    for step in range(STEPS):
        if rank == KILLED and step == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        client.submit_metric(metrics(data(rank, step, "kill")), step=step)
        start = time.monotonic()
        client.wait_submit(step=step)
        out["seconds"][step] = time.monotonic() - start
        out["results"][step] = client.result(step)
    return out


def _worker(rank: int, out_dir: str, runs: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir}/store",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    out = {}
    for run in runs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[run] = globals()[f"_{run}"](rank)
        out[run]["warnings"] = [str(w.message) for w in caught if "rlmetrics" in str(w.message)]
        (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(out))  # the survivors' part
    if "kill" not in runs:
        dist.destroy_process_group()


def run(tmp_path, *runs: str) -> list[dict | None]:
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp_path), *runs], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode in (0, 1), proc.stderr[-5000:]  # 1: a rank was killed, as the test asked
    files = [tmp_path / f"rank{r}.pkl" for r in range(WORLD)]
    return [pickle.loads(f.read_bytes()) if f.exists() else None for f in files]


def close(res, want: dict[str, float]) -> bool:
    return set(res) == set(want) and all(np.isclose(res[k], v, rtol=1e-12) for k, v in want.items())


# ----------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def slips(tmp_path_factory) -> list[dict]:
    return run(tmp_path_factory.mktemp("slips"), "skip", "counted", "double", "slow")


def test_a_skipped_wait_submit_loses_no_data_and_every_rank_is_told(slips):
    for r in range(WORLD):
        out = slips[r]["skip"]
        for step in range(STEPS):  # rank 1's names of step 1 were queued before its error
            assert close(out["results"][step], expected(step, "skip")), (r, step, dict(out["results"][step]))
            assert out["results"][step].meta.complete
        (told,) = out["warnings"]
        assert "rank1 at step 2" in told and "rank0, rank2 at step 1" in told and "wait_submit(step=" in told
    assert "bad/mean" in slips[1]["skip"]["error"]


def test_data_of_an_unknown_step_is_dropped_never_merged_into_a_wrong_step(slips):
    for r in range(WORLD):
        out = slips[r]["counted"]
        for step in range(STEPS):
            ranks = [0, 2] if step in (SLIP_STEP, SLIP_STEP + 1) else range(WORLD)
            assert close(out["results"][step], expected(step, "counted", ranks)), (r, step)
        assert any("rank1 at step 2" in w for w in out["warnings"])
    (dropped,) = [w for w in slips[1]["counted"]["warnings"] if "dropped" in w]
    assert "without step=" in dropped and "submit_metric(..., step=step)" in dropped


def test_a_doubled_wait_submit_is_ignored_with_a_warning(slips):
    for r in range(WORLD):
        out = slips[r]["double"]
        for step in range(STEPS):
            assert close(out["results"][step], expected(step, "double")), (r, step)
        assert len(out["warnings"]) == (r == 1)
    assert "step 1 again" in slips[1]["double"]["warnings"][0]


def test_a_slow_rank_is_waited_for_not_named_gone(slips):
    for r in range(WORLD):
        assert close(slips[r]["slow"]["results"][0], expected(0, "slow"))
        assert slips[r]["slow"]["warnings"] == []


def test_a_killed_rank_is_named_and_the_others_go_on_without_it(tmp_path):
    ranks = run(tmp_path, "kill")
    assert ranks[KILLED] is None or "kill" not in ranks[KILLED]
    survivors = [r for r in range(WORLD) if r != KILLED]
    for r in survivors:
        out = ranks[r]["kill"]
        for step in range(STEPS):
            res = out["results"][step]
            assert close(res, expected(step, "kill", range(WORLD) if step < KILL_STEP else survivors)), (
                r,
                step,
            )
            assert res.meta.missing_ranks == ([f"rank{KILLED}"] if step == KILL_STEP else [])
            assert res.meta.complete == (step != KILL_STEP)
        assert out["seconds"][KILL_STEP] < 30  # the gloo timeout is 60 s
        (told,) = [
            w for w in out["warnings"] if "is gone" in w
        ]  # once (a read of the step says it is partial)
        assert f"step {KILL_STEP}: rank{KILLED} is gone" in told and "missing_ranks" in told


if __name__ == "__main__":
    import torch.multiprocessing as mp

    context = mp.start_processes(_worker, args=(sys.argv[1], sys.argv[2:]), nprocs=WORLD, join=False)
    for p in context.processes:
        p.join(200)
    sys.exit(1 if any(p.exitcode for p in context.processes) else 0)
