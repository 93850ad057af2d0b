"""The Ray backend on a real local Ray instance: seed API, steps without a barrier, wire, faults."""

import gc
import json
import pickle
import random
import time
import uuid
import warnings
from unittest import mock

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import rlmetrics  # noqa: E402
from rlmetrics.backends.ray import compat  # noqa: E402
from rlmetrics.backends.ray.actor import AggregatorClass, _MetricWorker  # noqa: E402
from rlmetrics.backends.ray.store import KVStore  # noqa: E402
from rlmetrics.packing import pack  # noqa: E402
from rlmetrics.wire import encode  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def ray_instance(ray_session):
    """Every test of this module runs on the module's Ray instance (tests/conftest.py)."""


@pytest.fixture
def name():
    """The test's aggregator name; an aggregator of that name is killed after the test (rlmetrics
    keeps a handle of the driver's, and a module's idle aggregators would cost CPU until its end)."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    yield name
    for namespace in (None, "ns-test"):
        try:
            ray.kill(ray.get_actor(name, namespace=namespace))
        except ValueError:  # no such actor
            pass


def rank_data(rank, step):
    """What rank ``rank`` submits at ``step``: reproducible, sized by rank, tagged by step."""
    rng = np.random.default_rng([rank, step])
    return step * 1000.0 + rng.random(3 + 2 * rank)


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, rank, world, name):
        import rlmetrics

        self.rank = rank
        self.client = rlmetrics.connect("ray", name=name, world_size=world, label=f"rank{rank}")

    def step(self, step, sleep=0.0, read=False, timeout=60):
        time.sleep(sleep)
        d = rank_data(self.rank, step)
        self.client.submit_metric({"x/mean": d, "x/min": d, "x/max": d})
        self.client.submit_metric({"ranks/total": 1.0})
        self.client.wait_submit()
        return self.client.result(step, timeout=timeout) if read else None

    def run(self, steps, seed, read=False):
        pace = random.Random(seed)
        return [self.step(s, pace.random() * 0.02, read) for s in range(steps)]

    def grouped(self, metrics, group_by):
        self.client.submit_metric(metrics, group_by=group_by)
        self.client.wait_submit()

    def flush(self):
        self.client.flush()

    def set_world_size(self, world):
        self.client.set_world_size(world)

    def client_id(self):
        return self.client.client_id

    def pid(self):
        import os

        return os.getpid()


def check_step(res, step, ranks):
    allv = np.concatenate([rank_data(r, step) for r in ranks])
    assert res.meta.complete, res.meta
    assert res["x/mean"] == pytest.approx(allv.mean(), rel=1e-12)
    assert (res["x/min"], res["x/max"]) == (allv.min(), allv.max())  # no other step's data
    assert res["ranks/total"] == len(ranks)  # every rank counted once


def test_seed_worker_api_and_client_in_the_driver():
    worker = rlmetrics.MetricWorker.remote()
    ray.get(worker.start.remote())
    client = rlmetrics.MetricClient(worker)
    for r in range(3):
        ray.get(worker.submit_metric.remote({"direct/score/max": float(r), "direct/loss": float(r)}, 3))
    client.submit_metric({"c/mean": [1.0, 2.0]}, 1)
    client.wait_submit()
    final = client.wait_final_res()
    assert final["c/mean"] == 1.5
    ray.get(worker.stop.remote())
    worker2 = rlmetrics.MetricWorker.remote()
    for r in range(3):
        ray.get(worker2.submit_metric.remote({"direct/score/max": float(r), "direct/loss": float(r)}, 3))
    assert ray.get(worker2.wait_final_res.remote()) == {"direct/score/max": 2.0, "direct/loss": 1.0}


def test_named_worker_is_shared_and_takes_no_cpu(name):
    free = ray.available_resources().get("CPU")
    a = rlmetrics.get_metric_worker(name=name, namespace="ns-test")
    ray.get(a.ping.remote())
    assert ray.available_resources().get("CPU") == free  # num_cpus=0: never takes a training slot

    @ray.remote(num_cpus=0)
    def from_a_task(name):
        import rlmetrics

        client = rlmetrics.connect("ray", name=name, namespace="ns-test", world_size=2)
        client.submit_metric({"v": 3.0})
        client.wait_submit()

    ray.get(from_a_task.remote(name))
    client = rlmetrics.MetricClient(rlmetrics.get_metric_worker(name=name, namespace="ns-test"))
    client.submit_metric({"v": 5.0}, 2)
    client.wait_submit()
    assert client.result(0, timeout=30) == {"v": 4.0}


def test_eight_ranks_without_a_barrier_steps_exact_and_unmixed(name):
    world, steps = 8, 20
    rlmetrics.get_metric_worker(name=name)
    ranks = [Rank.remote(r, world, name) for r in range(world)]
    out = ray.get([a.run.remote(steps, seed=r, read=(r == 0)) for r, a in enumerate(ranks)])
    for step, res in enumerate(out[0]):
        assert res.step == step
        check_step(res, step, range(world))


def test_group_breakdowns_spread_unevenly_over_ranks_equal_the_concatenation(name):
    """Group "a" on ranks 0 and 1, "b" on ranks 0 and 2, "c" on rank 2 only: each group's numbers are
    numpy's on its values of all ranks, and the groups a rank lacks do not hold the step."""
    rng = np.random.default_rng(7)
    labels = [["a", "b", "a", "a"], ["a"] * 6, ["c", "b", "c"]]
    values = [rng.normal(size=len(lab)) for lab in labels]
    ranks = [Rank.remote(r, 3, name) for r in range(3)]
    ray.get(
        [
            rank.grouped.remote({"score/mean": v, "score/min": v, "score/std": v}, {"source": np.array(lab)})
            for rank, v, lab in zip(ranks, values, labels)
        ]
    )
    res = rlmetrics.connect("ray", name=name).result(0, timeout=30)
    assert res.meta.complete, res.meta
    allv, alll = np.concatenate(values), np.concatenate(labels)
    for group in "abc":
        x = allv[alll == group]
        assert res[f"group/source/{group}/score/mean"] == pytest.approx(x.mean(), rel=1e-12)
        assert res[f"group/source/{group}/score/min"] == x.min()
        assert res[f"group/source/{group}/score/std"] == pytest.approx(x.std(), rel=1e-12)
    assert res["score/mean"] == pytest.approx(allv.mean(), rel=1e-12)


def test_missing_labels_and_labels_that_read_alike_over_ray_ranks(name):
    """Issue 28.7 and 28.2 on Ray: None and NaN labels of every rank are the group ``--missing``
    (they raised numpy's TypeError in the rank and lost its call); ``"a b"`` and ``"a_b"`` on two ranks
    stay two groups. Each group is numpy's on its values of all ranks."""
    rng = np.random.default_rng(8)
    labels = [np.array(["a b", None, "a b"], dtype=object), [float("nan"), "a_b", None, "a_b"], ["a_b", "c"]]
    hashed, missing = "a_b--7faae47c", "--missing"  # the names of "a b" and of None / NaN
    groups = [hashed, missing, hashed] + [missing, "a_b", missing, "a_b"] + ["a_b", "c"]
    values = [rng.normal(size=len(lab)) for lab in labels]
    ranks = [Rank.remote(r, 3, name) for r in range(3)]
    ray.get(
        [
            rank.grouped.remote({"score/mean": v, "score/max": v}, {"source": lab})
            for rank, v, lab in zip(ranks, values, labels)
        ]
    )
    res = rlmetrics.connect("ray", name=name).result(0, timeout=30)
    assert res.meta.complete, res.meta
    allv, groups = np.concatenate(values), np.array(groups)
    assert {n.split("/")[2] for n in res if n.startswith("group/")} == set(groups)
    for group in set(groups):
        x = allv[groups == group]
        assert res[f"group/source/{group}/score/mean"] == pytest.approx(x.mean(), rel=1e-12)
        assert res[f"group/source/{group}/score/max"] == x.max()
    assert res["score/mean"] == pytest.approx(allv.mean(), rel=1e-12)


def test_one_rpc_per_step_per_client(name):
    world, steps = 3, 4
    worker = rlmetrics.get_metric_worker(name=name)
    ranks = [Rank.remote(r, world, name) for r in range(world)]
    for s in range(steps):
        ray.get([a.step.remote(s) for a in ranks])
    ray.get([a.flush.remote() for a in ranks])
    calls = ray.get(worker.stats.remote())["calls"]
    assert calls["messages"] == world * steps  # two submit_metric calls per step travel together
    assert calls.get("send_many", 0) + calls.get("send", 0) <= world * steps


@ray.remote(num_cpus=0)
class Host:
    """Several ranks' clients in one process, not blocking in ``wait_submit`` (the reader uses
    ``result(step)``): their messages share the process's sender."""

    def __init__(self, ranks, world, name):
        self.clients = {
            r: rlmetrics.connect("ray", name=name, world_size=world, label=f"rank{r}", blocking=False)
            for r in ranks
        }

    def step(self, step):
        for r, client in self.clients.items():
            client.submit_metric(host_scalars(r, step))
            client.submit_metric({"x/mean": rank_data(r, step)})  # a list: travels on its own
            client.wait_submit()


def host_scalars(rank, step):
    a, b = np.random.default_rng([rank, step, 7]).normal(size=2) * 10**rank
    return {"s/mean": a, "s/max": a, "s/min": a, "t/mean": b, "ranks/total": 1.0}


@pytest.mark.parametrize("restart", [False, True])
def test_clients_of_one_process_stay_exact(name, restart):
    world, steps = 8, 6
    worker = rlmetrics.get_metric_worker(name=name)
    reader = rlmetrics.MetricClient(worker)
    hosts = [Host.remote(range(h, world, 2), world, name) for h in range(2)]
    for s in range(steps):
        if restart and s == 3:
            ray.kill(worker, no_restart=False)
        ray.get([h.step.remote(s) for h in hosts])
        got = reader.result(s, timeout=90)
        a = np.array([host_scalars(r, s)["s/mean"] for r in range(world)])
        b = np.array([host_scalars(r, s)["t/mean"] for r in range(world)])
        x = np.concatenate([rank_data(r, s) for r in range(world)])
        assert got.meta.complete, got.meta
        assert got["s/max"] == a.max() and got["s/min"] == a.min() and got["ranks/total"] == world
        assert got["s/mean"] == pytest.approx(a.mean(), rel=1e-12, abs=1e-12)
        assert got["t/mean"] == pytest.approx(b.mean(), rel=1e-12, abs=1e-12)
        assert got["x/mean"] == pytest.approx(x.mean(), rel=1e-12)


def test_a_batch_the_actor_asks_to_repeat_is_repeated_at_once_not_at_the_clients_next_call(name):
    """Two clients of one process post in one batch after the actor restarted: it lacks their schema
    (the transports think it has it) and asks both to repeat with names. The sender does that
    itself: a reader gets the whole step although neither client makes another call (before, the
    repeat waited for the client's next call, and a reader waiting for the step timed out with it
    partial)."""
    from concurrent.futures import Future

    from rlmetrics.backends.ray import RayTransport

    worker = rlmetrics.get_metric_worker(name=name)
    clients = ("c1", "c2")
    ray.get([worker.register.remote(c) for c in clients])
    transports = {c: RayTransport(worker) for c in clients}  # one process: one sender for both
    values = {"c1": 1.0, "c2": 3.0}
    for c, t in transports.items():  # step 0 teaches the actor (and each transport) the names
        assert not t.send(c, [(0, 0, 2, pack({"r/mean": values[c]}))], [0]).errors
    restarted(worker, transports["c1"])
    items = {c: [(1, 1, 2, pack({"r/mean": values[c] + 1}))] for c in clients}
    sender = transports["c1"]._sender
    posted = {c: Future() for c in clients}
    with sender._cond:  # both messages in one batch
        sender._queue.extend((transports[c], c, items[c], [1], posted[c]) for c in clients)
        sender._cond.notify()
    got = rlmetrics.MetricClient(worker).result(1, timeout=20)
    assert got == {"r/mean": 3.0} and got.meta.complete, (dict(got), got.meta)  # (2 + 4) / 2
    for c in clients:
        assert not posted[c].result(timeout=10).errors
    calls = ray.get(worker.stats.remote())["calls"]
    assert (calls["send_many"], calls["send"]) == (1, 2)  # the batch, then each message alone


def restarted(worker, transport):
    """Kill ``worker`` (Ray restarts it) and wait for its next incarnation: it knows no schema."""
    before = ray.get(worker.ping.remote())
    ray.kill(worker, no_restart=False)
    deadline = time.monotonic() + 60
    while transport.wait_alive() == before:  # the kill lands a moment later
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_close_behind_a_message_the_actor_must_have_repeated_waits_for_it(name):
    """A validation schema sent at step 0 only, forgotten by the actor (``forget_after=2``) while the
    client still thinks it known. One client's two messages in one batch: the first carries that
    schema's data for step 5, the second step 5's other data and its close. The second is held back
    with the first and both are repeated in order: step 5 holds both (before, the close merged
    first, step 5 ended without the validation data, which came late)."""
    from concurrent.futures import Future

    from rlmetrics.backends.ray import RayTransport

    worker = rlmetrics.get_metric_worker(name=name, forget_after=2)
    ray.get(worker.register.remote("c1"))
    transport = RayTransport(worker)
    assert not transport.send("c1", [(0, 0, 1, pack({"val/acc/mean": 0.5, "q/mean": 0.0}))], [0]).errors
    for step in range(1, 5):
        assert not transport.send("c1", [(step, step, 1, pack({"q/mean": float(step)}))], [step]).errors
    sender = transport._sender
    posted = [Future(), Future()]
    first = [(5, 5, 1, pack({"val/acc/mean": 0.75, "q/mean": 5.0}))]
    with sender._cond:  # both in one batch
        sender._queue += [(transport, "c1", first, [], posted[0]),
                          (transport, "c1", [(5, 6, 1, pack({"q/mean": 7.0}))], [5], posted[1])]  # fmt: skip
        sender._cond.notify()
    got = rlmetrics.MetricClient(worker).result(5, timeout=20)
    assert dict(got) == {"val/acc/mean": 0.75, "q/mean": 6.0} and got.meta.late == 0, (dict(got), got.meta)
    assert [not f.result(timeout=10).errors for f in posted] == [True, True]


def test_an_interrupt_during_a_lone_clients_send_leaves_the_process_able_to_send(name, monkeypatch):
    """Ctrl-C while a rank's only client sends from its own thread: the interrupt reaches the
    caller, and the next wait_submit of that process goes through (before, the sender stayed busy
    and every later send of the process waited forever)."""
    from rlmetrics.backends.ray import compat

    client = rlmetrics.connect("ray", name=name, world_size=1, label="rank0")
    real_get, calls = compat.get, []

    def interrupted_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_get(*args, **kwargs)

    client.submit_metric({"r/mean": 1.0})
    monkeypatch.setattr(compat, "get", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        client.wait_submit()
    monkeypatch.setattr(compat, "get", real_get)
    client.submit_metric({"r/mean": 3.0}, step=1)
    assert in_threads(lambda _: client.wait_submit(step=1), [None], timeout=30)
    assert client.result(1, timeout=20) == {"r/mean": 3.0}


def in_threads(work, args, timeout=30):
    """``work(arg)`` for each of ``args`` at once, one thread each; False if one is still running at
    ``timeout`` (a liveness check: done in milliseconds unless a send waits)."""
    import threading

    threads = [threading.Thread(target=work, args=(a,), daemon=True) for a in args]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


def seed_step(clients, step):
    """Rank ``r`` (``clients[r]``, blocking) submits and closes ``step``, in a thread of its own."""
    import threading

    barrier = threading.Barrier(len(clients))

    def rank(r):
        barrier.wait()
        clients[r].submit_metric(host_scalars(r, step))
        clients[r].wait_submit()

    return in_threads(rank, range(len(clients)))


def check_scalars(res, step, ranks):
    a = np.array([host_scalars(r, step)["s/mean"] for r in ranks])
    assert res.step == step and res.meta.complete, res.meta
    assert res["s/mean"] == pytest.approx(a.mean(), rel=1e-12, abs=1e-12)
    assert (res["s/min"], res["s/max"], res["ranks/total"]) == (a.min(), a.max(), len(ranks))


def test_ranks_taking_turns_in_one_thread_do_not_wait_for_each_other(name):
    """Blocking clients closing a step one after the other in one thread: each message goes at once
    (the thread that would post the next one waits for this one's reply)."""
    world = 4
    worker = rlmetrics.get_metric_worker(name=name)
    clients = [rlmetrics.connect("ray", name=name, world_size=world, label=f"rank{r}") for r in range(world)]

    def run(_):
        for s in range(3):
            for r, client in enumerate(clients):
                client.submit_metric(host_scalars(r, s))
                client.wait_submit()

    assert in_threads(run, [None])
    check_scalars(rlmetrics.MetricClient(worker).wait_final_res(), 2, range(world))


def test_a_departed_client_is_not_waited_for(name):
    world = 3
    worker = rlmetrics.get_metric_worker(name=name)
    reader = rlmetrics.MetricClient(worker)
    clients = [rlmetrics.connect("ray", name=name, world_size=world, label=f"rank{r}") for r in range(world)]
    assert seed_step(clients, 0)
    check_scalars(reader.wait_final_res(), 0, range(world))
    clients.pop().stop()
    for client in clients:
        client.set_world_size(world - 1)
    for s in (1, 2):
        assert seed_step(clients, s)
        check_scalars(reader.wait_final_res(), s, range(world - 1))


def seed_style_names(m):
    """Names as the seed's conventions produce them; at M=1000 most are validation metrics."""
    sources = ["openai/gsm8k", "lighteval/MATH", "aime_2024", "minerva_math", "olympiadbench", "amc23",
               "gpqa_diamond", "math500"]  # fmt: skip
    stats = ["mean@16", "std@16"] + [f"{b}@{k}/{s}" for b in ("best", "worst", "maj") for k in (2, 4, 8, 16)
                                     for s in ("mean", "std")]  # fmt: skip
    val = [f"val-{'core' if v == 'acc' else 'aux'}/{d}/{v}/{s}" for d in sources
           for v in ("acc", "reward", "score", "response_len") for s in stats]  # fmt: skip
    train = [f"{k}/{x}/{r}" for k in ("critic", "response", "prompt", "actor", "analysis")
             for x in ("score", "rewards", "advantages", "returns", "values", "length", "entropy", "kl")
             for r in ("mean", "max", "min", "std")]  # fmt: skip
    return (val + train)[:m]


# After the first message a client sends no names: a later message is its float64s and a few dozen
# bytes around them, whatever the values (a pickled dict of the seed's names is ~6x that at M=1000).
@pytest.mark.parametrize("values", [np.arange(1000) / 16, np.random.default_rng(0).random(1000)])
def test_payload_after_the_first_submit_is_small(values):
    names = seed_style_names(1000)
    metrics = dict(zip(names, values.tolist()))
    schemas = {}
    first = pack(metrics, schemas=schemas)
    steady = pack(metrics, schemas=schemas)
    full = len(pickle.dumps(encode([(0, 0, 8, first)], [0], send_names=True), protocol=5))
    later = len(pickle.dumps(encode([(1, 1, 8, steady)], [1], send_names=False), protocol=5))
    assert full - later >= sum(map(len, names))  # the first message carries the names ...
    assert later <= 8 * len(values) + 200  # ... later ones only a schema id and the float64s


def test_schema_lost_in_a_restart_is_resent_transparently(name):
    worker = rlmetrics.get_metric_worker(name=name)
    client = rlmetrics.MetricClient(worker, world_size=1)
    client.submit_metric({"a/mean": 1.0, "b/max": 2.0})
    client.wait_submit()
    ray.kill(worker, no_restart=False)
    client.transport.wait_alive()
    client.submit_metric({"a/mean": 3.0, "b/max": 4.0})  # the client still believes the names are known
    client.wait_submit()
    assert client.result(1, timeout=60) == {"a/mean": 3.0, "b/max": 4.0}
    assert client.result(0, timeout=60) == {"a/mean": 1.0, "b/max": 2.0}


def test_the_aggregator_outlives_its_creator_dropping_the_handle(name):
    """Ray ends a non-detached actor when its creator drops the last handle; the pattern of
    docs/backends.md (a bare get_metric_worker in the driver) relies on rlmetrics keeping one, or the
    ranks would create their own aggregator, owned by one of them and dying with it."""
    first = ray.get(rlmetrics.get_metric_worker(name=name).ping.remote())  # the handle is dropped
    gc.collect()
    time.sleep(3)
    assert ray.get(ray.get_actor(name).ping.remote(), timeout=30) == first


def test_rank_killed_mid_run_gives_partial_then_continues_with_new_world_size(name):
    world = 4
    rlmetrics.get_metric_worker(name=name)  # the driver owns the aggregator; a rank's death can't take it
    ranks = [Rank.remote(r, world, name) for r in range(world)]
    for s in range(2):
        ray.get([a.step.remote(s) for a in ranks])
    ray.get(ranks[3].flush.remote())  # rank 3 delivered steps 0 and 1, then dies
    ray.kill(ranks[3])
    ray.get([a.step.remote(2) for a in ranks[:3]])
    ray.get([a.flush.remote() for a in ranks[:3]])  # delivered: the 2 s below wait for rank 3 only
    reader = rlmetrics.connect("ray", name=name)
    with pytest.warns(RuntimeWarning, match="partial"):
        res = reader.result(2, timeout=2, finalize=True)
    assert res.meta.complete is False
    assert len(res.meta.missing_ranks) == 1 and res.meta.missing_ranks[0].startswith("rank3@")
    assert res.meta.missing_metrics["x/mean"] == [3, 4]
    allv = np.concatenate([rank_data(r, 2) for r in range(3)])
    assert res["x/mean"] == pytest.approx(allv.mean(), rel=1e-12)
    ray.get([a.set_world_size.remote(3) for a in ranks[:3]])
    for s in (3, 4):
        ray.get([a.step.remote(s) for a in ranks[:3]])
        check_step(reader.result(s, timeout=30), s, range(3))


@pytest.mark.parametrize("when", ["between_steps", "mid_step"])
def test_aggregator_killed_and_restarted_loses_nothing_counts_nothing_twice(name, when):
    world, steps = 4, 6
    worker = rlmetrics.get_metric_worker(name=name, recovery_timeout=60)
    ranks = [Rank.remote(r, world, name) for r in range(world)]
    reader = rlmetrics.connect("ray", name=name)
    results = {}
    for s in range(steps):
        if s == 3 and when == "between_steps":
            ray.kill(worker, no_restart=False)
        if s == 3 and when == "mid_step":
            ray.get([a.step.remote(s) for a in ranks[:2]])  # half the ranks delivered step 3 ...
            ray.kill(worker, no_restart=False)  # ... then the aggregator dies
            ray.get([a.step.remote(s) for a in ranks[2:]])
        else:
            ray.get([a.step.remote(s) for a in ranks])
        results[s] = reader.result(s, timeout=90)
    for s in range(steps):
        check_step(results[s], s, range(world))


def test_resends_after_restarts_are_not_counted_late(name):
    """The aggregator killed three times over 12 steps, every rank on time: ``meta.late`` stays 0
    (before, the ranks' resends of steps the new incarnation restored as final were counted late:
    most steps after a restart carried a late count although no rank was late)."""
    world = 4
    worker = rlmetrics.get_metric_worker(name=name, recovery_timeout=60)
    ranks = [Rank.remote(r, world, name) for r in range(world)]
    reader = rlmetrics.connect("ray", name=name)
    lates = []
    for s in range(12):
        if s in (3, 6, 9):
            ray.kill(worker, no_restart=False)
        ray.get([a.step.remote(s) for a in ranks])
        res = reader.result(s, timeout=90, finalize=True)
        check_step(res, s, range(world))
        lates.append(res.meta.late)
    assert lates == [0] * 12, lates


CO_TENANT = """
import json, sys
import ray
from ray.experimental import internal_kv
from rlmetrics.packing import pack
from rlmetrics.wire import encode

name, address, rank0, seq = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ray.init(address=address, logging_level="ERROR", log_to_driver=False)  # another job, same cluster
found = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == name]
handle = ray.get_actor(name, namespace=found[0]["namespace"])
clients = ray.get(handle.stats.remote())["clients"]
forged = encode([(2, seq, 2, pack({"x/mean": [50.0], "x/min": [50.0], "x/max": [50.0]}))], [], True)
replies = [ray.get(handle.send.remote(who, forged)).errors for who in (rank0, rank0 + "#0123#")]
key = f"rlmetrics/state/{handle._actor_id.hex()}".encode()
state = {"clients": [], "done_below": 10**6, "finalized": [], "newest_closed": None}
internal_kv._internal_kv_put(key, json.dumps(state).encode(), overwrite=True)
ray.kill(handle, no_restart=False)
print("RESULT " + json.dumps({"clients": clients, "replies": replies}))
"""


def test_a_co_tenant_job_can_neither_send_under_a_ranks_id_nor_plant_a_saved_state(name, tmp_path):
    """Another job on the cluster finds the aggregator (also in this job's anonymous namespace),
    reads the ranks' ids, sends a message under rank 0's id with its next seq, overwrites the saved
    state in Ray's KV store (every step below 10**6 final) and kills the actor. The message is refused
    (its sender lacks rank 0's secret), the restarted aggregator refuses the planted state (it is not
    signed with the aggregator's secret) and starts empty, and the steps after are complete and
    exact. Before, the forged values replaced rank 0's (50.0 in step 2, complete) and every later
    step came back empty and "evicted"."""
    import subprocess
    import sys

    world = 2
    worker = rlmetrics.get_metric_worker(name=name, recovery_timeout=30)
    ranks = [Rank.remote(r, world, name) for r in range(world)]
    reader = rlmetrics.connect("ray", name=name)
    for s in range(2):  # each step: two submissions (seqs 2s and 2s + 1) per rank
        ray.get([a.step.remote(s) for a in ranks])
        check_step(reader.result(s, timeout=60), s, range(world))
    rank0 = ray.get(ranks[0].client_id.remote())
    first = ray.get(worker.ping.remote())
    script = tmp_path / "co_tenant.py"
    script.write_text(CO_TENANT)
    address = ray.get_runtime_context().gcs_address
    out = subprocess.run(
        [sys.executable, str(script), name, address, rank0, "4"], capture_output=True, text=True, timeout=120
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    seen = json.loads(lines[-1][len("RESULT ") :])
    assert rank0 in seen["clients"]  # a co-tenant reads the ids ...
    assert all(errors and "key does not match" in str(errors) for errors in seen["replies"]), seen
    while incarnation(worker) in (first, None):  # ... and kills the actor: Ray restarts it
        time.sleep(0.05)
    for s in range(2, 5):
        ray.get([a.step.remote(s) for a in ranks])
        check_step(reader.result(s, timeout=60), s, range(world))
    assert "refused" in ray.get(worker.stats.remote())["refused_state"]


UNREADABLE = {
    "wrong-shape": json.dumps(
        {"clients": [], "done_below": 0, "finalized": [], "results": [[0, {"x/mean": 1.0}]]}
    ),
    "not-json": '{"clients": [], "done_below": 0, "finalized"',
}


@pytest.mark.parametrize("form", sorted(UNREADABLE))
def test_a_signed_state_this_version_cannot_read_is_refused_and_the_run_goes_on(name, form):
    """A state the aggregator signed but cannot read (another version's form: a result entry of
    the wrong shape, or no JSON at all) is refused as a planted one is: the restarted actor starts
    empty and says why in ``stats()``, the ranks resend what they keep, and the steps after are
    complete and exact. Before, the restore raised in the actor's constructor, and the actor never
    came back (for a state that is no JSON, until the store's load refused it)."""
    import hashlib
    import hmac

    world, secret = 2, "known-secret"
    worker = rlmetrics.get_metric_worker(name=name, recovery_timeout=30, secret=secret)
    ranks = [Rank.remote(r, world, name) for r in range(world)]
    reader = rlmetrics.connect("ray", name=name)
    ray.get([a.step.remote(0) for a in ranks])
    check_step(reader.result(0, timeout=60), 0, range(world))
    key = f"rlmetrics/state/{worker._actor_id.hex()}".encode()
    deadline = time.monotonic() + 60
    while not finalized_saved(key, 0):  # the save of the step's end landed: no save to come after ours
        assert time.monotonic() < deadline, "the aggregator never saved step 0 finalized"
        time.sleep(0.05)
    body = UNREADABLE[form]
    mac = hmac.new(secret.encode(), key + b"\n" + body.encode(), hashlib.sha256).hexdigest().encode()
    compat.kv_put(key, mac + b"\n" + body.encode())
    first = incarnation(worker)
    ray.kill(worker, no_restart=False)
    deadline = time.monotonic() + 60
    while incarnation(worker) in (first, None):
        assert time.monotonic() < deadline, "the aggregator did not come back"
        time.sleep(0.05)
    assert "could not be read" in ray.get(worker.stats.remote())["refused_state"]
    for s in range(1, 3):
        ray.get([a.step.remote(s) for a in ranks])
        check_step(reader.result(s, timeout=60), s, range(world))


def finalized_saved(key, step):
    """The aggregator's saved state under ``key`` records ``step`` finalized."""
    saved = compat.kv_get(key)
    state = json.loads(saved.partition(b"\n")[2]) if saved else {}
    return state.get("done_below", 0) > step or step in state.get("finalized", [])


def incarnation(worker):
    """The incarnation of the aggregator actor answering now (None while it restarts)."""
    try:
        return ray.get(worker.ping.remote(), timeout=30)
    except (*compat.UNAVAILABLE, ray.exceptions.GetTimeoutError):
        return None


def kill_and_wait_for_the_next_incarnation(worker):
    """Kill the aggregator (Ray restarts it) and return once another incarnation answers."""
    first = ray.get(worker.ping.remote())
    ray.kill(worker, no_restart=False)
    while incarnation(worker) == first:
        time.sleep(0.05)


def check_whole_step(reader, step, ranks):
    """``check_step`` on the step read from ``reader``, a partial result failing it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        check_step(reader.result(step, timeout=15), step, ranks)


class _LateKVStore(KVStore):
    """Ray's KV store with every save landing 1 s late, as a loaded machine's saver thread may."""

    def _write(self):
        time.sleep(1.0)
        super()._write()


class _LateSavingWorker(_MetricWorker):
    """The aggregator with its state saves landing 1 s late."""

    store_class = _LateKVStore


LateSavingWorker = AggregatorClass(_LateSavingWorker)


def test_a_step_finalized_but_not_yet_saved_comes_back_whole_after_a_restart(name):
    """A reply lets a rank forget a step only once the aggregator's saved state records it finalized:
    killed after finalizing step 1 in memory but before saving that, the aggregator gets the step
    again from every rank's resend (before, the rank whose message completed the step had forgotten
    it, and the step came back partial)."""
    worker = LateSavingWorker.options(name=name).remote(recovery_timeout=60)
    ranks = [Rank.remote(r, 2, name) for r in range(2)]
    reader = rlmetrics.connect("ray", name=name)
    ray.get([a.step.remote(0) for a in ranks])
    check_step(reader.result(0, timeout=30), 0, range(2))
    key = f"rlmetrics/state/{worker._actor_id.hex()}".encode()
    deadline = time.monotonic() + 60
    while not finalized_saved(key, 0):  # every save so far landed
        assert time.monotonic() < deadline, "the aggregator never saved step 0 finalized"
        time.sleep(0.05)
    ray.get([a.step.remote(1) for a in ranks])  # step 1 finalized; its save lands 1 s later
    kill_and_wait_for_the_next_incarnation(worker)
    check_whole_step(reader, 1, range(2))


class _RefusingKVStore(KVStore):
    """Ray's KV store refusing every write (a GCS that takes no writes)."""

    refused_finalized = False  # a refused save recorded step 0 finalized

    def _write(self):
        state = self._next[0]
        refuse = mock.patch.object(compat, "kv_put", side_effect=ConnectionError("the GCS refused the write"))
        with refuse:
            super()._write()
        self.refused_finalized |= state["done_below"] > 0 or 0 in state["finalized"]


class _RefusedSaveWorker(_MetricWorker):
    """The aggregator with every state save refused by the KV store."""

    store_class = _RefusingKVStore

    def step_0_save_refused(self):
        return self.store.refused_finalized


RefusedSaveWorker = AggregatorClass(_RefusedSaveWorker)


def test_a_step_whose_save_failed_is_kept_by_its_ranks_and_comes_back_whole_after_a_restart(name):
    """A failed save leaves what replies let ranks forget as it was: step 0 was finalized but never
    saved, so rank 0 keeps it although a later reply (to its step 1) comes after the failure, and the
    next incarnation, which starts without state, gets the whole step again from both ranks."""
    worker = RefusedSaveWorker.options(name=name).remote(recovery_timeout=60)
    ranks = [Rank.remote(r, 2, name) for r in range(2)]
    reader = rlmetrics.connect("ray", name=name)
    ray.get([a.step.remote(0) for a in ranks])
    check_step(reader.result(0, timeout=30), 0, range(2))
    while not ray.get(worker.step_0_save_refused.remote()):
        time.sleep(0.05)
    ray.get(ranks[0].step.remote(1))  # a reply to rank 0 after the failure
    kill_and_wait_for_the_next_incarnation(worker)
    check_whole_step(reader, 0, range(2))


def test_a_client_of_an_aggregator_killed_for_good_fails_at_once_and_stops_watching(name):
    """Killed without a restart, the aggregator never comes back: the client's next call raises
    ConnectionError at once, and its watcher thread ends (before, both waited the reconnect timeout,
    120 s, pinging the dead actor ten times a second)."""
    import threading

    client = rlmetrics.connect("ray", name=name, world_size=1)
    client.submit_metric({"x/mean": 1.0})
    client.wait_submit()
    assert client.result(0, timeout=30) == {"x/mean": 1.0}
    ray.kill(ray.get_actor(name))
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="gone"):
        client.submit_metric({"x/mean": 2.0})
        client.wait_submit()
    deadline = time.monotonic() + 30
    while any(t.name == "rlmetrics-watch" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert time.monotonic() - start < 30, "waited for an incarnation that never comes"


def test_duplicate_delivery_is_merged_once(name):
    client = rlmetrics.connect("ray", name=name, world_size=1)
    client.submit_metric({"n/total": 1.0})
    item = client._buffer[0]
    for _ in range(3):  # a retry after a lost reply delivers the same (client, step, seq) again
        client.transport.send(client.client_id, [item], [])
    client.wait_submit()
    assert client.result(0, timeout=30) == {"n/total": 1.0}


def test_bad_submissions_are_refused_at_the_client_and_others_complete(name):
    good = rlmetrics.connect("ray", name=name, world_size=2, label="good")
    bad = rlmetrics.connect("ray", name=name, world_size=2, label="bad")
    cases = [
        ({"s/str": "oops"}, "s/str"),
        ({"s/nested": {"a": 1.0}}, "s/nested"),
        ({"s/none": None}, "s/none"),
        ({3: 1.0}, "metric name must be a non-empty str"),
    ]
    for metrics, needle in cases:
        with pytest.raises(rlmetrics.MetricValueError, match=needle):
            bad.submit_metric(metrics)
    for ws in (0, -2, np.zeros((2, 2))):
        with pytest.raises(ValueError, match="world_size"):
            bad.submit_metric({"ok": 1.0}, world_size=ws)
    bad.submit_metric({f"wide/m{i}": float(i) for i in range(100_000)}, world_size=1)
    bad.submit_metric({"ok": 1.0})
    bad.wait_submit()
    good.submit_metric({"ok": 3.0})
    good.wait_submit()
    res = good.result(0, timeout=60)
    assert res["ok"] == 2.0 and res["wide/m99999"] == 99999.0 and len(res) == 100_001


def test_a_malformed_message_is_refused_and_the_actor_keeps_serving(name):
    worker = rlmetrics.get_metric_worker(name=name)
    reply = ray.get(worker.send.remote("evil", ("not", "a", "message")))
    assert "malformed" in next(iter(reply.errors.values()))
    client = rlmetrics.MetricClient(worker)
    client.submit_metric({"a": 1.0}, 1)
    client.wait_submit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert client.result(0, timeout=30) == {"a": 1.0}


def test_validation_records_travel_and_merge_in_rank_order(name):
    from rlmetrics.metrics.validation import process_validation_metrics

    rng = np.random.default_rng(9)
    n = 18
    sources, prompts = ["aime"] * n, [f"p{i % 2}" for i in range(n)]
    infos = {"acc": rng.integers(0, 2, n).astype(float).tolist(), "pred": rng.integers(0, 4, n).tolist()}
    worker = rlmetrics.get_metric_worker(name=name)
    clients = [rlmetrics.MetricClient(worker, label=f"rank{r}") for r in range(3)]
    for r in (1, 2, 0):
        part = slice(6 * r, 6 * r + 6)
        clients[r].process_local_validation_metrics(
            sources[part], prompts[part], {k: v[part] for k, v in infos.items()}, world_size=3
        )
        clients[r].wait_submit()
    assert clients[0].result(0, timeout=30) == process_validation_metrics(sources, prompts, infos)


def test_validation_choices_travel_and_merge_in_rank_order(name):
    """pass^k, tie="none" and missing="count_as_zero" (issue 33 point 4) through the Ray aggregator:
    4 ranks' records merged equal one process over all samples."""
    from rlmetrics.metrics.validation import process_validation_metrics
    from tests.test_validation_choices import CHOICES, choices_split

    whole, parts = choices_split()
    worker = rlmetrics.get_metric_worker(name=name)
    clients = [rlmetrics.MetricClient(worker, label=f"rank{r}") for r in range(4)]
    for r in (3, 1, 0, 2):
        clients[r].process_local_validation_metrics(*parts[r], world_size=4, **CHOICES)
        clients[r].wait_submit()
    got = clients[0].result(0, timeout=30)
    assert got == process_validation_metrics(*whole, **CHOICES)
    assert "val-aux/math/acc:count_as_zero/pass^4" in got


def test_difficulty_groups_travel_and_decide_on_every_rank_s_samples(name):
    """Data breakdowns and prompt records of three clients through the Ray aggregator: a prompt whose
    samples sit on two ranks is classified once, on all of them."""
    from tests.test_groups import SOURCES, check_difficulty, grpo_batches

    batches = grpo_batches(11)
    for b in batches:
        b["data_source"] = np.array([SOURCES[i % 3] for i in range(len(b["uid"]))], dtype=object)
    worker = rlmetrics.get_metric_worker(name=name)
    clients = [rlmetrics.MetricClient(worker, label=f"rank{r}", world_size=3) for r in range(3)]
    for client, batch in zip(clients, batches):
        client.compute_local_data_metric(batch, group_by="data_source", difficulty=True)
        client.wait_submit()
    result = clients[0].result(0, timeout=30)
    assert result.meta.complete, result.meta
    check_difficulty(result, batches)
    assert "group/data_source/math/critic/rewards/mean" in result


AFTER_SHUTDOWN = """
import ray
import rlmetrics

ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
worker = rlmetrics.get_metric_worker(name="after")
client = rlmetrics.connect("ray", name="after", world_size=1)
client.submit_metric({"x/mean": 1.0})
client.wait_submit()
assert client.result(0, timeout=30) == {"x/mean": 1.0}
ray.shutdown()
for call in (lambda: client.result(1, timeout=1), client.flush, lambda: client.transport.wait_alive()):
    try:
        call()
    except ConnectionError:
        pass
    assert not ray.is_initialized(), "a call on the client started a new Ray instance"
print("ok")
"""


def test_a_client_used_after_ray_shut_down_raises_and_starts_no_ray(tmp_path):
    """Ray's own calls start a local Ray instance when Ray is not initialized; the client's calls
    (and its threads, which may still wait for an aggregator while the user shuts Ray down) raise
    ConnectionError instead. A stray instance started so during a shutdown once made the next
    ``ray.init`` of a process fail."""
    import subprocess
    import sys

    script = tmp_path / "after_shutdown.py"
    script.write_text(AFTER_SHUTDOWN)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        proc.stdout[-2000:] + proc.stderr[-3000:]
    )


@ray.remote(num_cpus=0)
def marked_histogram_rank(rank, world, name):
    """A rank that submits ``actor/entropy/hist`` (a name marked as a histogram) for step 0."""
    import rlmetrics
    from tests.test_histograms import marked

    client = rlmetrics.connect("ray", name=name, world_size=world, label=f"rank{rank}")
    client.submit_metric({"actor/entropy/hist": marked(rank, 0)}, step=0)
    client.wait_submit()


def test_histograms_of_ray_actors_equal_numpy_of_the_concatenation(name):
    from tests.test_histograms import check, marked

    ray.get([marked_histogram_rank.remote(r, 3, name) for r in range(3)])
    res = rlmetrics.connect("ray", name=name).result(0, timeout=60)
    assert "actor/entropy/hist" not in res
    check(res.histograms["actor/entropy/hist"], np.concatenate([marked(r, 0) for r in range(3)]))


def test_an_unknown_aggregator_option_raises_naming_it(name):
    """A typo in an aggregator option raises at once, naming it, its close match and the layer that
    owns it (the actor's creation failed and every call said "metric worker is gone"); so does the
    option ``node_timeout``, which is gone, and a client option given to the aggregator."""
    for make, message in (
        (
            lambda: rlmetrics.get_metric_worker(name=name, final_timout=5),
            "get_metric_worker(): no option 'final_timout'; did you mean final_timeout (an aggregator",
        ),
        (
            lambda: rlmetrics.connect("ray", name=name, world_size=1, node_timeout=5),
            "connect('ray'): no option 'node_timeout'; did you mean ",
        ),
        (
            lambda: rlmetrics.MetricWorker.options(name=name).remote(keep_result=3),
            "MetricWorker.remote(): no option 'keep_result'; did you mean keep_results (an aggregator",
        ),
        (
            lambda: rlmetrics.get_metric_worker(name=name, nan_strategy="drop"),
            "get_metric_worker(): no option 'nan_strategy'; it is a client option: give it to connect()",
        ),
    ):
        with pytest.raises(TypeError) as err:
            make()
        assert str(err.value).startswith(message)
