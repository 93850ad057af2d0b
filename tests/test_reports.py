"""What a user is told, and how: one warning per event, of an rlmetrics category a user can filter,
in the process of the client concerned; the aggregator does not log it again at WARNING (the
in-process backend runs the aggregator in the user's process). Local backend and a real local Ray."""

import logging
import os
import subprocess
import sys
import tempfile
import uuid
import warnings

import numpy as np
import pytest

import rlmetrics
from rlmetrics.backends import local

BATCH = {"attention_mask": np.ones((2, 5)), "response_mask": np.ones((2, 3)), "responses": np.ones((2, 3))}


@pytest.fixture
def name():
    name = f"reports-{uuid.uuid4().hex[:8]}"
    yield name
    local.drop_worker(name)


def ranks(name, n=2, backend="local"):
    return [rlmetrics.connect(backend, world_size=n, name=name, label=f"rank{r}") for r in range(n)]


def run_step(clients, value=1.0):
    for client in clients:
        client.submit_metric({"x/mean": value})
        client.wait_submit()


def reports(caught, category=None):
    """The messages of the recorded warnings of ``category`` (default: every rlmetrics warning)."""
    category = category or rlmetrics.RLMetricsWarning
    return [str(w.message) for w in caught if issubclass(w.category, category)]


def warned_logs(caplog):
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("rlmetrics") and r.levelno >= logging.WARNING
    ]


def test_a_partial_step_read_by_wait_final_res_is_one_warning_and_no_warning_log(name, caplog):
    a, _b = ranks(name)  # rank1 never submits
    reader = rlmetrics.connect("local", name=name)
    run_step([a])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = reader.wait_final_res(timeout=0.2)
    assert not res.meta.complete
    assert [type(w.message) for w in caught] == [rlmetrics.PartialStepWarning]
    text = str(caught[0].message)  # the rank by its rank, not by host and pid
    assert "step 0 is partial" in text and "not closed it: rank1;" in text and "@" not in text, text
    assert issubclass(rlmetrics.PartialStepWarning, RuntimeWarning)  # pytest.warns(RuntimeWarning) holds
    assert warned_logs(caplog) == []


def test_filtering_a_category_silences_its_reports(name):
    a, _b = ranks(name)
    reader = rlmetrics.connect("local", name=name)
    run_step([a])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=rlmetrics.PartialStepWarning)
        assert not reader.result(0, timeout=0.1, finalize=True).meta.complete
        run_step([a])
        warnings.filterwarnings("ignore", category=rlmetrics.RLMetricsWarning)
        assert reader.result(1, timeout=0.1).meta.provisional
    assert caught == []


def test_provisional_reads_warn_once_per_client(name):
    a, _b = ranks(name)
    dashboard = rlmetrics.connect("local", name=name)
    run_step([a])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert dashboard.result(0, timeout=0.05).meta.provisional
    assert len(reports(caught)) == 1 and reports(caught, rlmetrics.ProvisionalWarning) == reports(caught)


def test_reading_a_step_nobody_submitted_says_so_and_keeps_the_ranks(name, caplog):
    clients = ranks(name)
    reader = rlmetrics.connect("local", name=name)
    run_step(clients)
    ids = sorted(c.client_id for c in clients)
    for step in (99, 100):  # the first deadline used to de-register every rank: 'missing ranks []'
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = reader.result(step, timeout=0.1, finalize=True)
        assert res.meta.missing_ranks == ids and res.meta.provisional  # never finalized (issue 45)
        (message,) = reports(caught, rlmetrics.StepWarning)
        assert f"no rank has submitted anything for step {step}" in message
        assert "ranks rank0, rank1 have closed up to step 0" in message
    run_step(clients[:1])  # step 1 still waits for both ranks
    with pytest.warns(rlmetrics.ProvisionalWarning):
        assert reader.result(1, timeout=0.1).meta.missing_ranks == [clients[1].client_id]
    assert warned_logs(caplog) == []


def test_a_client_stopped_refuses_to_submit_and_still_reads(name):
    a, b = ranks(name)
    run_step([a, b])
    a.stop()
    a.stop()  # again: nothing to do
    for call in (
        lambda: a.submit_metric({"x/mean": 2.0}),
        a.wait_submit,
        lambda: a.compute_local_timing_metrics(BATCH, {"gen": 1.0}),
    ):
        with pytest.raises(RuntimeError, match=r"was stopped: stop\(\) leaves for good.*new client"):
            call()
    b.set_world_size(1)  # the survivor, as after a rank died
    run_step([b])
    assert a.result(1, timeout=5).meta.complete  # only b is waited for; a's reads work


def test_a_stop_whose_last_data_is_refused_raises_and_still_leaves(name):
    """``stop()`` sends what is queued: when the aggregator refuses some of it the error comes, and
    the client has left all the same (before, it stayed registered and every later step waited for
    it until its deadline)."""
    a, b = ranks(name)
    run_step([a, b])
    a.submit_metric({"timing_s/gen": 1.0, "perf/delta_time/gen": 2.0}, world_size=1)  # a result key twice
    with pytest.raises(rlmetrics.MetricValueError, match="perf/delta_time/gen"):
        a.stop()
    assert a.stopped
    b.set_world_size(1)
    run_step([b])
    assert a.result(1, timeout=5).meta.complete  # b alone is waited for


def test_a_client_created_after_step_0_closed_is_told_once_that_its_data_was_dropped(name, caplog):
    clients = ranks(name)
    run_step(clients)
    late = rlmetrics.connect("local", world_size=2, name=name, label="late")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        late.submit_metric({"x/mean": 9.0, "y/max": 1.0})
        late.submit_metric({"z/min": [1.0, 2.0]})  # two contributions, one report
        late.wait_submit()
    (message,) = reports(caught)
    assert type(caught[0].message) is rlmetrics.LateDataWarning and caught[0].filename == __file__
    assert late.client_id in message and "step(s) [0]" in message and "client.step = N" in message
    assert warned_logs(caplog) == []
    late.step = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_step([late, *clients])
        assert rlmetrics.connect("local", name=name).result(1, timeout=5).meta.complete


@pytest.mark.parametrize("blocking", [True, False])
def test_a_rank_slower_than_the_drivers_deadline_is_told_at_its_next_call(name, blocking):
    fast, slow = ranks(name)
    slow.blocking = blocking
    driver = rlmetrics.connect("local", name=name)
    run_step([fast])
    with pytest.warns(rlmetrics.PartialStepWarning):
        driver.result(0, timeout=0.05, finalize=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_step([slow])
        slow.flush()
    assert len(reports(caught, rlmetrics.LateDataWarning)) == 1 == len(reports(caught))
    with pytest.warns(rlmetrics.PartialStepWarning):
        assert driver.result(0).meta.missing_ranks == [slow.client_id]  # the result is unchanged


# --------------------------------------------------------------------------------------- Ray
@pytest.fixture
def ray_name(ray_session):
    """An aggregator name on the module's Ray instance; its actor is killed after the test."""
    name = f"reports-{uuid.uuid4().hex[:8]}"
    yield name
    try:
        ray_session.kill(ray_session.get_actor(name))
    except ValueError:
        pass


def late_rank(ray):
    @ray.remote(num_cpus=0)
    class LateRank:
        """A rank in a process of its own, created after the others closed step 0."""

        def __init__(self, name):
            self.client = rlmetrics.connect("ray", world_size=2, name=name, label="late")

        def step(self):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.client.submit_metric({"x/mean": 9.0, "y/max": 1.0})
                self.client.submit_metric({"z/min": [1.0, 2.0]})
                self.client.wait_submit()
            return [(w.category.__name__, str(w.message)) for w in caught], self.client.client_id

    return LateRank


@pytest.mark.ray
@pytest.mark.slow
def test_ray_a_rank_created_after_step_0_closed_is_told_in_its_process(ray_session, ray_name, caplog):
    clients = ranks(ray_name, backend="ray")
    run_step(clients)
    assert rlmetrics.connect("ray", name=ray_name).wait_final_res(timeout=10).meta.complete
    got, client_id = ray_session.get(late_rank(ray_session).remote(ray_name).step.remote(), timeout=60)
    assert [category for category, _ in got] == ["LateDataWarning"]
    assert client_id in got[0][1] and "step(s) [0]" in got[0][1]


@pytest.mark.ray
@pytest.mark.slow
def test_ray_late_scalars_of_clients_of_one_process_tell_each_client_once(ray_session, ray_name, caplog):
    clients = ranks(ray_name, backend="ray")
    driver = rlmetrics.connect("ray", name=ray_name)
    for step in range(2):
        run_step(clients, float(step))
    other = rlmetrics.connect("ray", name=ray_name, label="other")  # step 2 holds data: it can end
    other.submit_metric({"y/mean": 1.0}, world_size=1, step=2)
    other.wait_submit(step=2)
    with pytest.warns(rlmetrics.PartialStepWarning, match="step 2 is partial"):
        driver.result(2, timeout=0.05, finalize=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for client in clients:
            client.submit_metric({"x/mean": 5.0})
            client.wait_submit(block=False)
        for client in clients:
            client.flush()
    messages = reports(caught)
    assert len(messages) == 2 and reports(caught, rlmetrics.LateDataWarning) == messages
    assert all(c.client_id in m and "step(s) [2]" in m for c, m in zip(clients, messages))
    assert warned_logs(caplog) == []


@pytest.mark.ray
@pytest.mark.slow
def test_ray_connect_without_ray_says_once_that_it_started_a_local_instance():
    """In a fresh process (no Ray running there, no cluster to find), as a user runs a script."""
    script = """
import warnings
import rlmetrics
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        rlmetrics.connect("ray", name="fresh")
import ray
ray.shutdown()
for w in caught:
    print(w.category.__name__, "|", w.message)
"""
    temp = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=temp, RAY_DISABLE_USAGE_STATS="1", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    ).stdout.splitlines()
    ours = [line for line in out if "Warning |" in line and "rlmetrics" in line]
    assert len(ours) == 1 and ours[0].startswith("RayStartedWarning |"), out
    assert "ray.init(address=...)" in ours[0]
