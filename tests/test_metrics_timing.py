"""compute_timing_metrics and compute_throughput_metrics against loop references."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, TensorDict
from torch.overrides import TorchFunctionMode

from rlmetrics.core.stat import MetricValueError
from rlmetrics.metrics.timing import (
    compute_throughout_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
)

pytestmark = pytest.mark.torch

STAGES = ("gen", "ref", "values", "adv", "update_critic", "update_actor", "step", "reward", "testing")


def make_batch(rng: np.random.Generator, b: int, p: int, r: int, response_mask: bool) -> dict:
    prompt_len = rng.integers(0, p + 1, size=b)
    response_len = rng.integers(0, r + 1, size=b)
    prompt = (np.arange(p)[None, :] >= p - prompt_len[:, None]).astype(np.int64)
    response = (np.arange(r)[None, :] < response_len[:, None]).astype(np.int64)
    batch = {
        "responses": torch.zeros(b, r, dtype=torch.long),
        "attention_mask": torch.from_numpy(np.concatenate([prompt, response], axis=1)),
    }
    if response_mask:
        batch["response_mask"] = torch.from_numpy(response)
    return batch


def reference_timing(batch: dict, timing_raw: dict) -> dict[str, float]:
    """siiRL's definitions as loops: gen per response token, the others per prompt + response token."""
    attn = batch["attention_mask"].tolist()
    r = batch["responses"].shape[1]
    p = len(attn[0]) - r if attn else 0
    resp = batch["response_mask"].tolist() if "response_mask" in batch else [row[p:] for row in attn]
    n_prompt = sum(sum(row[:p]) for row in attn)
    n_response = sum(sum(row) for row in resp)
    out = {f"timing_s/{k}": float(v) for k, v in timing_raw.items()}
    for stage, tokens in [("gen", n_response)] + [
        (s, n_prompt + n_response) for s in ("ref", "values", "adv", "update_critic", "update_actor")
    ]:
        if stage in timing_raw and tokens > 0:
            out[f"timing_per_token_ms/{stage}"] = timing_raw[stage] * 1000 / tokens
    return out


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    b=st.integers(1, 6),
    p=st.integers(0, 5),
    r=st.integers(0, 6),
    response_mask=st.booleans(),
    stages=st.lists(st.sampled_from(STAGES), unique=True),
    tensordict=st.booleans(),
)
def test_timing_equals_reference(seed, b, p, r, response_mask, stages, tensordict):
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, b, p, r, response_mask)
    timing_raw = {s: float(rng.uniform(0.01, 30.0)) for s in stages}
    want = reference_timing(batch, timing_raw)
    data = TensorDict(batch, batch_size=[b]) if tensordict else batch
    got = compute_timing_metrics(data, timing_raw)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-12), name


def test_timing_by_hand():
    batch = {
        "responses": torch.zeros(2, 3),
        "attention_mask": torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
    }
    got = compute_timing_metrics(batch, {"gen": 0.4, "update_actor": 0.9, "step": 2.0})
    assert got == {
        "timing_s/gen": 0.4,
        "timing_s/update_actor": 0.9,
        "timing_s/step": 2.0,
        "timing_per_token_ms/gen": pytest.approx(400 / 5),  # 2 + 3 response tokens
        "timing_per_token_ms/update_actor": pytest.approx(900 / 8),  # and 1 + 2 prompt tokens
    }


def test_timing_refuses_a_stage_that_is_not_a_number_naming_it():
    timing_raw = {"gen": np.float32(0.5), "ref": torch.tensor(0.25)}
    got = compute_timing_metrics({}, timing_raw)  # no masks: no per-token metrics
    assert got == {"timing_s/gen": 0.5, "timing_s/ref": 0.25}
    with pytest.raises(MetricValueError) as err:
        compute_timing_metrics({}, {**timing_raw, "bad": "1.0", "none": None, "list": [1.0, 2.0]})
    message = str(err.value)
    for shown in (
        "timing_raw['bad'] is '1.0' (str)",
        "timing_raw['none'] is None",
        "['list'] is [1.0, 2.0] (list)",
    ):
        assert shown in message
    assert "not a number of seconds: this rank" in message and "pass a float" in message
    zero = {"responses": torch.zeros(2, 2), "attention_mask": torch.zeros(2, 4, dtype=torch.long)}
    assert compute_timing_metrics(zero, {"gen": 1.0, "adv": 1.0}) == {
        "timing_s/gen": 1.0,
        "timing_s/adv": 1.0,
    }
    assert compute_timing_metrics({"attention_mask": torch.ones(2, 4)}, {"gen": 1.0}) == {"timing_s/gen": 1.0}


class CountHostMoves(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.moves = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in {"cpu", "numpy", "tolist", "item", "__float__", "__int__"}:
            self.moves.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_timing_reads_the_token_counts_in_one_transfer():
    batch = make_batch(np.random.default_rng(0), 4, 3, 5, response_mask=True)
    with CountHostMoves() as moves:
        compute_timing_metrics(batch, {s: 1.0 for s in STAGES})
    assert moves.moves == ["numpy"]


# -------------------------------------------------------------------------------------- throughput
@pytest.mark.parametrize(
    "tokens",
    [
        [100, 250, 50],
        np.array([100, 250, 50], dtype=np.int64),
        torch.tensor([100, 250, 50]),
        NonTensorData([100, 250, 50]),
    ],
    ids=["list", "numpy", "tensor", "tensordict"],
)
def test_throughput(tokens):
    if isinstance(tokens, NonTensorData):
        batch = TensorDict({"x": torch.zeros(3)}, batch_size=[3])
        batch["global_token_num"] = tokens
    else:
        batch = {"global_token_num": tokens}
    got = compute_throughput_metrics(batch, {"step": 4.0, "gen": 1.0}, n_gpus=8)
    assert got == {
        "perf/total_num_tokens": 400.0,
        "perf/time_per_step": 4.0,
        "perf/throughput": 400 / (4.0 * 8),
    }


def test_throughput_falls_back_to_the_attention_mask_and_skips_what_it_cannot_compute():
    batch = {"attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}
    assert compute_throughput_metrics(batch, {"step": 0.5}, 1) == {
        "perf/total_num_tokens": 5.0,
        "perf/time_per_step": 0.5,
        "perf/throughput": 10.0,
    }
    assert compute_throughput_metrics({}, {}, 1) == {}
    assert compute_throughput_metrics({"global_token_num": [3]}, {}, 1) == {"perf/total_num_tokens": 3.0}
    assert compute_throughput_metrics({"global_token_num": [3]}, {"step": 0.0}, 1) == {
        "perf/total_num_tokens": 3.0,
        "perf/time_per_step": 0.0,
    }
    for bad in (0, -1, float("nan"), "2", None):
        with pytest.raises(
            MetricValueError, match=rf"the GPU count \(n_gpu\) is {re.escape(repr(bad))} .*positive"
        ):
            compute_throughput_metrics({"global_token_num": [3]}, {"step": 1.0}, bad)
    with pytest.raises(MetricValueError, match=r"timing_raw\['step'\] is '1\.0' \(str\)"):
        compute_throughput_metrics({"global_token_num": [3]}, {"step": "1.0"}, 1)


def test_seed_spelling_is_the_same_function():
    assert compute_throughout_metrics is compute_throughput_metrics
