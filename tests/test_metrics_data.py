"""compute_data_metric / compute_data_stats against a loop reference, merging, and the transfer count."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, TensorDict
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import rlmetrics
from rlmetrics.backends import local
from rlmetrics.core.stat import Stat
from rlmetrics.metrics import AUX_PREFIX, VF_TOKENS, derive_metrics
from rlmetrics.metrics.data import compute_data_metric, compute_data_stats, data_metrics_from_stats
from rlmetrics.metrics.data import tokens as tokens_module

pytestmark = pytest.mark.torch

MEM = "perf/process_cpu_mem_used_gb"
CLIP = ("response/clip_ratio/mean", "prompt/clip_ratio/mean")


# ------------------------------------------------------------------------------------------ batches
def make_batch(
    rng: np.random.Generator,
    b: int,
    p: int,
    r: int,
    *,
    rewards: str = "random",
    values: bool = True,
    response_mask: bool = True,
    num_turns: str | None = "int32",
    tool_calls: bool = False,
    dtype: torch.dtype = torch.float32,
    garbage: bool = True,
) -> dict:
    """A PPO batch: prompts left-padded to ``p``, responses right-padded to ``r`` (lengths 0..r).

    With ``garbage``, advantages / returns / values hold random numbers, nan and inf off the response.
    """
    prompt_len = rng.integers(0, p + 1, size=b)
    response_len = rng.integers(0, r + 1, size=b)
    prompt_mask = (np.arange(p)[None, :] >= p - prompt_len[:, None]).astype(np.int64)
    resp_mask = (np.arange(r)[None, :] < response_len[:, None]).astype(np.int64)
    on = resp_mask.astype(bool)
    scores = np.where(on, rng.normal(0.0, 0.3, size=(b, r)), 0.0)
    if rewards == "all_correct":
        scores[:, :1] = 2.0  # every row sums above 0.5 (also zero-length responses: siiRL sums the row)
        scores[:, 1:] = 0.0
    elif rewards == "all_wrong":
        scores = np.minimum(scores, 0.0)
    adv = rng.normal(0.0, 1.0, size=(b, r))
    val = rng.normal(0.5, 2.0, size=(b, r))
    ret = adv + val + rng.normal(0.0, 0.5, size=(b, r))
    if garbage:
        junk = rng.choice(np.array([np.nan, np.inf, -np.inf, 1e30, 7.0]), size=(b, r))
        adv, val, ret = (np.where(on, x, junk) for x in (adv, val, ret))
    batch = {
        "responses": torch.zeros(b, r, dtype=torch.long),
        "attention_mask": torch.from_numpy(np.concatenate([prompt_mask, resp_mask], axis=1)),
        "token_level_scores": torch.tensor(scores, dtype=dtype),
        "token_level_rewards": torch.tensor(scores * 0.9 if rewards == "random" else scores, dtype=dtype),
        "advantages": torch.tensor(adv, dtype=dtype),
        "returns": torch.tensor(ret, dtype=dtype),
    }
    if values:
        batch["values"] = torch.tensor(val, dtype=dtype)
    if response_mask:
        batch["response_mask"] = torch.from_numpy(resp_mask)
    turns = rng.integers(1, 6, size=b)
    if num_turns == "int32":
        batch["__num_turns__"] = turns.astype(np.int32)  # siiRL's agent loop: an int32 numpy array
    elif num_turns == "int64_tensor":
        batch["__num_turns__"] = torch.from_numpy(turns)
    elif num_turns == "float_tensor":
        batch["__num_turns__"] = torch.from_numpy(turns).float()
    elif num_turns == "list":
        batch["__num_turns__"] = turns.tolist()
    if tool_calls:
        batch["tool_call_counts"] = rng.integers(0, 4, size=b)
    return batch


def to_tensordict(batch: dict) -> TensorDict:
    b = batch["attention_mask"].shape[0]
    td = TensorDict({k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}, batch_size=[b])
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor):
            td[k] = NonTensorData(v)
    return td


# ---------------------------------------------------------------------------------------- reference
def reference(batch: dict) -> dict[str, float]:
    """siiRL's metric definitions, written as loops over sequences and tokens in float64."""

    def arr(key):
        v = batch.get(key)
        return None if v is None else np.asarray(v.double() if isinstance(v, torch.Tensor) else v, float)

    out: dict[str, float] = {}

    def mmm(prefix, xs):
        if xs:
            out[f"{prefix}/mean"] = math.fsum(xs) / len(xs)
            out[f"{prefix}/max"] = max(xs)
            out[f"{prefix}/min"] = min(xs)

    attn = arr("attention_mask")
    r = batch["responses"].shape[1]
    p = attn.shape[1] - r
    rmask = arr("response_mask") if "response_mask" in batch else attn[:, p:]
    rows = range(attn.shape[0])
    resp_len = [math.fsum(rmask[i]) for i in rows]
    prompt_len = [math.fsum(attn[i, :p]) for i in rows]
    seq_score = [math.fsum(arr("token_level_scores")[i]) for i in rows]
    seq_reward = [math.fsum(arr("token_level_rewards")[i]) for i in rows]
    mmm("critic/score", seq_score)
    mmm("critic/rewards", seq_reward)
    tokens = {}
    for key in ("advantages", "returns", "values"):
        if key in batch:
            x = arr(key)
            tokens[key] = [x[i, j] for i in rows for j in range(r) if rmask[i, j] != 0]
            mmm(f"critic/{key}", tokens[key])
    if "values" in tokens and len(tokens["returns"]) >= 2:
        residual = [a - b for a, b in zip(tokens["returns"], tokens["values"])]
        var_res, var_ret = statistics.variance(residual), statistics.variance(tokens["returns"])
        out["critic/vf_explained_var"] = 1.0 - var_res / (var_ret + 1e-5)
    mmm("response/length", resp_len)
    out["response/clip_ratio/mean"] = sum(n == r for n in resp_len) / len(resp_len)
    out["response/aborted_ratio"] = sum(n == 0 for n in resp_len) / len(resp_len)
    mmm("response/correct_length", [n for n, w in zip(resp_len, seq_reward) if w > 0.5])
    mmm("response/wrong_length", [n for n, w in zip(resp_len, seq_reward) if not w > 0.5])
    mmm("prompt/length", prompt_len)
    out["prompt/clip_ratio/mean"] = sum(n == p for n in prompt_len) / len(prompt_len)
    for key, prefix in (("__num_turns__", "num_turns"), ("tool_call_counts", "tool_call_counts")):
        if key in batch:
            mmm(prefix, [float(v) for v in np.asarray(batch[key]).reshape(-1)])
    return out


def assert_matches(got: dict[str, float], want: dict[str, float], skip: tuple[str, ...] = ()) -> None:
    got = {k: v for k, v in got.items() if k != MEM and k not in skip}
    want = {k: v for k, v in want.items() if k not in skip}
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        tol = 1e-4 if name == "critic/vf_explained_var" else 1e-5
        assert got[name] == pytest.approx(w, rel=tol, abs=tol), name


# ------------------------------------------------------------------------------------- equality
@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    b=st.integers(1, 6),
    p=st.integers(0, 5),
    r=st.integers(0, 7),
    rewards=st.sampled_from(["random", "all_correct", "all_wrong"]),
    values=st.booleans(),
    response_mask=st.booleans(),
    num_turns=st.sampled_from([None, "int32", "int64_tensor", "float_tensor", "list"]),
    tool_calls=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    tensordict=st.booleans(),
)
@example(seed=1, b=1, p=3, r=4, rewards="random", values=True, response_mask=True, num_turns="int32",
         tool_calls=False, dtype=torch.float32, tensordict=False)  # fmt: skip
def test_equals_loop_reference(
    seed, b, p, r, rewards, values, response_mask, num_turns, tool_calls, dtype, tensordict
):
    batch = make_batch(
        np.random.default_rng(seed), b, p, r, rewards=rewards, values=values,
        response_mask=response_mask, num_turns=num_turns, tool_calls=tool_calls, dtype=dtype,
    )  # fmt: skip
    want = reference(batch)
    got = compute_data_metric(to_tensordict(batch) if tensordict else batch)
    assert_matches(got, want)
    assert 0 < got[MEM] < 1024


@pytest.mark.parametrize(
    "case",
    [
        dict(rewards="all_correct"),
        dict(rewards="all_wrong"),
        dict(values=False),
        dict(num_turns=None),
        dict(num_turns="int32"),
        dict(num_turns="int64_tensor"),
        dict(response_mask=False),
        dict(tool_calls=True),
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_named_cases(case):
    batch = make_batch(np.random.default_rng(7), 5, 4, 6, **case)
    got = compute_data_metric(batch)
    assert_matches(got, reference(batch))
    if case.get("rewards") == "all_correct":
        assert "response/wrong_length/mean" not in got and got["response/correct_length/min"] >= 0
        assert "response/wrong_length/mean" in compute_data_stats(batch)  # the name is still submitted
    if case.get("rewards") == "all_wrong":
        assert "response/correct_length/mean" not in got
    if "values" in case:
        assert not any(k.startswith(("critic/values", "critic/vf")) for k in got)
    if case.get("num_turns") is None and "num_turns" in case:
        assert not any(k.startswith("num_turns") for k in got)
    elif "num_turns" in case:
        assert got["num_turns/mean"] == pytest.approx(np.mean(np.asarray(batch["__num_turns__"], float)))


def test_zero_length_responses_and_a_batch_of_one():
    batch = make_batch(np.random.default_rng(3), 1, 3, 4)
    batch["attention_mask"][:, 3:] = 0
    batch["response_mask"][:] = 0
    got = compute_data_metric(batch)
    assert got["response/length/max"] == 0.0 and got["response/aborted_ratio"] == 1.0
    assert not any(k.startswith(("critic/advantages", "critic/vf")) for k in got)  # no response token
    assert compute_data_stats(batch)["critic/advantages/mean"].count == 0
    assert_matches(got, reference(batch))


def test_exact_values_by_hand():
    batch = {
        "responses": torch.zeros(2, 3),
        "attention_mask": torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
        "token_level_rewards": torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.25]]),
        "advantages": torch.tensor([[2.0, 100.0, float("nan")], [1.0, 2.0, 3.0]]),
        "returns": torch.tensor([[1.0, 0.0, 0.0], [2.0, 3.0, 4.0]]),
        "values": torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0]]),
    }
    m = compute_data_metric(batch)
    assert m["critic/advantages/mean"] == 2.0 and m["critic/advantages/max"] == 3.0  # 4 tokens: 2, 1, 2, 3
    assert m["response/length/mean"] == 2.0 and m["response/clip_ratio/mean"] == 0.5
    assert m["prompt/length/mean"] == 2.5 and m["prompt/clip_ratio/mean"] == 0.5
    assert m["response/correct_length/mean"] == 1.0 and m["response/wrong_length/mean"] == 3.0
    returns, residual = [1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 1.0, 2.0]
    ev = 1 - statistics.variance(residual) / (statistics.variance(returns) + 1e-5)
    assert m["critic/vf_explained_var"] == pytest.approx(ev, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_token_tensors_summarized_together_or_one_at_a_time_agree(monkeypatch, dtype):
    """Small batches take the token summaries of all tensors in one group, large ones one at a time;
    both give the same bits, and the loop reference's numbers (garbage padding included)."""
    for seed in range(5):
        batch = make_batch(np.random.default_rng(seed), 9, 4, 13, dtype=dtype)
        monkeypatch.setattr(tokens_module, "_STACK_BYTES", 2**40)
        together = compute_data_stats(batch)
        monkeypatch.setattr(tokens_module, "_STACK_BYTES", 0)
        alone = compute_data_stats(batch)
        assert together.keys() == alone.keys()
        for name in together.keys() - {MEM}:
            assert together[name].to_array().tobytes() == alone[name].to_array().tobytes(), name
        assert_matches(compute_data_metric(batch), reference(batch))


@pytest.mark.parametrize("stack_bytes", [2**40, 0])  # the tensors together, or one at a time
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_metrics_skip_the_m2_no_metric_reads_and_stats_keep_it(monkeypatch, stack_bytes, dtype):
    """``compute_data_metric`` computes no M2 of advantages and values (no reported metric reads it):
    its numbers are the bits of the reduced ``compute_data_stats`` all the same (the explained
    variance's M2 of returns and of the residual included), and those Stats keep their M2."""
    monkeypatch.setattr(tokens_module, "_STACK_BYTES", stack_bytes)
    for seed, values in ((0, True), (1, True), (2, False)):
        batch = make_batch(np.random.default_rng(seed), 9, 4, 13, dtype=dtype, values=values)
        got = compute_data_metric(batch)
        stats = compute_data_stats(batch)
        want = data_metrics_from_stats(stats)
        assert got.keys() == want.keys()
        assert {k: v for k, v in got.items() if k != MEM} == {k: v for k, v in want.items() if k != MEM}
        for key in ("advantages", "values") if values else ("advantages",):
            x, on = batch[key].double(), batch["response_mask"] != 0
            m2 = float(((x[on] - x[on].mean()) ** 2).sum())
            assert stats[f"critic/{key}/mean"].m2 == pytest.approx(m2, rel=1e-5)
        assert_matches(got, reference(batch))


def test_per_sequence_vectors_of_another_length_are_summarized_on_their_own():
    batch = make_batch(np.random.default_rng(8), 5, 3, 4)
    batch["__num_turns__"] = np.array([1, 2, 3, 4, 5, 6, 7], dtype=np.int32)  # 7 values for 5 sequences
    got = compute_data_metric(batch)
    assert (got["num_turns/mean"], got["num_turns/min"], got["num_turns/max"]) == (4.0, 1.0, 7.0)
    assert_matches(got, reference(batch))


# ------------------------------------------------------------------------------------ robustness
@pytest.mark.parametrize(
    ("drop", "gone"),
    [
        (("responses",), ()),  # the width comes from response_mask
        (("response_mask",), ()),  # the response part of attention_mask
        (("responses", "response_mask"), ("response/", "critic/advantages", "critic/returns", "critic/values",
                                          "critic/vf", "prompt/")),
        (("attention_mask",), ("prompt/",)),
        (("token_level_scores",), ("critic/score",)),
        (("token_level_rewards",), ("critic/rewards", "response/correct", "response/wrong")),
        (("advantages",), ("critic/advantages",)),
        (("returns",), ("critic/returns", "critic/vf")),
        (("values",), ("critic/values", "critic/vf")),
        (("__num_turns__",), ("num_turns",)),
    ],
)  # fmt: skip
def test_missing_keys_skip_their_metrics(drop, gone):
    batch = make_batch(np.random.default_rng(5), 4, 3, 5)
    full = compute_data_metric(batch)
    for key in drop:
        del batch[key]
    got = compute_data_metric(batch)
    assert set(got) == {n for n in full if not n.startswith(gone)} if gone else set(got) == set(full)
    for name in got.keys() - {MEM}:
        assert got[name] == full[name], name


def test_empty_inputs_give_empty_summaries():
    assert set(compute_data_metric({})) == {MEM}
    assert set(compute_data_stats({})) == {MEM}
    empty = make_batch(np.random.default_rng(0), 0, 3, 4)
    assert set(compute_data_metric(empty)) == {MEM}  # every name is submitted, none has data
    assert set(compute_data_stats(empty)) == set(
        compute_data_stats(make_batch(np.random.default_rng(0), 3, 3, 4))
    )


def test_low_precision_and_bool_masks():
    batch = make_batch(np.random.default_rng(11), 6, 4, 8, garbage=False)
    want = reference(batch)
    batch["response_mask"] = batch["response_mask"].bool()
    batch["attention_mask"] = batch["attention_mask"].float()
    for key in ("advantages", "returns", "values"):
        batch[key] = batch[key].to(torch.bfloat16)
    got = compute_data_metric(batch)
    assert set(got) - {MEM} == set(want)
    assert got["response/length/mean"] == want["response/length/mean"]
    assert got["critic/advantages/max"] == pytest.approx(want["critic/advantages/max"], rel=1e-2)


def close_to_psutil() -> bool:
    """``perf/process_cpu_mem_used_gb``'s reading is psutil's rss: between two of psutil's readings
    (memory may move between reads), give or take 1 MiB."""
    import psutil

    from rlmetrics.metrics.data import _rss_bytes

    before = psutil.Process().memory_info().rss
    ours = _rss_bytes()
    after = psutil.Process().memory_info().rss
    return min(before, after) - 2**20 <= ours <= max(before, after) + 2**20


def test_process_memory_is_psutils_rss_also_in_a_forked_child():
    """``perf/process_cpu_mem_used_gb`` is psutil's rss (not the virtual size), and a fork reads its
    own, not its parent's (one psutil ``Process`` per pid)."""
    import os

    assert close_to_psutil()
    ballast = np.ones(2**25)  # the parent grows by 256 MiB (written pages); the child lets them go
    assert close_to_psutil()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        del ballast
        os.write(write, b"1" if close_to_psutil() else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    assert close_to_psutil() and ballast.size == 2**25


def test_every_name_of_the_seed():
    batch = make_batch(np.random.default_rng(2), 8, 4, 6, tool_calls=True)
    names = set(compute_data_metric(batch))
    for prefix in ("critic/score", "critic/rewards", "critic/advantages", "critic/returns", "critic/values",
                   "response/length", "response/correct_length", "response/wrong_length", "prompt/length",
                   "num_turns", "tool_call_counts"):  # fmt: skip
        assert {f"{prefix}/{r}" for r in ("mean", "max", "min")} <= names, prefix
    assert {"critic/vf_explained_var", "response/clip_ratio/mean", "prompt/clip_ratio/mean", MEM,
            "response/aborted_ratio"} <= names  # fmt: skip
    assert not any(n.startswith(AUX_PREFIX) for n in names)
    stats = compute_data_stats(batch)
    assert {n for n in stats if n.startswith(AUX_PREFIX)} == {
        "_aux/vf_explained_var/returns/std",
        "_aux/vf_explained_var/residual/std",
        VF_TOKENS,
    }
    assert not any(n.startswith(AUX_PREFIX) for n in compute_data_stats(batch, aux=False))


# ------------------------------------------------------------------------------ one host transfer
HOST_MOVES = {"cpu", "numpy", "tolist", "item", "__float__", "__int__", "__bool__", "__index__", "__array__"}
SYNCING_OPS = ("nonzero", "masked_select", "_local_scalar_dense", "unique", "index.Tensor", "masked_scatter")


class CountHostMoves(TorchFunctionMode):
    """Tensor methods that copy data to the host (or read a value there), as the code calls them."""

    def __init__(self):
        super().__init__()
        self.moves = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_cpu = name == "to" and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device")))
        if name in HOST_MOVES or to_cpu:
            self.moves.append((name, tuple(args[0].shape) if isinstance(args[0], torch.Tensor) else None))
        return func(*args, **kwargs)


class CountOps(TorchDispatchMode):
    """Every aten op that runs; ops with data-dependent output shapes synchronize an accelerator."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("tensordict", [False, True])
def test_one_host_transfer_per_call(tensordict):
    """On this CPU-only machine no copy really happens, so the test counts what would be one: every
    call that moves tensor data to the host or reads a value there (``.cpu()``, ``.to("cpu")``,
    ``.numpy()``, ``.tolist()``, ``.item()``, ``float(t)``, ``bool(t)``, ...), seen at the Python API
    (TorchFunctionMode), plus, at the ATen level (TorchDispatchMode), scalar reads and the ops whose
    output shape depends on the data (``nonzero``, ``masked_select``, boolean indexing), which make a
    GPU wait and copy their size to the host. The same code on CUDA does exactly the calls counted
    here, so exactly one of them is a device-to-host copy."""
    batch = make_batch(np.random.default_rng(4), 16, 8, 12, tool_calls=True, num_turns="int64_tensor")
    batch = to_tensordict(batch) if tensordict else batch
    compute_data_metric(batch)  # warm-up (lazy imports)
    with CountHostMoves() as moves, CountOps() as ops:
        stats = compute_data_stats(batch)
    assert len(stats) > 40
    assert len(moves.moves) == 1, moves.moves
    name, shape = moves.moves[0]
    assert name == "numpy" and len(shape) == 1 and shape[0] >= 5 * 15  # all summaries and lengths at once
    assert not [op for op in ops.ops if any(s in op for s in SYNCING_OPS)]
    with CountHostMoves() as moves:
        compute_data_metric(batch)
    assert len(moves.moves) == 1


def test_the_counter_sees_per_metric_reads():
    """The counter is not blind: siiRL's style (one ``.item()`` per metric) is counted as such."""
    x, mask = torch.randn(4, 5), torch.rand(4, 5) > 0.5
    with CountHostMoves() as moves, CountOps() as ops:
        v = torch.masked_select(x, mask)
        _ = [v.mean().item(), v.max().item(), float(v.min())]
    assert len(moves.moves) == 3
    assert any("masked_select" in op for op in ops.ops)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_syncs_once():
    batch = make_batch(np.random.default_rng(4), 16, 8, 12)
    batch = {
        k: torch.as_tensor(v).cuda() for k, v in batch.items()
    }  # all on the device: no host-to-device copy
    compute_data_metric(batch)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning) as record:
            compute_data_stats(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len([w for w in record if "synchroniz" in str(w.message)]) == 1


# ------------------------------------------------------------------------------- exact merging
def concatenate(batches: list[dict]) -> dict:
    """One batch of all ranks: prompts left-padded and responses right-padded to common widths."""
    p = max(b["attention_mask"].shape[1] - b["responses"].shape[1] for b in batches)
    r = max(b["responses"].shape[1] for b in batches)
    out: dict[str, list] = {}
    for b in batches:
        rb = b["responses"].shape[1]
        pb = b["attention_mask"].shape[1] - rb
        attn = b["attention_mask"]
        parts = {
            "attention_mask": torch.cat(
                [F.pad(attn[:, :pb], (p - pb, 0)), F.pad(attn[:, pb:], (0, r - rb))], 1
            ),
            "responses": F.pad(b["responses"], (0, r - rb)),
            "__num_turns__": torch.as_tensor(np.asarray(b["__num_turns__"])),
        }
        for key in (
            "response_mask",
            "token_level_scores",
            "token_level_rewards",
            "advantages",
            "returns",
            "values",
        ):
            parts[key] = F.pad(b[key], (0, r - rb))
        for key, value in parts.items():
            out.setdefault(key, []).append(value)
    return {key: torch.cat(values) for key, values in out.items()}


def rank_batches(seed: int, dtype: torch.dtype) -> list[dict]:
    rng = np.random.default_rng(seed)
    shapes = [(1, 3, 4), (7, 5, 9), (3, 2, 2), (12, 6, 11)]  # different batch sizes and widths
    return [make_batch(rng, b, p, r, dtype=dtype) for b, p, r in shapes]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_merged_rank_stats_equal_the_concatenated_batch(seed):
    """float64 data: merged and concatenated agree to rounding (float32 data: see the next test)."""
    batches = rank_batches(seed, torch.float64)
    per_rank = [compute_data_stats(b) for b in batches]
    merged = {name: Stat() for name in per_rank[0]}
    for stats in per_rank:
        assert stats.keys() == merged.keys()  # every rank submits the same names
        merged = {name: merged[name].merge(stats[name]) for name in merged}
    got = data_metrics_from_stats(merged)
    want = compute_data_metric(concatenate(batches))
    assert_matches(got, {k: v for k, v in want.items() if k != MEM}, skip=CLIP)  # clip ratios: widths differ
    for name in ("critic/advantages/mean", "response/length/mean", "critic/score/min", "critic/score/max",
                 "critic/vf_explained_var", "num_turns/mean"):  # fmt: skip
        assert got[name] == pytest.approx(want[name], rel=1e-9, abs=1e-12), name
    # the test can fail: the mean of the ranks' means is not the token-weighted mean
    means = [s["critic/advantages/mean"].mean for s in per_rank if s["critic/advantages/mean"].count]
    assert not math.isclose(statistics.mean(means), want["critic/advantages/mean"], rel_tol=1e-9)


def test_merging_through_local_clients(request):
    name = request.node.name
    batches = rank_batches(12345, torch.float32)
    try:
        clients = [rlmetrics.connect("local", world_size=4, name=name, label=f"rank{r}") for r in range(4)]
        for client, batch in zip(clients, batches):
            client.submit_metric(compute_data_stats(batch))
            client.wait_submit()
        result = clients[0].result(0, timeout=10)
    finally:
        local.drop_worker(name)
    assert result.meta.complete, result.meta
    got = derive_metrics(result)  # idempotent: the aggregator derives already
    assert got == dict(result) and not any(n.startswith(AUX_PREFIX) for n in result)
    want = compute_data_metric(concatenate(batches))
    assert_matches(got, {k: v for k, v in want.items() if k != MEM}, skip=CLIP)
    for key in ("critic/advantages/mean", "response/length/mean", "critic/score/min", "critic/score/max"):
        assert got[key] == pytest.approx(want[key], rel=1e-9), key
    # per-token deviations are squared in the data's precision, float32 here: the centre differs
    # between a rank and the whole batch, so the sums of squares agree to float32 rounding
    assert got["critic/vf_explained_var"] == pytest.approx(want["critic/vf_explained_var"], rel=1e-6)
    # the fallback under the name itself (each rank's value, token-weighted) is not the global value
    fallback = Stat()
    for batch in batches:
        fallback = fallback.merge(compute_data_stats(batch)["critic/vf_explained_var"])
    assert fallback.mean != pytest.approx(want["critic/vf_explained_var"], rel=1e-4)


# -------------------------------------------------------------------------------- torch.compile
TOKEN_KEYS = {
    "critic/advantages/mean": "advantages",
    "critic/returns/mean": "returns",
    "critic/values/mean": "values",
}


def exact_token_sums(batch: dict, key: str) -> tuple[float, float, float, float, int]:
    """Sum, m2 about the exact mean, sum of |x|, |mean| and count of the response tokens of
    ``batch[key]``, in exact (fsum) arithmetic on the tensor's own values."""
    on = batch["response_mask"].numpy() != 0
    x = batch[key].double().numpy()[on]
    total = math.fsum(x)
    mean = total / len(x)
    return total, math.fsum((x - mean) ** 2), math.fsum(np.abs(x)), abs(mean), len(x)


def sum_bounds(batch: dict, key: str, unit: float) -> tuple[float, float]:
    """Worst-case rounding errors of the token sum and m2 when each row (``r`` terms) is summed with
    roundoff ``unit`` and the rows are added in float64, for any order of summation (so they hold
    eager and compiled, on every CPU whatever its vector width): ``(r - 1) unit sum|x|`` for the sum;
    for m2 the same over its non-negative terms, plus the rounding of each deviation and square,
    plus the rounded centre's distance from the mean."""
    total, m2, abs_sum, mean, n = exact_token_sums(batch, key)
    r = batch["response_mask"].shape[1]
    gamma = r * unit / (1 - r * unit) + 2.0**-52 * n  # a row's sum, then the rows added in float64
    centre = gamma * abs_sum / n + 2.0**-23 * mean  # how far the (rounded) centre can be off the mean
    return gamma * abs_sum, (gamma + 4 * unit) * m2 + n * centre * centre


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_torch_compile_gives_the_eager_numbers(request, dtype):
    """Compiled and eager token summaries: counts and extremes are the same bits; sums and m2 within
    the data precision's error bound for the row width (they sum rows in another order, which
    depends on the CPU's vector width: a fixed relative tolerance failed on some CPUs). A second
    shape runs without recompiling."""
    rng = np.random.default_rng(21)
    unit = 2.0**-24 if dtype == torch.float32 else 2.0**-53
    for b, p, r in ((9, 4, 13), (33, 7, 50)):
        batch = make_batch(rng, b, p, r, dtype=dtype, values=dtype == torch.float32)
        compiled, eager = compute_data_stats(batch, torch_compile=True), compute_data_stats(batch)
        assert compiled.keys() == eager.keys()
        for name in compiled.keys() - {MEM}:  # counts, min and max: exact on both paths
            c, e = compiled[name].to_array(), eager[name].to_array()
            exact = [0, 3, 4] if name != "critic/vf_explained_var" else [0]
            assert np.array_equal(c[exact], e[exact], equal_nan=True), name
        for name, key in TOKEN_KEYS.items():
            if name not in compiled:
                continue
            total, m2, *_ = exact_token_sums(batch, key)
            sum_err, m2_err = sum_bounds(batch, key, unit)
            for path, stats in (("compiled", compiled), ("eager", eager)):
                assert abs(stats[name].sum - total) <= sum_err, (name, path, stats[name].sum - total, sum_err)
                assert abs(stats[name].m2 - m2) <= m2_err, (name, path, stats[name].m2 - m2, m2_err)
        assert_matches(compute_data_metric(batch, torch_compile=True), reference(batch))
    batch = make_batch(rng, 6, 3, 8)
    try:
        client = rlmetrics.connect("local", world_size=1, name=request.node.name)
        client.compute_local_data_metric(batch, torch_compile=True)
        client.wait_submit()
        result = client.result(0, timeout=10)
    finally:
        local.drop_worker(request.node.name)
    assert_matches(dict(result), reference(batch))


def test_float32_sums_are_checked_against_a_bound_that_can_fail():
    """The bound of the test above is not vacuous: float32 sums of a long row overshoot the bound of
    float64 row sums, and stay inside float32's."""
    batch = make_batch(np.random.default_rng(5), 4, 2, 4096, garbage=False)
    batch["response_mask"][:] = 1
    noise = torch.rand(4, 4096, generator=torch.Generator().manual_seed(0))
    batch["advantages"] = torch.full((4, 4096), 0.1) + noise * 1e-3
    total, *_ = exact_token_sums(batch, "advantages")
    row_sums = batch["advantages"].sum(-1, dtype=torch.float32).double().sum().item()  # float32 rows
    assert abs(row_sums - total) <= sum_bounds(batch, "advantages", 2.0**-24)[0]
    assert abs(row_sums - total) > sum_bounds(batch, "advantages", 2.0**-53)[0]


def test_torch_compile_falls_back_to_eager_with_a_warning_when_compiling_fails():
    """On a machine without a C++ compiler the first call warns once; every call computes eagerly.

    The inductor config is patched with its own ``patch`` (pytest's monkeypatch would delete the
    entry on undo, which hides it: ``force_disable_caches does not exist`` in later compiles)."""
    torch._dynamo.reset()  # compile afresh, from no cache, with a compiler that is not there
    saved = dict(tokens_module._compiled)
    tokens_module._compiled.clear()
    batch = make_batch(np.random.default_rng(3), 5, 3, 6)
    patch = {"force_disable_caches": True, "cpp.cxx": ("/nonexistent/c++",)}
    try:
        with torch._inductor.config.patch(patch):
            with pytest.warns(RuntimeWarning, match="compiling the token summaries failed"):
                first = compute_data_stats(batch, torch_compile=True)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                again = compute_data_stats(batch, torch_compile=True)
    finally:
        torch._dynamo.reset()
        tokens_module._compiled.clear()
        tokens_module._compiled.update(saved)
    eager = compute_data_stats(batch)
    for name in eager:
        if name != MEM:
            assert first[name] == eager[name] and again[name] == eager[name], name
    assert not torch._inductor.config.force_disable_caches  # restored, and still there


def test_data_metrics_from_stats_reduces_quantile_names_from_their_sketches():
    """Merged Stats a user adds to the data metrics may carry sketches (a quantile name)."""
    values = np.random.default_rng(0).normal(size=101)
    stats = {"x/p50": Stat.of(values, sketch=True), "critic/score/mean": Stat.of(values)}
    got = data_metrics_from_stats(stats)
    assert got == {
        "x/p50": pytest.approx(float(np.median(values))),
        "critic/score/mean": pytest.approx(values.mean()),
    }


def test_derive_metrics_keeps_the_fallback_without_ingredients():
    assert derive_metrics({"critic/vf_explained_var": 0.5, "a/mean": 1.0}) == {
        "critic/vf_explained_var": 0.5,
        "a/mean": 1.0,
    }
    assert derive_metrics({VF_TOKENS: 1.0, "_aux/vf_explained_var/returns/std": 1.0,
                           "_aux/vf_explained_var/residual/std": 0.0}) == {}  # fmt: skip


def test_imports_stay_light():
    code = (
        "import sys, rlmetrics, rlmetrics.metrics as m\n"
        "assert 'torch' not in sys.modules and 'rlmetrics.metrics.data' not in sys.modules\n"
        "m.derive_metrics({})\n"
        "assert callable(m.compute_data_metric) and 'torch' in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("group_by", [None, "task"])
def test_min_and_max_are_the_datas_own_values_when_a_sequence_is_constant(group_by):
    """GRPO's advantages are one value per sequence: the float32 mean of a sequence's equal values can
    lie an ulp outside them, so the padding must not take the mean where min and max are read."""
    gen = torch.Generator().manual_seed(0)
    b, r = 64, 8
    mask = (torch.rand(b, r, generator=gen) > 0.3).float()
    mask[:, 0] = 1
    adv = torch.randn(b, 1, generator=gen) * mask
    batch = {
        "responses": torch.ones(b, r, dtype=torch.long), "prompts": torch.ones(b, 3, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(b, 3), mask], 1), "response_mask": mask,
        "token_level_scores": torch.rand(b, r, generator=gen), "advantages": adv, "returns": adv / 3,
        "task": ["copy", "reverse"] * (b // 2),
    }  # fmt: skip
    got = compute_data_metric(batch, group_by=group_by)
    tasks = np.array(batch["task"])
    parts = [("", np.ones(b, bool))]
    if group_by:
        parts += [(f"group/task/{t}/", tasks == t) for t in ("copy", "reverse")]
    for prefix, rows in parts:
        on = mask.bool().numpy() & rows[:, None]
        for name, x in (("critic/advantages", adv), ("critic/returns", adv / 3)):
            values = x.double().numpy()[on]
            assert (got[f"{prefix}{name}/min"], got[f"{prefix}{name}/max"]) == (values.min(), values.max())


def test_a_registered_reduction_that_reads_m2_gets_it_for_advantages():
    """compute_data_metric skips the M2 of advantages and values only while no reduction of their
    names reads it: a std registered for them is the std of the response tokens."""
    from rlmetrics.core.reduce import register_reduction, unregister_reduction

    batch = make_batch(np.random.default_rng(5), 6, 3, 7)
    adv = np.asarray(batch["advantages"], float)[np.asarray(batch["attention_mask"])[:, -7:] != 0]
    register_reduction("critic/advantages/*", "std")
    try:
        got = compute_data_metric(batch)["critic/advantages/mean"]
    finally:
        unregister_reduction("critic/advantages/*")
    assert got == pytest.approx(adv.std(), rel=1e-5)
    mean = compute_data_metric(batch)["critic/advantages/mean"]
    assert mean == pytest.approx(adv.mean(), rel=1e-5, abs=1e-6)
