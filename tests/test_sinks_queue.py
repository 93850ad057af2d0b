"""A tracker that is down, frozen or slow never holds a training step (issue 46, "never stall
training"): each background sink has its own queue and thread (:mod:`rlmetrics.sinks.writer`).

The trackers here are sinks whose calls fail or block on an Event the test holds, so what the
training loop does while the tracker is down is decided by the test, not by a clock; the real
MLflow server killed and frozen mid-run is tests/test_sinks_more.py.
"""

import logging
import threading

import pytest

from rlmetrics import StepResult
from rlmetrics.health import Alert
from rlmetrics.sinks import JsonlSink, Sink, Tracking, read_jsonl


class Remote(Sink):
    """A tracker behind a server: ``up`` cleared, each call fails; ``frozen`` cleared, each call
    waits for it."""

    tracker = "remote"
    background = True

    def __init__(self):
        self.up, self.frozen = threading.Event(), threading.Event()
        self.up.set()
        self.frozen.set()
        self.steps, self.alerts, self.closed, self.failures = [], [], False, 0
        self.entered = threading.Event()  # a call is in flight
        self.refused = threading.Event()  # a call failed

    def _serve(self):
        self.entered.set()
        self.frozen.wait()
        if not self.up.is_set():
            self.failures += 1
            self.refused.set()
            raise ConnectionError("tracking server down")

    def log(self, metrics, step):
        self._serve()
        self.steps.append((step, dict(metrics)))

    def alert(self, alert):
        self._serve()
        self.alerts.append(alert.step)

    def close(self):
        self.closed = True


def messages(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_tracker_down_costs_the_loop_nothing_and_gets_every_step_when_it_returns(caplog, tmp_path):
    remote = Remote()
    with caplog.at_level(logging.WARNING, logger="rlmetrics.sinks"):
        with Tracking(
            [JsonlSink(tmp_path / "m.jsonl"), remote], health=False, retry=(0.01, 0.05)
        ) as tracking:
            tracking.log({"a": 0.0}, 0)
            remote.up.clear()
            for step in range(1, 20):
                values = {"a": float(step)}
                tracking.log(values, step)
                values["a"] = -1.0  # a caller reusing its dict does not change what the tracker gets
            assert read_jsonl(tmp_path / "m.jsonl").steps == list(range(20))  # the journal first, at once
            assert remote.refused.wait(60)
            remote.up.set()
    assert remote.steps == [(s, {"a": float(s)}) for s in range(20)] and remote.closed
    assert remote.failures >= 1
    assert len(messages(caplog, "failed at train_step")) == 1 and len(messages(caplog, "is back")) == 1


def test_a_frozen_tracker_does_not_hold_the_loop(caplog):
    remote = Remote()
    tracking = Tracking([remote], health=False)
    remote.frozen.clear()
    tracking.log({"a": 0.0}, 0)
    assert remote.entered.wait(60)  # the writer is inside the tracker's call, which does not return
    loop = threading.Thread(target=lambda: [tracking.log({"a": float(s)}, s) for s in range(1, 50)])
    loop.start()
    loop.join(60)  # returns at once: before, the first log() waited for the tracker, forever
    assert (
        not loop.is_alive()
        and remote.steps == []
        and tracking.writers[0].pending() == [("train_step", s) for s in range(50)]
    )
    remote.frozen.set()
    tracking.close()
    assert [s for s, _ in remote.steps] == list(range(50))


def test_a_full_queue_is_read_back_from_the_journal_in_order(caplog, tmp_path):
    """A queue of 3 steps, a tracker down for 30: the steps it did not hold come from the journal,
    with their alerts, in order, once; steps of another axis too."""
    remote = Remote()
    journal = JsonlSink(tmp_path / "m.jsonl")
    journal.overwrite = True  # as verl's Tracking has it: a later call at a step adds to it
    with caplog.at_level(logging.WARNING, logger="rlmetrics.sinks"):
        tracking = Tracking([journal, remote], health=False, queue=3, retry=(0.01, 0.05))
        remote.up.clear()
        for step in range(30):
            tracking.log(StepResult({"a": float(step), "b/c": step / 2}, step), step)
            if step == 12:
                later = {"a": 12.0, "b/c": 6.0, "val/x": 1.0}
                for sink in (journal, remote):
                    tracking.write(sink, later, 12, [Alert("r", 12, "m", "warning", "a", 12.0)])
        tracking.log_axis({"r": 1.0}, 3, "policy_version")
        remote.up.set()
        tracking.close()
    train = [(s, m) for s, m in remote.steps if "a" in m]
    assert [s for s, _ in train] == list(range(30))
    coverage = {"meta/coverage": 1.0, "meta/late": 0.0}
    assert dict(train)[29] == {"a": 29.0, "b/c": 14.5, **coverage}
    assert dict(train)[12] == {"a": 12.0, "b/c": 6.0, "val/x": 1.0}  # the step's later record, once
    assert [s for s, _ in train] == sorted(s for s, _ in train)  # in order
    assert remote.alerts == [12]
    assert (3, {"policy_version/r": 1.0}) in remote.steps
    assert len(messages(caplog, "steps behind")) == 1 and not messages(caplog, "lost")


def test_without_a_journal_a_full_queue_drops_steps_and_says_which(caplog):
    remote = Remote()
    with caplog.at_level(logging.WARNING, logger="rlmetrics.sinks"):
        tracking = Tracking([remote], health=False, queue=2, retry=(0.01, 0.05))
        remote.up.clear()
        for step in range(6):
            tracking.log({"a": float(step)}, step)
        remote.up.set()
        tracking.close()
    assert [s for s, _ in remote.steps] == [0, 1]
    assert len(messages(caplog, "never (no journal: dropped)")) == 1
    assert len(messages(caplog, "not in the journal and are lost")) == 1
    assert "[('train_step', 2), ('train_step', 3)" in messages(caplog, "lost")[0]


def test_close_waits_a_bounded_time_and_names_what_it_could_not_deliver(caplog, tmp_path):
    remote = Remote()
    remote.up.clear()
    with caplog.at_level(logging.WARNING, logger="rlmetrics.sinks"):
        tracking = Tracking([JsonlSink(tmp_path / "m.jsonl"), remote], health=False, close_timeout=0.2)
        for step in range(5):
            tracking.log({"a": float(step)}, step)
        assert remote.refused.wait(60)
        tracking.close()  # the tracker never comes back
    assert (
        len(messages(caplog, "tracker remote is down with 5 steps to deliver: close() waits up to 0.2 s"))
        == 1
    )
    (error,) = messages(caplog, "not delivered")
    assert "tracker remote: 5 steps (0 to 4) not delivered 0.2 s after close()" in error
    assert "m.jsonl: make_sinks(..., resume=True)" in error and not remote.closed
    assert tracking.undelivered == {"remote": [0, 1, 2, 3, 4]}  # what a driver can check in code


@pytest.mark.parametrize("journal_first", [True, False])
def test_the_journal_is_never_disabled(caplog, tmp_path, journal_first):
    """A journal write that fails (a full disk) is reported once; the next steps are written."""
    journal = JsonlSink(tmp_path / "m.jsonl")
    write = journal._write
    full = {"disk": True}

    def flaky(record):
        if full["disk"] and record.get("step") in (1, 2):
            raise OSError("No space left on device")
        write(record)

    journal._write = flaky
    with caplog.at_level(logging.WARNING, logger="rlmetrics.sinks"):
        with Tracking([journal] if journal_first else [Remote(), journal], health=False) as tracking:
            for step in range(5):
                tracking.log({"a": float(step)}, step)
            assert not tracking.failed
    assert read_jsonl(tmp_path / "m.jsonl").steps == [0, 3, 4]
    assert (
        len(messages(caplog, "tried again at each step")) == 1 and len(messages(caplog, "writes again")) == 1
    )


@pytest.mark.parametrize(
    "error", [ValueError("logs steps of axes when created with axes=True"), SystemExit(3)]
)
def test_an_error_a_retry_cannot_mend_disables_the_tracker_once(caplog, error):
    """A sink's bug or a refusal (a ValueError: W&B made without ``axes=True`` given a step axis; a
    library's ``sys.exit``) is not retried for ever: the sink is disabled, said once, and closed."""

    class Refusing(Remote):
        def log_axis(self, metrics, step, axis):
            raise error

    remote = Refusing()
    with caplog.at_level(logging.ERROR, logger="rlmetrics.sinks"):
        with Tracking([remote], health=False, retry=(0.01, 0.05)) as tracking:
            tracking.log({"a": 0.0}, 0)
            tracking.log_axis({"v": 1.0}, 0, "policy_version")
            for step in range(1, 5):
                tracking.log({"a": float(step)}, step)
            tracking.writers[0].finish()
            assert tracking.writers[0].join(60) == []
            assert tracking.failed == {0: error}
    assert [s for s, _ in remote.steps] == [0] and remote.closed
    assert len(messages(caplog, "is disabled")) == 1 and not messages(caplog, "not delivered")


def test_the_journal_is_written_first_whatever_the_order_of_the_sinks(tmp_path, caplog):
    """``Tracking([tracker, journal])``: a tracker behind still finds each step in the journal."""
    remote = Remote()
    with caplog.at_level(logging.WARNING, logger="rlmetrics.sinks"):
        tracking = Tracking(
            [remote, JsonlSink(tmp_path / "m.jsonl")], health=False, queue=2, retry=(0.01, 0.05)
        )
        remote.up.clear()
        for step in range(10):
            tracking.log({"a": float(step)}, step)
        remote.up.set()
        tracking.close()
    assert [s for s, _ in remote.steps] == list(range(10)) and remote.closed
    assert not messages(caplog, "lost") and not messages(caplog, "not delivered")


@pytest.mark.slow
def test_a_script_that_ends_without_close_still_delivers_every_step(tmp_path):
    """A script's last ``log()`` then its end, no ``close()``: the trackers' threads deliver their
    queues at exit, before W&B's own exit hook ends its service (before, with the queues and
    without the exit hook, MLflow held 0 of 50 steps; with the hook registered at import, W&B 0)."""
    import json
    import os
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    from tests.trackers import read_wandb

    script = (
        "import sys\n"
        "from rlmetrics.sinks import make_sinks\n"
        "tracking = make_sinks(['jsonl', 'mlflow', 'wandb'], sys.argv[1], health=False)\n"
        "for step in range(50):\n"
        "    tracking.log({'x': float(step)}, step)\n"
    )
    argv = [sys.executable, "-c", script, str(tmp_path)]
    # a W&B run earlier in this process left WANDB_SERVICE set: the script would log to that service
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    out = subprocess.run(argv, timeout=300, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    run_id = json.loads((tmp_path / "run_ids.json").read_text())["mlflow"]
    history = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(run_id, "x")
    assert sorted(m.step for m in history) == list(range(50))
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    assert sorted(read_wandb(run_file)) == list(range(50)), out.stderr[-3000:]


@pytest.mark.parametrize("timeout", ["5", -1, None, float("inf")])
def test_a_close_timeout_that_is_no_number_of_seconds_is_refused_at_once(timeout):
    with pytest.raises(ValueError, match=f"close_timeout={timeout!r}: the seconds close"):
        Tracking([Remote()], health=False, close_timeout=timeout)
