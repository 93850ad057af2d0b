"""Tracker limits (issue 33): a run of 3,000 metrics over a few steps and a histogram of more than 512
bins, logged to W&B (offline), MLflow (sqlite) and TensorBoard and read back with each tracker's own
reader (tests/trackers.py). W&B takes at most 512 bins: its histogram arrives re-binned, with the total
count numpy finds in the data. MLflow's LogBatch requests are at most 1 MB
(``MAX_BATCH_LOG_REQUEST_SIZE``), each measured as MLflow's REST client writes it, while the sqlite store
receives every point. TensorBoard keeps everything; its reader samples unless told not to."""

import math

import numpy as np
import pytest

from rlmetrics.core.histogram import Histogram
from rlmetrics.messages import StepResult
from rlmetrics.sinks import MLflowSink, TensorBoardSink, WandbSink
from tests.trackers import one, read_tensorboard, read_wandb, tensorboard_accumulator

pytestmark = pytest.mark.slow

KEYS, STEPS, BINS = 3000, 3, 1030
HIST = "response/length/hist"
# long non-ASCII names, valid in every tracker (MLflow takes Unicode letters, at most 250 characters):
# each is some 1,200 bytes of JSON (\uXXXX), so 1000 of them make a request of more than 1 MB
NAMES = [f"验证/数学/{i:04d}/" + "准确率" * 60 for i in range(KEYS)]


def run_data(seed=33):
    """``{step: {name: value}}`` and the data of the step's histogram."""
    rng = np.random.default_rng(seed)
    steps = {s: {k: float(rng.normal() * 10.0 ** rng.integers(-4, 5)) for k in NAMES} for s in range(STEPS)}
    data = {s: rng.gamma(2.0, 100.0, size=5000 + s) for s in range(STEPS)}
    return steps, data


def histogram(data):
    counts, edges = np.histogram(data, BINS)
    return Histogram(edges, counts.astype(np.float64), float(data.sum()), float((data * data).sum()))


def log_all(sink, steps, data):
    with sink:
        for step, metrics in steps.items():
            sink.log(StepResult(metrics, step, histograms={HIST: histogram(data[step])}), step)


def test_wandb_histogram_of_more_than_512_bins_is_merged_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    steps, data = run_data()
    log_all(WandbSink(project="rlmetrics-test", name="limits", dir=tmp_path), steps, data)
    history = read_wandb(one(tmp_path, "wandb/offline-run-*/run-*.wandb"))
    assert sorted(history) == list(range(STEPS))
    for step, metrics in steps.items():
        row = history[step]
        assert {k: float(row[k]) for k in NAMES} == metrics
        counts, edges = np.histogram(data[step], BINS)  # numpy's, merged by threes (the last bin alone)
        values, bins = row[f"{HIST}/values"], row[f"{HIST}/bins"]
        assert len(values) <= 512 and len(bins) == len(values) + 1
        assert sum(values) == len(data[step]) == counts.sum()
        assert values == np.append(counts, [0, 0]).reshape(-1, 3).sum(axis=1).tolist()
        assert bins == [*edges[::3].tolist(), edges[-1]]


def test_mlflow_requests_within_one_megabyte(tmp_path):
    from mlflow.protos.service_pb2 import LogBatch
    from mlflow.tracking import MlflowClient
    from mlflow.utils.proto_json_utils import message_to_json
    from mlflow.utils.validation import MAX_BATCH_LOG_REQUEST_SIZE

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    steps, data = run_data()
    sizes: list[tuple[int, int, int]] = []  # (metrics, params, bytes) of every request
    # a config of 150 params of 6,000 non-ASCII characters (36 kB of JSON each): 5.4 MB in all
    config = {f"prompt_{i:03d}": "提示" * 3000 for i in range(150)}
    real = MlflowClient.log_batch

    def observed(client, run_id, metrics=(), params=(), tags=(), **kw):
        """The request as MLflow's REST store writes it (RestStore.log_batch), then the real call."""
        body = message_to_json(
            LogBatch(
                run_id=run_id,
                metrics=[m.to_proto() for m in metrics],
                params=[p.to_proto() for p in params],
                tags=[t.to_proto() for t in tags],
            )
        )
        sizes.append((len(metrics), len(params), len(body.encode())))
        return real(client, run_id, metrics=metrics, params=params, tags=tags, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MlflowClient, "log_batch", observed)
        sink = MLflowSink(uri, experiment="rlmetrics-test", run_name="limits", config=config)
        log_all(sink, steps, data)
    assert all(size <= MAX_BATCH_LOG_REQUEST_SIZE for *_, size in sizes), max(s for *_, s in sizes)
    assert sum(n for n, _, _ in sizes) == KEYS * STEPS and sum(p for _, p, _ in sizes) == len(config)
    client = MlflowClient(uri)
    run = client.get_run(sink.run_id)
    assert run.data.params == config and set(run.data.metrics) == set(NAMES)
    for key in NAMES:
        history = {m.step: m.value for m in client.get_metric_history(sink.run_id, key)}
        assert history == {step: metrics[key] for step, metrics in steps.items()}


def test_tensorboard_keeps_every_scalar_and_bin(tmp_path):
    steps, data = run_data()
    log_all(TensorBoardSink(tmp_path / "tb"), steps, data)
    got = read_tensorboard(tmp_path / "tb")  # EventAccumulator, size_guidance 0: nothing sampled away
    assert set(got) == set(NAMES)
    for key in NAMES:  # float32 on disk (simple_value)
        assert got[key] == {step: float(np.float32(m[key])) for step, m in steps.items()}
    histograms = tensorboard_accumulator(tmp_path / "tb").Histograms(HIST)
    assert [h.step for h in histograms] == list(range(STEPS))
    for h in histograms:
        counts, edges = np.histogram(data[h.step], BINS)
        assert list(h.histogram_value.bucket) == counts.tolist()
        assert list(h.histogram_value.bucket_limit) == edges[1:].tolist()
        assert math.isclose(h.histogram_value.num, len(data[h.step]))
