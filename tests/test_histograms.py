"""Histograms of all ranks' data (rlmetrics.core.histogram): the built-in data histograms and a name the
user marks, merged by the in-process backend (threads as ranks), written by the JSONL and
TensorBoard sinks and read back with each one's own reader (Ray actors: ``test_ray_backend.py``;
W&B, MLflow and SwanLab: ``test_sinks_trackers.py``; the demo's histograms and ``rlmetrics plot
--hist``: ``test_cli.py``). Every count is compared with ``numpy.histogram`` of the concatenated
data of every rank on numpy's own edges: equal while the merged sketch is exact (at most 1,000,000
values), else within the sketch's documented bound (:func:`sketch_bound`)"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import rlmetrics
from rlmetrics.backends import local
from rlmetrics.core.histogram import HIST_BINS, Histogram
from rlmetrics.core.stat import Stat
from rlmetrics.sinks import make_sinks, read_jsonl
from tests.trackers import tensorboard_accumulator

REL_ERR = 0.005  # the sketch's default relative error
WORLD = 3


def sketch_bound(data: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Per bin, how far the sketch's count may be from numpy's: the number of values within
    ``REL_ERR * |x|`` of the bin's inner edges (a bucket representative is within that of each value
    of its bucket; 1e-9 more for the rounding of the bucket index)."""
    inner = edges[1:-1]
    near = np.abs(data[:, None] - inner[None, :]) <= REL_ERR * (1 + 1e-9) * np.abs(data)[:, None]
    per_edge = near.sum(axis=0)
    bound = np.zeros(edges.size - 1)
    bound[:-1] += per_edge
    bound[1:] += per_edge
    return bound


def check(h: Histogram, data: np.ndarray) -> None:
    """``h`` is numpy's histogram of ``data`` on numpy's edges, exact for at most 4096 values."""
    counts, edges = np.histogram(data, HIST_BINS)
    assert np.array_equal(h.edges, edges)
    assert h.count == data.size
    if data.size <= 4096:
        assert np.array_equal(h.counts, counts)
    else:
        assert (np.abs(h.counts - counts) <= sketch_bound(data, edges)).all()


def rank_batch(rank: int, step: int):
    """A PPO batch of rank ``rank`` (``tests.test_syncs.ppo_batch``): uneven sizes, 20 to 60
    sequences, prompts of up to 16 tokens, responses of up to 128 (5k+ response tokens in all)."""
    from tests.test_syncs import ppo_batch

    return ppo_batch(20 + 20 * rank, 16, 128, seed=100 * step + rank, optional=False)


def reference(batches: list[dict]) -> dict[str, np.ndarray]:
    """The histogram names' data of the concatenated batches, computed with numpy."""
    out: dict[str, list] = {}
    for batch in batches:
        mask = batch["attention_mask"].numpy()
        response = mask[:, 16:]
        parts = {
            "response/length/hist": response.sum(-1),
            "prompt/length/hist": mask[:, :16].sum(-1),
            "critic/score/hist": batch["token_level_scores"].sum(-1).numpy(),  # the row sums, as torch adds
            "critic/advantages/hist": batch["advantages"].numpy()[response != 0],
        }
        for name, v in parts.items():
            out.setdefault(name, []).append(np.asarray(v, dtype=np.float64))
    return {name: np.concatenate(v) for name, v in out.items()}


def marked(rank: int, step: int) -> np.ndarray:
    """What rank ``rank`` submits under a name the user marks as a histogram (2000+ values)."""
    return np.random.default_rng([rank, step]).lognormal(0.0, 1.0, 2000 * (rank + 1))


@pytest.mark.torch
def test_threads_histograms_equal_numpy_of_the_concatenated_batches(tmp_path):
    from rlmetrics.metrics.data import compute_data_stats

    name = "test-histograms-threads"
    results, errors = {}, []

    def rank(r):
        try:
            client = rlmetrics.connect("local", world_size=WORLD, name=name, label=f"rank{r}")
            for step in range(2):
                client.compute_local_data_metric(rank_batch(r, step), step=step)  # the default histograms
                tokens = compute_data_stats(rank_batch(r, step), histograms=["critic/advantages/hist"])
                client.submit_metric({"critic/advantages/hist": tokens["critic/advantages/hist"]})
                entropy = marked(r, step)
                client.submit_metric({"actor/entropy/hist": entropy, "actor/entropy/mean": entropy})
                client.wait_submit()
                if r == 0:
                    results[step] = client.result(step, timeout=30)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        local.drop_worker(name)
    assert not errors
    for step, res in results.items():
        want = reference([rank_batch(r, step) for r in range(WORLD)])
        want["actor/entropy/hist"] = np.concatenate([marked(r, step) for r in range(WORLD)])
        assert sorted(res.histograms) == sorted(want)
        assert not any(n.endswith("/hist") for n in res)  # histograms never among the float values
        assert res["actor/entropy/mean"] == pytest.approx(want["actor/entropy/hist"].mean(), rel=1e-12)
        for hist_name, data in want.items():
            check(res.histograms[hist_name], data)
    assert want["critic/advantages/hist"].size > 4096 and want["response/length/hist"].size <= 4096

    # the trackers: what each one's own reader finds is numpy's histogram
    with make_sinks(["jsonl", "tensorboard"], tmp_path, health=None) as tracking:
        for step in sorted(results):
            tracking.log(results[step], step)
    run = read_jsonl(tmp_path / "metrics.jsonl")
    acc = tensorboard_accumulator(tmp_path / "tensorboard")
    for step, res in results.items():
        for hist_name, h in res.histograms.items():
            steps, stored = run.histograms(hist_name)
            assert stored[list(steps).index(step)] == h
            tb = {e.step: e.histogram_value for e in acc.Histograms(hist_name)}[step]
            assert list(tb.bucket) == h.counts.tolist() and list(tb.bucket_limit) == h.edges[1:].tolist()
            assert (tb.min, tb.max, tb.num) == (h.edges[0], h.edges[-1], h.count)


def test_a_bucket_mode_histogram_stays_within_the_bound_and_an_exact_one_is_numpy(monkeypatch):
    monkeypatch.setenv("RLMETRICS_EXACT_QUANTILES", "4096")  # 7050 values: bucket mode once merged
    rng = np.random.default_rng(7)
    data = np.concatenate([rng.normal(-3.0, 2.0, 3000), rng.exponential(5.0, 4000), np.zeros(50)])
    parts = np.array_split(data, 5)
    merged = Stat.of(parts[0], sketch=True)
    for part in parts[1:]:
        merged = merged.merge(Stat.of(part, sketch=True))
    assert not merged.sketch.is_exact
    check(Histogram.of(merged), data)
    check(Histogram.of(Stat.of(data[:4000], sketch=True)), data[:4000])
    assert Histogram.of(Stat.of([1.0, np.inf], sketch=True)) is None  # numpy has no finite edges either


def test_a_resumed_run_gives_the_trackers_the_histograms_of_the_jsonl_file(tmp_path):
    """A driver restarted after a crash: TensorBoard gets the steps it lacks from the JSONL file
    (make_sinks' catch-up), histograms included."""
    from rlmetrics.messages import StepResult

    data = [np.arange(float(step), 50.0 + step) for step in range(3)]
    with make_sinks(["jsonl"], tmp_path, health=None) as tracking:  # TensorBoard was not there yet
        for step, x in enumerate(data):
            histogram = Histogram.of(Stat.of(x, sketch=True))
            tracking.log(StepResult({"x/mean": x.mean()}, step, histograms={"x/hist": histogram}), step)
    with make_sinks(["jsonl", "tensorboard"], tmp_path, resume=True, health=None):
        pass
    got = {
        e.step: e.histogram_value
        for e in tensorboard_accumulator(tmp_path / "tensorboard").Histograms("x/hist")
    }
    for step, x in enumerate(data):
        counts, edges = np.histogram(x, HIST_BINS)
        assert (
            list(got[step].bucket) == counts.tolist() and list(got[step].bucket_limit) == edges[1:].tolist()
        )
