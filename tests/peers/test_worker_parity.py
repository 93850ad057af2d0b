"""MetricWorker: rlmetrics against siiRL 0.2.0's real Ray ``MetricWorker`` actor, same submissions.

One Ray instance for the module (``num_cpus=2``). Two siiRL actors (``num_cpus=1`` each) live for the
module: one shared (drained by ``wait_final_res`` after every test), one for the test that poisons
it. Every call into them has a timeout (siiRL's ``MetricClient.wait_submit`` has none, so the tests
``ray.get(client.fut, timeout=...)`` instead), so a poisoned actor fails a test instead of hanging it.
Our side: ``rlmetrics.MetricWorker.remote()`` + ``MetricClient`` on Ray, or the local backend (same
engine) where the test is about reductions, not transport.
"""

import math
import warnings

import numpy as np
import pytest

pytest.importorskip("siirl.execution.metric_worker.metric_worker")
ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from siirl.execution.metric_worker import metric_worker as siirl_mw  # noqa: E402
from siirl.execution.metric_worker.utils import MetricFunc as siirl_metric_func  # noqa: E402

import rlmetrics  # noqa: E402
from rlmetrics.backends import local  # noqa: E402
from rlmetrics.metrics.data import compute_data_metric  # noqa: E402
from tests.peers.parity import assert_close  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.ray, pytest.mark.slow]

TIMEOUT = 20.0
REL = 1e-12

# Names whose reduction siiRL's substring rules and our token rules resolve alike.
PARITY_NAMES = {
    "critic/score/mean": "mean",
    "critic/rewards/max": "max",
    "critic/advantages/min": "min",
    "actor/pg_loss": "mean",
    "actor/entropy_loss": "mean",
    "perf/total_num_tokens": "sum",
    "perf/max_memory_allocated_gb": "max",
    "response/length/mean": "mean",
}
# siiRL's substring rules pick min / sum; ours (last path segment's tokens) pick the mean.
NAME_TRAPS = {
    "actor/minibatch_loss": "min",
    "admin/score": "min",
    "summary/loss": "sum",
    "val-core/minerva_math/acc/mean@4": "min",
}
# Found here, not in the list: "timing" contains "min", so siiRL reports the fastest rank's time.
TIMING_TRAPS = {"timing_s/gen": "min", "timing_per_token_ms/gen": "min"}


def renamed(name: str) -> str:
    """``timing_s/`` is reported as ``perf/delta_time/`` by both."""
    return name.replace("timing_s/", "perf/delta_time/")


@pytest.fixture(scope="module")
def siirl_actors(ray_session):
    """Two siiRL actors started together (each start imports siiRL and torch in a new process):
    one shared by the tests, one for the test that poisons it."""
    actors = [siirl_mw.MetricWorker.remote() for _ in range(2)]
    # a bound against a hang, not a speed claim: on a loaded 2-core machine the two imports took over 60 s
    ray.get([a.start.remote() for a in actors], timeout=600)
    yield actors
    for actor in actors:
        ray.kill(actor)


@pytest.fixture
def siirl_worker(siirl_actors):
    """The shared siiRL actor, drained after the test (``wait_final_res`` resets it)."""
    yield siirl_actors[0]
    ray.get(siirl_actors[0].wait_final_res.remote(), timeout=TIMEOUT)


@pytest.fixture
def our_worker(ray_session):
    worker = rlmetrics.MetricWorker.remote()
    ray.get(worker.start.remote(), timeout=TIMEOUT)
    yield worker
    ray.kill(worker)


@pytest.fixture
def local_name(request):
    name = f"peers-{request.node.name}"
    yield name
    local.drop_worker(name)


def siirl_final(worker) -> dict:
    return ray.get(worker.wait_final_res.remote(), timeout=TIMEOUT)


def both_final(siirl_worker, local_name: str, subs: list[dict], world: int) -> tuple[dict, dict]:
    """The same submissions, in order, through siiRL's worker and our in-process one (seed calls)."""
    theirs = siirl_mw.MetricClient(siirl_worker)
    ours = rlmetrics.MetricClient(local.get_worker(local_name))
    for sub in subs:
        theirs.submit_metric(sub, world)
        ours.submit_metric(sub, world)
    ray.get(theirs.fut, timeout=TIMEOUT)
    ours.wait_submit()
    result = dict(ours.wait_final_res())
    ours.stop()  # done: later steps do not wait for this client
    return siirl_final(siirl_worker), result


def reduce_flat(kind: str, values: list[float]) -> float:
    return {"mean": np.mean, "min": np.min, "max": np.max, "sum": np.sum}[kind](values)


def random_submissions(rng, names, world: int) -> list[dict]:
    """Per rank: each name a plain number or a list of 1..6 numbers (equal weight per element)."""
    subs = []
    for _ in range(world):
        sub = {}
        for name in names:
            if rng.random() < 0.5:
                sub[name] = float(rng.normal())
            else:
                sub[name] = rng.normal(size=int(rng.integers(1, 7))).tolist()
        subs.append(sub)
    return subs


def flat(subs: list[dict], name: str) -> list[float]:
    return [v for sub in subs for v in (sub[name] if isinstance(sub[name], list) else [sub[name]])]


def test_substring_rules_agree_on_parity_names():
    """The parity names resolve to the same reduction under siiRL's ``MetricFunc`` and ours, and the
    trap names do not (the premise of the tests below)."""
    ours = {"mean": "mean", "max": "max", "min": "min", "sum": "sum"}
    for name, kind in PARITY_NAMES.items():
        assert siirl_metric_func(name).__name__ == f"{kind.capitalize()}Metric", name
        assert ours[rlmetrics.resolve(name).name] == kind, name
    for name, kind in {**NAME_TRAPS, **TIMING_TRAPS}.items():
        assert siirl_metric_func(name).__name__ == f"{kind.capitalize()}Metric", name
        assert rlmetrics.resolve(name).name == "mean", name


def test_ray_workers_agree_on_scalars_and_lists(siirl_worker, our_worker):
    """On real Ray, both actors, 4 ranks (a client each) x 3 steps: equal-weight scalar and list
    submissions under the parity names give siiRL's numbers (1e-12); siiRL flattens lists into
    its reduction, and we count every element once, so both are element-weighted."""
    world, rng = 4, np.random.default_rng(0)
    theirs_clients = [siirl_mw.MetricClient(siirl_worker) for _ in range(world)]
    our_clients = [rlmetrics.MetricClient(our_worker, label=f"rank{r}") for r in range(world)]
    for step in range(3):
        subs = random_submissions(rng, PARITY_NAMES, world)
        for client, sub in zip(theirs_clients, subs):
            client.submit_metric(sub, world)
        for client in theirs_clients:
            ray.get(client.fut, timeout=TIMEOUT)
            client.fut = []
        theirs = siirl_final(siirl_worker)
        for client, sub in zip(our_clients, subs):
            client.submit_metric(sub, world)
            client.wait_submit()
        ours = our_clients[0].result(step, timeout=TIMEOUT)
        assert ours.meta.complete
        assert_close(dict(ours), theirs, REL)
        expected = {name: reduce_flat(kind, flat(subs, name)) for name, kind in PARITY_NAMES.items()}
        assert_close(dict(ours), expected, REL)


def test_seed_spelling_wait_final_res_agrees(siirl_worker, our_worker):
    """The seed's spelling on both actors (one client submitting for every rank, ``wait_submit``,
    ``wait_final_res``) gives the same numbers, step after step."""
    world, rng = 3, np.random.default_rng(1)
    theirs_client, our_client = siirl_mw.MetricClient(siirl_worker), rlmetrics.MetricClient(our_worker)
    for _ in range(2):
        subs = random_submissions(rng, PARITY_NAMES, world)
        for sub in subs:
            theirs_client.submit_metric(sub, world)
            our_client.submit_metric(sub, world)
        ray.get(theirs_client.fut, timeout=TIMEOUT)
        theirs_client.fut = []
        our_client.wait_submit()
        assert_close(dict(our_client.wait_final_res()), siirl_final(siirl_worker), REL)


def test_name_traps_siirl_min_or_sum_we_mean(siirl_worker, local_name):
    """Intended difference: ``actor/minibatch_loss``, ``admin/score``, ``val-core/minerva_math/...``
    contain ``min`` and ``summary/loss`` contains ``sum``, so siiRL reports a min / sum; we report
    the mean (tokens of the last path segment), on the same submissions. Likewise ``timing_s/*`` and
    ``timing_per_token_ms/*`` (``timing`` contains ``min``): siiRL reports the smallest rank's time,
    we the mean over ranks; both rename ``timing_s/`` to ``perf/delta_time/``."""
    world, rng = 3, np.random.default_rng(2)
    traps = {**NAME_TRAPS, **TIMING_TRAPS}
    subs = random_submissions(rng, traps, world)
    theirs, ours = both_final(siirl_worker, local_name, subs, world)
    assert set(ours) == set(theirs) == {renamed(name) for name in traps}
    for name, kind in traps.items():
        values, out = flat(subs, name), renamed(name)
        assert theirs[out] == pytest.approx(reduce_flat(kind, values), rel=REL)
        assert ours[out] == pytest.approx(np.mean(values), rel=REL)
        assert ours[out] != pytest.approx(theirs[out], rel=1e-6)


def test_count_names_siirl_mean_we_sum(siirl_worker, local_name):
    """Difference found here (our ``count`` token): ``tool_calls/count`` has no ``min``/``max``/
    ``sum``/``total`` substring, so siiRL averages the ranks' counts; we sum them."""
    counts = [3.0, 5.0, 10.0]
    subs = [{"tool_calls/count": c} for c in counts]
    theirs, ours = both_final(siirl_worker, local_name, subs, len(counts))
    assert theirs["tool_calls/count"] == 6.0
    assert ours["tool_calls/count"] == 18.0


def test_graph_output_handling_siirl_actor_means_it_we_max(siirl_worker, local_name):
    """Difference found here: siiRL 0.2.0 declares ``Special_Metric = {"graph_output_handling":
    MaxMetric}`` but its ``MetricWorker.compute_metric`` only calls ``MetricFunc(name)``, so the
    real actor reports the mean; we apply the declared max (built-in exact-name rule)."""
    assert siirl_mw.Special_Metric["graph_output_handling"].__name__ == "MaxMetric"
    values = [0.0, 1.0, 0.0, 0.0]
    subs = [{"graph_output_handling": v} for v in values]
    theirs, ours = both_final(siirl_worker, local_name, subs, len(values))
    assert theirs["graph_output_handling"] == 0.25
    assert ours["graph_output_handling"] == 1.0


def random_batch(seed: int, b: int, p: int = 6, r: int = 10) -> dict:
    g = torch.Generator().manual_seed(seed)
    resp_len = torch.randint(1, r + 1, (b,), generator=g)
    response_mask = (torch.arange(r)[None, :] < resp_len[:, None]).long()
    fm = response_mask.float()
    values = torch.randn(b, r, generator=g) * fm
    return {
        "responses": torch.zeros(b, r, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(b, p, dtype=torch.long), response_mask], dim=1),
        "response_mask": response_mask,
        "token_level_scores": torch.randn(b, r, generator=g) * fm,
        "token_level_rewards": (torch.rand(b, r, generator=g) * fm > 0.8).float(),
        "advantages": (torch.randn(b, r, generator=g) + 2 * seed) * fm,  # rank means differ
        "returns": (values + (1 + seed) * torch.randn(b, r, generator=g)) * fm,
        "values": values,
    }


def test_unequal_batches_siirl_mean_of_means_we_weighted(siirl_worker, local_name):
    """Intended difference: two ranks with batches of 4 and 28 sequences. siiRL's
    ``compute_local_data_metric`` sends each rank's pre-reduced numbers and averages them (a mean
    of means); ours sends mergeable summaries and reports the metrics of the concatenated batch
    (token- and sequence-weighted means, exact ``critic/vf_explained_var``). Min / max agree."""
    from tensordict import TensorDict

    batches = [random_batch(0, 4), random_batch(1, 28)]
    client = siirl_mw.MetricClient(siirl_worker)
    for batch in batches:
        client.compute_local_data_metric(TensorDict(batch, batch_size=[len(batch["responses"])]), 2)
    ray.get(client.fut, timeout=TIMEOUT)
    theirs = siirl_final(siirl_worker)

    clients = [rlmetrics.connect("local", world_size=2, name=local_name, label=f"rank{r}") for r in range(2)]
    for c, batch in zip(clients, batches):
        c.compute_local_data_metric(batch)
        c.wait_submit()
    ours = clients[0].result(0, timeout=TIMEOUT)
    assert ours.meta.complete

    per_rank = [compute_data_metric(b) for b in batches]
    whole = compute_data_metric({k: torch.cat([b[k] for b in batches]) for k in batches[0]})
    names = [
        "critic/advantages/mean",
        "critic/rewards/mean",
        "response/length/mean",
        "critic/vf_explained_var",
    ]
    for name in names:
        mean_of_means = (per_rank[0][name] + per_rank[1][name]) / 2
        assert theirs[name] == pytest.approx(mean_of_means, rel=1e-5)
        assert ours[name] == pytest.approx(whole[name], rel=1e-6)  # float32 sums per rank
        assert not math.isclose(whole[name], mean_of_means, rel_tol=1e-3)
    for name in ["critic/advantages/max", "critic/advantages/min", "response/length/max"]:
        assert ours[name] == pytest.approx(theirs[name], rel=1e-5)


def test_weighted_scalar_submissions_versus_siirl_plain_mean(siirl_worker, local_name):
    """Intended difference, pre-reduced scalars: ranks that send their batch mean give siiRL's mean
    of means in both systems when sent as plain numbers; ours also takes ``(mean, batch size)`` and
    then reports the mean over all sequences, which siiRL cannot express."""
    sizes, means = [2, 30, 5], [1.0, 4.0, -2.0]
    theirs, ours_plain = both_final(siirl_worker, local_name, [{"critic/score/mean": m} for m in means], 3)
    theirs, plain = theirs["critic/score/mean"], ours_plain["critic/score/mean"]
    ours = rlmetrics.MetricClient(local.get_worker(local_name))
    for m, n in zip(means, sizes):  # step 1: step 0 (the plain numbers) is finalized
        ours.submit_metric({"critic/score/mean": (m, n)}, len(means), step=1)
    ours.wait_submit(step=1)
    weighted = ours.wait_final_res()["critic/score/mean"]
    assert theirs == pytest.approx(np.mean(means), rel=REL)
    assert plain == pytest.approx(theirs, rel=REL)
    assert weighted == pytest.approx(np.dot(means, sizes) / sum(sizes), rel=REL)


def test_bad_value_poisons_siirl_rejected_alone_by_us(siirl_actors, our_worker):
    """Intended difference: one string value kills siiRL's processing task (``statistics.mean``
    raises TypeError inside it), so that step and every later step fail in ``wait_final_res`` and
    nothing is aggregated any more. Ours refuses the string at the submitting client
    (``MetricValueError`` naming it), the call's other metrics and the other rank count, and later
    steps are complete and right. Both on real Ray."""
    good = [{"ok/mean": 1.0}, {"ok/mean": 3.0}]
    siirl_worker = siirl_actors[1]  # poisoned for good: not the shared one
    client = siirl_mw.MetricClient(siirl_worker)
    client.submit_metric({"bad": "oops", "ok/mean": 1.0}, 2)
    client.submit_metric({"bad": 1.0, "ok/mean": 2.0}, 2)
    ray.get(client.fut, timeout=TIMEOUT)
    client.fut = []
    for _ in range(2):  # the bad step, then a clean one: both fail, nothing comes back
        with pytest.raises(ray.exceptions.RayTaskError) as err:
            siirl_final(siirl_worker)
        assert isinstance(err.value.as_instanceof_cause(), TypeError)
        for sub in good:
            client.submit_metric(sub, 2)
        ray.get(client.fut, timeout=TIMEOUT)
        client.fut = []

    ranks = [rlmetrics.MetricClient(our_worker, label=f"rank{r}") for r in range(2)]
    with pytest.raises(rlmetrics.MetricValueError, match="bad"):
        ranks[0].submit_metric({"bad": "oops", "ok/mean": 1.0}, 2)
    ranks[1].submit_metric({"bad": 1.0, "ok/mean": 2.0}, 2)
    for r in ranks:
        r.wait_submit()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # step 0 is partial: "bad" has 1 of 2 values
        first = ranks[0].result(0, timeout=0.5)
    assert first["ok/mean"] == pytest.approx(1.5)
    assert first.meta.missing_metrics == {"bad": [1, 2]}
    for step in (1, 2):
        for r, sub in zip(ranks, good):
            r.submit_metric(sub, 2)
            r.wait_submit()
        res = ranks[0].result(step, timeout=TIMEOUT)
        assert res.meta.complete and dict(res) == {"ok/mean": 2.0}
