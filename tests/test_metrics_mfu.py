"""perf/mfu/<stage> against the hand formula, merged over ranks with unequal tokens and times, and the
per-stage GPU memory (absent on CPU, the max over ranks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rlmetrics
from rlmetrics.backends import MetricClient, local
from rlmetrics.core.reduce import resolve
from rlmetrics.metrics.memory import compute_memory_metrics, memory_metrics
from rlmetrics.metrics.mfu import ModelFlops, compute_mfu_metrics, compute_mfu_stats, peak_flops_of

pytestmark = pytest.mark.torch

N, L, H = 7.6e9, 28, 3584  # about Qwen2.5-7B
H100 = 989e12


def run_ranks(calls) -> dict:
    """Each of ``calls`` (one per rank: ``f(client)``) on its own in-process client; the merged step 0."""
    worker = local.LocalMetricWorker()
    clients = [MetricClient(worker, world_size=len(calls), rank=r) for r in range(len(calls))]
    for client, call in zip(clients, calls):
        call(client)
        client.wait_submit()
    return dict(clients[0].wait_final_res())


def batch_of(lengths: list[int], width: int = 64) -> dict:
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"attention_mask": mask}


def test_the_model_count_is_the_stated_formula():
    m = ModelFlops(N, L, H)
    assert m.per_token(2048) == 6 * N + 12 * L * H * 2048
    assert m.per_token(2048, training=False) == pytest.approx((6 * N + 12 * L * H * 2048) / 3)
    assert m.of_sequences([3, 5]) == 3 * (6 * N + 12 * L * H * 3) + 5 * (6 * N + 12 * L * H * 5)
    assert ModelFlops.of({"num_params": N, "num_hidden_layers": L, "hidden_size": H}) == m


def test_peak_by_name_is_dense_and_unknown_names_are_refused():
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12  # the longest name inside wins
    assert peak_flops_of("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_of("NVIDIA H200") == 989e12  # not the H20's
    with pytest.raises(ValueError, match="unknown device"):
        peak_flops_of("TPU v5e")
    with pytest.raises(ValueError, match="positive"):
        peak_flops_of(0.0)


def test_merged_mfu_over_unequal_ranks_equals_the_hand_formula():
    """Four ranks, different tokens, times and GPUs: sum of all FLOPs / (mean seconds * GPUs * peak)."""
    rng = np.random.default_rng(0)
    ranks = []
    for r in range(4):
        lengths = rng.integers(1, 64, size=int(rng.integers(1, 9))).tolist()
        ranks.append((lengths, {"update_actor": float(rng.uniform(5, 20)), "step": 30.0}, r % 2 + 1))
    calls = [
        lambda c, b=lengths, t=timing, g=gpus: c.compute_local_mfu_metrics(
            batch_of(b), t, g, model=ModelFlops(N, L, H), peak_flops="H100"
        )
        for lengths, timing, gpus in ranks
    ]
    got = run_ranks(calls)
    s = np.concatenate([np.array(b, float) for b, _, _ in ranks])
    flops = float((s * (6 * N + 12 * L * H * s)).sum())
    seconds = np.mean([t["update_actor"] for _, t, _ in ranks])
    gpus = sum(g for _, _, g in ranks)
    assert got["perf/mfu/actor"] == pytest.approx(flops / (seconds * gpus * H100), rel=1e-12)
    assert not [k for k in got if k.startswith("_aux/")]


def test_the_open_instruct_mistake_is_not_ours():
    """open-instruct PR #1808: each rank counted FLOPs with the global token count, so the summed
    FLOPs (or the mean of per-rank MFUs) was W times the truth (44.3 against 11.1 on 4 ranks)."""
    fpt, seconds, world, peak = 6 * N, 10.0, 4, H100
    tokens = [40_000, 55_000, 61_000, 44_000]
    calls = [
        lambda c, n=n: c.compute_local_mfu_metrics(
            n, {"step": seconds}, 1, flops_per_token=fpt, peak_flops=peak
        )
        for n in tokens
    ]
    got = run_ranks(calls)["perf/mfu/actor"]
    truth = sum(tokens) * fpt / (seconds * world * peak)
    per_rank_with_global_tokens = [sum(tokens) * fpt / (seconds * 1 * peak) for _ in tokens]
    mistaken = float(np.mean(per_rank_with_global_tokens))
    assert got == pytest.approx(truth, rel=1e-12)
    assert mistaken == pytest.approx(world * truth)
    assert got != pytest.approx(mistaken)
    # the mean of each rank's own MFU is also wrong once tokens are unequal and times differ
    own = [n * fpt / (s * peak) for n, s in zip(tokens, (8.0, 10.0, 12.0, 10.0))]
    calls = [
        lambda c, n=n, s=s: c.compute_local_mfu_metrics(
            n, {"step": s}, 1, flops_per_token=fpt, peak_flops=peak
        )
        for n, s in zip(tokens, (8.0, 10.0, 12.0, 10.0))
    ]
    got = run_ranks(calls)["perf/mfu/actor"]
    assert got == pytest.approx(sum(tokens) * fpt / (10.0 * world * peak), rel=1e-12)
    assert got != pytest.approx(float(np.mean(own)), rel=1e-6)


def test_timer_defaults_to_the_stage_then_the_step_and_forward_stages_count_a_third():
    batch = batch_of([10, 20])
    model = {"n_params": 1e9, "n_layers": 4, "hidden_size": 256}
    one = compute_mfu_metrics(batch, {"update_actor": 2.0, "step": 4.0}, 1, model=model, peak_flops=1e12)
    step = compute_mfu_metrics(batch, {"step": 4.0}, 1, model=model, peak_flops=1e12)
    assert one["perf/mfu/actor"] == pytest.approx(2 * step["perf/mfu/actor"])
    ref = compute_mfu_metrics(batch, {"ref": 2.0}, 1, model=model, peak_flops=1e12, stage="ref")
    assert ref["perf/mfu/ref"] == pytest.approx(one["perf/mfu/actor"] / 3)
    assert compute_mfu_stats(batch, {"gen": 1.0}, 1, model=model, peak_flops=1e12) == {}


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="either flops_per_token or model"):
        compute_mfu_stats(10, {"step": 1.0}, 1, peak_flops=1e12)
    with pytest.raises(ValueError, match="stage"):
        compute_mfu_stats(10, {"step": 1.0}, 1, flops_per_token=1.0, peak_flops=1e12, stage="rollout")
    with pytest.raises(rlmetrics.MetricValueError, match="seq_len"):
        compute_mfu_stats(10, {"step": 1.0}, 1, model=ModelFlops(1e9, 2, 64), peak_flops=1e12)
    with pytest.raises(ValueError, match=r"timer='update_actr' is not in timing_raw \(it has \['step'\]\)"):
        compute_mfu_stats(10, {"step": 1.0}, 1, flops_per_token=1.0, peak_flops=1e12, timer="update_actr")
    with pytest.raises(ValueError, match="got a object.*ModelFlops\\(n_params=sum"):
        compute_mfu_stats(10, {"step": 1.0}, 1, model=object(), peak_flops=1e12, seq_len=8)


def test_axes_client_takes_the_new_methods():
    from rlmetrics.axes import AxesClient

    assert AxesClient.compute_local_mfu_metrics.__wrapped__ is MetricClient.compute_local_mfu_metrics
    assert AxesClient.compute_local_memory_metrics.__wrapped__ is MetricClient.compute_local_memory_metrics


def test_memory_names_merge_as_the_max_of_ranks():
    names = memory_metrics(1.0, 2.0, 3.0, 4.0, stage="update_actor")
    head = "perf/memory/update_actor/"
    assert sorted(names) == [
        "perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb", head + "allocated_gb",
        head + "peak_gb", head + "reserved_gb",
    ]  # fmt: skip
    assert {resolve(n).name for n in names} == {"max"}
    calls = [
        lambda c, r=r: c.submit_metric(memory_metrics(r * 2**30, 0, r * 2**30, 0, "gen")) for r in (3, 7, 5)
    ]
    got = run_ranks(calls)
    assert got["perf/memory/gen/peak_gb"] == 7.0 and got["perf/max_memory_allocated_gb"] == 7.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_memory_is_absent_on_cpu():
    assert compute_memory_metrics("gen") == {}
    got = run_ranks([lambda c: (c.compute_local_memory_metrics("gen"), c.submit_metric({"x": 1.0}))])
    assert not [k for k in got if "memory" in k]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_on_cuda_reads_the_allocator():
    x = torch.empty(2**28, dtype=torch.uint8, device="cuda")  # 256 MiB
    got = compute_memory_metrics("gen", reset_peak=True)
    assert got["perf/memory/gen/allocated_gb"] >= 0.25 and got["perf/memory/gen/peak_gb"] >= 0.25
    assert got["perf/memory/gen/reserved_gb"] >= got["perf/memory/gen/allocated_gb"]
    del x
