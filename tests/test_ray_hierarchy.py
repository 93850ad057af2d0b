"""Per-node sub-aggregators on a real 2-node Ray cluster (ray.cluster_utils.Cluster)."""

import uuid

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

import rlmetrics  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

NODES, RANKS, STEPS = 2, 6, 3
CLUSTER: list = []  # the module's Cluster (a test adds a node of its own and removes it)


@pytest.fixture(scope="module")
def cluster(own_ray):
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    CLUSTER[:] = [c]
    for _ in range(NODES - 1):
        c.add_node(num_cpus=1)
    ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
    c.wait_for_nodes()
    yield [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    ray.shutdown()
    c.shutdown()


def rank_data(rank, step):
    rng = np.random.default_rng([rank, step])
    return rng.normal(step, 1.0, size=2 + rank)


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, rank, name, hierarchy):
        import rlmetrics

        self.rank = rank
        opts = {"hierarchy": hierarchy} if hierarchy else {}
        self.client = rlmetrics.connect("ray", name=name, world_size=RANKS, label=f"rank{rank}", **opts)

    def ready(self):
        return True

    def step(self, step):
        d = rank_data(self.rank, step)
        self.client.submit_metric({"x/mean": d, "x/max": d, "x/std": d, "x/p50": d, "n/total": 1.0})
        self.client.wait_submit()
        self.client.flush()
        return ray.get_runtime_context().get_node_id()

    def set_world_size(self, world):
        self.client.set_world_size(world)

    def client_id(self):
        return self.client.client_id

    def resync(self):  # what a rank does when a call fails (e.g. the root restarted under its read)
        self.client.resync()


def _stall_forwarder(node_actor, seconds):
    """Run inside a node sub-aggregator: its next forward upstream waits ``seconds`` (a slow link)."""
    import time

    node_actor._forwarder.submit(time.sleep, seconds)


def _saved_clients(actor):
    """Run inside an aggregator: the registered clients of its saved state (None: nothing saved)."""
    import json
    import time

    from rlmetrics.backends.ray import compat

    for _ in range(100):  # the save lands from the actor's saver thread
        saved = compat.kv_get(actor.store.key)
        if saved is not None:  # its signature, then the state
            return json.loads(saved.partition(b"\n")[2])["clients"]
        time.sleep(0.05)
    return None


def run(node_ids, hierarchy, read="result", stall=0.0):
    name = f"h-{uuid.uuid4().hex[:8]}"
    root = rlmetrics.get_metric_worker(name=name, hierarchy=hierarchy)
    ranks = [
        Rank.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_ids[r % NODES], soft=False)
        ).remote(r, name, hierarchy)
        for r in range(RANKS)
    ]
    reader = rlmetrics.connect("ray", name=name)
    ray.get([a.ready.remote() for a in ranks])  # every rank connected (registered) before step 0
    nodes = [rlmetrics.backends.ray.node_worker(name, None, n) for n in node_ids] if hierarchy else []
    results = []
    for s in range(STEPS):
        if stall:
            ray.get([n.__ray_call__.remote(_stall_forwarder, stall) for n in nodes])
        placed = ray.get([a.step.remote(s) for a in ranks])
        results.append(reader.result(s, timeout=60) if read == "result" else reader.wait_final_res())
    assert sorted(set(placed)) == sorted(node_ids)  # ranks really spread over both nodes
    stats = ray.get(root.stats.remote())
    stats["saved"] = [ray.get(n.__ray_call__.remote(_saved_clients)) for n in nodes]
    for a in ranks:
        ray.kill(a)
    return results, stats


def check_step(res, s):
    allv = np.concatenate([rank_data(r, s) for r in range(RANKS)])
    assert res.step == s and res.meta.complete, (res.step, res.meta)
    assert res["x/mean"] == pytest.approx(allv.mean(), rel=1e-12)
    assert res["x/std"] == pytest.approx(allv.std(), rel=1e-12)
    assert res["x/max"] == allv.max() and res["n/total"] == RANKS
    assert res["x/p50"] == pytest.approx(np.quantile(allv, 0.5), rel=1e-12)


def test_node_hierarchy_equals_flat_and_root_gets_one_message_per_node_per_step(cluster):
    flat, flat_stats = run(cluster, None)
    tree, tree_stats = run(cluster, "node")
    for s in range(STEPS):
        for res in (flat[s], tree[s]):
            check_step(res, s)
        assert tree[s].keys() == flat[s].keys()
    assert flat_stats["calls"]["messages"] == RANKS * STEPS
    assert tree_stats["calls"]["messages"] == NODES * STEPS
    # the root knows the ranks, as in the flat layout: every step names them as its contributors
    assert len(tree_stats["clients"]) == RANKS and all(c.startswith("rank") for c in tree_stats["clients"])
    assert all(len(tree[s].meta.contributors) == RANKS for s in range(STEPS))
    # each node saved its own ranks, which a restarted node waits for
    assert [len(saved or ()) for saved in tree_stats["saved"]] == [RANKS // NODES] * NODES


def test_seed_loop_through_node_sub_aggregators_reads_each_steps_own_numbers(cluster):
    """The driver reads with ``wait_final_res()`` right after the ranks' blocking ``wait_submit``,
    while the nodes' forwards upstream are slow: each node announced the step to the root before it
    answered its ranks, so the root waits for the forwards and the read is that step, complete."""
    tree, _ = run(cluster, "node", read="final", stall=0.5)
    for s in range(STEPS):
        check_step(tree[s], s)


def check_partial(res, s, ranks):
    """``res`` is final, partial, and exact over ``ranks`` alone."""
    allv = np.concatenate([rank_data(r, s) for r in ranks])
    assert res.step == s and not res.meta.complete and not res.meta.provisional, res.meta
    assert res["x/mean"] == pytest.approx(allv.mean(), rel=1e-12)
    assert res["x/max"] == allv.max() and res["n/total"] == len(ranks)
    assert res.meta.missing_metrics["x/mean"] == [len(ranks), 3]


@pytest.mark.parametrize(
    "hierarchy, read",
    [(None, "finalize"), ("node", "finalize"), ("node", "step deadline")],
    ids=["flat", "node", "node-step-deadline"],
)
def test_a_rank_dead_below_a_node_is_named_at_the_readers_deadline_as_in_the_flat_layout(
    cluster, hierarchy, read
):
    """Three ranks on one node, rank 2 dies before it closes step 2. The driver's read of step 2
    ends at its deadline (``finalize=True``), or the step's own deadline ends it (``step_timeout``):
    in both layouts step 2 is final and exact over ranks 0-1, ``missing_ranks`` names rank 2 (the node
    forwarded what it held when the root's deadline came), and after ``set_world_size(2)`` steps 3-4
    are complete. Before, the node waited its own 30 s while the root finalized without its forward:
    the step came back empty, missing ``node:...``."""
    name = f"d-{uuid.uuid4().hex[:8]}"
    opts = {"step_timeout": 3.0} if read == "step deadline" else {}
    rlmetrics.get_metric_worker(name=name, hierarchy=hierarchy, **opts)
    on_node0 = NodeAffinitySchedulingStrategy(cluster[0], soft=False)
    ranks = [Rank.options(scheduling_strategy=on_node0).remote(r, name, hierarchy) for r in range(3)]
    ray.get([a.set_world_size.remote(3) for a in ranks])  # connected with world_size=RANKS
    ids = ray.get([a.client_id.remote() for a in ranks])
    reader = rlmetrics.connect("ray", name=name)
    for s in range(2):
        ray.get([a.step.remote(s) for a in ranks])
        assert reader.result(s, timeout=60).meta.complete
    ray.kill(ranks[2])
    ray.get([a.step.remote(2) for a in ranks[:2]])
    with pytest.warns(RuntimeWarning, match="step 2 is partial"):
        res = reader.result(2, timeout=3.0, finalize=True) if read == "finalize" else reader.result(2)
    check_partial(res, 2, range(2))
    assert res.meta.missing_ranks == [ids[2]]
    ray.get([a.set_world_size.remote(2) for a in ranks[:2]])
    for s in (3, 4):
        ray.get([a.step.remote(s) for a in ranks[:2]])
        res = reader.result(s, timeout=60)
        allv = np.concatenate([rank_data(r, s) for r in range(2)])
        assert res.meta.complete and res.meta.contributors == sorted(ids[:2]), res.meta
        assert res["x/mean"] == pytest.approx(allv.mean(), rel=1e-12) and res["n/total"] == 2
    for a in ranks[:2]:
        ray.kill(a)


@pytest.mark.parametrize("hierarchy", [None, "node"], ids=["flat", "node"])
def test_a_provisional_read_returns_what_arrived_below_a_node_as_in_the_flat_layout(cluster, hierarchy):
    """Three ranks on one node; ranks 0-1 close step 0, rank 2 is late. A dashboard's read
    (``result(0, timeout)``, not finalizing) gets ranks 0-1's data, provisional, naming rank 2 alone,
    and the step stays open: once rank 2 sends, the step is complete over all three. Before, below
    a node the read saw nothing (the node held the step back for rank 2) and blamed all three."""
    name = f"p-{uuid.uuid4().hex[:8]}"
    rlmetrics.get_metric_worker(name=name, hierarchy=hierarchy)
    on_node0 = NodeAffinitySchedulingStrategy(cluster[0], soft=False)
    ranks = [Rank.options(scheduling_strategy=on_node0).remote(r, name, hierarchy) for r in range(3)]
    ray.get([a.set_world_size.remote(3) for a in ranks])  # connected with world_size=RANKS
    ids = ray.get([a.client_id.remote() for a in ranks])
    reader = rlmetrics.connect("ray", name=name)
    ray.get([a.step.remote(0) for a in ranks[:2]])
    with pytest.warns(rlmetrics.ProvisionalWarning):
        res = reader.result(0, timeout=2.0)
    allv = np.concatenate([rank_data(r, 0) for r in range(2)])
    assert res.meta.provisional and res.meta.missing_ranks == [ids[2]], res.meta
    assert res["x/mean"] == pytest.approx(allv.mean(), rel=1e-12) and res["n/total"] == 2, dict(res)
    ray.get(ranks[2].step.remote(0))
    res = reader.result(0, timeout=60)
    allv = np.concatenate([rank_data(r, 0) for r in range(3)])
    assert res.meta.complete and res["n/total"] == 3, res.meta
    assert res["x/mean"] == pytest.approx(allv.mean(), rel=1e-12)
    for a in ranks:
        ray.kill(a)


def survivors_complete_step_3(reader, survivors):
    """Step 3 on ``survivors`` (ranks 0-1) is complete and exact without ``set_world_size``."""
    ray.get([a.step.remote(3) for a in survivors])
    res = reader.result(3, timeout=60, finalize=True)
    allv = np.concatenate([rank_data(r, 3) for r in range(2)])
    assert res.meta.complete and res["x/mean"] == pytest.approx(allv.mean(), rel=1e-12), res.meta
    for a in survivors:
        ray.kill(a)


def test_a_rank_on_a_lost_node_ends_its_step_partial_within_seconds(cluster):
    """Rank 2 of 3 runs on a node of its own, which is removed after ranks 0-1 closed step 2: Ray
    records the node dead, the aggregator asks while the step waits, and step 2 ends partial naming
    rank 2 (``meta.lost`` says the node was lost) well before the 60 s deadline; step 3 completes
    on ranks 0-1 without ``set_world_size``."""
    import time

    name = f"l-{uuid.uuid4().hex[:8]}"
    rlmetrics.get_metric_worker(name=name, final_timeout=60)
    extra = CLUSTER[0].add_node(num_cpus=1)
    CLUSTER[0].wait_for_nodes()
    lone = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in cluster)
    where = [cluster[0], cluster[0], lone]
    ranks = [
        Rank.options(scheduling_strategy=NodeAffinitySchedulingStrategy(where[r], soft=False)).remote(
            r, name, None
        )
        for r in range(3)
    ]
    ray.get([a.set_world_size.remote(3) for a in ranks])  # connected with world_size=RANKS
    ids = ray.get([a.client_id.remote() for a in ranks])
    reader = rlmetrics.connect("ray", name=name)
    for s in range(2):
        ray.get([a.step.remote(s) for a in ranks])
        assert reader.result(s, timeout=60, finalize=True).meta.complete
    ray.get([a.step.remote(2) for a in ranks[:2]])
    CLUSTER[0].remove_node(extra)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="step 2 is partial"):
        res = reader.result(2, timeout=60, finalize=True)
    assert time.monotonic() - start < 30, "step 2 waited for the deadline"
    check_partial(res, 2, range(2))
    assert res.meta.missing_ranks == [ids[2]] and "node" in res.meta.lost[ids[2]], res.meta
    survivors_complete_step_3(reader, ranks[:2])


def test_a_node_sub_aggregator_killed_mid_run_loses_nothing_and_counts_no_resend_late(cluster):
    """A rank resends what it keeps to its node, which did not restart (step 1: a rank's call failed);
    then the node sub-aggregator of three ranks is killed (Ray restarts it) between two steps and in
    the middle of one: its ranks resend what they keep, the restarted node forwards those resends
    keyed by each rank, and every step equals numpy, complete, with ``meta.late`` 0. Before, the
    first resend made the root refuse the node's merged forward (the other ranks' data was lost),
    and the resends through a restarted node were counted late."""
    name = f"r-{uuid.uuid4().hex[:8]}"
    rlmetrics.get_metric_worker(name=name, hierarchy="node", recovery_timeout=20)
    on_node0 = NodeAffinitySchedulingStrategy(cluster[0], soft=False)
    ranks = [Rank.options(scheduling_strategy=on_node0).remote(r, name, "node") for r in range(3)]
    ray.get([a.set_world_size.remote(3) for a in ranks])
    node = rlmetrics.backends.ray.node_worker(name, None, cluster[0])
    reader = rlmetrics.connect("ray", name=name)
    for s in range(6):
        first, then = (ranks[:2], ranks[2:]) if s in (1, 4) else (ranks, [])
        if s == 2:
            ray.kill(node, no_restart=False)  # between two steps
        ray.get([a.step.remote(s) for a in first])
        if s == 1:
            ray.get(ranks[0].resync.remote())  # to a node that holds (or forwarded) all of it
        if s == 4:
            ray.kill(node, no_restart=False)  # in the middle of a step
        ray.get([a.step.remote(s) for a in then])
        res = reader.result(s, timeout=60, finalize=True)
        allv = np.concatenate([rank_data(r, s) for r in range(3)])
        assert res.meta.complete and res.meta.late == 0, (s, res.meta)
        assert res["x/mean"] == pytest.approx(allv.mean(), rel=1e-12) and res["n/total"] == 3
    for a in ranks:
        ray.kill(a)


def three_ranks_below_a_node(cluster):
    """Three ranks below node 0's sub-aggregator (``recovery_timeout=3``, the reader's deadline 60 s),
    steps 0-1 complete: ``(ranks, their client ids, the node, a reader)``."""
    name = f"n-{uuid.uuid4().hex[:8]}"
    rlmetrics.get_metric_worker(name=name, hierarchy="node", recovery_timeout=3.0, final_timeout=60)
    on_node0 = NodeAffinitySchedulingStrategy(cluster[0], soft=False)
    ranks = [Rank.options(scheduling_strategy=on_node0).remote(r, name, "node") for r in range(3)]
    ray.get([a.set_world_size.remote(3) for a in ranks])
    ids = ray.get([a.client_id.remote() for a in ranks])
    node = rlmetrics.backends.ray.node_worker(name, None, cluster[0])
    reader = rlmetrics.connect("ray", name=name)
    for s in range(2):
        ray.get([a.step.remote(s) for a in ranks])
        assert reader.result(s, timeout=60, finalize=True).meta.complete
    return ranks, ids, node, reader


def test_a_node_and_one_of_its_ranks_dying_together_cost_the_next_step_at_most_the_recovery_timeout(
    cluster,
):
    """A node sub-aggregator and one of its three ranks are killed together between two steps (Ray
    restarts the node). The restarted node waits for its ranks to resend what they keep, as long as
    the aggregator's ``recovery_timeout`` given to ``get_metric_worker`` (3 s here): the next step
    ends partial over the survivors within seconds, not after the 30 s default, and the step after
    it is complete on them. Before, the node ignored ``recovery_timeout`` (it waited 30 s), and
    nothing forwarded the step when its recovery ended: the read took its whole 60 s deadline."""
    import time

    ranks, ids, node, reader = three_ranks_below_a_node(cluster)
    ray.kill(ranks[2])
    ray.kill(node, no_restart=False)
    start = time.monotonic()
    ray.get([a.step.remote(2) for a in ranks[:2]])
    with pytest.warns(RuntimeWarning, match="step 2 is partial"):
        res = reader.result(2, timeout=60, finalize=True)
    took = time.monotonic() - start
    assert took < 25, f"step 2 took {took:.1f} s: the restarted node waited 30 s, or the reader 60"
    check_partial(res, 2, range(2))
    assert res.meta.missing_ranks == [ids[2]], res.meta
    survivors_complete_step_3(reader, ranks[:2])


def test_a_node_restarted_after_the_root_lost_one_of_its_ranks_does_not_wait_for_it_again(cluster):
    """Rank 2 of three below a node dies; the root finds it gone and tells the node (step 2 ends
    partial at once). Then the node is killed (Ray restarts it): its saved state no longer lists rank
    2, so step 3 over ranks 0-1 is complete within seconds. Before, the node had not saved the loss:
    restarted, it waited for rank 2 again, its recovery's end forwarded nothing, and the read of
    step 3 took the reader's whole 60 s deadline."""
    import time

    ranks, _, node, reader = three_ranks_below_a_node(cluster)
    ray.kill(ranks[2])
    ray.get([a.step.remote(2) for a in ranks[:2]])
    with pytest.warns(RuntimeWarning, match="step 2 is partial"):
        check_partial(reader.result(2, timeout=60, finalize=True), 2, range(2))
    ray.kill(node, no_restart=False)
    start = time.monotonic()
    survivors_complete_step_3(reader, ranks[:2])
    took = time.monotonic() - start
    assert took < 25, f"step 3 took {took:.1f} s: the restarted node waited for the lost rank again"
