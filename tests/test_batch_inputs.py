"""What compute functions accept (a mapping, a TensorDict, a DataProto-shaped object), what they refuse,
and that the names they yield depend on the batch's keys only (an empty batch yields every name)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import rlmetrics
from rlmetrics.backends import local
from rlmetrics.core.stat import MetricValueError
from rlmetrics.metrics.analysis import compute_example_metrics, compute_example_stats
from rlmetrics.metrics.data import compute_data_metric, compute_data_stats
from rlmetrics.metrics.timing import (
    compute_throughput_metrics,
    compute_throughput_stats,
    compute_timing_metrics,
    compute_timing_stats,
)

pytestmark = pytest.mark.torch

MEM = "perf/process_cpu_mem_used_gb"
TIMING = {"gen": 1.5, "ref": 0.5, "update_actor": 2.0, "step": 6.0}


class DataProto:
    """The shape of verl's ``DataProto`` (verl is not installed here): a TensorDict of tensors, a dict
    of numpy arrays for everything else, and a dict of meta information."""

    def __init__(self, batch: TensorDict | None, non_tensor_batch: dict, meta_info: dict) -> None:
        self.batch = batch
        self.non_tensor_batch = non_tensor_batch
        self.meta_info = meta_info

    def __len__(self) -> int:
        return len(self.batch)


def flat_batch(b: int, seed: int = 0) -> dict:
    """A PPO batch as one dict (what a DataProto holds, flattened)."""
    rng = np.random.default_rng(seed)
    p, r = 4, 6
    prompt_len, response_len = rng.integers(1, p + 1, b), rng.integers(0, r + 1, b)
    prompt = torch.from_numpy((np.arange(p)[None] >= p - prompt_len[:, None]).astype(np.int64))
    response = torch.from_numpy((np.arange(r)[None] < response_len[:, None]).astype(np.int64))
    on = response.double()
    return {
        "responses": torch.from_numpy(rng.integers(0, 9, (b, r))),
        "attention_mask": torch.cat([prompt, response], 1),
        "response_mask": response,
        "prompts": torch.ones(b, p, dtype=torch.long),
        "token_level_scores": torch.tensor(rng.normal(size=(b, r))) * on,
        "token_level_rewards": torch.tensor(rng.normal(size=(b, r))) * on,
        "advantages": torch.tensor(rng.normal(size=(b, r)), dtype=torch.float32),
        "returns": torch.tensor(rng.normal(size=(b, r)), dtype=torch.float32),
        "values": torch.tensor(rng.normal(size=(b, r)), dtype=torch.float32),
        "loss_values": torch.tensor(rng.normal(size=b)),
        "__num_turns__": rng.integers(1, 5, b).astype(object),  # verl: an object array of ints
        "tool_call_counts": rng.integers(0, 3, b),
        "global_token_num": (prompt.sum(-1) + response.sum(-1)).tolist(),
    }


NON_TENSOR = ("__num_turns__", "tool_call_counts")


def proto_of(batch: dict) -> DataProto:
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    b = len(batch["responses"])
    return DataProto(
        TensorDict(tensors, batch_size=[b]),
        {k: np.asarray(batch[k]) for k in NON_TENSOR},
        {"global_token_num": batch["global_token_num"]},
    )


def without_mem(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != MEM}


# ------------------------------------------------------------------------------------------ accepted
def test_a_dataproto_shaped_object_is_read_whole():
    """Issue 16: a DataProto-shaped object computed only ``perf/process_cpu_mem_used_gb``;
    ``DataProto.batch`` alone silently loses ``num_turns/*``."""
    batch = flat_batch(7)
    proto = proto_of(batch)
    want = without_mem(compute_data_metric(batch))
    assert {"num_turns/mean", "tool_call_counts/max", "critic/advantages/mean"} <= set(want)
    assert without_mem(compute_data_metric(proto)) == want
    assert compute_timing_metrics(proto, TIMING) == compute_timing_metrics(batch, TIMING)
    assert compute_throughput_metrics(proto, TIMING, 2) == compute_throughput_metrics(batch, TIMING, 2)
    assert compute_example_metrics(proto) == compute_example_metrics(batch)
    assert not any(k.startswith("num_turns") for k in compute_data_metric(proto.batch))  # keys decide


def test_a_client_reads_a_dataproto_whole(request):
    batch = flat_batch(5, seed=3)
    try:
        client = rlmetrics.connect("local", world_size=1, name=request.node.name)
        client.compute_local_data_metric(proto_of(batch))
        client.compute_local_timing_metrics(proto_of(batch), TIMING)
        client.compute_local_throughout_metrics(proto_of(batch), TIMING, 1)
        client.wait_submit()
        res = client.result(0, timeout=10)
    finally:
        local.drop_worker(request.node.name)
    want = {
        **compute_data_metric(batch),
        **compute_timing_metrics(batch, TIMING),
        **compute_throughput_metrics(batch, TIMING, 1),
    }
    want = {k.replace("timing_s/", "perf/delta_time/"): v for k, v in want.items()}
    assert set(res) == set(want)
    for name in set(want) - {MEM}:
        assert res[name] == pytest.approx(want[name], rel=1e-12), name


@pytest.mark.parametrize(
    "call",
    [
        lambda d: compute_data_metric(d),
        lambda d: compute_data_stats(d),
        lambda d: compute_timing_metrics(d, TIMING),
        lambda d: compute_throughput_stats(d, TIMING, 1),
        lambda d: compute_example_stats(d),
    ],
    ids=["data", "data_stats", "timing", "throughput", "example_pack"],
)
@pytest.mark.parametrize("data", [[1, 2], None, "batch", torch.ones(2, 3), 3.0], ids=repr)
def test_anything_else_raises_a_type_error_naming_what_is_accepted(call, data):
    """Issue 16: a list, None or a string gave only the memory metric; a bare tensor raised torch's
    ``Tensor.__contains__`` error."""
    with pytest.raises(TypeError, match=r"a mapping, a TensorDict, or an object with \.batch"):
        call(data)


def test_a_client_refuses_anything_else_before_submitting(request):
    try:
        client = rlmetrics.connect("local", world_size=1, name=request.node.name)
        with pytest.raises(TypeError, match="compute_local_data_metric needs a mapping"):
            client.compute_local_data_metric([{"responses": torch.ones(1, 2)}])
    finally:
        local.drop_worker(request.node.name)


# ---------------------------------------------------------------------------------- wrong shapes
WRONG = {
    "advantages": torch.ones(7, 5),  # not the response mask's shape
    "responses": torch.ones(7),  # not 2-D
    "attention_mask": torch.ones(7, 3, dtype=torch.long),  # narrower than the response
    "response_mask": torch.ones(7, 4, dtype=torch.long),  # not the shape of responses
    "token_level_rewards": torch.ones(5, 6),  # another batch size
    "token_level_scores": torch.ones(7, 6, dtype=torch.cfloat),  # complex
    "__num_turns__": np.array(["a"] * 7),  # strings
    "tool_call_counts": "x",
    "values": torch.ones(7, 6, device="meta"),
}


@pytest.mark.parametrize("key", list(WRONG))
def test_a_recognised_key_of_the_wrong_shape_or_dtype_raises_naming_it(key):
    batch = flat_batch(7)
    batch[key] = WRONG[key]
    with pytest.raises(MetricValueError, match=f"batch key '{key}'"):
        compute_data_stats(batch)


def test_a_global_token_num_of_strings_raises_naming_it():
    with pytest.raises(MetricValueError, match="batch key 'global_token_num'"):
        compute_throughput_metrics({"global_token_num": ["x"]}, {"step": 1.0}, 1)


# -------------------------------------------------------------------------------- names from keys
def names_of_every_function(batch: dict | DataProto, hidden: torch.Tensor) -> dict[str, set]:
    return {
        "data": set(compute_data_stats(batch)),
        "timing": set(compute_timing_stats(batch, TIMING)),
        "throughput": set(compute_throughput_stats(batch, TIMING, 1)),
        "example": set(compute_example_stats(batch, {"hidden_states": hidden})),
    }


@pytest.mark.parametrize("as_proto", [False, True])
def test_an_empty_batch_yields_the_names_of_a_full_one(as_proto):
    """Issue 15: with the same keys, a batch of 0 sequences lacked ``num_turns/*`` and the
    tool-call metrics (and the per-token times)."""
    full, empty = flat_batch(6), flat_batch(0)
    full_names = names_of_every_function(proto_of(full) if as_proto else full, full["values"])
    empty_names = names_of_every_function(proto_of(empty) if as_proto else empty, empty["values"])
    for kind, names in full_names.items():
        assert empty_names[kind] == names, (kind, names ^ empty_names[kind])
    assert {"num_turns/mean", "tool_call_counts/min"} <= full_names["data"]
    assert all(s.count == 0 for n, s in compute_data_stats(empty).items() if n != MEM and n[0] != "_")


def test_a_step_with_an_empty_rank_completes_with_the_full_ranks_numbers(request):
    """Empty summaries merge as count 0: the step completes (no deadline wait) with the values of
    the rank that had data."""
    full, empty = flat_batch(6, seed=1), flat_batch(0)
    try:
        clients = [rlmetrics.connect("local", world_size=2, name=request.node.name) for _ in range(2)]
        for client, batch in zip(clients, (full, empty)):
            client.compute_local_data_metric(batch)
            client.compute_local_timing_metrics(batch, TIMING)
            client.compute_local_throughout_metrics(batch, TIMING, 1)
            client.wait_submit()
        res = clients[0].result(0, timeout=0.5)
    finally:
        local.drop_worker(request.node.name)
    assert res.meta.complete, res.meta
    want = {**compute_data_metric(full), **compute_timing_metrics(full, TIMING)}
    for name in (
        "num_turns/mean",
        "tool_call_counts/max",
        "critic/advantages/mean",
        "timing_per_token_ms/gen",
    ):
        assert res[name] == pytest.approx(want[name], rel=1e-12), name
