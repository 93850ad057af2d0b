"""Tests of rlmetrics.metrics.analysis: every example metric equals its loop reference, merges exactly,
computes entropy in bounded memory and reads the device once.

The loop references are the seed's example functions as its docs write them (a Python loop per
sequence); they live in benchmarks/bench_analysis.py, which times the library against them.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from rlmetrics.core.reduce import STD, resolve
from rlmetrics.metrics import analysis as an
from rlmetrics.metrics.analysis.evaluate import Call

REL = 1e-10
pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore:std\\(\\):UserWarning"),
]  # the seed's std of one value


def _load_bench():
    """The loop references live in the benchmark, once; it imports the benchmarks' report module."""
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(benchmarks) not in sys.path:
        sys.path.append(str(benchmarks))
    path = benchmarks / "bench_analysis.py"
    spec = importlib.util.spec_from_file_location("bench_analysis", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


bench = _load_bench()

# (batch, response length, prompt length, probability of a masked position inside a response)
SHAPES = [
    (1, 1, 1, 0.0),
    (1, 9, 3, 0.3),
    (2, 0, 2, 0.0),
    (5, 16, 4, 0.0),
    (17, 33, 8, 0.25),
    (48, 96, 16, 0.1),
]


def make(b: int, r: int, p: int, holes: float, seed: int = 0):
    """A random batch (bench.make_batch) with an all-masked first row and small token ids (repeats)."""
    data, outputs = bench.make_batch(b, r, p, seed=seed, vocab=12, holes=holes, v_small=7)
    data["response_mask"][0] = 0
    data["attention_mask"][0] = 0
    data["token_level_rewards"][0] = 0.0
    return data, outputs


def close(a: float, b: float, rel: float = REL) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=1e-300)


def assert_same(ours: dict[str, float], ref: dict[str, float], rel: float = REL) -> None:
    bench.assert_same(ours, ref, rel=rel)


# ------------------------------------------------------------------------- equal to loop references
@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{b}-R{r}-P{p}-h{h}" for b, r, p, h in SHAPES])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_function_equals_its_loop_reference(shape, seed):
    data, outputs = make(*shape, seed=seed)
    assert_same(an.compute_custom_data_metrics(data), bench.ref_custom_data_metrics(data))
    assert_same(an.compute_custom_training_metrics(data), bench.ref_custom_training_metrics(data))
    assert_same(an.compute_advanced_metrics(data), bench.ref_advanced_metrics(data))
    assert_same(an.analyze_token_transitions(data), bench.ref_token_transitions(data))
    assert_same(an.analyze_reward_distribution(data), bench.ref_reward_distribution(data))
    assert_same(an.compute_conversation_quality_metrics(data), bench.ref_conversation_quality_metrics(data))
    ours = an.compute_model_performance_metrics(data, outputs)
    ref = bench.ref_model_performance_metrics(data, outputs)
    if shape[1] == 0:  # the seed's [:, :, :-0] is empty: it reports 0 where all attention is on the prompt
        assert ref["model/prompt_attention_ratio/mean"] == 0.0
        assert ours.pop("model/prompt_attention_ratio/mean") == 1.0
        ref.pop("model/prompt_attention_ratio/mean")
    assert_same(ours, ref, rel=1e-6)  # the prompt ratio adds float32 row sums; the rest holds at REL
    for name in ("model/attention_entropy/mean", "model/hidden_norm/mean", "model/hidden_norm/std"):
        assert close(ours[name], ref[name])
    if shape[1]:
        assert_same(
            an.compute_example_metrics(data, outputs), bench.ref_example_metrics(data, outputs), rel=1e-6
        )


@pytest.mark.parametrize("seed", range(4))
def test_per_sequence_helpers_equal_the_seeds(seed):
    data, _ = make(23, 40, 5, 0.2, seed=seed)
    torch.testing.assert_close(
        an.compute_response_quality_score(data), bench.ref_response_quality_score(data)
    )
    torch.testing.assert_close(
        an.compute_sequence_coherence(data), bench.ref_sequence_coherence(data), rtol=1e-12, atol=0
    )
    np.testing.assert_allclose(
        an.conversation_quality_scores(data).numpy(), bench.ref_conversation_quality_scores(data), rtol=1e-12
    )
    np.testing.assert_allclose(
        an.conversation_quality_scores(data, target_length=7).numpy(),
        bench.ref_conversation_quality_scores(data, target_length=7),
        rtol=1e-12,
    )
    gen = torch.Generator().manual_seed(seed)
    for n in (0, 1, 2, 3, 10, 57):
        tokens = torch.randint(0, 4, (n,), generator=gen)
        assert an.compute_repetition_score(tokens) == bench.ref_repetition_score(tokens)


def test_length_appropriateness_equals_the_seeds():
    lengths = list(range(0, 240))
    ours = an.compute_length_appropriateness(torch.tensor(lengths))
    for length, value in zip(lengths, ours.tolist()):
        assert value == bench.ref_length_appropriateness(length) == an.compute_length_appropriateness(length)
    assert an.compute_length_appropriateness(30, target_length=20) == bench.ref_length_appropriateness(30, 20)


def test_the_seed_in_float32_agrees_to_its_own_precision():
    """The seed's code as written (``.float()``) against the library's float64 statistics."""
    data, outputs = make(31, 64, 8, 0.1, seed=5)
    data["responses"] = data["responses"] * 4_000  # large ids: float32 variance of ids loses digits
    f32 = torch.float32
    pairs = [
        (an.compute_custom_data_metrics(data), bench.ref_custom_data_metrics(data, f32)),
        (an.compute_custom_training_metrics(data), bench.ref_custom_training_metrics(data, f32)),
        (an.compute_advanced_metrics(data), bench.ref_advanced_metrics(data, f32)),
        (
            an.compute_model_performance_metrics(data, outputs),
            bench.ref_model_performance_metrics(data, outputs, f32),
        ),
        (an.compute_conversation_quality_metrics(data), bench.ref_conversation_quality_metrics(data, f32)),
    ]
    for ours, ref in pairs:
        assert_same(ours, ref, rel=1e-5)


# --------------------------------------------------------------------------------- the Stat view
def test_stat_view_reduces_to_the_dict_view_except_std():
    data, outputs = make(40, 50, 6, 0.2, seed=3)
    stats = an.compute_example_stats(data, outputs)
    floats = an.compute_example_metrics(data, outputs)
    assert set(stats) == set(floats)
    for name, stat in stats.items():
        red = resolve(name)
        if red is STD:  # dict: torch's unbiased std; Stat: population std, as merged by rlmetrics
            n = stat.count
            assert close(floats[name], math.sqrt(stat.m2 / (n - 1)))
            assert close(red.apply(stat), floats[name] * math.sqrt((n - 1) / n))
        else:
            assert close(red.apply(stat), floats[name]), name
    # names of one statistic share one Stat; the quantile names carry a sketch
    assert (
        stats["analysis/coherence/mean"]
        is stats["analysis/coherence/median"]
        is stats["analysis/coherence/std"]
    )
    assert stats["analysis/reward_distribution/p25"].sketch is not None
    # the family functions give the same Stats as the pack
    for family in (
        an.compute_custom_data_stats(data),
        an.compute_custom_training_stats(data),
        an.compute_advanced_stats(data),
        an.compute_token_transition_stats(data),
        an.compute_reward_distribution_stats(data),
        an.compute_model_performance_stats(data, outputs),
        an.compute_conversation_quality_stats(data),
    ):
        for name, stat in family.items():
            assert np.allclose(stat.to_array(), stats[name].to_array(), rtol=1e-12), name


def _split(data, outputs, sizes):
    parts, start = [], 0
    for n in sizes:
        rows = slice(start, start + n)
        part = {k: (v[rows] if k not in ("loss_values", "grad_norm") else v) for k, v in data.items()}
        parts.append((part, {k: v[rows] for k, v in outputs.items()}))
        start += n
    return parts


@pytest.mark.parametrize("seed", [0, 1])
def test_merged_rank_stats_equal_the_concatenated_batch(seed):
    """Three ranks with unequal batches: merged Stats reduce to the statistics of the whole batch."""
    data, outputs = make(30, 40, 6, 0.2, seed=seed)
    del data["loss_values"], data["grad_norm"]  # per-rank scalars: not split from a batch
    ranks = [an.compute_example_stats(d, o) for d, o in _split(data, outputs, (3, 19, 8))]
    whole = an.compute_example_stats(data, outputs)
    merged = {name: ranks[0][name].merge(ranks[1][name]).merge(ranks[2][name]) for name in whole}
    unique, total = "analysis/unique_transitions/total", "analysis/total_transitions/total"
    for name, stat in whole.items():
        if name in (unique, "analysis/transition_diversity/mean"):
            continue
        red = resolve(name)
        assert close(red.apply(merged[name]), red.apply(stat), rel=1e-9), name
    # distinct transitions: the merged value is the sum of the ranks' counts, at least the global count
    per_rank = [r[unique].sum for r in ranks]
    assert merged[unique].sum == sum(per_rank) >= whole[unique].sum
    denominators = [max(r[total].sum, 1.0) for r in ranks]
    diversity = resolve("analysis/transition_diversity/mean").apply(
        merged["analysis/transition_diversity/mean"]
    )
    assert close(diversity, sum(per_rank) / sum(denominators))


# --------------------------------------------------------------------------------------- entropy
def _seed_entropy(logits: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    return -torch.sum(probs * torch.log(probs + eps), dim=-1)


@pytest.mark.parametrize("chunk_elements", [1, 36, 37, 38, 111, 10**9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_entropy_equals_the_seed_formula(chunk_elements, dtype):
    logits = 5 * torch.randn(3, 5, 37, generator=torch.Generator().manual_seed(0), dtype=dtype)
    logits[0, 0] = -1e4  # a (numerically) one-hot row
    ours = an.policy_entropy(logits, chunk_elements=chunk_elements)
    assert ours.dtype == dtype and ours.shape == (3, 5)
    torch.testing.assert_close(ours, _seed_entropy(logits), rtol=0, atol=0)
    weights = torch.softmax(logits, -1)
    torch.testing.assert_close(
        an.attention_entropy(weights, chunk_elements=chunk_elements),
        -torch.sum(weights * torch.log(weights + 1e-9), dim=-1),
        rtol=0,
        atol=0,
    )


def test_low_precision_logits_are_taken_in_float32():
    logits = 4 * torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    ours = an.policy_entropy(logits.bfloat16(), chunk_elements=100)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, _seed_entropy(logits.bfloat16().float()), rtol=0, atol=0)


def test_policy_entropy_metric_skips_masked_rows_exactly():
    data, _ = make(9, 30, 4, 0.3, seed=7)
    full = an.compute_custom_training_metrics(data, chunk_elements=10**9)
    chunked = an.compute_custom_training_metrics(data, chunk_elements=7)
    assert close(chunked["training/policy_entropy/mean"], full["training/policy_entropy/mean"], rel=1e-15)


class _LargestAllocation(TorchDispatchMode):
    """Bytes of the largest storage an op creates (views and in-place results reuse their input's)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {
            a.untyped_storage().data_ptr()
            for a in (*args, *(kwargs or {}).values())
            if isinstance(a, torch.Tensor) and a.device.type != "meta"
        }
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_entropy_memory_is_bounded_at_a_150k_vocabulary():
    vocab = 150_000
    logits = torch.randn(2, 8, vocab, generator=torch.Generator().manual_seed(2))
    budget = 2 * vocab  # two rows per chunk
    with _LargestAllocation() as probe:
        chunked = an.policy_entropy(logits, chunk_elements=budget)
    assert probe.largest <= budget * 4  # float32 temporaries of at most one chunk
    with _LargestAllocation() as probe:
        one_shot = _seed_entropy(logits)
    assert probe.largest >= logits.numel() * 4  # the probe sees the seed's full-size temporaries
    torch.testing.assert_close(chunked, one_shot, rtol=0, atol=0)
    data = {"policy_logits": logits, "response_mask": torch.ones(2, 8)}
    with _LargestAllocation() as probe:  # the metric's masked-row path too
        an.compute_custom_training_stats(data, chunk_elements=budget)
    assert probe.largest <= budget * 4


# ------------------------------------------------------------------------------- device contract
class _HostReads(TorchFunctionMode):
    """Tensor methods that move data to the host (a device→host copy on a GPU)."""

    HOST = {"cpu", "numpy", "item", "tolist", "__float__", "__int__", "__bool__", "__index__", "__array__"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.HOST:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


class _ScalarReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_one_host_copy_per_call_and_no_scalar_reads():
    data, outputs = make(12, 20, 4, 0.2, seed=4)
    with _HostReads() as host, _ScalarReads() as scalars:
        stats = an.compute_example_stats(data, outputs)
    assert len(stats) == 33
    assert host.calls == ["numpy"]  # one copy of everything (numpy(force=True) copies from a device)
    assert scalars.ops == []


def test_building_the_plan_needs_no_data_on_an_accelerator():
    """On a non-CPU device nothing reads data before the copy: the planners run on meta tensors."""
    data, outputs = make(6, 10, 3, 0.2, seed=1)
    meta = {k: v.to("meta") for k, v in data.items()}
    meta_out = {k: v.to("meta") for k, v in outputs.items()}
    call = Call(chunk_elements=50)
    for planner in an._pack_planners(meta_out, an.TARGET_LENGTH):
        planner(meta, call)
    assert len(call.plan._tensors) > 10 and all(t.device.type == "meta" for t in call.plan._tensors)


# ----------------------------------------------------------------------------------------- inputs
def test_missing_keys_skip_their_metrics():
    assert an.compute_example_metrics({}) == {}
    assert an.compute_custom_data_metrics({"responses": torch.ones(2, 3, dtype=torch.long)}) == {}
    assert an.compute_conversation_quality_metrics({"responses": torch.ones(2, 3, dtype=torch.long)}) == {}
    assert an.compute_model_performance_metrics({}, {}) == {}
    only = an.compute_model_performance_metrics({}, {"attention_weights": torch.full((1, 2, 4), 0.25)})
    assert list(only) == ["model/attention_entropy/mean"]  # no attention_mask: no prompt ratio


def test_tensordict_and_plain_dict_agree():
    tensordict = pytest.importorskip("tensordict")
    data, outputs = make(7, 12, 3, 0.2, seed=2)
    del data["grad_norm"]  # a 0-d tensor does not share the TensorDict's batch size
    td = tensordict.TensorDict({k: v for k, v in data.items() if k != "loss_values"}, batch_size=[7])
    plain = {k: v for k, v in data.items() if k != "loss_values"}
    assert an.compute_example_metrics(td, outputs) == an.compute_example_metrics(plain, outputs)


def test_token_ids_beyond_32_bits_raise():
    data = {"responses": torch.tensor([[1, 2**40, 3]]), "prompts": torch.ones(1, 1)}
    with pytest.raises(ValueError, match="32 bits"):
        an.analyze_token_transitions(data)
    with pytest.raises(ValueError, match="32 bits"):
        an.compute_conversation_quality_metrics(data)
    masked = dict(data, response_mask=torch.tensor([[1, 0, 1]]))  # masked ids do not matter
    assert an.analyze_token_transitions(masked)["analysis/unique_transitions/total"] == 1.0


def test_negative_and_int32_ids_pack_without_collisions():
    responses = torch.tensor([[-1, 5, -1, 5], [5, -1, 2**31 - 1, -(2**31)]], dtype=torch.int32)
    data = {"responses": responses, "prompts": torch.ones(2, 1)}
    assert_same(an.analyze_token_transitions(data), bench.ref_token_transitions(data))
    assert_same(an.compute_conversation_quality_metrics(data), bench.ref_conversation_quality_metrics(data))


def test_bad_chunk_size_is_rejected():
    with pytest.raises(ValueError, match="chunk_elements"):
        an.policy_entropy(torch.zeros(2, 3), chunk_elements=0)
