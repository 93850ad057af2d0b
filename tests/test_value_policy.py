"""One value policy on every path: scalars of any type, nan_strategy, odd tensors, masked arrays.

Each finding of issue 16 ("one value policy everywhere") has a test here; the numbers are checked
against numpy on the same values.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import rlmetrics
from rlmetrics.backends import local
from rlmetrics.core.packing import pack
from rlmetrics.core.stat import MetricValueError, Stat
from rlmetrics.engine.aggregator import Aggregator
from rlmetrics.metrics.analysis import compute_custom_training_metrics, compute_custom_training_stats
from rlmetrics.metrics.data import compute_data_metric, compute_data_stats
from rlmetrics.metrics.timing import compute_timing_stats
from rlmetrics.metrics.validation import encode_samples, process_validation_metrics

pytestmark = pytest.mark.torch

NAN = math.nan
SCALAR_KINDS = {
    "float": float,
    "int-valued numpy float32": np.float32,
    "numpy float64": np.float64,
    "0-d array": np.array,
    "0-d tensor": torch.tensor,
    "0-d tensor requiring grad": lambda v: torch.tensor(v, dtype=torch.float64, requires_grad=True) * 1.0,
}


def merged(per_rank: list[dict], nan_strategy: str = "propagate") -> dict:
    """Pack each rank's dict and merge them in one engine step."""
    agg = Aggregator()
    for r, metrics in enumerate(per_rank):
        agg.submit(f"r{r}", 0, 0, len(per_rank), pack(metrics, nan_strategy))
        agg.close(f"r{r}", 0)
    return dict(agg.finalize(0))


# ------------------------------------------------------------------------------------------ scalars
@pytest.mark.parametrize("kind", list(SCALAR_KINDS))
def test_a_scalar_means_the_same_whatever_its_type_also_under_a_std_name(kind):
    """Issue 16: a 0-d tensor under ``.../std`` was taken as data (std of the per-rank stds), a float
    averaged. Every scalar type is now one rank's number, averaged under a std name (with a warning)."""
    stds = [0.5, 0.9, 0.7]
    make = SCALAR_KINDS[kind]
    with pytest.warns(rlmetrics.ValueWarning, match="rank's std"):
        got = merged([{"actor/entropy/std": make(v), "actor/loss/mean": make(v)} for v in stds])
    assert got["actor/entropy/std"] == pytest.approx(np.mean(stds), rel=1e-6)
    assert got["actor/loss/mean"] == pytest.approx(np.mean(stds), rel=1e-6)


def test_mixed_scalar_kinds_give_one_result_whatever_the_arrival_order():
    values = [np.float32(0.5), torch.tensor(0.9), np.array(0.7), 0.3]
    results = set()
    for order in ([0, 1, 2, 3], [1, 0, 3, 2], [2, 3, 1, 0]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results.add(round(merged([{"x/std": values[i]} for i in order])["x/std"], 6))
    assert results == {round(float(np.mean([0.5, 0.9, 0.7, 0.3])), 6)}


# ------------------------------------------------------------------------------------- nan_strategy
def value_kinds(values: list[float]) -> dict:
    return {
        "list": list(values),
        "array": np.array(values),
        "tensor": torch.tensor(values),
        "stat": Stat.of(values),
        "weighted": (np.array(values), np.ones(len(values))),
    }


@pytest.mark.parametrize("kind", ["list", "array", "tensor", "stat", "weighted"])
def test_nan_strategy_is_honoured_by_every_kind_of_value(kind):
    """Issue 16: a Stat with a NaN gave NaN under "drop" and raised nothing under "error"."""
    data = [1.0, NAN, 3.0]
    finite = [1.0, 3.0]
    assert math.isnan(merged([{"m/mean": value_kinds(data)[kind], "ok": 1.0}])["m/mean"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dropped = merged(
            [{"m/mean": value_kinds(data)[kind], "ok": 1.0}, {"m/mean": [5.0], "ok": 2.0}], "drop"
        )
    if kind == "stat":  # a summary's values cannot be told apart: dropped whole, with a warning
        assert dropped["m/mean"] == 5.0
        assert any("dropped whole" in str(w.message) for w in caught)
    else:
        assert dropped["m/mean"] == pytest.approx(np.mean(finite + [5.0]))
    errors: dict = {}
    p = pack({"m/mean": value_kinds(data)[kind], "ok": 1.0}, "error", errors=errors)
    assert p.schema.names == ("ok",) and "'m/mean'" in errors["m/mean"]
    with pytest.raises(MetricValueError, match="m/mean"):
        pack({"m/mean": value_kinds(data)[kind]}, "error")


def test_stats_built_with_drop_keep_their_finite_values_under_drop():
    got = merged([{"m/mean": Stat.of([1.0, NAN, 3.0], nan_strategy="drop")}], "drop")
    assert got["m/mean"] == 2.0


def test_sketch_names_follow_nan_strategy():
    data = np.array([1.0, 2.0, NAN, 4.0, 8.0])
    assert merged([{"lat/p50": data}], "drop")["lat/p50"] == pytest.approx(
        np.quantile(data[~np.isnan(data)], 0.5)
    )
    with pytest.raises(MetricValueError, match="lat/p50"):
        pack({"lat/p50": Stat.of(data, sketch=True)}, "error")


# --------------------------------------------------------------------------------------- odd values
def test_odd_values_are_refused_alone_naming_the_metric():
    """Issue 16: requires_grad lists raised torch's RuntimeError, meta / sparse tensors
    NotImplementedError / RuntimeError, and the call's valid metrics were lost."""
    w = torch.tensor([1.0, 3.0], requires_grad=True)
    losses = [w[0] * 1.0, w[1] * 1.0]  # requires_grad elements: detached copies are summarized
    errors: dict = {}
    p = pack(
        {
            "actor/pg_loss": losses,
            "meta": torch.ones(3, device="meta"),
            "sparse": torch.eye(3).to_sparse(),
            "complex": torch.tensor([1 + 2j]),
            "complex/scalar": torch.tensor(1 + 2j),
            "huge": 10**400,
            "critic/score/mean": [0.5, 1.5],
        },
        errors=errors,
    )
    assert p.schema.names == ("actor/pg_loss", "critic/score/mean")
    assert p.stats[:2].T.tolist() == [[2.0, 4.0], [2.0, 2.0]]
    assert set(errors) == {"meta", "sparse", "complex", "complex/scalar", "huge"}
    for name, message in errors.items():
        assert repr(name) in message, message
    assert "meta tensor" in errors["meta"] and "sparse" in errors["sparse"] and "float64" in errors["huge"]


def test_an_int_beyond_float64_on_the_scalar_fast_path_is_refused_alone():
    """Issue 16: once names went the scalar fast path, ``10**400`` raised a bare OverflowError."""
    schemas: dict = {}
    pack({"huge": 1, "ok": 2.0}, schemas=schemas)
    assert pack({"huge": 3, "ok": 2.0}, schemas=schemas).stats.tolist() == [3.0, 2.0]  # the fast path
    errors: dict = {}
    p = pack({"huge": 10**400, "ok": 2.0}, schemas=schemas, errors=errors)
    assert p.schema.names == ("ok",) and "float64" in errors["huge"]


def test_numpy_masked_arrays_honour_their_mask():
    """Issue 16: the mask of a numpy masked array was ignored (mean 334 instead of 1.5)."""
    values = np.ma.array([1.0, 2.0, 1000.0], mask=[False, False, True])
    assert Stat.of(values).mean == 1.5
    assert Stat.of(values, mask=[0, 1, 1]).mean == 2.0  # both masks apply
    assert Stat.of(values, sketch=True).sketch.quantile(1.0) == 2.0
    assert merged([{"m/mean": values}, {"m/mean": np.ma.masked_invalid([NAN, 4.0])}])[
        "m/mean"
    ] == pytest.approx(7 / 3)
    assert Stat.of(np.ma.masked).count == 0


def test_a_client_call_keeps_its_valid_names_when_some_are_refused(request):
    try:
        client = rlmetrics.connect("local", world_size=1, name=request.node.name, nan_strategy="error")
        with pytest.raises(MetricValueError) as exc:
            client.submit_metric(
                {
                    "actor/pg_loss": [torch.tensor(1.0, requires_grad=True)],
                    "nan": [NAN],
                    "bad": "x",
                    "ok": 2.0,
                }
            )
        assert "'nan'" in str(exc.value) and "'bad'" in str(exc.value)
        client.wait_submit()
        res = client.result(0, timeout=10)
    finally:
        local.drop_worker(request.node.name)
    assert dict(res) == {"actor/pg_loss": 1.0, "ok": 2.0} and res.meta.complete


# --------------------------------------------------------------------------- built-in computations
def data_batch(nan_in: str | None) -> dict:
    rng = np.random.default_rng(0)
    b, p, r = 6, 3, 5
    response_mask = torch.ones(b, r, dtype=torch.long)
    response_mask[0, 3:] = 0
    batch = {
        "responses": torch.zeros(b, r, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(b, p, dtype=torch.long), response_mask], 1),
        "response_mask": response_mask,
        "token_level_rewards": torch.tensor(rng.normal(size=(b, r)), dtype=torch.float32),
        "advantages": torch.tensor(rng.normal(size=(b, r)), dtype=torch.float32),
        "returns": torch.tensor(rng.normal(size=(b, r)), dtype=torch.float32),
        "values": torch.tensor(rng.normal(size=(b, r)), dtype=torch.float32),
        "__num_turns__": np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
    }
    batch["advantages"][0, 4] = NAN  # off the response: never an observation
    if nan_in == "advantages":
        batch["advantages"][1, 2] = NAN
    elif nan_in == "token_level_rewards":
        batch["token_level_rewards"][2, 0] = NAN
    elif nan_in == "__num_turns__":
        batch["__num_turns__"][3] = NAN
    return batch


def finite_reference(batch: dict) -> dict[str, float]:
    """The metrics the NaN touches, with numpy over the finite observations only."""
    on = batch["response_mask"].numpy() != 0
    out = {}
    for key in ("advantages", "returns", "values"):
        x = batch[key].double().numpy()[on]
        x = x[np.isfinite(x)]
        out[f"critic/{key}/mean"], out[f"critic/{key}/max"] = x.mean(), x.max()
    seq = batch["token_level_rewards"].double().numpy().sum(-1)
    seq = seq[np.isfinite(seq)]
    out["critic/rewards/mean"], out["critic/rewards/min"] = seq.mean(), seq.min()
    turns = np.asarray(batch["__num_turns__"], float)
    out["num_turns/mean"] = turns[np.isfinite(turns)].mean()
    return out


@pytest.mark.parametrize("nan_in", ["advantages", "token_level_rewards", "__num_turns__"])
def test_data_metrics_follow_nan_strategy(nan_in):
    """Issue 16: a NaN in ``token_level_rewards`` under "error" raised nothing; "drop" kept it."""
    batch = data_batch(nan_in)
    assert any(math.isnan(v) for v in compute_data_metric(batch).values())
    got = compute_data_metric(batch, nan_strategy="drop")
    for name, want in finite_reference(batch).items():
        assert got[name] == pytest.approx(want, rel=1e-6), name
    assert set(compute_data_stats(batch, nan_strategy="drop")) == set(compute_data_stats(data_batch(None)))
    prefix = {"advantages": "critic/advantages", "token_level_rewards": "critic/rewards"}.get(
        nan_in, "num_turns"
    )
    with pytest.raises(MetricValueError, match=prefix):
        compute_data_stats(batch, nan_strategy="error")
    assert compute_data_stats(
        data_batch(None), nan_strategy="error"
    )  # NaN off the response is no observation


def test_drop_leaves_a_nan_reward_sequence_out_of_correct_and_wrong():
    batch = data_batch("token_level_rewards")
    got = compute_data_stats(batch, nan_strategy="drop")
    lengths = batch["response_mask"].sum(-1).numpy()
    assert (
        got["response/correct_length/mean"].count + got["response/wrong_length/mean"].count
        == len(lengths) - 1
    )


def test_client_compute_functions_refuse_only_the_non_finite_names_under_error(request):
    batch = data_batch("advantages")
    try:
        client = rlmetrics.connect("local", world_size=1, name=request.node.name, nan_strategy="error")
        with pytest.raises(MetricValueError, match="critic/advantages/mean"):
            client.compute_local_data_metric(batch)
        with pytest.raises(MetricValueError, match="timing_s/gen"):
            client.compute_local_timing_metrics(batch, {"gen": NAN, "step": 2.0})
        client.wait_submit()
        res = client.result(0, timeout=10)
    finally:
        local.drop_worker(request.node.name)
    assert "critic/advantages/mean" not in res and "response/length/mean" in res
    assert res["critic/returns/mean"] == pytest.approx(
        finite_reference(batch)["critic/returns/mean"], rel=1e-6
    )
    assert res["perf/delta_time/step"] == 2.0 and "perf/delta_time/gen" not in res


def test_timing_and_throughput_follow_nan_strategy():
    batch = data_batch(None)
    stats = compute_timing_stats(batch, {"gen": NAN, "ref": 1.0}, nan_strategy="drop")
    assert stats["timing_s/gen"].count == 0 and stats["timing_per_token_ms/gen"].count == 0
    assert stats["_aux/timing_per_token_ms/gen/tokens/sum"].count == 0  # its tokens go with it
    assert stats["timing_s/ref"].count == 1
    with pytest.raises(MetricValueError, match="timing_s/gen"):
        compute_timing_stats(batch, {"gen": NAN}, nan_strategy="error")


def test_example_pack_follows_nan_strategy():
    data = {"loss_values": torch.tensor([1.0, NAN, 3.0]), "grad_norm": torch.tensor([2.0, math.inf])}
    assert math.isnan(compute_custom_training_metrics(data)["training/loss/mean"])
    got = compute_custom_training_metrics(data, nan_strategy="drop")
    assert got["training/loss/mean"] == 2.0 and got["training/grad_norm/mean"] == 2.0
    assert compute_custom_training_stats(data, nan_strategy="drop")["training/loss/std"].std == 1.0
    with pytest.raises(MetricValueError, match="training/grad_norm"):
        compute_custom_training_stats(data, nan_strategy="error")
    logits = torch.zeros(2, 3, 4)
    logits[1, 0, 0] = NAN
    entropy = compute_custom_training_stats(
        {"policy_logits": logits, "response_mask": torch.ones(2, 3)}, nan_strategy="drop"
    )["training/policy_entropy/mean"]
    assert entropy.count == 5 and entropy.mean == pytest.approx(math.log(4), rel=1e-6)


def test_validation_samples_follow_nan_strategy():
    sources, prompts = ["a"] * 4, ["p", "p", "q", "q"]
    infos = {"acc": [1.0, NAN, 0.0, 1.0], "reward": [1.0, 0.5, 0.0, 1.0]}
    assert math.isnan(process_validation_metrics(sources, prompts, infos)["val-core/a/acc/mean@2"])
    got = process_validation_metrics(sources, prompts, infos, sample_turns=[1, 2, 3, 4], nan_strategy="drop")
    want = process_validation_metrics(
        ["a"] * 3,
        ["p", "q", "q"],
        {"acc": [1.0, 0.0, 1.0], "reward": [1.0, 0.0, 1.0]},
        sample_turns=[1, 3, 4],
    )
    assert got == want
    with pytest.raises(MetricValueError, match="'acc'"):
        encode_samples(sources, prompts, infos, nan_strategy="error")
