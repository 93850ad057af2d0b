"""The server rules on the in-process backend: what finalizes a step, and what memory stays bounded.

Real clients on a real :class:`~rlmetrics.backends.local.LocalMetricWorker`; the engine's own
counters (names, schemas, layouts, pending steps) and the clients' (schemas, kept steps) are read
directly. The Ray versions of the long runs are in ``tests/test_soak.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from rlmetrics import LocalMetricWorker, MetricClient
from rlmetrics.engine.aggregator import Aggregator
from rlmetrics.engine.server import Server
from rlmetrics.packing import Packed, pack


def engine_counts(engine: Aggregator) -> tuple[int, int, int]:
    held = engine.memory()
    return held["names"], held["schemas"], held["layouts"]


@pytest.mark.slow
def test_names_that_change_every_step_are_forgotten_and_memory_stays_flat():
    """2000 steps, 200 names each step that no other step uses (plus 5 kept): the engine holds the
    names of the last ``forget_after`` steps, the client a bounded schema cache, and every step's
    values are exact."""
    steps, new = 2000, 200
    worker = LocalMetricWorker(forget_after=32)
    ranks = [MetricClient(worker, world_size=2) for _ in range(2)]
    counts, kept = [], []
    for step in range(steps):
        names = [f"kept/m{k}/max" for k in range(5)] + [f"s{step}/m{k}/mean" for k in range(new)]
        values = [np.random.default_rng([r, step]).random(len(names)) for r in range(2)]
        for client, v in zip(ranks, values):
            client.submit_metric(dict(zip(names, v.tolist())))
            client.wait_submit()
        if step % 97 == 0 or step == steps - 1:
            res = ranks[0].result(step)
            want = np.where(
                [n.endswith("max") for n in names], np.maximum(*values), (values[0] + values[1]) / 2
            )
            assert [res[n] for n in names] == pytest.approx(want.tolist(), rel=1e-12)
        if step >= 200:
            counts.append(engine_counts(worker.engine))
            kept.append((len(ranks[0]._schemas), len(ranks[0]._kept)))
    window = 32 + 2  # steps whose names may still be held
    assert max(c[0] for c in counts) <= 5 + window * new, max(counts)
    assert max(c[1] for c in counts) <= window and max(c[2] for c in counts) <= window, max(counts)
    assert worker.engine.memory()["columns"] <= 5 + (window + 1) * new  # columns are reused
    assert max(k[0] for k in kept) <= 514 and max(k[1] for k in kept) <= 1, max(kept)


def test_a_forgotten_name_that_comes_back_is_learned_again_and_merges_exactly():
    worker = LocalMetricWorker(forget_after=4)
    rank = MetricClient(worker, world_size=1)
    for step in range(25):
        rank.submit_metric(
            {"often/mean": [1.0, float(step)]} | ({"rare/max": [step, -1.0]} if step % 9 == 0 else {})
        )
        rank.wait_submit()
        res = rank.result(step)
        assert res["often/mean"] == (1.0 + step) / 2
        assert ("rare/max" in res) == (step % 9 == 0) and res.get("rare/max", step) == step
    assert "rare/max" not in worker.engine.columns.names  # last used in step 18, forgotten 4 steps later


def test_steps_nobody_reads_are_finalized_when_complete():
    """A driver that reads every 10th step: the other steps are finalized when complete all the
    same, so neither the aggregator nor the clients hold them, and the results read are exact."""
    worker = LocalMetricWorker()
    ranks = [MetricClient(worker, world_size=3) for _ in range(3)]
    driver = MetricClient(worker)
    for step in range(300):
        for r, client in enumerate(ranks):
            client.submit_metric({"x/mean": [float(r + step)] * (r + 1)})
            client.wait_submit()
        assert len(worker.engine.pending_steps()) == 0
        assert max(len(c._kept) for c in ranks) <= 1
        if step % 10 == 0:
            assert driver.result(step)["x/mean"] == pytest.approx(step + 4 / 3, rel=1e-12)
    assert worker.engine.late == 0


def test_a_dead_rank_does_not_keep_steps_forever():
    """One of two ranks dies; nobody reads: at most ``max_pending`` steps stay pending, the oldest
    are finalized partial and flagged stale."""
    engine = Aggregator(max_pending=8)
    for step in range(50):
        for rank in ("r0", "r1")[: 1 if step >= 3 else 2]:
            engine.submit(rank, step, step, 2, pack({"x": 1.0}))
            engine.close(rank, step)
        assert len(engine.pending_steps()) <= 8
    assert engine.pending_steps() == list(range(42, 50))
    stale = engine.result(41)
    assert stale.meta.stale and not stale.meta.complete and stale.meta.missing_metrics == {"x": [1, 2]}


def test_reading_a_step_ahead_finalizes_that_step_alone():
    engine = Aggregator()
    engine.submit("r", 0, 0, 1, pack({"x": 1.0}))
    engine.close("r", 0)
    engine.finalize(0)
    engine.finalize(5)  # a reader's deadline passed for step 5
    assert [engine.is_finalized(s) for s in range(7)] == [True, False, False, False, False, True, False]
    for step in (1, 2, 3, 4):
        assert engine.submit("r", step, step, 1, pack({"x": float(step)}))  # not late
        engine.close("r", step)
        assert engine.finalize(step) == {"x": float(step)}
    assert engine.finalized_state() == (6, [])


def test_a_sender_speaks_only_for_the_clients_relayed_to_it():
    """Items keyed by other clients' submissions and closes on their behalf (a node's forward) are
    refused from a sender no relay named for them, and merged once relayed."""
    server = Server()
    one = pack({"x/mean": 1.0})
    item = (0, (("rank0", 0), ("rank1", 0)), 2, Packed(one.schema, one.stats, contributions=2))  # two merged
    errors = server.merge("intruder", [item], [(0, ("rank0", "rank1"))])
    assert len(errors) == 2 and all(
        "does not speak for" in e or "does not close for" in e for e in errors.values()
    )
    assert server.engine.pending_steps() == [] or not server.engine.has_closed_data(0)
    for rank in ("rank0", "rank1"):
        assert server.relay("node", rank, "node-actor") is None
    assert server.merge("node", [item], [(0, ("rank0", "rank1"))]) == {}
    server.finalize_complete([0])
    res = server.read(0).end()
    assert res.meta.complete and res.meta.contributors == ["rank0", "rank1"] and dict(res) == {"x/mean": 1.0}
    assert server.nodes_of(0) == []


def test_a_new_session_ends_only_the_sessions_that_are_over():
    """The first client of a new session ends the sessions ``session_ended`` reports over: their
    clients are not waited for, their open contributions are dropped, their messages refused; a
    session still running is left alone."""
    over: set[str] = set()
    server = Server(session_ended=lambda session: session in over, step_timeout=100.0)
    assert server.merge("a", [(0, 0, 2, pack({"x/mean": 100.0}))], [0], session="old") == {}
    server.announce(5, "a")  # and closed step 5 below a node, which had not forwarded it
    assert server.register("b", "live") is None  # another run, still going: "old" is not over
    over.add("old")  # the old run's driver is killed
    assert server.register("c", "new") is None  # a restarted run's first client ends "old"
    assert server.engine.clients == {"b", "c"}
    # nothing of the ended run's steps is left: no deadline, and no step for wait_final_res to target
    assert server.tick()[1] is None and server.engine.newest_closed is None
    assert "ended" in server.merge("a", [(1, 1, 2, pack({"x/mean": 7.0}))], [1], session="old")["a"]
    for client, value, session in (("b", 1.0, "live"), ("c", 3.0, "new")):
        assert server.merge(client, [(0, 0, 2, pack({"x/mean": value}))], [0], session=session) == {}
    server.finalize_complete([0])
    res = server.read(0).end()
    assert res.meta.complete and res.meta.contributors == ["b", "c"], res.meta
    assert dict(res) == {"x/mean": 2.0}  # rank a's 100.0 is gone


def test_a_step_below_the_first_one_used_reopens_only_near_the_steps_in_use():
    """A trainer's steps from 1 (or 5): the steps below count as final (no reply lists every step
    since). A rank that sends step 0 (or 3) a few steps later (out of order) reopens it and its data
    is merged; one that counts from 0 while the trainer is 300 steps on, or resumed at step 1000, is
    late. Either way no step is left that nothing can end (before: 300 finalized steps listed in
    every reply, millions for token counts; a reopened 3 left step 4 open for good)."""
    for first, newest, late, merged in (
        (1, 5, 0, True),
        (5, 7, 3, True),
        (1, 300, 0, False),
        (1000, 1003, 0, False),
    ):
        engine = Aggregator()
        for step in range(first, newest + 1):
            engine.submit("t", step, step, 1, pack({"x/mean": 1.0}))
            engine.close("t", step)
            engine.finalize(step)
        assert engine.finalized_state() == (newest + 1, [])
        assert engine.submit("late", late, 0, 1, pack({"x/mean": 2.0})) is merged
        if merged:
            assert engine.finalized_state() == (late, list(range(late + 1, newest + 1)))
            assert engine.finalize(late)["x/mean"] == 2.0
        else:
            assert engine.late == 1
        assert engine.finalized_state() == (newest + 1, [])  # nothing left that no step can end


def test_a_rank_ahead_by_one_step_of_data_is_not_taken_for_one_that_closed_twice():
    """Both ranks give step 1 (world_size 3: it cannot complete), rank a also step 2; the logging
    reader ends step 1 at its deadline. Rank a gave step 1 its data: it is not one step off, and
    rank b is told nothing (before: b was told it missed step 2, and its step-2 data was dropped)."""
    server = Server()
    for client in ("a", "b"):
        assert server.merge(client, [(1, 0, 3, pack({"x/mean": 1.0}))], [1]) == {}
    assert server.merge("a", [(2, 1, 2, pack({"x/mean": 2.0}))], [2]) == {}
    read = server.read(reader="reader")
    assert read.target == 1
    res = read.end()
    assert res.step == 1 and not res.meta.complete
    assert server.notices == [] and server.missed == {}


def test_a_lost_client_of_an_ended_run_closes_its_run_and_leaves_no_step(caplog):
    """Rank a of run "old" gave step 0, rank b closed it; the run's driver is killed, then rank a's
    process is found gone: the run is closed (no step waits for its ranks), step 0 (only the ended
    run's) is gone rather than pending forever, and the log names the run once."""
    over: set[str] = set()
    server = Server(session_ended=lambda session: session in over)
    assert server.merge("a", [(0, 0, 2, pack({"x/mean": 1.0}))], [], session="old") == {}
    assert server.merge("b", [], [0], session="old") == {}
    server.processes["a"] = "pid 1"
    over.add("old")
    server.lose("a", "its process exited")
    assert server.engine.clients == set() and server.engine.pending_steps() == []
    assert "a" not in server.processes and server.engine.newest_closed is None
    said = [r.getMessage() for r in caplog.records if "ended" in r.getMessage()]
    assert len(said) == 1 and "run old ended:" in said[0], said
