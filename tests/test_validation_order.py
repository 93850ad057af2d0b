"""Validation samples are concatenated in an order given by data (rank, then the call within the
rank, else content), never by arrival: shuffled arrivals give identical results, equal to the
single-process computation on the concatenated samples."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import rlmetrics
from rlmetrics.backends import local
from rlmetrics.metrics.validation import encode_samples, process_validation_metrics, record_digest

W = 4
ORDERS = ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1])


def rank_samples(seed: int) -> list[tuple[list, list, dict]]:
    """Each rank holds samples of the same prompts, so best/worst/maj@N depend on their order."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(W):
        n = int(rng.integers(3, 7))
        prompts = [f"q{int(i)}" for i in rng.integers(0, 3, n)]
        out.append(
            (
                ["math"] * n,
                prompts,
                {
                    "acc": rng.integers(0, 2, n).astype(float).tolist(),
                    "reward": rng.normal(size=n).tolist(),
                    "pred": [str(v) for v in rng.integers(0, 3, n)],
                },
            )
        )
    return out


def client_options(mode: str, r: int) -> dict:
    return {
        "rank=": {"rank": r},
        "rankN label": {"label": f"rank{r}"},
        "dp-tp labels": {"label": f"dp{r}-tp0"},
        "no label": {},
        "shared rank": {"rank": r // 2},  # two ranks per number: ties go by content
    }[mode]


def run(name: str, mode: str, order: list[int], samples: list) -> dict:
    """Rank threads submit their samples in ``order`` (each waits for the previous one's submission)."""
    submitted = [threading.Event() for _ in range(W)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            client = rlmetrics.connect("local", world_size=W, name=name, **client_options(mode, r))
            position = order.index(r)
            if position:
                assert submitted[order[position - 1]].wait(10)
            client.process_local_validation_metrics(*samples[r])
            client.wait_submit()
        except BaseException as exc:
            errors.append(exc)
        finally:
            submitted[r].set()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(W)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        res = rlmetrics.connect("local", name=name).result(0, timeout=10)
    finally:
        local.drop_worker(name)
    assert res.meta.complete, res.meta
    return dict(res)


def concatenated(samples: list, order: list[int]) -> dict:
    sources, prompts, infos = [], [], {k: [] for k in samples[0][2]}
    for r in order:
        s, p, i = samples[r]
        sources += s
        prompts += p
        for k in infos:
            infos[k] += i[k]
    return process_validation_metrics(sources, prompts, infos)


@pytest.mark.parametrize("mode", ["rank=", "rankN label", "dp-tp labels", "no label", "shared rank"])
def test_shuffled_arrival_gives_identical_results(request, mode):
    """Issue 16: without a label (siiRL's ``MetricClient(worker)``), with labels like ``dp0-tp0``, or
    two ranks sharing a number, best@N / maj@N changed with the order of arrival."""
    samples = rank_samples(7)
    results = [run(f"{request.node.name}-{i}", mode, order, samples) for i, order in enumerate(ORDERS)]
    assert results[0] == results[1] == results[2]
    if mode in ("rank=", "rankN label"):
        want = concatenated(samples, list(range(W)))
    else:  # no rank: ordered by content (shared rank: by rank, ties by content)
        digests = [record_digest(encode_samples(*s)) for s in samples]
        key = (lambda r: digests[r]) if mode != "shared rank" else (lambda r: (r // 2, digests[r]))
        want = concatenated(samples, sorted(range(W), key=key))
    assert results[0] == pytest.approx(want, rel=1e-12)
    # the test can fail: another concatenation order gives other bootstrap numbers
    assert concatenated(samples, [3, 1, 0, 2]) != pytest.approx(want, rel=1e-12)


def test_a_ranks_calls_keep_their_order_within_the_rank(request):
    samples = rank_samples(11)
    try:
        clients = [rlmetrics.connect("local", world_size=2, name=request.node.name, rank=r) for r in (1, 0)]
        clients[0].process_local_validation_metrics(*samples[2])  # rank 1, first call
        clients[0].process_local_validation_metrics(*samples[3])  # rank 1, second call
        clients[1].process_local_validation_metrics(*samples[1])  # rank 0
        for client in clients:
            client.wait_submit()
        res = clients[0].result(0, timeout=10)
    finally:
        local.drop_worker(request.node.name)
    assert dict(res) == pytest.approx(concatenated(samples, [1, 2, 3]), rel=1e-12)


def test_rank_must_be_a_non_negative_int():
    with pytest.raises(ValueError, match="rank"):
        rlmetrics.connect("local", name="rank-check", rank=-1)
    local.drop_worker("rank-check")
