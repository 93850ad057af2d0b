"""trackio, ClearML (offline) and a live Prometheus endpoint, each read back with its own reader:
the Prometheus endpoint scraped over HTTP on loopback and parsed with prometheus_client's parser,
trackio's SQLite store through trackio's ``SQLiteStorage``, ClearML's offline session through its
``metrics.jsonl`` event file (ClearML's own offline import needs a server)."""

import json
import logging
import os
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rlmetrics.health import Alert
from rlmetrics.messages import StepResult
from rlmetrics.sinks import PROMETHEUS_PORT, TRACKERS, adapt_name, make_sinks, read_jsonl
from tests.trackers import mlflow_server

pytestmark = pytest.mark.slow

STEPS = [
    {"critic/score/mean": 0.25 * s, "val-core/math/acc/mean@4": 1.0 / (s + 1), "loss": -s} for s in range(4)
]


def scrape(url: str) -> dict[str, list]:
    """family name → [(labels, value)] of the endpoint, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def test_prometheus_serves_the_newest_step_and_frees_its_port():
    from rlmetrics.sinks import PrometheusSink

    sink = PrometheusSink(run="demo")
    assert sink.url.startswith("http://127.0.0.1:")
    for step, values in enumerate(STEPS):
        sink.log(values, step)
        got = scrape(sink.url)
        assert got["rlmetrics_step"] == [({"run": "demo", "axis": "train_step"}, step)]
        assert got["rlmetrics_critic_score_mean"] == [({"run": "demo"}, values["critic/score/mean"])]
        assert got["rlmetrics_val_core_math_acc_mean_at_4"] == [
            ({"run": "demo"}, values["val-core/math/acc/mean@4"])
        ]
        assert got["rlmetrics_loss"] == [({"run": "demo"}, values["loss"])]
        assert set(got) == {
            "rlmetrics_step", "rlmetrics_critic_score_mean", "rlmetrics_val_core_math_acc_mean_at_4",
            "rlmetrics_loss", "rlmetrics_alerts",
        }  # fmt: skip
    sink.log({"critic/score/mean": 9.0}, 7)  # a metric missing from the newest step holds its value
    got = scrape(sink.url)
    assert (
        got["rlmetrics_loss"] == [({"run": "demo"}, -3.0)] and got["rlmetrics_critic_score_mean"][0][1] == 9.0
    )
    sink.log({"critic/score/mean": 8.0}, 1004)  # not logged in the last 1000 steps: not served
    got = scrape(sink.url)
    assert "rlmetrics_loss" not in got and got["rlmetrics_critic_score_mean"][0][1] == 8.0
    sink.alert(Alert(step=7, rule="reward_collapse", message="x"))
    sink.alert(Alert(step=8, rule="reward_collapse", message="y"))
    assert scrape(sink.url)["rlmetrics_alerts"] == [({"run": "demo", "rule": "reward_collapse"}, 2.0)]
    sink.log_axis({"reward/mean": 0.5}, 3, "policy_version")
    got = scrape(sink.url)
    assert ({"run": "demo", "axis": "policy_version"}, 3.0) in got["rlmetrics_step"]
    assert got["rlmetrics_policy_version_reward_mean"] == [({"run": "demo"}, 0.5)]
    port = sink.port
    sink.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    with PrometheusSink(
        port
    ) as again:  # the port is free again (its closed connections may wait in TIME_WAIT)
        again.log({"a": 1.0}, 0)
        assert scrape(again.url)["rlmetrics_a"] == [({"run": "rlmetrics"}, 1.0)]
    with pytest.raises(ValueError, match="closed"):
        sink.log({"a": 1.0}, 9)


def test_prometheus_names_never_meet_and_the_step_gauge_is_kept():
    from rlmetrics.sinks import PrometheusSink

    with PrometheusSink() as sink:
        sink.log({"a/b": 1.0, "a-b": 2.0, "step": 3.0, "x:y": 4.0}, 0)
        got = scrape(sink.url)
    assert got["rlmetrics_a_b"][0][1] == 1.0 and got["rlmetrics_a_b__2"][0][1] == 2.0
    assert got["rlmetrics_step__2"][0][1] == 3.0 and got["rlmetrics_step"][0][1] == 0.0
    assert got["rlmetrics_x_y"][0][1] == 4.0
    with PrometheusSink() as sink:  # HELP is each gauge's rlmetrics name
        sink.log({"a/b": 1.0, "a-b": 2.0}, 0)
        page = urllib.request.urlopen(sink.url).read().decode()
    assert "# HELP rlmetrics_a_b a/b" in page and "# HELP rlmetrics_a_b__2 a-b" in page
    with PrometheusSink() as sink:  # a metric named as the alert counter's sample (issue 46): before, the
        sink.log({"alerts/total": 5.0}, 0)  # whole exposition was unparseable
        got = scrape(sink.url)
    assert got["rlmetrics_alerts_total__2"][0][1] == 5.0 and "rlmetrics_alerts" in got
    assert adapt_name("critic/score/mean", "prometheus") == "critic_score_mean"


def test_prometheus_through_make_sinks_on_a_given_port(tmp_path, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(PROMETHEUS_PORT, str(port))
    with make_sinks(["jsonl", "prometheus"], tmp_path / "run", run_name="r1") as tracking:
        for step, values in enumerate(STEPS):
            tracking.log(StepResult(values, step), step)
        got = scrape(f"http://127.0.0.1:{port}/metrics")
    assert got["rlmetrics_critic_score_mean"] == [({"run": "r1"}, STEPS[-1]["critic/score/mean"])]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]  # no file of its own


@pytest.fixture
def local_trackio(monkeypatch):
    for var in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("trackio")


def trackio_logs(project: str, run: str) -> dict[int, dict]:
    from trackio.sqlite_storage import SQLiteStorage

    rows = SQLiteStorage.get_logs(project, run)
    steps = [int(r["step"]) for r in rows]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {int(r["step"]): r for r in rows}


def test_trackio_reads_back_and_resumes(tmp_path, local_trackio):
    out = tmp_path / "run"
    with make_sinks(["jsonl", "trackio"], out, project="proj", run_name="r1", config={"lr": 0.1}) as tracking:
        for step, values in enumerate(STEPS[:3]):
            tracking.log(StepResult(values, step), step)
    assert (out / "trackio" / "proj.db").exists()
    logs = trackio_logs("proj", "r1")
    assert sorted(logs) == [0, 1, 2]
    for step in range(3):
        for name, value in STEPS[step].items():
            assert logs[step][name] == pytest.approx(value)
    assert json.loads((out / "run_ids.json").read_text())["trackio"] == "r1"
    # a restart: the folder's trackio run continues, catching up from the JSONL file
    JSONL = out / "metrics.jsonl"
    with JSONL.open("a") as f:  # a step the JSONL file has and trackio lacks (a killed process)
        f.write(json.dumps({"step": 3, "metrics": STEPS[3]}) + "\n")
    assert [r["step"] for r in read_jsonl(JSONL).records] == [0, 1, 2, 3]
    with make_sinks(["jsonl", "trackio"], out, project="proj", run_name="r1", resume=True) as tracking:
        assert tracking.resumed_at == 3
        tracking.log(StepResult({"critic/score/mean": 5.0}, 4), 4)
        tracking.log(StepResult({"critic/score/mean": 7.0}, 2), 2)  # held: skipped
    logs = trackio_logs("proj", "r1")
    assert sorted(logs) == [0, 1, 2, 3, 4]
    assert (
        logs[3]["loss"] == -3 and logs[4]["critic/score/mean"] == 5.0 and logs[2]["critic/score/mean"] == 0.5
    )


def test_trackio_refuses_a_remote_run(tmp_path, local_trackio, monkeypatch):
    from rlmetrics.sinks import TrackioSink

    monkeypatch.setenv("TRACKIO_SPACE_ID", "someone/space")
    with pytest.raises(RuntimeError, match="TRACKIO_SPACE_ID"):
        TrackioSink(logdir=tmp_path)


def clearml_events(folder: Path) -> list[dict]:
    """The events of a ClearML offline session: ``metrics.jsonl``, a JSON list of events a line."""
    return [
        e for line in (folder / "metrics.jsonl").read_text().splitlines() if line for e in json.loads(line)
    ]


def test_clearml_offline_reads_back_and_refuses_resume(tmp_path):
    pytest.importorskip("clearml")
    out = tmp_path / "run"
    with make_sinks(["clearml"], out, project="proj", run_name="r1", config={"lr": 0.1}) as tracking:
        for step, values in enumerate(STEPS):
            tracking.log(StepResult(values, step), step)
        sink = tracking.sinks[0]
        folder = sink.folder
        task_id = sink.run_id
    assert folder.parent == (out / "clearml" / "offline").resolve() and folder.name == task_id
    assert (folder.parent / f"{task_id}.zip").exists()
    scalars = {
        (e["metric"], e["variant"], e["iter"]): e["value"]
        for e in clearml_events(folder)
        if e["type"] == "training_stats_scalar"
    }
    expected = {
        ("critic/score", "mean"): "critic/score/mean",
        ("val-core/math/acc", "mean@4"): "val-core/math/acc/mean@4",
        ("loss", "loss"): "loss",
    }
    for (title, series), name in expected.items():
        for step, values in enumerate(STEPS):
            assert scalars[(title, series, step)] == pytest.approx(values[name])
    task = json.loads((folder / "task.json").read_text())
    assert task["name"] == "r1"
    with pytest.raises(ValueError, match="clearml"):
        make_sinks(["clearml"], out, resume=True)


def test_clearml_one_task_per_process(tmp_path):
    pytest.importorskip("clearml")
    from rlmetrics.sinks import ClearMLSink

    with ClearMLSink(logdir=tmp_path / "a") as first:
        with pytest.raises(RuntimeError, match="one per process"):
            ClearMLSink(logdir=tmp_path / "b")
        first.log({"loss": 1.0}, 0)
    assert [e["value"] for e in clearml_events(first.folder) if e["type"] == "training_stats_scalar"] == [1.0]


def test_the_new_trackers_are_registered():
    assert {"prometheus", "trackio", "clearml"} <= set(TRACKERS)
    assert adapt_name("loss", "clearml") == "loss/loss"
    assert adapt_name("val-core/acc/mean@4", "trackio") == "val-core/acc/mean@4"


def test_a_step_logged_twice_is_skipped_by_every_sink(tmp_path, monkeypatch, local_trackio, caplog, capsys):
    """A retried loop iteration logs step 1 again: one warning, no sink disabled, every tracker's own
    reader finds steps 0-3 once each with the first values of step 1."""
    pytest.importorskip("clearml")
    from tests.trackers import mlflow_history, one, swanlab_scalars, tensorboard_steps, wandb_rows

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(PROMETHEUS_PORT, str(port))
    out = tmp_path / "run"
    with make_sinks(list(TRACKERS), out, project="twice", run_name="r1") as tracking:
        for step, loss in [(0, 0.0), (1, 1.0), (1, 101.0), (2, 2.0), (3, 3.0)]:  # step 1 retried
            tracking.log(StepResult({"loss": loss}, step), step)
        assert not tracking.failed
        assert scrape(f"http://127.0.0.1:{port}/metrics")["rlmetrics_loss"][0][1] == 3.0
        ids = {name: sink.run_id for name, sink in zip(TRACKERS, tracking.sinks)}
        clearml_folder = tracking.sinks[list(TRACKERS).index("clearml")].folder
    repeats = [r for r in caplog.records if "step 1 is logged already" in r.getMessage()]
    assert len(repeats) == 1 and repeats[0].levelname == "WARNING"
    want = [(s, float(s)) for s in range(4)]
    jsonl = read_jsonl(out / "metrics.jsonl")
    assert list(zip(*jsonl.series("loss"))) == want
    assert tensorboard_steps(out / "tensorboard")["loss"] == [0, 1, 2, 3]
    rows = wandb_rows([one(out, "wandb/offline-run-*/run-*.wandb")])
    assert [(step, row["loss"]) for step, row in rows] == want
    assert mlflow_history(f"sqlite:///{out / 'mlflow.db'}", ids["mlflow"], "loss") == want
    assert swanlab_scalars([one(out, "swanlab/run-*/run-*.swanlab")])["loss"] == want
    logs = trackio_logs("twice", "r1")  # asserts each step is there once
    assert [(s, logs[s]["loss"]) for s in sorted(logs)] == want
    events = clearml_events(clearml_folder)
    assert [
        (e["iter"], e["value"])
        for e in events
        if e["type"] == "training_stats_scalar" and e["metric"] == "loss"
    ] == want
    tables = capsys.readouterr().out
    assert [tables.count(f"step {s}") for s in range(4)] == [1, 1, 1, 1] and not re.search(
        r"(?<![\w.])101(?![\w.])", tables
    )


@pytest.mark.slow
def test_a_teams_mlflow_server_gets_every_step_through_a_freeze_a_kill_and_a_resume(
    tmp_path, monkeypatch, caplog
):
    """``MLFLOW_TRACKING_URI`` names a real MLflow server: ``make_sinks`` logs the run there (no
    ``mlflow.db`` in the run folder; before, the variable was ignored), and a resume of the folder
    continues that run on the server. Mid-run the server is frozen (SIGSTOP) and let go, then killed
    (SIGKILL) and restarted on its port (issue 46, "never stall training"): the training loop goes on
    through both (while the server is stopped or dead, every ``log()`` of the loop returned), one
    warning says MLflow failed, one that it is back, and MLflow holds every step once. Before, the
    first ``log()`` after the kill waited in MLflow's retries (246.7 s), and MLflow logging was then
    disabled for the rest of the run."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # our retries, not MLflow's 4 minutes
    proc, uri = mlflow_server(tmp_path)
    port = int(uri.rsplit(":", 1)[1])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    out, step = tmp_path / "run", 0

    def train(steps):
        nonlocal step
        for _ in range(steps):
            tracking.log(StepResult({"x/mean": float(step), "y": -float(step)}, step), step)
            step += 1

    def train_in_thread(steps):
        loop = threading.Thread(target=train, args=(steps,))
        loop.start()
        loop.join(60)  # a loop held by the server would still be inside log()
        assert not loop.is_alive(), "log() waited for the MLflow server"

    try:
        with caplog.at_level(logging.WARNING, logger="rlmetrics.sinks"):
            tracking = make_sinks(["jsonl", "mlflow"], out, health=False)
            train(5)
            os.killpg(proc.pid, signal.SIGSTOP)  # the server and its worker
            train_in_thread(10)
            os.killpg(proc.pid, signal.SIGCONT)
            train(5)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            train_in_thread(10)
            proc, _ = mlflow_server(tmp_path, port)
            tracking.close()  # tries at once, whatever the retry's backoff
            with make_sinks(["jsonl", "mlflow"], out, resume=True, health=False) as tracking:
                train(5)
        assert not (out / "mlflow.db").exists()
        run_id = json.loads((out / "run_ids.json").read_text())["mlflow"]
        history = MlflowClient(uri).get_metric_history(run_id, "x/mean")
        assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(35)]
        assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED"
        text = [r.getMessage() for r in caplog.records]
        assert sum("tracker mlflow failed" in t for t in text) == 1
        assert sum("tracker mlflow is back" in t for t in text) == 1
        assert not [t for t in text if "not delivered" in t or "lost" in t]
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


@pytest.mark.slow
def test_an_mlflow_server_down_when_the_run_starts_holds_nothing_and_gets_every_step(tmp_path, monkeypatch):
    """A real ``mlflow server`` that is not up yet when the driver starts (issue 46, "never stall"):
    ``make_sinks`` returns without asking it anything, the loop's ``log()`` calls return, and once
    the server is up the run is created, holds every step and the config, and its id is saved in
    ``run_ids.json`` (a resume continues it). Before, ``make_sinks`` waited in MLflow's retries
    (about 4 minutes by default) and then raised: the training never started."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # our retries, not MLflow's 4 minutes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    out, proc = tmp_path / "run", None

    def train(tracking, steps):
        loop = threading.Thread(target=lambda: [tracking.log({"x": float(s)}, s) for s in steps])
        loop.start()
        loop.join(60)  # a loop held by the server would still be inside log()
        assert not loop.is_alive(), "log() waited for the MLflow server"

    try:
        started = []
        starter = threading.Thread(
            target=lambda: started.append(
                make_sinks(["jsonl", "mlflow"], out, health=False, config={"lr": 0.1})
            )
        )
        starter.start()
        starter.join(60)
        assert started, "make_sinks waited for the MLflow server"
        tracking = started[0]
        train(tracking, range(10))
        assert not (out / "run_ids.json").exists()  # no run yet
        proc, uri = mlflow_server(tmp_path, port)
        tracking.close()
        run_id = json.loads((out / "run_ids.json").read_text())["mlflow"]
        with make_sinks(["jsonl", "mlflow"], out, resume=True, health=False) as tracking:
            train(tracking, range(10, 15))
        client = MlflowClient(uri)
        assert sorted(m.step for m in client.get_metric_history(run_id, "x")) == list(range(15))
        run = client.get_run(run_id)
        assert run.data.params == {"lr": "0.1"} and run.info.status == "FINISHED"
        assert len(client.search_runs([run.info.experiment_id])) == 1
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)


@pytest.mark.slow
def test_a_run_resumed_while_the_mlflow_server_is_down_goes_on_and_logs_each_step_once(tmp_path, monkeypatch):
    """A driver restarted from an older checkpoint while the tracking server is down (a node lost,
    the server with it): ``make_sinks(resume=True)`` returns, the loop's ``log()`` calls return,
    and once the server is back the run learns the steps it holds: the steps logged again are not
    sent twice, the journal's steps the server lacked are. Before, the resume raised."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    proc, uri = mlflow_server(tmp_path)
    port = int(uri.rsplit(":", 1)[1])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    out = tmp_path / "run"
    try:
        with make_sinks(["jsonl", "mlflow"], out, health=False) as tracking:
            for step in range(10):
                tracking.log({"x": float(step)}, step)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        resumed = []
        starter = threading.Thread(
            target=lambda: resumed.append(make_sinks(["jsonl", "mlflow"], out, resume=True, health=False))
        )
        starter.start()
        starter.join(60)
        assert resumed, "make_sinks(resume=True) waited for the MLflow server"
        tracking = resumed[0]
        assert tracking.resumed_at == 9
        loop = threading.Thread(target=lambda: [tracking.log({"x": 100.0 + s}, s) for s in range(5, 15)])
        loop.start()
        loop.join(60)
        assert not loop.is_alive(), "log() waited for the MLflow server"
        proc, _ = mlflow_server(tmp_path, port)
        tracking.close()
        run_id = json.loads((out / "run_ids.json").read_text())["mlflow"]
        history = MlflowClient(uri).get_metric_history(run_id, "x")
        assert sorted((m.step, m.value) for m in history) == [
            (s, float(s if s < 10 else 100 + s)) for s in range(15)
        ]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_prometheus_as_a_scraper_sees_its_last_step_counters_from_0_and_held_gauges(tmp_path, monkeypatch):
    """A scraper parsing the exposition format while steps are logged (issue 46): every scrape is
    one step's values; the alert counters start at 0 (``increase()`` sees a rule's first alert); a
    validation gauge holds its value between rounds; and ``close()`` serves the last step until the
    endpoint is scraped once more (before, the endpoint closed with the last step never scraped)."""
    monkeypatch.delenv(PROMETHEUS_PORT, raising=False)
    scrapes, stop, first, last = [], threading.Event(), threading.Event(), []

    def scraper():
        while not stop.is_set():
            scrapes.append(scrape(url))
            first.set()

    def late_scraper():  # Prometheus' next scrape, after the run's last step and close()
        time.sleep(0.5)
        try:
            last.append(scrape(url))
        except OSError as exc:
            last.append(exc)

    with make_sinks(["jsonl", "prometheus"], tmp_path / "run", run_name="r") as tracking:
        url = next(s for s in tracking.sinks if s.tracker == "prometheus").url
        threads = [threading.Thread(target=scraper), threading.Thread(target=late_scraper)]
        threads[0].start()
        assert first.wait(60)
        for step in range(40):
            values = {"x": float(step), "y": 2.0 * step}
            if step in (5, 30):
                values["val-core/acc/mean@4"] = step / 100
            if step == 20:
                values["x"] = float("nan")  # the non_finite rule's alert
            if step == 39:
                stop.set()
                threads[0].join(60)
                threads[1].start()
            tracking.log(values, step)
    threads[1].join(60)
    (final,) = last
    assert isinstance(final, dict), final  # before, the endpoint was closed: the last step never scraped
    counters = [dict((s[0]["rule"], s[1]) for s in got["rlmetrics_alerts"]) for got in [*scrapes, final]]
    assert counters[0]["non_finite"] == 0 and counters[-1]["non_finite"] == 1  # the first, the late one
    served = [(got["rlmetrics_step"][0][1], got) for got in scrapes if "rlmetrics_y" in got]
    for step, got in served:  # one step's values in every scrape
        assert got["rlmetrics_y"][0][1] == 2 * step
        if 5 <= step < 30:
            assert got["rlmetrics_val_core_acc_mean_at_4"][0][1] == 0.05
    assert final["rlmetrics_step"][0][1] == 39 and final["rlmetrics_val_core_acc_mean_at_4"][0][1] == 0.3
