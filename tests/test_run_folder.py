"""A folder holds one run (issue 29): ``make_sinks`` refuses a folder that holds a run, unless
``resume=True`` (continue it) or ``overwrite=True`` (replace it: only the run's files go), whatever the
sink — each read back with the tracker's own reader (tests/trackers.py); ``make demo`` puts a
rerun into ``runs/demo-2`` and refuses an ``--out`` that holds a run, in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlmetrics.sinks import TRACKERS, make_sinks, new_run_folder, read_jsonl, run_files
from tests.trackers import mlflow_history, swanlab_scalars, tensorboard_steps, wandb_rows

ROOT = Path(__file__).resolve().parents[1]

SLOW = pytest.mark.slow
SINKS = ["jsonl", "tensorboard", pytest.param("wandb", marks=SLOW), pytest.param("mlflow", marks=SLOW)]
SINKS.append(pytest.param("swanlab", marks=SLOW))


def points(sink: str, out: Path) -> list[tuple[int, float]]:
    """``(step, value)`` of the metric ``x`` in every run of ``out``, as the tracker's reader finds it."""
    if sink == "jsonl":
        return [(r["step"], r["metrics"]["x"]) for r in read_jsonl(out / "metrics.jsonl").records]
    if sink == "tensorboard":
        from tests.trackers import tensorboard_accumulator

        events = tensorboard_accumulator(out / "tensorboard").Scalars("x")
        return sorted((e.step, e.value) for e in events)  # files in name order: ...<pid>.10 before .9
    if sink == "wandb":
        return [(s, row["x"]) for s, row in wandb_rows(sorted(out.glob("wandb/offline-run-*/run-*.wandb")))]
    if sink == "mlflow":
        from mlflow.tracking import MlflowClient

        uri = f"sqlite:///{out / 'mlflow.db'}"
        client = MlflowClient(uri)
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        return [p for run in runs for p in mlflow_history(uri, run.info.run_id, "x")]
    return swanlab_scalars(sorted(out.glob("swanlab/run-*/run-*.swanlab"))).get("x", [])


def log(sink: str, out: Path, steps: range, offset: float, **kw) -> None:
    names = ["jsonl", sink] if TRACKERS[sink].rebuilds else [sink]  # rebuilt from the journal on resume
    with make_sinks(names, out, health=None, **kw) as tracking:
        for step in steps:
            tracking.log({"x": offset + step}, step)


@pytest.mark.parametrize("sink", SINKS)
def test_a_folder_holding_a_run_is_refused_replaced_or_continued(tmp_path, sink, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    log(sink, out, range(3), 0.0)
    (out / "reward.png").write_bytes(b"the user's")
    held = [p.name for p in run_files(out)]
    with pytest.raises(FileExistsError) as refused:
        make_sinks([sink], out, health=None)
    message = str(refused.value)
    assert "\n" not in message and str(out) in message and all(name in message for name in held)
    assert all(choice in message for choice in ("resume=True", "overwrite=True", "another folder"))
    assert points(sink, out) == [(s, s) for s in range(3)]  # left as it was

    log(sink, out, range(3), 10.0, overwrite=True)  # a new run in place of the old one
    assert points(sink, out) == [(s, 10.0 + s) for s in range(3)]
    assert (out / "reward.png").read_bytes() == b"the user's"

    log(sink, out, range(5), 10.0, resume=True)  # the same run, continued: steps 0..2 skipped
    assert points(sink, out) == [(s, 10.0 + s) for s in range(5)]


def test_what_a_run_folder_holds_and_the_next_free_one(tmp_path):
    out = tmp_path / "demo"
    assert run_files(out) == [] and new_run_folder(out) == out
    for name in ("notes.txt", "reward.png", "mlflow.db.bak"):  # the user's files, not a run
        out.mkdir(exist_ok=True)
        (out / name).write_text("mine")
    assert run_files(out) == [] and new_run_folder(out) == out
    left = ["mlflow.db", "mlflow.db-journal", "mlflow.db.1a2b3c4d.init", "run_ids.json", "run_ids.tmp"]
    for name in left:  # what a start killed while it created the MLflow store and the run ids leaves
        (out / name).write_text("")
    assert [p.name for p in run_files(out)] == left
    log("jsonl", tmp_path / "demo-2", range(1), 0.0)
    assert new_run_folder(out) == tmp_path / "demo-3"
    log("jsonl", out, range(2), 0.0, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "metrics.jsonl",
        "mlflow.db.bak",
        "notes.txt",
        "reward.png",
    ]
    with pytest.raises(ValueError, match="pass one"):
        make_sinks(["jsonl"], out, resume=True, overwrite=True)


def test_a_start_whose_tracker_is_not_installed_leaves_the_folder_free(tmp_path, monkeypatch):
    """A tracker that fails to start (here W&B not installed: what ``import wandb`` does then) leaves
    no run behind: the JSONL file and TensorBoard folder created before it go, and the retry without
    it starts (before, the folder 'held a run' and the retry was refused). With ``overwrite=True``
    the run it was to replace comes back whole."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # Python's own marker of a module that cannot import
    with pytest.raises(ImportError, match="wandb"):
        make_sinks(["jsonl", "tensorboard", "wandb"], tmp_path)
    assert run_files(tmp_path) == []
    with make_sinks(["jsonl", "tensorboard"], tmp_path) as tracking:
        tracking.log({"x": 1.0}, 0)
    assert points("tensorboard", tmp_path) == [(0, 1.0)]
    with pytest.raises(ImportError, match="wandb"):  # replacing that run fails the same way: it stays
        make_sinks(["jsonl", "tensorboard", "wandb"], tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "run_ids.json", "tensorboard"]
    assert points("tensorboard", tmp_path) == [(0, 1.0)] == points("jsonl", tmp_path)


def test_a_tensorboard_sink_refuses_a_folder_holding_event_files(tmp_path):
    """TensorBoard reads every event file of a folder as one run: a second run's file would double
    each series, so a TensorBoardSink made directly (not through make_sinks) refuses too."""
    from rlmetrics.sinks import TensorBoardSink

    with TensorBoardSink(tmp_path) as sink:
        sink.log({"x": 1.0}, 0)
    with pytest.raises(FileExistsError, match="resume=True"):
        TensorBoardSink(tmp_path)
    assert tensorboard_steps(tmp_path) == {"x": [0]}


# ------------------------------------------------------------------------------------- the demo
def demo(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m examples.grpo ARGS`` (simulated, 3 steps) run in ``cwd``: the checkout on its path."""
    cmd = [sys.executable, "-m", "examples.grpo", "--simulate", "--backend", "local", "--steps", "3"]
    cmd += ["--workers", "2", "--val-every", "0", "--pace", "0", *args]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def tensorboard_score_steps(out: Path) -> list[int]:
    return tensorboard_steps(out / "tensorboard")["critic/score/mean"]


@pytest.fixture(scope="module")
def first_demo(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One ``make demo``-like run into the default folder (``runs/demo``), shared: each test copies the
    folder it made (a demo run holds a run whichever test then reuses it), so the module starts 3 demo
    runs, not 5 (each ~10 s, mostly imports and the plots)."""
    cwd = tmp_path_factory.mktemp("first-demo")
    return cwd, demo(cwd)


@pytest.mark.torch
@pytest.mark.slow
def test_demo_twice_into_the_default_folder_makes_a_second_folder(tmp_path, first_demo):
    """``make demo`` twice: the second run goes to runs/demo-2, says so, and names it in its last
    lines; each folder holds one run (TensorBoard: 3 points for 3 steps, not 6). The first run is
    the module's (its folder copied here)."""
    first_cwd, first = first_demo
    shutil.copytree(first_cwd / "runs", tmp_path / "runs")
    for folder, done in (("runs/demo", first), ("runs/demo-2", None)):
        done = done or demo(tmp_path)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        assert f"metrics: {folder}/metrics.jsonl" in done.stdout
        assert f"tensorboard --logdir {folder}/tensorboard" in done.stdout
        assert f"{folder}/reward.png" in done.stdout
        assert tensorboard_score_steps(tmp_path / folder) == [0, 1, 2]
    assert "runs/demo holds a run: this one goes to runs/demo-2" in done.stdout


@pytest.mark.torch
@pytest.mark.slow
def test_demo_refuses_an_out_holding_a_run_in_one_line_and_overwrites_it(tmp_path, first_demo):
    """``--out`` holding a demo's run (the module's first run, copied there) is refused in one line,
    and ``--overwrite`` replaces the run (3 TensorBoard points, not 6) and keeps the user's files."""
    first_cwd, first = first_demo
    assert first.returncode == 0, first.stderr
    out = tmp_path / "mine"
    shutil.copytree(first_cwd / "runs" / "demo", out)
    (out / "notes.txt").write_text("mine")
    refused = demo(tmp_path, "--out", str(out))
    assert refused.returncode != 0 and refused.stdout == ""
    (line,) = refused.stderr.splitlines()
    assert line.startswith(
        f"python -m examples.grpo: {out} holds a run (metrics.jsonl, run_ids.json, tensorboard)"
    )
    assert "--overwrite" in line and "another --out" in line and "--resume" not in line
    assert tensorboard_score_steps(out) == [0, 1, 2]
    done = demo(tmp_path, "--out", str(out), "--overwrite")
    assert done.returncode == 0, done.stderr
    assert tensorboard_score_steps(out) == [0, 1, 2] and read_jsonl(out / "metrics.jsonl").steps == [0, 1, 2]
    assert (out / "notes.txt").read_text() == "mine"
