"""The client state machine against an in-memory transport of ours: resends, retries and restarts.

:class:`RestartingTransport` is a real :class:`~rlmetrics.engine.server.Server` over a
:class:`~rlmetrics.engine.store.MemoryStore` behind a transport that can lose its aggregator at a chosen
moment, as a Ray actor restart does: the next call raises
:class:`~rlmetrics.client.AggregatorRestarted`, and a new incarnation (a new Server on the same store)
resumes from the state the old one saved (registered clients, finalized steps, kept results) and
waits for the clients' resends.
Posted messages stay in flight until collected, and can be delivered twice. (The Ray backend is
tested with real Ray in ``tests/test_ray_backend.py`` and ``tests/test_chaos.py``.)
"""

from __future__ import annotations

import numpy as np
import pytest

from rlmetrics.backends import MetricClient
from rlmetrics.client import AggregatorRestarted, ClientCore, Transport, identity
from rlmetrics.engine.server import Server
from rlmetrics.engine.store import MemoryStore
from rlmetrics.messages import Message, StepResult


class RestartingTransport:
    """One aggregator for several clients (each gets a view with :meth:`client`)."""

    def __init__(self) -> None:
        self.store = MemoryStore()  # what a Ray actor keeps in Ray's KV store
        self.server = Server(final_timeout=0.0, store=self.store)
        self.died = False
        self.incarnations = 1
        self.duplicate = False  # deliver every posted message twice

    def restart(self) -> None:
        """The aggregator dies now: the next call fails; a new incarnation resumes from the save."""
        self.died = True

    def _live(self) -> Server:
        if self.died:
            self.died = False
            self.incarnations += 1
            self.server = Server(final_timeout=0.0, store=self.store, recovery_timeout=5.0)
            raise AggregatorRestarted("the aggregator restarted")
        return self.server

    def send(self, who, items, close, resync=False):
        return self._live().handle([Message(identity(who)[0], items, close, resync)])[0]

    def post(self, client_id, items, close, block=False):
        self._live()
        return (client_id, items, close)

    def collect(self, posted, block=True) -> dict:
        reply = self.send(*posted)
        if self.duplicate:
            reply = self.send(*posted)
        return reply

    def result(self, step, timeout, finalize=False, who=None) -> StepResult:
        return self._live().read(step, finalize=finalize).end()

    def final(self, timeout=None, who=None) -> StepResult:
        return self._live().read().end()

    def register(self, who) -> None:
        self._live().register(identity(who)[0])

    def depart(self, who) -> None:
        self._live().depart(identity(who)[0])

    def watch(self, client) -> None:
        """The clients learn of a restart from their calls only."""


def test_the_in_memory_transport_is_a_complete_transport():
    assert isinstance(RestartingTransport(), Transport)


def ranks(transport: RestartingTransport, n: int) -> list[ClientCore]:
    out = [ClientCore(transport, world_size=n, label=f"rank{r}") for r in range(n)]
    for client in out:
        client.register()
    return out


def test_a_restart_between_a_send_and_its_reply_loses_and_doubles_nothing():
    transport = RestartingTransport()
    a, b = ranks(transport, 2)
    a.submit_metric({"x/mean": [1.0, 2.0]})
    a.wait_submit()
    transport.restart()  # a's step 0 was in the old incarnation only (never finalized)
    b.submit_metric({"x/mean": [6.0]})
    b.wait_submit()  # fails, resends its own data; a's data must come from a's resend
    assert transport.incarnations == 2 and transport.server.recovering()
    a.submit_metric({"x/mean": [0.0]})
    a.wait_submit()  # a learns of the restart from the new incarnation id: resends step 0 too
    b.submit_metric({"x/mean": [2.0]})
    b.wait_submit()
    assert not transport.server.recovering()
    assert dict(a.result(0)) == {"x/mean": 3.0} and dict(a.result(1)) == {"x/mean": 1.0}
    assert a.result(0).meta.complete


def test_a_stopped_clients_resend_after_a_restart_counts_its_data_and_does_not_rejoin():
    """The watcher resends every client's kept data after a restart, a stopped one's too: its data
    is merged, and it leaves again (the resend registered it: every later step waited for it)."""
    transport = RestartingTransport()
    a, b = ranks(transport, 2)
    a.submit_metric({"x/mean": [1.0]})
    a.wait_submit()
    a.stop()
    transport.restart()
    a.resync()  # what the Ray watcher does for every live client
    b.submit_metric({"x/mean": [3.0]})
    b.wait_submit()
    assert dict(b.result(0)) == {"x/mean": 2.0}
    assert a.client_id not in transport.server.engine.clients
    b.set_world_size(1)
    b.submit_metric({"x/mean": [5.0]})
    b.wait_submit()
    assert b.result(1).meta.complete


# the second delivery of a message that completed its step finds the step final: the server cannot
# tell it from late data (it keeps no seqs of final steps), so the client warns; Ray delivers a
# message twice only as a resend after a restart, which is never counted late
@pytest.mark.filterwarnings("ignore::rlmetrics.LateDataWarning")
def test_a_message_delivered_twice_is_merged_once():
    transport = RestartingTransport()
    transport.duplicate = True
    (a,) = ranks(transport, 1)
    for step in range(3):
        a.submit_metric({"n/total": 1.0, "x/mean": [float(step)] * 3})
        a.wait_submit()
        assert dict(a.result(step)) == {"n/total": 1.0, "x/mean": float(step)}


def test_a_finalized_step_survives_the_restart_and_is_not_kept_by_clients():
    transport = RestartingTransport()
    a, b = ranks(transport, 2)
    for client in (a, b):
        client.submit_metric({"x": 1.0})
        client.wait_submit()
    assert transport.server.engine.is_finalized(0)
    a.submit_metric({"x": 2.0})
    a.wait_submit()  # the reply tells a that step 0 is finalized: a keeps only step 1
    assert list(a._kept) == [1]
    transport.restart()
    with pytest.warns(RuntimeWarning, match="step 1 is partial"):
        res = a.result(
            1, timeout=0, finalize=True
        )  # the retried read finds the new incarnation, a resent step 1
    assert transport.incarnations == 2 and dict(res) == {"x": 2.0} and res.meta.missing_ranks
    assert dict(a.result(0)) == {"x": 1.0}  # kept across the restart


def test_the_restart_limit_of_one_call_raises():
    class AlwaysRestarting(RestartingTransport):
        def _live(self) -> Server:
            raise AggregatorRestarted("again")

    client = ClientCore(AlwaysRestarting(), world_size=1)
    with pytest.raises(ConnectionError, match="restarted 5 times"):
        client.result(0)


def test_a_finalized_steps_histograms_and_slowest_ranks_survive_the_restart():
    """A reader after a restart gets what the first reader got: the step's histograms (numpy's
    over both ranks' values) and the straggler report's list of the slowest ranks."""
    transport = RestartingTransport()
    a, b = (MetricClient(transport, world_size=2, rank=r) for r in range(2))
    for client in (a, b):
        client.register()
    data = {a: [1.0, 2.0, 2.5], b: [7.0, 9.0]}
    for client, seconds in ((a, 3.0), (b, 12.0)):
        client.submit_metric({"actor/entropy/hist": data[client]})
        client.compute_local_straggler_metrics({"gen": seconds}, step=0)
        client.wait_submit()
    before = a.result(0)
    transport.restart()
    a.submit_metric({"x": 1.0})  # the new incarnation answers from the saved state
    a.wait_submit()
    after = a.result(0)
    assert after.lists == before.lists == {"perf/straggler/gen/slowest": ["rank1", "rank0"]}
    counts, edges = np.histogram(data[a] + data[b], bins=before.histograms["actor/entropy/hist"].edges)
    for res in (before, after):
        h = res.histograms["actor/entropy/hist"]
        assert h.counts.tolist() == counts.tolist() and h.edges.tolist() == edges.tolist()
