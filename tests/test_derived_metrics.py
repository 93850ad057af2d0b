"""Ratios and functions of sums are derived after the merge: over unequal shards they equal the value
of the whole batch (numpy on the concatenation), not an average of per-rank ratios."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import rlmetrics
from rlmetrics.backends import local
from rlmetrics.core.stat import MetricValueError, Stat
from rlmetrics.metrics.analysis import compute_example_metrics, compute_example_stats
from rlmetrics.metrics.data import data_metrics_from_stats
from rlmetrics.metrics.timing import compute_throughput_metrics, compute_timing_metrics

pytestmark = pytest.mark.torch

SIZES = (1, 9, 3, 0, 14)  # unequal shards, one empty
P, R = 5, 8
GPUS_PER_RANK = 2


class DataProto:
    """The shape of verl's DataProto (verl is not installed here)."""

    def __init__(self, batch: TensorDict, non_tensor_batch: dict, meta_info: dict) -> None:
        self.batch, self.non_tensor_batch, self.meta_info = batch, non_tensor_batch, meta_info


def shard(rng: np.random.Generator, b: int) -> dict:
    prompt_len, response_len = rng.integers(0, P + 1, b), rng.integers(0, R + 1, b)
    prompt = (np.arange(P)[None] >= P - prompt_len[:, None]).astype(np.int64)
    response = (np.arange(R)[None] < response_len[:, None]).astype(np.int64)
    return {
        "responses": torch.from_numpy(rng.integers(0, 50, (b, R))),
        "attention_mask": torch.from_numpy(np.concatenate([prompt, response], 1)),
        "response_mask": torch.from_numpy(response),
        "correct_tokens": torch.from_numpy(rng.integers(0, 2, (b, P + R))),
        "token_level_rewards": torch.from_numpy(rng.choice([0.0, 0.0, 1.0, -1.0], (b, R)) * response),
        "policy_logits": torch.from_numpy(rng.normal(size=(b, R, 6))),
    }


def shards(seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [shard(rng, b) for b in SIZES]


def concat(parts: list[dict]) -> dict:
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def run_ranks(name: str, parts: list, timings: list[dict], read: str = "result") -> dict:
    """Every rank computes and submits its timing and throughput metrics on the local backend."""
    try:
        clients = [rlmetrics.connect("local", world_size=len(parts), name=name) for _ in parts]
        for client, part, timing in zip(clients, parts, timings):
            client.compute_local_timing_metrics(part, timing)
            client.compute_local_throughout_metrics(part, timing, GPUS_PER_RANK)
            client.wait_submit()
        res = clients[0].result(0, timeout=10) if read == "result" else clients[0].wait_final_res()
    finally:
        local.drop_worker(name)
    assert res.meta.complete, res.meta
    return dict(res)


def reference(full: dict, timings: list[dict], gpus: int) -> dict[str, float]:
    """The whole batch's numbers with numpy: a stage's time (the ranks' mean) over all its tokens."""
    attention, response = full["attention_mask"].numpy(), full["response_mask"].numpy()
    response_tokens, all_tokens = response.sum(), attention.sum()
    seconds = {stage: np.mean([t[stage] for t in timings]) for stage in timings[0]}
    return {
        "timing_per_token_ms/gen": 1000 * seconds["gen"] / response_tokens,
        "timing_per_token_ms/update_actor": 1000 * seconds["update_actor"] / all_tokens,
        "perf/total_num_tokens": float(all_tokens),
        "perf/time_per_step": seconds["step"],
        "perf/throughput": all_tokens / (seconds["step"] * gpus),
    }


@pytest.mark.parametrize("read", ["result", "wait_final_res"])
def test_timing_and_throughput_over_unequal_shards_equal_the_full_batch(request, read):
    """Issue 16: ``timing_per_token_ms/*`` came out ~W times too high (each rank divided by its own
    tokens, then ranks were averaged); ``perf/throughput`` averaged per-rank ratios."""
    parts = shards(0)
    rng = np.random.default_rng(1)
    timings = [{"gen": g, "update_actor": a, "step": s} for g, a, s in rng.uniform(1.0, 9.0, (len(parts), 3))]
    got = run_ranks(request.node.name, parts, timings, read)
    want = reference(concat(parts), timings, GPUS_PER_RANK * len(parts))
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-12), name
    # the test can fail: the average of the ranks' own ratios is far from the whole batch's
    per_rank = [compute_timing_metrics(p, t).get("timing_per_token_ms/gen") for p, t in zip(parts, timings)]
    assert np.mean([v for v in per_rank if v is not None]) > 2 * want["timing_per_token_ms/gen"]


def test_with_one_timing_for_all_ranks_the_merge_equals_the_single_process_functions(request):
    parts = shards(2)
    timing = {"gen": 4.0, "ref": 1.5, "update_actor": 6.0, "step": 20.0}
    got = run_ranks(request.node.name, parts, [timing] * len(parts))
    full = concat(parts)
    want = {
        **compute_timing_metrics(full, timing),
        **compute_throughput_metrics(full, timing, GPUS_PER_RANK * len(parts)),
    }
    want = {k.replace("timing_s/", "perf/delta_time/"): v for k, v in want.items()}
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-12), name


def proto(part: dict, meta: dict, with_mask: bool = True) -> DataProto:
    keys = [k for k in part if with_mask or k != "attention_mask"]
    return DataProto(TensorDict({k: part[k] for k in keys}, batch_size=[len(part["responses"])]), {}, meta)


def test_a_global_token_num_copied_into_every_shards_meta_info_is_counted_once(request):
    """Issue 16: verl's whole-batch ``global_token_num`` list, copied into each shard's
    ``meta_info``, made ``perf/total_num_tokens`` W times too high."""
    parts = shards(3)
    full = concat(parts)
    meta = {"global_token_num": full["attention_mask"].sum(-1).tolist()}  # the whole batch's list
    timing = {"step": 10.0}
    got = run_ranks(request.node.name, [proto(p, meta) for p in parts], [timing] * len(parts))
    assert got["perf/total_num_tokens"] == sum(meta["global_token_num"])
    assert got["perf/throughput"] == pytest.approx(
        sum(meta["global_token_num"]) / (10.0 * GPUS_PER_RANK * len(parts)), rel=1e-12
    )
    with pytest.raises(MetricValueError, match="global_token_num"):  # no mask to count this rank's own
        compute_throughput_metrics(proto(parts[1], meta, with_mask=False), timing, 1)


def test_a_ranks_own_global_token_num_is_used_as_given(request):
    parts = shards(4)
    lists = [(p["attention_mask"].sum(-1) // 2).tolist() for p in parts]  # siiRL divides by tp_size
    got = run_ranks(
        request.node.name,
        [proto(p, {"global_token_num": t}) for p, t in zip(parts, lists)],
        [{"step": 1.0}] * len(parts),
    )
    assert got["perf/total_num_tokens"] == sum(map(sum, lists))


def test_the_example_packs_ratios_are_exact_over_shards():
    """Token accuracy, policy entropy, the reward ratios and the attention ratio are ratios of sums;
    their Stats merge to the whole batch's value (the unique-transition count is documented apart)."""
    parts = [p for p in shards(5) if len(p["responses"])]
    weights = [torch.softmax(p["policy_logits"].float(), -1) for p in parts]
    merged: dict[str, Stat] = {}
    for part, w in zip(parts, weights):
        for name, stat in compute_example_stats(part, {"attention_weights": w}).items():
            merged[name] = merged[name].merge(stat) if name in merged else stat
    got = data_metrics_from_stats(merged)
    want = compute_example_metrics(concat(parts), {"attention_weights": torch.cat(weights)})
    for name in (
        "custom/token_accuracy/mean",
        "training/policy_entropy/mean",
        "analysis/reward_positive_ratio/mean",
        "analysis/reward_zero_ratio/mean",
        "analysis/reward_nonzero_token_ratio/mean",
        "analysis/total_transitions/total",
        "model/prompt_attention_ratio/mean",
        "model/attention_entropy/mean",
    ):
        assert got[name] == pytest.approx(want[name], rel=1e-6), name


def test_a_metric_under_the_reserved_prefix_is_refused_and_the_librarys_ingredients_still_work(request):
    """Issue 28.10: a user's ``_aux/...`` metric was accepted and never reported. It is refused at the
    client, naming it, and the call's other names go through; the ingredients the compute functions
    submit under that prefix still give the derived metrics of the whole batch (numpy)."""
    parts = shards(3)
    rng = np.random.default_rng(4)
    for part in parts:
        part["values"] = torch.from_numpy(rng.normal(size=(len(part["responses"]), R)))
        part["returns"] = part["values"] + torch.from_numpy(rng.normal(size=part["values"].shape))
    timings = [{"gen": g, "update_actor": a, "step": s} for g, a, s in rng.uniform(1.0, 9.0, (len(parts), 3))]
    refused = (
        r"metric '_aux/my/latency/mean': the prefix '_aux/' is reserved .* \(e\.g\. 'aux/my/latency/mean'\)"
    )
    try:
        clients = [rlmetrics.connect("local", world_size=len(parts), name=request.node.name) for _ in parts]
        for r, (client, part, timing) in enumerate(zip(clients, parts, timings)):
            with pytest.raises(MetricValueError, match=refused):
                client.submit_metric(
                    {"_aux/my/latency/mean": 1.0, "group/env/a/_aux/x": [2.0], "my/loss": float(r)}
                )
            client.compute_local_data_metric(part)
            client.compute_local_timing_metrics(part, timing)
            client.compute_local_throughout_metrics(part, timing, GPUS_PER_RANK)
            client.wait_submit()
        res = rlmetrics.connect("local", name=request.node.name).wait_final_res()
    finally:
        local.drop_worker(request.node.name)
    assert res.meta.complete, res.meta
    assert res["my/loss"] == np.mean(range(len(parts))) and not [n for n in res if "aux/" in n]
    full = concat(parts)
    for name, value in reference(full, timings, GPUS_PER_RANK * len(parts)).items():
        assert res[name] == pytest.approx(value, rel=1e-12), name
    on = full["response_mask"].numpy() != 0
    ret, val = full["returns"].numpy()[on], full["values"].numpy()[on]
    want = 1.0 - np.var(ret - val, ddof=1) / (np.var(ret, ddof=1) + 1e-5)
    assert res["critic/vf_explained_var"] == pytest.approx(want, rel=1e-9)
