"""Device→host synchronisations per call, counted on an accelerator emulated on the CPU (tests/syncs.py).

Every ``compute_*`` / ``analyze_*`` function of :mod:`rlmetrics.metrics` (data, timing and throughput,
the analysis pack) and ``submit_metric`` of tensors wait for the device at most once per call,
whatever the batch (several shapes, optional keys present or not, an empty batch), and give the same
numbers as on the CPU. The counter itself is checked first: it sees each kind of sync, once.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import rlmetrics  # noqa: E402
from rlmetrics import Stat, stat  # noqa: E402
from rlmetrics.backends import local  # noqa: E402
from rlmetrics.core.host import _device_to_host, _pinned_to_host, to_host  # noqa: E402
from rlmetrics.metrics import analysis, data, timing  # noqa: E402
from tests.syncs import DEVICE, DeviceTensor, SyncCounter, on_device  # noqa: E402

pytestmark = pytest.mark.torch


def count(fn, *args, **kwargs):
    """``(result, syncs, events)`` of ``fn`` called inside a counter."""
    with SyncCounter() as counter:
        out = fn(*args, **kwargs)
    return out, counter.syncs, counter.events


# ---------------------------------------------------------------------------------------- the counter
def test_queued_work_is_not_a_sync():
    x = on_device(torch.arange(12.0).reshape(3, 4))
    with SyncCounter() as counter:
        y = (x * 2).sum(-1) + torch.ones(3, device=DEVICE)  # kernels and a factory on the device
        z = torch.where(y > 3, y, math.inf).view(torch.int32)[1:]  # views and a Python scalar
        w = torch.cat([z, z]).to(torch.float32).clone()  # device to device
        v = torch.tensor([1.0, 2.0]).to(DEVICE, non_blocking=True)  # to the device, not waiting
    assert counter.syncs == 0, counter.events
    assert all(isinstance(t, DeviceTensor) for t in (y, z, w, v)) and w.device == DEVICE


@pytest.mark.parametrize(
    "read",
    [
        lambda x, m: x.sum().item(),
        lambda x, m: float(x[0]),
        lambda x, m: bool(x[0] > 0),
        lambda x, m: x.tolist(),
        lambda x, m: x.cpu(),
        lambda x, m: x.to("cpu"),
        lambda x, m: x.numpy(force=True),
        lambda x, m: torch.empty(4).copy_(x),
        lambda x, m: torch.ones(2).to(DEVICE),
        lambda x, m: torch.equal(x, x),
        lambda x, m: x.nonzero(),
        lambda x, m: torch.masked_select(x, m),
        lambda x, m: x[m],
        lambda x, m: x.clone().__setitem__(m, x[:1] * 0),
        lambda x, m: torch.unique(x),
        lambda x, m: torch.repeat_interleave(m.long()),
    ],
    ids=["item", "float", "bool", "tolist", "cpu", "to-cpu", "numpy-force", "copy_-to-host",
         "to-device", "equal", "nonzero", "masked_select", "bool-index",
         "bool-index-put", "unique", "repeat_interleave"],
)  # fmt: skip
def test_each_kind_of_sync_counts_once(read):
    x, m = on_device((torch.tensor([1.0, -2.0, 3.0, 0.5]), torch.tensor([True, False, True, True])))
    _, syncs, events = count(read, x, m)
    assert syncs == 1, events


def test_per_metric_reads_count_per_metric():
    """siiRL's style, one ``.item()`` per metric after a masked_select: one sync each."""
    x, mask = on_device((torch.randn(4, 5), torch.rand(4, 5) > 0.5))

    def seed_style():
        v = torch.masked_select(x, mask)
        return [v.mean().item(), v.max().item(), float(v.min())]

    _, syncs, events = count(seed_style)
    assert syncs == 4 and events[0] == "data-dependent shape: aten.masked_select.default"


def test_device_tensors_behave_as_on_a_gpu():
    x = on_device(torch.ones(3))
    with pytest.raises(TypeError, match="Use Tensor.cpu"):
        x.numpy()
    with pytest.raises(TypeError):
        np.asarray(x)
    with SyncCounter(), pytest.raises(RuntimeError, match="same device"):
        _ = x + torch.ones(3)
    with SyncCounter():
        assert isinstance(x + torch.tensor(2.0), DeviceTensor)  # a 0-dim host tensor is a scalar
    with SyncCounter(), pytest.raises(NotImplementedError, match="blocking copy"):
        _ = x + torch.tensor([1.0, 2.0, 3.0], device=DEVICE)  # no op to see: made without its data


def test_a_non_blocking_copy_to_the_host_is_garbage_until_the_stream_syncs():
    x = on_device(torch.tensor([1.0, 2.0]))
    with SyncCounter() as counter:
        host = x.to("cpu", non_blocking=True)
        early = host.clone()
        assert counter.syncs == 0
        counter.synchronize()
    assert counter.syncs == 1 and torch.isnan(early).all() and host.tolist() == [1.0, 2.0]


# ------------------------------------------------------------------------------- the CUDA-only path
def test_the_pinned_copy_path_syncs_once_and_only_after_its_wait():
    """``to_host`` on CUDA copies into pinned memory without blocking, then waits for the stream:
    run here on the emulated device with the counter's stream wait, it syncs once, like the
    blocking path, with the same numbers; without the wait it would read garbage."""
    flat = torch.tensor([1.5, -2.0, math.inf, 4.0], dtype=torch.float64)
    dev = on_device(flat)
    with SyncCounter() as counter:
        pinned = _pinned_to_host(dev, counter.synchronize)
    assert counter.syncs == 1 and counter.events == ["stream synchronize: synchronize"]
    blocking, syncs, _ = count(_device_to_host, dev)
    assert syncs == 1 and pinned.tolist() == blocking.tolist() == flat.tolist()
    with SyncCounter():
        unwaited = _pinned_to_host(dev, lambda: None)
    assert np.isnan(unwaited).all()


def test_to_host_copies_device_tensors_once_and_leaves_host_tensors():
    host = [torch.tensor([1, 2]), torch.ones(2, 2, dtype=torch.bool)]
    dev = on_device([torch.arange(3.0), torch.tensor(7, dtype=torch.int32), torch.zeros(0)])
    out, syncs, events = count(to_host, [dev[0], host[0], dev[1], host[1], dev[2]])
    assert syncs == 1, events
    assert [a.tolist() for a in out] == [[0.0, 1.0, 2.0], [1.0, 2.0], [7.0], [1.0] * 4, []]
    assert count(to_host, host)[1] == 0 and count(to_host, [])[1] == 0


# -------------------------------------------------------------------------------------------- batches
def ppo_batch(b: int, p: int, r: int, seed: int, *, optional: bool) -> dict:
    """A PPO batch (left-padded prompts, right-padded responses of lengths 0..r); ``optional`` adds
    every optional key of the data, timing and analysis metrics."""
    g = torch.Generator().manual_seed(seed)
    prompt_len, response_len = (
        torch.randint(0, p + 1, (b,), generator=g),
        torch.randint(0, r + 1, (b,), generator=g),
    )
    prompt_mask = (torch.arange(p)[None, :] >= p - prompt_len[:, None]).long()
    response_mask = (torch.arange(r)[None, :] < response_len[:, None]).long()
    scores = torch.randn(b, r, generator=g) * response_mask
    out = {
        "responses": torch.randint(0, 7, (b, r), generator=g),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "token_level_scores": scores,
        "token_level_rewards": scores * 0.9,
        "advantages": torch.randn(b, r, generator=g),
        "returns": torch.randn(b, r, generator=g),
    }
    if optional:
        v = 11
        out.update(
            response_mask=response_mask,
            values=torch.randn(b, r, generator=g, dtype=torch.float64),
            __num_turns__=torch.randint(1, 5, (b,), generator=g),
            tool_call_counts=torch.randint(0, 3, (b,), generator=g, dtype=torch.int32),
            global_token_num=prompt_len + response_len,
            prompts=torch.randint(0, 7, (b, p), generator=g),
            correct_tokens=torch.randint(0, 2, (b, p + r), generator=g),
            policy_logits=torch.randn(b, r, v, generator=g),
            grad_norm=torch.rand((), generator=g),
            loss_values=torch.rand(5, generator=g),
            old_log_probs=-torch.rand(b, r, generator=g),
            sum_pi_squared=torch.rand(b, r, generator=g),
        )
    return out


def model_outputs(b: int, p: int, r: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "attention_weights": torch.softmax(torch.randn(b, 2, r, p + r, generator=g), dim=-1),
        "hidden_states": torch.randn(b, p + r, 6, generator=g),
    }


SHAPES = [(0, 4, 5), (1, 1, 1), (3, 4, 5), (16, 8, 12), (64, 32, 48)]
TIMING = {"gen": 0.5, "ref": 0.25, "update_actor": 1.5, "step": 3.0}

DATA_CALLS = {
    "compute_data_stats": lambda d: data.compute_data_stats(d),
    "compute_data_metric": lambda d: data.compute_data_metric(d),
    "compute_verl_data_stats": lambda d: data.compute_verl_data_stats(d),
    "compute_variance_proxy_stats": lambda d: data.compute_variance_proxy_stats(d, 1.0),
}
TIMING_CALLS = {
    "compute_timing_stats": lambda d: timing.compute_timing_stats(d, TIMING),
    "compute_throughput_stats": lambda d: timing.compute_throughput_stats(d, TIMING, 8),
    "compute_timing_metrics": lambda d: timing.compute_timing_metrics(d, TIMING),
    "compute_throughput_metrics": lambda d: timing.compute_throughput_metrics(d, TIMING, 8),
    "compute_throughout_metrics": lambda d: timing.compute_throughout_metrics(d, TIMING, 8),
}


def _batch_only(name: str):
    fn = getattr(analysis, name)
    return lambda d: fn(d)


ANALYSIS_CALLS = {
    name: _batch_only(name)
    for name in (
        "compute_custom_data_stats", "compute_custom_data_metrics", "compute_custom_training_stats",
        "compute_custom_training_metrics", "compute_advanced_stats", "compute_advanced_metrics",
        "compute_token_transition_stats", "analyze_token_transitions", "compute_reward_distribution_stats",
        "analyze_reward_distribution", "compute_conversation_quality_stats",
        "compute_conversation_quality_metrics", "compute_response_quality_score",
        "compute_sequence_coherence",
    )
}  # fmt: skip
MODEL_CALLS = {
    "compute_model_performance_stats": analysis.compute_model_performance_stats,
    "compute_model_performance_metrics": analysis.compute_model_performance_metrics,
    "compute_example_stats": analysis.compute_example_stats,
    "compute_example_metrics": analysis.compute_example_metrics,
}
NEEDS = {  # functions that raise without these keys, as the seed's do
    "compute_response_quality_score": ("response_mask",),
    "compute_sequence_coherence": ("responses", "attention_mask"),
}
VOLATILE = {"perf/process_cpu_mem_used_gb"}  # the process RSS at call time


def test_every_compute_function_is_counted():
    """A compute_* / analyze_* function added to a metrics module must be added here."""
    counted = {*DATA_CALLS, *TIMING_CALLS, *ANALYSIS_CALLS, *MODEL_CALLS}
    public = {
        name
        for module in (data, timing, analysis)
        for name, fn in vars(module).items()
        if name.startswith(("compute_", "analyze_")) and inspect.isfunction(fn) and name in module.__all__
    }
    exempt = {"compute_length_appropriateness", "compute_repetition_score"}  # take one value, not a batch
    assert public - exempt == counted


def same(a, b) -> bool:
    """Equal results of the device and the CPU run: numbers (relative 1e-12), Stats, tensors."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a if k not in VOLATILE)
    if isinstance(a, Stat):
        arrays = np.allclose(a.to_array(), b.to_array(), rtol=1e-12, atol=0, equal_nan=True)
        sketches = (a.sketch is None) == (b.sketch is None) and (
            a.sketch is None or same(a.sketch.quantile(0.3), b.sketch.quantile(0.3))
        )
        return bool(arrays and sketches)
    if isinstance(a, torch.Tensor):
        return torch.equal(a.elem if isinstance(a, DeviceTensor) else a, b)
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300)


@pytest.mark.parametrize("optional", [True, False], ids=["all-keys", "required-keys"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{b}-P{p}-R{r}" for b, p, r in SHAPES])
def test_at_most_one_sync_per_call(shape, optional):
    batch = ppo_batch(*shape, seed=sum(shape), optional=optional)
    outputs = model_outputs(*shape, seed=1)
    dev_batch, dev_outputs = on_device((batch, outputs))
    calls = {**DATA_CALLS, **TIMING_CALLS, **ANALYSIS_CALLS}
    calls.update({name: (lambda d, fn=fn, o=outputs: fn(d, o)) for name, fn in MODEL_CALLS.items()})
    dev_calls = {**calls}
    dev_calls.update({name: (lambda d, fn=fn, o=dev_outputs: fn(d, o)) for name, fn in MODEL_CALLS.items()})
    for name, call in calls.items():
        if any(k not in batch for k in NEEDS.get(name, ())):
            continue
        expected = call(batch)
        got, syncs, events = count(dev_calls[name], dev_batch)
        assert syncs <= 1, (name, events)
        assert same(got, expected), (name, got, expected)


def test_timing_values_given_as_device_tensors_are_read_with_the_token_counts():
    batch = on_device(ppo_batch(8, 4, 6, seed=3, optional=True))
    timing_raw = {**TIMING, **on_device({"gen": torch.tensor(0.5), "step": torch.tensor([3.0])})}
    got, syncs, events = count(timing.compute_timing_metrics, batch, timing_raw)
    assert syncs == 1 and got == timing.compute_timing_metrics(batch, TIMING), events
    got, syncs, events = count(timing.compute_throughput_metrics, batch, timing_raw, 8)
    assert syncs == 1 and got == timing.compute_throughput_metrics(batch, TIMING, 8), events


# ---------------------------------------------------------------------------------------- submit_metric
@pytest.fixture
def client():
    c = rlmetrics.connect("local", world_size=1, name="test-syncs")
    yield c
    local.drop_worker("test-syncs")


def test_submit_metric_of_tensors_syncs_once(client):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, generator=g)
    metrics = {
        "loss/mean": torch.tensor(0.25),  # 0-dim
        "score/max": x,
        "score/std": x.reshape(5, 8),
        "score/p95": x,  # a quantile: the values themselves come over
        "weighted/mean": (x, 2.0),  # a host weight
        "token/mean": (x, torch.rand(40, generator=g)),  # a device weight
        "empty/mean": torch.zeros(0),
        "number/mean": 1.5,
    }
    dev = on_device(metrics)
    with SyncCounter() as counter:
        client.submit_metric(dev)
    assert counter.syncs == 1, counter.events
    with SyncCounter() as counter:  # the Stats of a compute_*_stats call are on the host already
        client.submit_metric(data.compute_data_stats(on_device(ppo_batch(4, 3, 5, seed=0, optional=True))))
    assert counter.syncs == 1, counter.events  # the one of compute_data_stats
    client.wait_submit()
    host = rlmetrics.connect("local", world_size=1, name="test-syncs-host")
    try:
        host.submit_metric(metrics)
        host.wait_submit()
        expected = host.result(0)
    finally:
        local.drop_worker("test-syncs-host")
    got = client.result(0)
    assert same({k: got[k] for k in expected}, dict(expected))


def test_refused_tensors_are_refused_by_name_and_the_others_kept(client):
    dev = on_device({"ok/mean": torch.ones(3), "bad/mean": (torch.ones(3), torch.ones(2))})
    with SyncCounter() as counter, pytest.raises(stat.MetricValueError, match="bad/mean"):
        client.submit_metric(dev)
    assert counter.syncs == 1
    client.wait_submit()
    assert dict(client.result(0)) == {"ok/mean": 1.0}
