"""Resume: a real driver process (examples/resumable_run.py) is killed with SIGKILL mid-run and started
again; it goes back to its training checkpoint and runs steps it had already logged. Every tracker
then holds every step exactly once, with the numbers of the ranks' data (numpy on the concatenated
batches), and the health alert of a replayed step once — read back with each tracker's own reader
(tests/trackers.py). Plus the resume of each file sink alone."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import traceback
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

from rlmetrics.health import Alert
from rlmetrics.sinks import JsonlSink, MLflowSink, TensorBoardSink, Tracking, make_sinks, read_jsonl
from tests.trackers import (
    mlflow_history,
    read_tensorboard,
    swanlab_scalars,
    swanlab_texts,
    tensorboard_steps,
    tensorboard_texts,
    wandb_alerts,
    wandb_rows,
    wandb_run_files,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "resumable_run.py"
STEPS, NAN_STEP, KILL_AFTER = 16, 12, 13  # killed once 13 steps are in the JSONL file (0..12)

pytestmark = pytest.mark.slow


def example():
    spec = importlib.util.spec_from_file_location("resumable_run", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(step):
    """The merged step from the ranks' own data: numpy on the concatenated batches."""
    batches = [example().rank_batch(step, rank, NAN_STEP) for rank in range(2)]
    scores = np.concatenate([b["critic/score/mean"] for b in batches])
    grads = np.concatenate([b["actor/grad_norm"] for b in batches])
    return {
        "critic/score/mean": scores.mean(),
        "critic/score/max": scores.max(),
        "actor/grad_norm": grads.mean(),
    }


def same(a, b):
    """Equal up to float64 rounding (a merged mean sums in another order than numpy)."""
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=0)


def driver(out, **popen):
    cmd = [sys.executable, str(EXAMPLE), str(out), "--steps", str(STEPS), "--step-seconds", "0.15"]
    cmd += ["--nan-step", str(NAN_STEP)]
    env = {**os.environ, "WANDB_SILENT": "true"}
    env.pop("WANDB_SERVICE", None)  # set once this process used W&B: the drivers would share its service
    return subprocess.Popen(
        cmd, cwd=out.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen
    )


def logged_steps(out):
    path = out / "metrics.jsonl"
    return read_jsonl(path).steps if path.exists() else []


def test_driver_killed_and_restarted_logs_every_step_once_in_every_tracker(tmp_path):
    out = tmp_path / "run"
    first = driver(out)
    deadline = time.monotonic() + 120
    while len(logged_steps(out)) < KILL_AFTER:
        assert first.poll() is None, first.stdout.read().decode()
        assert time.monotonic() < deadline, "the driver did not log its first steps in time"
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    ids = json.loads((out / "run_ids.json").read_text())
    restart_at = json.loads((out / "checkpoint.json").read_text())["next_step"]
    before = logged_steps(out)
    assert restart_at <= NAN_STEP < len(before) < STEPS  # the restart replays logged steps, the NaN one too

    second = driver(out)
    output = second.communicate(timeout=180)[0].decode()
    assert second.returncode == 0, output
    assert f"starting at step {restart_at}" in output
    assert json.loads((out / "run_ids.json").read_text()) == ids  # the same runs, continued
    want = {s: reference(s) for s in range(STEPS)}
    steps = list(range(STEPS))

    run = read_jsonl(out / "metrics.jsonl")
    assert run.steps == steps
    for name in want[0]:
        assert all(same(v, want[s][name]) for s, v in zip(*run.series(name)))
    alerts = [(e["step"], e["event"]["rule"]) for e in run.events]
    assert alerts == [(NAN_STEP, "non_finite"), (NAN_STEP, "grad_norm")]

    tb = tensorboard_steps(out / "tensorboard")
    assert {tag: sorted(s) for tag, s in tb.items() if not tag.startswith("meta/")} == dict.fromkeys(
        want[0], steps
    )
    assert {tag: [s for s, _ in items] for tag, items in tensorboard_texts(out / "tensorboard").items()} == {
        "alert/non_finite": [NAN_STEP],
        "alert/grad_norm": [NAN_STEP],
    }

    wandb_files = wandb_run_files(out, ids["wandb"])
    assert len(wandb_files) == 1  # rebuilt from the journal: what wandb sync uploads
    assert len(list(out.glob(f"wandb/replaced/offline-run-*-{ids['wandb']}"))) == 1  # the killed session
    rows = wandb_rows(wandb_files)
    assert [s for s, _ in rows] == steps  # each once, never a lower step after a higher one
    for s, row in rows:
        assert all(same(float(row[name]), want[s][name]) for name in want[s])
    assert sorted(title for title, _, _ in wandb_alerts(wandb_files)) == [
        "grad_norm: actor/grad_norm",
        "non_finite: actor/grad_norm",
    ]

    uri = f"sqlite:///{out / 'mlflow.db'}"
    for name in want[0]:
        history = mlflow_history(uri, ids["mlflow"], name)
        assert sorted(s for s, _ in history) == steps
        assert all(same(v, want[s][name]) for s, v in history)
    assert mlflow_history(uri, ids["mlflow"], "alert/grad_norm") == [(NAN_STEP, 1.0)]
    from mlflow.tracking import MlflowClient

    assert MlflowClient(uri).get_run(ids["mlflow"]).info.status == "FINISHED"

    swanlab_files = sorted(out.glob(f"swanlab/run-*-{ids['swanlab']}/run-{ids['swanlab']}.swanlab"))
    assert len(swanlab_files) == 1  # rebuilt from the journal
    assert len(list(out.glob(f"swanlab/replaced/run-*-{ids['swanlab']}"))) == 1  # the killed session
    scalars = swanlab_scalars(swanlab_files)
    for name in want[0]:
        assert sorted(s for s, _ in scalars[name]) == steps
        assert all(same(v, want[s][name]) for s, v in scalars[name])
    texts = swanlab_texts(swanlab_files)
    assert {key: [s for s, _ in items] for key, items in texts.items()} == {
        "alert/non_finite": [NAN_STEP],
        "alert/grad_norm": [NAN_STEP],
    }


PAGE = (ROOT / "docs" / "resume.md").read_text(encoding="utf-8")


def test_the_try_it_block_runs_as_written_and_prints_what_the_page_says(tmp_path):
    """docs/resume.md's "Try it" block, run by bash as pasted in the repository root (a folder holding
    examples/), with ``python`` the one running the tests on PATH. The folder already holds the
    finished run of an earlier paste: the block starts a new run all the same. The restart starts at
    a checkpoint of the killed run and the last line is the one the page shows."""
    (block,) = re.findall(r"^## Try it\n.*?^```bash\n(.*?)^```", PAGE, re.S | re.M)
    last_line = re.search(r"the last line prints\s+`(.*?)`", PAGE)[1]
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    earlier = tmp_path / "runs" / "resumable"
    with JsonlSink(earlier / "metrics.jsonl") as sink:
        for step in range(60):
            sink.log({"critic/score/mean": 0.5}, step)
    (earlier / "checkpoint.json").write_text(json.dumps({"next_step": 60}))
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])}
    env.pop("WANDB_SERVICE", None)  # a fresh shell: not this process's W&B service
    done = subprocess.run(
        ["bash", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == last_line
    starts = [int(n) for n in re.findall(r"^starting at step (\d+)$", done.stdout, re.M)]
    assert starts[0] == 0 and 0 < starts[1] <= NAN_STEP and starts[1] % 5 == 0, done.stdout


# ------------------------------------------------------------------ a kill inside MLflow's store creation
STORE_KILLS = [  # the SQL statement right after which a start is killed, what it is, store in place after
    (r"CREATE TABLE span_metrics\b", "a table of a migration (issue 29's)", False),
    (r"INSERT INTO experiments\b", "the Default experiment: MLflow's last step", False),
    (r"INSERT INTO runs\b", "the run, in the store in place", True),
]
STORE_STEPS = 5


def store_start(out: Path, stop_at: str | None = None, mlflow_only: bool = False) -> None:
    """A start of a driver logging STORE_STEPS steps to ``make_sinks(["jsonl", "mlflow"], out,
    resume=True)``. ``stop_at``: it stops right after the first SQL statement matching it ran and prints
    ``stopped <pid>``; ``mlflow_only``: MLflow alone creates the store first, as drivers did before
    rlmetrics created stores whole."""
    if stop_at:
        from sqlalchemy import event
        from sqlalchemy.engine import Engine

        @event.listens_for(Engine, "after_cursor_execute")
        def stop(conn, cursor, statement, *_):
            if re.search(stop_at, statement):
                print(f"stopped {os.getpid()}", flush=True)
                time.sleep(600)

    if mlflow_only:
        from mlflow.tracking import MlflowClient

        out.mkdir()
        MlflowClient(f"sqlite:///{out / 'mlflow.db'}").search_experiments()
    with make_sinks(["jsonl", "mlflow"], out, resume=True, health=None) as tracking:
        for step in range(STORE_STEPS):
            tracking.log({"x": float(step)}, step)


def forked_starts() -> None:
    """Run each start read from stdin (a JSON list of :func:`store_start`'s arguments) in a process
    forked from this one, which imported MLflow once (seconds that each start would pay again), and
    print ``ended <its exit code>``."""
    import alembic.command  # noqa: F401
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
    import mlflow.tracking  # noqa: F401

    for line in sys.stdin:
        out, stop_at, mlflow_only = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                store_start(Path(out), stop_at, mlflow_only)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            os._exit(code)
        print(f"ended {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}", flush=True)


@pytest.fixture
def start(tmp_path):
    """``start(out, stop_at=None, mlflow_only=False) -> (exit code, output)``: a start of the driver
    (:func:`store_start`, forked by :func:`forked_starts`), killed with SIGKILL when it stops."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    pipe = subprocess.PIPE
    forker = subprocess.Popen(
        [sys.executable, __file__],
        cwd=tmp_path,
        env=env,
        stdin=pipe,
        stdout=pipe,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def run(out: Path, stop_at: str | None = None, mlflow_only: bool = False) -> tuple[int, str]:
        forker.stdin.write(json.dumps([str(out), stop_at, mlflow_only]) + "\n")
        forker.stdin.flush()
        output = []
        for line in forker.stdout:
            if line.startswith("stopped "):
                os.kill(int(line.split()[1]), signal.SIGKILL)
            elif line.startswith("ended "):
                return int(line.split()[1]), "".join(output)
            else:
                output.append(line)
        raise AssertionError(f"the process forking the starts ended:\n{''.join(output)}")

    yield run
    forker.stdin.close()
    forker.wait(timeout=60)


def test_driver_killed_while_mlflow_creates_its_store_resumes(tmp_path, start):
    """MLflow alone is killed in a table of a migration of ``mlflow.db`` (issue 28's store, as drivers
    left it before rlmetrics created stores whole); then each start of the driver is killed at the next
    moment of :data:`STORE_KILLS`, and the last start logs every step once, in the one run of the
    store, read back with MLflow's client; the killed starts leave no file behind."""
    out = tmp_path / "run"
    code, output = start(out, r"CREATE TABLE evaluation_datasets\b", mlflow_only=True)
    assert code == -signal.SIGKILL, output
    for stop_at, moment, in_place in STORE_KILLS:
        code, output = start(out, stop_at)
        assert code == -signal.SIGKILL, f"not killed at {moment}:\n{output}"
        assert (out / "mlflow.db").exists() == in_place, moment  # a half-made store is never in place
    code, output = start(out)
    assert code == 0, output
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.run_id == json.loads((out / "run_ids.json").read_text())["mlflow"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "x")] == list(range(STORE_STEPS))
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "mlflow.db", "run_ids.json"]


@pytest.mark.parametrize("drop", [None, "latest_metrics"])
def test_a_damaged_mlflow_store_holding_a_run_is_refused_with_one_line(tmp_path, drop):
    """A kill after the last migration and before its version stamp (as an MLflow upgrade leaves it)
    makes a store MLflow cannot open, also with a table missing (MLflow then runs the migration
    again); it holds a run, so the sink leaves it as it is and raises one line naming it, without the
    SQLAlchemy traceback."""
    from alembic.script import ScriptDirectory
    from mlflow.store import db_migrations

    with make_sinks(["mlflow"], tmp_path / "made", health=None) as tracking:
        tracking.log({"x": 1.0}, 0)
    store = tmp_path / "run" / "mlflow.db"  # a path this process's MLflow never opened
    store.parent.mkdir()
    store.write_bytes((tmp_path / "made" / "mlflow.db").read_bytes())
    with closing(sqlite3.connect(store)) as db, db:
        (head,) = db.execute("SELECT version_num FROM alembic_version").fetchone()
        before = ScriptDirectory(os.path.dirname(db_migrations.__file__)).get_revision(head).down_revision
        db.execute("UPDATE alembic_version SET version_num = ?", (before,))
        if drop:
            db.execute(f"DROP TABLE {drop}")
    damaged = store.read_bytes()
    with pytest.raises(RuntimeError) as refused:
        MLflowSink(f"sqlite:///{store}")
    message = str(refused.value)
    assert str(store) in message and "\n" not in message
    assert refused.value.__suppress_context__ and refused.value.__cause__ is None
    assert store.read_bytes() == damaged


# ------------------------------------------------------------------------------ file sinks alone
def test_jsonl_resume_skips_the_steps_in_the_file(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonlSink(path) as sink:
        for step in range(5):
            sink.log({"x": float(step)}, step)
    with open(path, "ab") as f:
        f.write(b'{"step": 5, "time": 1.0, "metr')  # a crash mid-write
    with JsonlSink(path, resume=True) as sink:
        assert sink.resumed_at == 4
        for step in range(2, 8):
            sink.log({"x": 10.0 + step}, step)
    run = read_jsonl(path)
    assert run.steps == list(range(8)) and run.truncated is None
    assert run.series("x")[1].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 15.0, 16.0, 17.0]
    with JsonlSink(tmp_path / "new.jsonl", resume=True) as sink:  # nothing to resume: a new file
        assert sink.resumed_at is None
        sink.log({"x": 1.0}, 0)


def test_tensorboard_resume_replaces_the_steps_it_is_given_again(tmp_path):
    """Resumed, TensorBoard reads nothing: the session starts with TensorBoard's START event at the
    first train step it writes (torch's ``purge_step``), and TensorBoard's reader drops every point
    the earlier file holds from there: a driver restarted from an older checkpoint shows the new
    values, never two points a step (before, the steps it held were skipped: the old values stayed)."""
    with TensorBoardSink(tmp_path / "tb") as sink:
        for step in range(5):
            sink.log({"x": float(step), "y": float(step)}, step)
    with TensorBoardSink(tmp_path / "tb", resume=True) as sink:
        assert sink.resumed_at is None
        for step in range(3, 8):
            sink.log({"x": 10.0 + step}, step)
    assert tensorboard_steps(tmp_path / "tb") == {"x": list(range(8)), "y": [0, 1, 2]}
    assert read_tensorboard(tmp_path / "tb")["x"] == {
        0: 0.0,
        1: 1.0,
        2: 2.0,
        **{s: 10.0 + s for s in range(3, 8)},
    }


def test_tensorboard_kept_when_the_journal_lacks_a_start(tmp_path, caplog):
    """A TensorBoard run the journal does not hold whole (one start without jsonl, or a folder
    without run_ids.json) is neither rebuilt nor caught up from it: it goes on as it is, one warning
    each start, TensorBoard dropping its points from the first train step logged on; a step of
    another axis logged first does not move that START (at its step 0, it dropped every train step)."""

    def run(names, steps, value):
        with make_sinks(names, tmp_path, resume=True, health=None) as tracking:
            tracking.log_axis({"r": value}, 0, "policy_version")
            for step in steps:
                tracking.log({"x": value}, step)

    run(["jsonl", "tensorboard"], range(0, 4), 1.0)
    run(["tensorboard"], range(4, 8), 2.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run(["jsonl", "tensorboard"], range(6, 10), 3.0)
    assert sum("does not hold the whole run" in r.message for r in caplog.records) == 1
    want = {**dict.fromkeys(range(4), 1.0), 4: 2.0, 5: 2.0, **dict.fromkeys(range(6, 10), 3.0)}
    assert read_tensorboard(tmp_path / "tensorboard")["x"] == want
    assert tensorboard_steps(tmp_path / "tensorboard")["x"] == list(range(10))
    (tmp_path / "run_ids.json").unlink()  # a folder an earlier rlmetrics wrote
    run(["jsonl", "tensorboard"], range(10, 12), 4.0)
    assert read_tensorboard(tmp_path / "tensorboard")["x"] == {**want, 10: 4.0, 11: 4.0}
    assert tensorboard_steps(tmp_path / "tensorboard")["x"] == list(range(12))


def test_jsonl_alert_written_before_a_crash_is_not_repeated(tmp_path):
    path = tmp_path / "m.jsonl"
    alert = Alert("grad_norm", 3, "actor/grad_norm is 0", "error", "actor/grad_norm", 0.0)
    with JsonlSink(path) as sink:
        for step in range(3):
            sink.log({"actor/grad_norm": 1.0}, step)
        sink.alert(alert)  # the crash comes before step 3 itself is written
    with Tracking([JsonlSink(path, resume=True)]) as tracking:
        assert tracking.resumed_at == 2
        for step in range(4):  # the replay raises the alert of step 3 again
            tracking.log({"actor/grad_norm": 0.0 if step == 3 else 1.0}, step)
    run = read_jsonl(path)
    assert run.steps == [0, 1, 2, 3]
    assert [(e["step"], e["event"]["rule"]) for e in run.events] == [(3, "grad_norm")]


def test_make_sinks_resume_keeps_ids_and_skips(tmp_path):
    with make_sinks(["jsonl", "console"], tmp_path, health=None) as tracking:
        assert tracking.resumed_at is None
        tracking.sinks[1].console.quiet = True
        for step in range(3):
            tracking.log({"x": float(step)}, step)
    with make_sinks(["jsonl"], tmp_path, resume=True) as tracking:
        assert tracking.resumed_at == 2
        for step in range(5):
            tracking.log({"x": float(step)}, step)
    assert read_jsonl(tmp_path / "metrics.jsonl").steps == [0, 1, 2, 3, 4]
    with make_sinks(["jsonl"], tmp_path, overwrite=True) as tracking:  # a new file
        assert tracking.resumed_at is None
    assert read_jsonl(tmp_path / "metrics.jsonl").steps == []
    assert not (tmp_path / "run_ids.json").exists()  # no tracker run, no id to keep


def test_alerts_written_before_a_crash_are_not_repeated_by_any_tracker(tmp_path):
    """The crash falls between a step's alerts and the step: every tracker holds the alert, none
    the step. The resumed driver logs the step once and no tracker writes the alert again."""
    out = tmp_path / "run"
    names = ["jsonl", "tensorboard", "wandb", "mlflow", "swanlab"]
    alert = Alert("grad_norm", 3, "actor/grad_norm is 0", "error", "actor/grad_norm", 0.0)
    with make_sinks(names, out, health=None) as tracking:
        for step in range(3):
            tracking.log({"actor/grad_norm": 1.0}, step)
        for sink in tracking.sinks:
            sink.alert(alert)
    with make_sinks(names, out, resume=True) as tracking:
        assert tracking.resumed_at == 2
        for step in range(5):
            tracking.log({"actor/grad_norm": 0.0 if step == 3 else 1.0}, step)
    ids = json.loads((out / "run_ids.json").read_text())
    steps = list(range(5))
    run = read_jsonl(out / "metrics.jsonl")
    assert run.steps == steps and [(e["step"], e["event"]["rule"]) for e in run.events] == [(3, "grad_norm")]
    assert tensorboard_steps(out / "tensorboard") == {"actor/grad_norm": steps}
    assert {t: [s for s, _ in v] for t, v in tensorboard_texts(out / "tensorboard").items()} == {
        "alert/grad_norm": [3]
    }
    wandb_files = wandb_run_files(out, ids["wandb"])
    assert [s for s, row in wandb_rows(wandb_files) if "actor/grad_norm" in row] == steps
    assert [title for title, _, _ in wandb_alerts(wandb_files)] == ["grad_norm: actor/grad_norm"]
    uri = f"sqlite:///{out / 'mlflow.db'}"
    assert [s for s, _ in mlflow_history(uri, ids["mlflow"], "actor/grad_norm")] == steps
    assert mlflow_history(uri, ids["mlflow"], "alert/grad_norm") == [(3, 1.0)]
    swanlab_files = sorted(out.glob(f"swanlab/run-*-{ids['swanlab']}/run-{ids['swanlab']}.swanlab"))
    assert [s for s, _ in swanlab_scalars(swanlab_files)["actor/grad_norm"]] == steps
    assert {k: [s for s, _ in v] for k, v in swanlab_texts(swanlab_files).items()} == {"alert/grad_norm": [3]}


def test_swanlab_resume_is_rebuilt_from_the_journal(tmp_path):
    """SwanLab writes a record per metric and flushes every 8 KB: a killed session can leave its last
    step with part of its metrics (100 steps of 40 metrics, SIGKILL: step 8 held 39). Its files are
    not read: the earlier session is set aside, and the new one gets every step of the journal, each
    axis too, then the steps after it."""
    with make_sinks(["jsonl", "swanlab"], tmp_path, health=None) as tracking:
        for step in range(5):
            tracking.log({"a": float(step), "b": float(step)}, step)
        tracking.log_axis({"r": 4.0}, 4, "policy_version")
    with make_sinks(["jsonl", "swanlab"], tmp_path, resume=True, health=None) as tracking:
        assert tracking.resumed_at == 4
        for version in (4, 5):
            tracking.log_axis({"r": float(version)}, version, "policy_version")
        for step in range(3, 8):
            tracking.log({"a": float(step), "b": 10.0 + step}, step)
    (session,) = tmp_path.glob("swanlab/run-*/run-*.swanlab")
    assert len(list(tmp_path.glob("swanlab/replaced/run-*/run-*.swanlab"))) == 1
    scalars = swanlab_scalars([session])
    assert sorted(scalars["b"]) == [(s, float(s)) for s in range(5)] + [(5, 15.0), (6, 16.0), (7, 17.0)]
    assert sorted(scalars["policy_version/r"]) == [(4, 4.0), (5, 5.0)]


if __name__ == "__main__":
    forked_starts()


def test_a_lagging_tracker_gets_every_metric_of_a_step_verl_logged_in_several_calls(tmp_path):
    """verl's trainer calls ``Tracking.log`` several times for one step (its training metrics, then
    its validation metrics): the JSONL file holds a record per call, the later one with all the
    step's metrics so far. A resumed run catches up a tracker that lost those steps with the step's
    last record (before, its first: the validation metrics never reached the tracker)."""
    import shutil

    from rlmetrics.integrations.verl import Tracking as VerlTracking

    tracking = VerlTracking("p", "e", default_backend=["file", "tensorboard"], out_dir=tmp_path, health=None)
    for step in range(3):
        tracking.log({"train/loss": float(step)}, step)
        tracking.log({"val/score": 10.0 + step}, step)
    tracking.finish()
    shutil.rmtree(tmp_path / "tensorboard")  # the tracker's files lost (a killed writer, a new disk)
    tracking = VerlTracking("p", "e", default_backend=["file", "tensorboard"], out_dir=tmp_path, health=None)
    assert tracking.resumed_at == 2
    tracking.log({"train/loss": 3.0, "val/score": 13.0}, 3)
    tracking.finish()
    assert tensorboard_steps(tmp_path / "tensorboard") == {
        "train/loss": [0, 1, 2, 3],
        "val/score": [0, 1, 2, 3],
    }


def wandb_run(out, steps, **kw):
    """A finished offline W&B run of ``x = 123400 + step`` at ``steps``; its id and run file."""
    with make_sinks(["jsonl", "wandb"], out, health=None, **kw) as tracking:
        for step in steps:
            tracking.log({"x": 123400.0 + step}, step)
    run_id = json.loads((out / "run_ids.json").read_text())["wandb"]
    return run_id, wandb_run_files(out, run_id)[-1]


@pytest.mark.parametrize("damage", ["value", "format"])
def test_a_resumed_offline_wandb_run_is_rebuilt_from_the_journal(tmp_path, damage):
    """Resume never reads W&B's own run files (an undocumented format): the earlier session is set
    aside, whatever its file holds (a byte of a value damaged, or a format version this rlmetrics
    never saw), and the new session gets every step of the journal, then the steps after it."""
    out = tmp_path / "run"
    run_id, run_file = wandb_run(out, range(10))
    data = bytearray(run_file.read_bytes())
    data[data.index(b"123406") if damage == "value" else 6] ^= 1
    run_file.write_bytes(bytes(data))
    with make_sinks(["jsonl", "wandb"], out, health=None, resume=True) as tracking:
        assert tracking.resumed_at == 9
        for step in range(8, 12):
            tracking.log({"x": 123400.0 + step}, step)
    (rebuilt,) = wandb_run_files(out, run_id)
    assert rebuilt != run_file and tracking.sinks[1].run_id == run_id
    assert [(s, row["x"]) for s, row in wandb_rows([rebuilt]) if "x" in row] == [
        (s, 123400 + s) for s in range(12)
    ]
    assert (out / "wandb" / "replaced" / run_file.parent.name / run_file.name).read_bytes() == bytes(data)
    assert all(path.exists() for path in (out / "wandb").iterdir())  # no W&B link into a moved folder


def test_a_wandb_session_started_in_the_same_second_as_the_last_is_set_aside(tmp_path, monkeypatch):
    """W&B names a session's folder ``offline-run-<time>-<id>`` to the second and adds ``-1`` when
    that folder exists (a restart within the second). Empty folders of the next seconds stand in
    for such a start here: the first session lands in a ``-1`` folder, which the next session names
    among its earlier ones (what a rebuilt run sets aside), its own folder not."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    from rlmetrics.sinks import WandbSink

    run_id, wandb_dir = "samesecond1", tmp_path / "wandb"
    now = time.time()
    for t in range(30):
        stamp = time.strftime("%Y%m%d_%H%M%S", time.localtime(now + t))
        (wandb_dir / f"offline-run-{stamp}-{run_id}").mkdir(parents=True, exist_ok=True)
    with WandbSink(dir=tmp_path, resume=run_id) as first:
        first.log({"x": 1.0}, 1)
    assert Path(first.run.settings.sync_dir).name.endswith(f"-{run_id}-1")
    with WandbSink(dir=tmp_path, resume=run_id) as second:
        assert second.resumed_at is None  # offline: W&B knows nothing of the earlier sessions
        earlier = second.earlier_sessions()
    assert Path(first.run.settings.sync_dir) in earlier and Path(second.run.settings.sync_dir) not in earlier
    assert all(d.name.startswith("offline-run-") and run_id in d.name for d in earlier)


@pytest.mark.parametrize("first", [["wandb"], ["jsonl", "wandb"]])
def test_a_wandb_run_the_journal_does_not_hold_whole_continues_in_a_new_run(tmp_path, caplog, first):
    """The journal missing at a start (no ``jsonl`` then, or now) holds part of the run: the W&B run
    is not rebuilt from it (setting the earlier sessions aside would lose their steps) but continued
    in a new W&B run, with one warning naming the run and what to do; the earlier sessions stay."""
    second = ["jsonl", "wandb"] if first == ["wandb"] else ["wandb"]
    with make_sinks(first, tmp_path, health=None) as tracking:
        for step in range(5):
            tracking.log({"x": float(step)}, step)
    old = json.loads((tmp_path / "run_ids.json").read_text())["wandb"]
    with caplog.at_level("WARNING", logger="rlmetrics.sinks"):
        with make_sinks(second, tmp_path, health=None, resume=True) as tracking:
            tracking.log({"x": 5.0}, 5)
    new = json.loads((tmp_path / "run_ids.json").read_text())["wandb"]
    (warning,) = [r.getMessage() for r in caplog.records if "does not hold the whole" in r.getMessage()]
    assert old in warning and "a new run continues" in warning and new != old
    assert [s for s, row in wandb_rows(wandb_run_files(tmp_path, old)) if "x" in row] == list(range(5))
    assert not (tmp_path / "wandb" / "replaced").exists()
    caplog.clear()
    with make_sinks(["jsonl", "wandb"], tmp_path, health=None, resume=True) as tracking:  # jsonl from now on
        tracking.log({"x": 6.0}, 6)
    ids = json.loads((tmp_path / "run_ids.json").read_text())
    if first == ["wandb"]:  # the new run had the journal from its start: it is rebuilt and continued
        assert ids["wandb"] == new and not [r for r in caplog.records if "does not hold" in r.getMessage()]
        assert [s for s, row in wandb_rows(wandb_run_files(tmp_path, new)) if "x" in row] == [5, 6]
    else:  # the new run has steps the journal lacks: another new run
        assert ids["wandb"] not in (old, new)


def test_a_rebuilt_wandb_run_without_axes_is_not_given_the_journals_axis_steps(tmp_path):
    """The journal holds steps of a step axis; a ``WandbSink`` made without ``axes=True`` refuses
    them, so the rebuild gives it the train steps only (it was disabled by the first axis step)."""
    with make_sinks(["jsonl", "wandb"], tmp_path, health=None, axes=True) as tracking:
        tracking.log({"x": 0.0}, 0)
        tracking.log_axis({"r": 1.0}, 0, "policy_version")
    with make_sinks(["jsonl", "wandb"], tmp_path, health=None, resume=True) as tracking:
        tracking.log({"x": 1.0}, 1)
        assert not tracking.failed
    run_id = json.loads((tmp_path / "run_ids.json").read_text())["wandb"]
    assert [s for s, row in wandb_rows(wandb_run_files(tmp_path, run_id)) if "x" in row] == [0, 1]


def test_mlflow_alert_tag_holds_the_rules_latest_message(tmp_path):
    """A rule's second alert at a step (another metric) adds no point to ``alert/<rule>`` (one per
    rule and step) but its tag holds the latest message."""
    from rlmetrics.sinks import MLflowSink

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with MLflowSink(uri) as sink:
        sink.log({"critic/a": 1.0, "critic/b": 1.0}, 3)
        for metric in ("critic/a", "critic/b"):
            sink.alert(Alert("nan", 3, f"{metric} is NaN", "error", metric, float("nan")))
        run_id = sink.run_id
    from mlflow.tracking import MlflowClient

    assert mlflow_history(uri, run_id, "alert/nan") == [(3, 1.0)]
    assert "critic/b is NaN" in MlflowClient(uri).get_run(run_id).data.tags["alert/nan"]


def test_two_names_that_collide_in_a_tracker_keep_their_series_after_a_resume(tmp_path):
    """MLflow takes no ``@``: ``pass@k`` and ``pass_at_k`` both adapt to ``pass_at_k``, and the one
    met second gets ``pass_at_k__2``. The resumed session meets them in the other order first; its
    name map, rebuilt from the journal's order, keeps each on its series."""
    with make_sinks(["jsonl", "mlflow"], tmp_path, health=None) as tracking:
        tracking.log({"pass_at_k": 1.0}, 0)
        tracking.log({"pass@k": 2.0, "pass_at_k": 1.0}, 1)
    with make_sinks(["jsonl", "mlflow"], tmp_path, health=None, resume=True) as tracking:
        tracking.log({"pass@k": 3.0, "pass_at_k": 1.5}, 2)
    uri, run_id = (
        f"sqlite:///{tmp_path / 'mlflow.db'}",
        json.loads((tmp_path / "run_ids.json").read_text())["mlflow"],
    )
    assert sorted(mlflow_history(uri, run_id, "pass_at_k")) == [(0, 1.0), (1, 1.0), (2, 1.5)]
    assert sorted(mlflow_history(uri, run_id, "pass_at_k__2")) == [(1, 2.0), (2, 3.0)]


def test_an_mlflow_store_moved_away_as_the_refusal_advises_resumes_in_a_new_run(tmp_path, caplog):
    """Our refusal of a damaged ``mlflow.db`` says "move it away to start a new store": the resumed
    folder then gets a new MLflow run, caught up from ``metrics.jsonl`` (before, the id in
    ``run_ids.json`` was not in the new store and the resume raised)."""
    import json

    from mlflow.tracking import MlflowClient

    with make_sinks(["jsonl", "mlflow"], tmp_path, health=False) as tracking:
        for step in range(3):
            tracking.log({"a": float(step)}, step)
    old = json.loads((tmp_path / "run_ids.json").read_text())["mlflow"]
    (tmp_path / "mlflow.db").rename(tmp_path / "mlflow.db.damaged")
    with caplog.at_level("WARNING", logger="rlmetrics.sinks"):
        with make_sinks(["jsonl", "mlflow"], tmp_path, resume=True, health=False) as tracking:
            for step in range(3, 5):
                tracking.log({"a": float(step)}, step)
    new = json.loads((tmp_path / "run_ids.json").read_text())["mlflow"]
    assert new != old and f"MLflow run {old} is not in" in caplog.text
    history = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(new, "a")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(5)]
