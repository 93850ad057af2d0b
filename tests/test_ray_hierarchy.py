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


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
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
        saved = compat.kv_get(actor._kv_key)
        if saved is not None:
            return json.loads(saved)["clients"]
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
    assert len(tree_stats["clients"]) == NODES and all(c.startswith("node:") for c in tree_stats["clients"])
    # each node saved its own ranks, which a restarted node waits for
    assert [len(saved or ()) for saved in tree_stats["saved"]] == [RANKS // NODES] * NODES


def test_seed_loop_through_node_sub_aggregators_reads_each_steps_own_numbers(cluster):
    """The driver reads with ``wait_final_res()`` right after the ranks' blocking ``wait_submit``,
    while the nodes' forwards upstream are slow: each node announced the step to the root before it
    answered its ranks, so the root waits for the forwards and the read is that step, complete."""
    tree, _ = run(cluster, "node", read="final", stall=0.5)
    for s in range(STEPS):
        check_step(tree[s], s)
