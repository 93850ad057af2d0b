"""Exact across data-parallel ranks: verl's functions on 4 unequal shards, submitted with verl's
naming by 4 ranks (threads; Ray rank actors run the same functions in examples/verl_style.py,
tests/test_verl_example.py), merge to verl 0.9.1's numbers on the full batch."""

import math
import threading
import uuid

import numpy as np
import pytest

pytest.importorskip("verl.trainer.ppo.metric_utils")
torch = pytest.importorskip("torch")

import verl.trainer.ppo.metric_utils as verl_metrics  # noqa: E402
import verl.utils.metric as verl_metric  # noqa: E402

import rlmetrics  # noqa: E402
from rlmetrics.integrations import verl as ours  # noqa: E402
from tests.peers.test_verl_validation_parity import random_validation  # noqa: E402
from tests.peers.verl_batches import assert_same, data_proto, verl_batch  # noqa: E402

pytestmark = pytest.mark.torch

TIMING = {"gen": 1.5, "ref": 0.25, "update_actor": 2.5, "step": 6.0, "reshard": 0.5}
N_GPUS = 4
GRAD_NORM = 0.3

CUTS = (0, 3, 10, 11, 26)  # 4 unequal shards of 26 sequences; the 1-sequence shard is aborted


def full_batch():
    tensors, non_tensors = verl_batch(21, b=26, multi_turn=True, aborted=3)
    return data_proto(tensors, non_tensors)


def shards(batch):
    """``DataProto`` slices: each keeps the whole batch's meta_info, as ``DataProto.chunk`` does."""
    return [batch[lo:hi] for lo, hi in zip(CUTS[:-1], CUTS[1:])]


def rank_metrics(shard):
    """What a rank computes on its shard: verl's four batch functions."""
    return {
        **ours.compute_data_metrics(shard),
        **ours.compute_timing_metrics(shard, TIMING),
        **ours.compute_throughout_metrics(shard, TIMING, N_GPUS),
        **ours.compute_variance_proxy_metrics(shard, GRAD_NORM),
    }


def submit_rank(client, rank, shard, val_part, worker_output):
    client.submit_metric(rank_metrics(shard))
    client.submit_metric(worker_output)
    sources, uids, infos, expected, turns = val_part
    ours.submit_validation_metrics(
        client, sources, uids, infos, expected_acc_counts=expected, sample_turns=turns
    )
    client.wait_submit()


def verl_full(batch):
    return {
        **verl_metrics.compute_data_metrics(batch),
        **verl_metrics.compute_timing_metrics(batch, TIMING),
        **verl_metrics.compute_throughout_metrics(batch, TIMING, N_GPUS),
        **verl_metrics.compute_variance_proxy_metrics(batch, GRAD_NORM),
    }


def verl_trainer_keys(nested, sample_turns):
    """The keys verl's trainer logs from ``process_validation_metrics``: ``val-core`` for the core
    variable (``acc`` if the source has it, else ``reward``) on names starting with mean, maj or best
    at the variable's largest ``@n``, ``val-aux`` for the rest, and the turn counts."""
    out = {}
    for source, by_var in nested.items():
        core = "acc" if "acc" in by_var else "reward"
        for var, metrics in by_var.items():
            largest = max(int(name.split("@")[-1].split("/")[0]) for name in metrics)
            for name, value in metrics.items():
                is_core = var == core and name.startswith(("mean", "maj", "best")) and f"@{largest}" in name
                out[f"{'val-core' if is_core else 'val-aux'}/{source}/{var}/{name}"] = value
    turns = np.concatenate(sample_turns)
    out.update({"val-aux/num_turns/min": turns.min(), "val-aux/num_turns/max": turns.max(),
                "val-aux/num_turns/mean": turns.mean()})  # fmt: skip
    return out


def validation_parts():
    """A validation set with None values and expected acc counts, cut in 4 unequal rank parts
    (prompts straddle ranks), and verl's trainer keys of the whole set."""
    sources, uids, infos = random_validation(4, none_rate=0.1)
    expected = {(s, u): 18 for s, u in set(zip(sources.tolist(), uids))}
    turns = np.random.default_rng(0).integers(1, 5, len(uids))
    cuts = np.linspace(0, len(uids), 5).astype(int) + np.array([0, 3, -5, 1, 0])
    parts = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        part_infos = {k: v[lo:hi] for k, v in infos.items()}
        parts.append((sources[lo:hi], uids[lo:hi], part_infos, expected, turns[lo:hi]))
    nested = verl_metrics.process_validation_metrics(sources, uids, infos, expected_acc_counts=expected)
    return parts, verl_trainer_keys(nested, [turns])


def worker_outputs():
    """Per rank, the update metrics verl's workers return: Metrics (ours and verl's) with one value
    per micro-batch (2 each, as verl requires for aggregate_dp) and lists of floats."""
    rng = np.random.default_rng(5)
    outputs = []
    for rank in range(4):
        mb = rng.normal(size=(5, 2))
        module = ours if rank % 2 else verl_metric
        outputs.append({
            "actor/pg_loss": module.Metric("sum", mb[0, 0]),
            "actor/pg_clipfrac": module.Metric("mean", mb[1, 0]),
            "actor/grad_norm_max": module.Metric("max", mb[2, 0]),
            "actor/entropy": mb[3].tolist(),
            "rollout_is_std": np.abs(mb[4]).tolist(),
        })  # fmt: skip
        for name, col in (("actor/pg_loss", 0), ("actor/pg_clipfrac", 1), ("actor/grad_norm_max", 2)):
            outputs[-1][name].append(mb[col, 1])
    return outputs


def verl_driver(outputs):
    """verl's driver path: ``Metric.aggregate_dp`` over ranks, lists concatenated, ``reduce_metrics``."""
    merged = {}
    for name in outputs[0]:
        values = [out[name] for out in outputs]
        if isinstance(values[0], list):
            merged[name] = [v for part in values for v in part]
        else:
            as_verl = []
            for m in values:
                copy = verl_metric.Metric(m.aggregation.value)
                copy.extend(list(m.values))
                as_verl.append(copy)
            merged[name] = verl_metric.Metric.aggregate_dp(as_verl)
    return {k: float(v) for k, v in verl_metric.reduce_metrics(merged).items()}


def check(result, batch, val_keys, outputs):
    expected = verl_full(batch)
    assert_same({k: result[k] for k in expected}, expected, 1e-5)
    assert_same({k: result[k] for k in val_keys}, val_keys, 1e-9)
    assert_same({k: result[k] for k in outputs[0]}, verl_driver(outputs), 1e-12)
    assert set(result) == set(expected) | set(val_keys) | set(outputs[0])  # no auxiliary name left
    assert "timing_s/reshard" in result and not any(k.startswith("perf/delta_time") for k in result)
    assert result.meta.complete


def test_four_unequal_shards_on_local_threads_merge_to_verls_full_batch():
    """Data, timing, throughput, variance proxy, validation and worker metrics of 4 ranks (one with
    one aborted sequence) equal verl's numbers on the full batch under verl's names."""
    batch = full_batch()
    parts, val_keys = validation_parts()
    outputs = worker_outputs()
    name = f"verl-{uuid.uuid4().hex[:8]}"
    clients = [ours.connect("local", world_size=4, name=name, label=f"rank{r}") for r in range(4)]
    threads = [
        threading.Thread(target=submit_rank, args=(clients[r], r, s, parts[r], outputs[r]))
        for r, s in enumerate(shards(batch))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        check(ours.connect("local", name=name).result(0, timeout=30), batch, val_keys, outputs)
    finally:
        rlmetrics.backends.local.drop_worker(name)


def test_siirl_naming_renames_timing_and_sums_proxy2_total_power():
    """The same submissions without verl's naming keep siiRL's behaviour: ``timing_s/*`` becomes
    ``perf/delta_time/*`` and ``variance_proxy/proxy2_total_power`` is summed over the ranks'
    sequences (its ``total`` token) instead of averaged, unlike verl's full-batch value."""
    batch = full_batch()
    name = f"siirl-{uuid.uuid4().hex[:8]}"
    clients = [rlmetrics.connect("local", world_size=4, name=name, label=f"rank{r}") for r in range(4)]
    for client, shard in zip(clients, shards(batch)):
        stats = {k: v.stat for k, v in rank_metrics(shard).items()}
        client.submit_metric(stats)
        client.wait_submit()
    try:
        result = rlmetrics.connect("local", name=name).result(0, timeout=30)
    finally:
        rlmetrics.backends.local.drop_worker(name)
    full = verl_full(batch)
    assert "timing_s/gen" not in result and result["perf/delta_time/gen"] == full["timing_s/gen"]
    power = result["variance_proxy/proxy2_total_power"]
    assert not math.isclose(power, full["variance_proxy/proxy2_total_power"], rel_tol=1e-3)
    assert power == pytest.approx(full["variance_proxy/proxy2_total_power"] * len(batch), rel=1e-5)


def test_names_without_data_verl_reports_nan_merged_results_leave_out():
    """Intended difference: with every response of every rank empty, verl's full batch reports NaN
    for ``critic/score/*`` and the other metrics of no observation; the merged result leaves those
    names out (and lists them in ``meta["empty"]``), as for every metric without data. The
    single-process functions still return verl's NaN."""
    tensors, non_tensors = verl_batch(23, b=8, aborted=8)
    tensors["attention_mask"][:, 10:] = 0
    tensors["response_mask"][:] = 0
    batch = data_proto(tensors, non_tensors)
    theirs = verl_metrics.compute_data_metrics(batch)
    assert math.isnan(theirs["critic/score/mean"]) and math.isnan(
        ours.compute_data_metrics(batch)["critic/score/mean"]
    )
    name = f"verl-{uuid.uuid4().hex[:8]}"
    for shard in (batch[:3], batch[3:]):
        client = ours.connect("local", world_size=2, name=name)
        client.submit_metric(ours.compute_data_metrics(shard))
        client.wait_submit()
    try:
        result = ours.connect("local", name=name).result(0, timeout=10)
    finally:
        rlmetrics.backends.local.drop_worker(name)
    nan_names = {k for k, v in theirs.items() if math.isnan(v)}
    assert nan_names and not nan_names & set(result) and nan_names <= set(result.meta.empty)
    assert_same(result, {k: v for k, v in theirs.items() if k not in nan_names}, 1e-5)
