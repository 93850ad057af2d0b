"""The trainer's step is the step (issue 45, points 1 and 8a-c), the way a user hits it on Ray: rank
actors with one client each, a driver that reads verl's 1-based ``global_steps``, a second reader,
a step numbered like a token count, a driver SIGKILLed during a read. Values are compared with numpy
on the concatenation of every rank's data.
"""

import json
import subprocess
import sys
import time
import uuid
import warnings

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import rlmetrics  # noqa: E402
from rlmetrics.messages import StepWarning  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

WORLD = 4
QUICK = 30.0  # a read that waited for no deadline returns well within this (the deadlines are 60 s)


@pytest.fixture(scope="module", autouse=True)
def ray_instance(ray_session):
    """Every test of this module runs on the module's Ray instance (tests/conftest.py)."""


@pytest.fixture
def name():
    name = f"steps-{uuid.uuid4().hex[:8]}"
    yield name
    for namespace in (None, "steps-ns"):
        try:
            ray.kill(ray.get_actor(name, namespace=namespace))
        except ValueError:
            pass


def rank_data(rank, step):
    rng = np.random.default_rng([rank, step])
    return step * 1000.0 + rng.random(3 + 2 * rank)


@ray.remote(num_cpus=0)
class Rank:
    """One data-parallel rank of a trainer: its own client, as a verl worker holds it."""

    def __init__(self, rank, world, name, namespace=None):
        import warnings

        import rlmetrics

        warnings.simplefilter("always")
        self.rank = rank
        self.client = rlmetrics.connect(
            "ray", name=name, namespace=namespace, world_size=world, label=f"rank{rank}"
        )
        self.caught = []

    def step(self, data_step, close_step=None, sleep=0.0, extra=None):
        """Submit ``data_step``'s data and close it: with ``close_step`` (the trainer's step passed
        as ``step=``) or with the client's own counter (None); ``extra``: one more ``(metrics, step)``."""
        time.sleep(sleep)
        d = rank_data(self.rank, data_step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.client.submit_metric({"x/mean": d, "x/min": d, "x/max": d}, step=close_step)
            if extra is not None:
                metrics, step = extra
                self.client.submit_metric(metrics, world_size=1, step=step)
                self.client.wait_submit(step=step)
            self.client.wait_submit(step=close_step)
            self.client.flush()
        self.caught += [str(w.message) for w in caught]
        return self.client.step

    def warnings(self):
        self.client.flush()
        return self.caught


def check(res, data_step, ranks=range(WORLD)):
    """``res`` is data step ``data_step`` of ``ranks``, whole: numpy on their concatenation."""
    allv = np.concatenate([rank_data(r, data_step) for r in ranks])
    assert res.meta.complete and not res.meta.provisional, res.meta
    assert res["x/mean"] == pytest.approx(allv.mean(), rel=1e-12)
    assert (res["x/min"], res["x/max"]) == (allv.min(), allv.max())
    assert res.meta.late == 0


def timed(read, *args, **kwargs):
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = read(*args, **kwargs)
    return res, time.monotonic() - start, [w for w in caught]


def test_verl_loop_passes_global_steps_to_the_ranks_from_1_and_after_a_resume(name):
    """verl's loop: ``global_steps`` from 1 (from the checkpoint's step after a resume); each rank
    passes it (``submit_metric(step=)`` / ``wait_submit(step=)``) and the driver reads it with
    ``result(global_steps, 60, finalize=True)`` and ``wait_final_res()``: every read returns at once
    and whole; no step 0 is ever closed and nothing waits on it."""
    reader = rlmetrics.connect("ray", name=name, final_timeout=60)
    ranks = [Rank.remote(r, WORLD, name) for r in range(WORLD)]
    for global_steps in (*range(1, 4), *range(7, 9)):  # a run, then a resume from step 7's checkpoint
        ray.get([a.step.remote(global_steps, global_steps) for a in ranks])
        res, took, _ = timed(reader.result, global_steps, timeout=60, finalize=True)
        assert took < QUICK and res.step == global_steps
        check(res, global_steps)
        final, took, _ = timed(reader.wait_final_res)
        assert took < QUICK and final.step == global_steps
        check(final, global_steps)
    assert all(not w for w in ray.get([a.warnings.remote() for a in ranks]))


def test_a_driver_one_step_ahead_of_the_ranks_finalizes_nothing_and_is_told_how_to_align(name):
    """Issue 45, point 1: the ranks count from 0 (no ``step=``), the driver reads verl's 1-based
    ``global_steps`` with ``finalize=True``. The read of a step nothing arrived for returns at its
    deadline provisional and empty, with a warning naming where the ranks are and ``step=``; it
    ends nothing, so the ranks' data for that step, which comes one iteration later, is whole and
    not late. Before: each step was finalized empty and the ranks' data for it dropped as late."""
    reader = rlmetrics.connect("ray", name=name)
    ranks = [Rank.remote(r, WORLD, name) for r in range(WORLD)]
    for global_steps in (1, 2, 3):
        ray.get([a.step.remote(global_steps - 1) for a in ranks])  # the ranks' own counter: 0, 1, 2
        res, took, caught = timed(reader.result, global_steps, timeout=3, finalize=True)
        assert res.meta.provisional and not res and res.meta.late == 0, res.meta
        assert set(res.meta.ranks_at.values()) == {global_steps - 1}
        [warning] = [w for w in caught if issubclass(w.category, StepWarning)]
        text = str(warning.message)
        assert f"step {global_steps}" in text and f"closed up to step {global_steps - 1}" in text, text
        assert "rank0, rank1, rank2, rank3" in text and "step=global_steps" in text, text
    for step in (1, 2):  # the ranks' data for the steps read too early is there, whole
        check(reader.result(step, timeout=60, finalize=True), step)
    assert not [w for w in ray.get([a.warnings.remote() for a in ranks]) if w], "late data in a rank"


def test_a_read_of_a_step_every_rank_went_past_returns_at_once_and_ends_nothing(name):
    """The ranks pass the trainer's step and close 1 and 3 (2 was not theirs): a read of step 2
    returns at once (every registered rank closed a later step without data for 2), provisional."""
    reader = rlmetrics.connect("ray", name=name)
    ranks = [Rank.remote(r, WORLD, name) for r in range(WORLD)]
    for step in (1, 3):
        ray.get([a.step.remote(step, step) for a in ranks])
    res, took, caught = timed(reader.result, 2, timeout=60, finalize=True)
    assert took < QUICK and res.meta.provisional and not res
    assert "went past it" in str([w.message for w in caught if issubclass(w.category, StepWarning)])
    check(reader.result(3, timeout=60, finalize=True), 3)


def test_one_step_numbered_like_a_token_count_does_not_take_wait_final_res_over(name):
    """Issue 45, point 8a: at step 2, rank 3 also sends one submission whose step is a token count
    (10**6) and closes it. ``wait_final_res()`` still returns steps 0..5 in order, each whole and at
    once. Before, every read from step 2 on returned step 10**6 (after the 60 s deadline). A step
    of 2**63 is refused with its value named."""
    reader = rlmetrics.connect("ray", name=name, final_timeout=60)
    ranks = [Rank.remote(r, WORLD, name) for r in range(WORLD)]
    got = []
    for step in range(6):
        extra = ({"tokens/total": 123.0}, 10**6) if step == 2 else None
        ray.get([a.step.remote(step, step, extra=extra if r == 3 else None) for r, a in enumerate(ranks)])
        res, took, _ = timed(reader.wait_final_res)
        assert took < QUICK, (step, res.step)
        check(res, step)
        got.append(res.step)
    assert got == list(range(6))
    client = rlmetrics.connect("local", name=f"{name}-local", world_size=1)
    for call in (
        lambda: client.submit_metric({"x": 1.0}, step=2**63),
        lambda: client.wait_submit(step=2**63),
    ):
        with pytest.raises(ValueError, match="9223372036854775808.*|step must be an int in"):
            call()
    rlmetrics.backends.local.drop_worker(f"{name}-local")


@ray.remote(num_cpus=0, max_concurrency=2)  # stop() runs while run() reads
class Monitor:
    """A second reader in its own process: ``wait_final_res(timeout)`` in a loop (a dashboard)."""

    def __init__(self, name):
        import rlmetrics

        self.client = rlmetrics.connect("ray", name=name)
        self.steps = []
        self.partial = 0
        self.running = True

    def run(self, timeout):
        import warnings

        warnings.simplefilter("ignore")
        while self.running:
            res = self.client.wait_final_res(timeout)
            if res.step >= 0:
                self.steps.append(res.step)
                self.partial += not res.meta.complete and not res.meta.provisional
        return self.steps, self.partial

    def stop(self):
        self.running = False


def test_a_second_reader_with_wait_final_res_never_ends_a_step_for_the_driver(name):
    """Issue 45, point 8b: the driver logs each step with ``result(step, 60, finalize=True)``; a
    dashboard in another process reads ``wait_final_res(0.2)`` in a loop while ranks are slow (up
    to 1 s). Its deadlines end nothing: every step the driver reads is whole and nothing is late;
    the dashboard gets each step at most once, in order. Before, its deadlines finalized steps
    partial for everyone and the ranks' data for them was dropped as late."""
    reader = rlmetrics.connect("ray", name=name)
    ranks = [Rank.remote(r, WORLD, name) for r in range(WORLD)]
    ray.get([a.step.remote(0) for a in ranks])
    check(reader.result(0, timeout=60, finalize=True), 0)  # the driver is the logging reader
    monitor = Monitor.remote(name)
    watched = monitor.run.remote(0.2)
    for step in range(1, 9):
        pending = [a.step.remote(step, sleep=0.25 * ((r + step) % WORLD)) for r, a in enumerate(ranks)]
        check(reader.result(step, timeout=60, finalize=True), step)
        ray.get(pending)
    ray.get(monitor.stop.remote())
    steps, partial = ray.get(watched, timeout=120)
    assert partial == 0 and steps == sorted(set(steps)), steps
    assert not [w for w in ray.get([a.warnings.remote() for a in ranks]) if w]


def test_two_wait_final_res_readers_the_first_one_logs_the_second_one_is_provisional():
    """In-process: the first reader of ``wait_final_res`` is the logging reader (the seed's
    behaviour); a second one's deadline gives the step provisional and leaves it open; each reader
    gets a step once."""
    name = f"two-readers-{uuid.uuid4().hex[:6]}"
    ranks = [rlmetrics.connect("local", name=name, world_size=2, label=f"rank{r}") for r in range(2)]
    first, second = rlmetrics.connect("local", name=name), rlmetrics.connect("local", name=name)
    try:
        for step in range(2):
            for r, client in enumerate(ranks):
                client.submit_metric({"x/mean": rank_data(r, step)})
                client.wait_submit()
            assert first.wait_final_res(5).step == step
        ranks[0].submit_metric({"x/mean": rank_data(0, 2)})
        ranks[0].wait_submit()  # rank 1 is late for step 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert [r.step for r in (second.wait_final_res(0.1), second.wait_final_res(0.1))] == [1, 2]
            again = second.wait_final_res(0.1)  # nothing new for this reader
        assert again.step == -1 and not again
        ranks[1].submit_metric({"x/mean": rank_data(1, 2)})
        ranks[1].wait_submit()
        res = first.wait_final_res(5)
        allv = np.concatenate([rank_data(r, 2) for r in range(2)])
        assert res.step == 2 and res.meta.complete and res["x/mean"] == pytest.approx(allv.mean())
    finally:
        rlmetrics.backends.local.drop_worker(name)


KILLED_DRIVER = """
import sys, time
import ray, rlmetrics

name, namespace, address = sys.argv[1], sys.argv[2], sys.argv[3]
ray.init(address=address, namespace=namespace, logging_level="ERROR", log_to_driver=False)


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, rank):
        import rlmetrics

        label = f"rank{rank}"
        self.client = rlmetrics.connect("ray", name=name, namespace=namespace, world_size=2, label=label)

    def step(self, step, value):
        self.client.submit_metric({"x/mean": [value], "x/max": [value]}, step=step)
        self.client.wait_submit(step=step)


reader = rlmetrics.connect("ray", name=name, namespace=namespace)
ranks = [Rank.remote(r) for r in range(2)]
ray.get([a.step.remote(1, 100.0 + r) for r, a in enumerate(ranks)])
print("STEP1", dict(reader.result(1, timeout=60, finalize=True)), flush=True)
ray.get(ranks[0].step.remote(2, 200.0))  # rank 1 dies with the driver before its step 2
print("READING", flush=True)
reader.result(2, timeout=float(sys.argv[4]), finalize=True)
"""


def test_a_sigkilled_drivers_pending_read_ends_nothing_after_its_run_ended(name, tmp_path):
    """Issue 45, point 8c: a detached aggregator; a driver run (its own Ray job, its ranks) closes
    step 1, half of step 2, and is SIGKILLed while it reads step 2 with ``finalize=True``. Its
    read's deadline passes before the restarted run comes back: it ends nothing (its run ended), so
    the new run's step 2 (resumed from the step-1 checkpoint) is whole and the dead run's half is
    gone. Before, the dead read finalized step 2 at coverage 0.5 and the new run's step 2 was dropped
    as late."""
    namespace, timeout = "steps-ns", 6.0
    rlmetrics.get_metric_worker(name, namespace, lifetime="detached")
    script = tmp_path / "driver.py"
    script.write_text(KILLED_DRIVER)
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [sys.executable, str(script), name, namespace, address, str(timeout)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("READING"):
            break
    assert lines and lines[-1].startswith("READING"), "".join(lines) + proc.stderr.read()[-3000:]
    worker = ray.get_actor(name, namespace=namespace)
    deadline = time.monotonic() + 60
    while ray.get(worker.stats.remote())["calls"].get("result", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # the read of step 2 reached the aggregator
    proc.kill()
    proc.wait()
    time.sleep(timeout + 4)  # the dead driver's read reached its deadline
    ranks = [Rank.remote(r, 2, name, namespace) for r in range(2)]  # the restarted run (this job)
    reader = rlmetrics.connect("ray", name=name, namespace=namespace)
    ray.get([a.step.remote(2, 2) for a in ranks])
    res = reader.result(2, timeout=60, finalize=True)
    check(res, 2, range(2))
    assert json.dumps(sorted(res.meta.contributors)).count("rank") == 2


def test_a_raw_message_closing_step_2_63_is_refused_naming_it():
    """A step past ``MAX_STEP`` that bypasses the client (a raw message) is refused in the reply."""
    from rlmetrics.engine.server import Server
    from rlmetrics.messages import Message

    server = Server()
    [reply] = server.handle([Message("rank0", [], [2**63])])
    assert "9223372036854775808" in str(reply.errors) and server.engine.newest_closed is None


def test_a_run_from_step_n_never_waits_on_the_steps_before_it():
    """A trainer's steps from 1 (or from 7 after a resume), in-process: each is whole at once and
    ``wait_final_res`` returns it; no client keeps a step, and no reply lists every step since 0
    (every step below the first one used counts as final)."""
    name = f"from-n-{uuid.uuid4().hex[:6]}"
    ranks = [rlmetrics.connect("local", name=name, world_size=2, label=f"rank{r}") for r in range(2)]
    reader = rlmetrics.connect("local", name=name)
    try:
        for step in (*range(7, 40), 40):
            for r, client in enumerate(ranks):
                client.submit_metric({"x/mean": rank_data(r, step)}, step=step)
                client.wait_submit(step=step)
            res = reader.wait_final_res(60)
            allv = np.concatenate([rank_data(r, step) for r in range(2)])
            assert res.step == step and res.meta.complete and res["x/mean"] == pytest.approx(allv.mean())
        assert [c.finalized_state for c in ranks] == [(40, []), (41, [])]  # as of each one's last reply
        assert not ranks[1]._kept and not ranks[1]._closed
    finally:
        rlmetrics.backends.local.drop_worker(name)
