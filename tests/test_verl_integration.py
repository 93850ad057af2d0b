"""rlmetrics.integrations.verl without verl: verl's semantics against numpy references on the
concatenated data, shards merged through clients, the naming profile, worker metrics."""

import json
import math
import pickle
import subprocess
import sys
import textwrap
import threading
import uuid
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import rlmetrics  # noqa: E402
from rlmetrics.integrations import verl  # noqa: E402
from rlmetrics.metrics.validation import bootstrap_sizes  # noqa: E402
from tests.peers.verl_batches import verl_batch  # noqa: E402

pytestmark = pytest.mark.torch

TIMING = {"gen": 1.5, "ref": 0.25, "update_actor": 2.5, "step": 6.0}


def close(a, b, tol=1e-9):
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=tol, abs_tol=tol)


def assert_close(ours, expected, tol=1e-9):
    bad = {
        k: (ours.get(k), v) for k, v in expected.items() if k not in ours or not close(float(ours[k]), v, tol)
    }
    assert not bad, bad


# ------------------------------------------------------------------------------- numpy references
def ref_data(t, nt, use_critic=True):
    """verl's compute_data_metrics, written out in numpy (float64)."""
    width_r, width_p = t["responses"].shape[-1], t["prompts"].shape[-1]
    attention = t["attention_mask"].numpy()
    response, prompt = (
        attention[:, -width_r:].sum(1).astype(float),
        attention[:, :-width_r].sum(1).astype(float),
    )
    kept = response > 0
    tokens = t["response_mask"].numpy() != 0
    nan = float("nan")

    def mmm(prefix, x):
        if not len(x):
            return {f"{prefix}/{s}": nan for s in ("mean", "max", "min")}
        return {f"{prefix}/mean": x.mean(), f"{prefix}/max": x.max(), f"{prefix}/min": x.min()}

    out = {}
    for key, prefix in (("token_level_scores", "critic/score"), ("token_level_rewards", "critic/rewards")):
        out.update(mmm(prefix, t[key].double().numpy().sum(1)[kept]))
    for key in ("advantages", "returns") + (("values",) if use_critic else ()):
        out.update(mmm(f"critic/{key}", t[key].double().numpy()[tokens]))
    if use_critic:
        ret, val = t["returns"].double().numpy()[tokens], t["values"].double().numpy()[tokens]
        out["critic/vf_explained_var"] = 1 - np.var(ret - val, ddof=1) / (np.var(ret, ddof=1) + 1e-5)
    out.update(mmm("response_length", response))
    out["response_length/clip_ratio"] = np.mean(response == width_r)
    out.update(mmm("response_length_non_aborted", response[kept]))
    out["response_length_non_aborted/clip_ratio"] = np.mean(response[kept] == width_r) if kept.any() else nan
    out["response/aborted_ratio"] = np.mean(~kept)
    out.update(mmm("prompt_length", prompt))
    out["prompt_length/clip_ratio"] = np.mean(prompt == width_p)
    for key, prefix in (("__num_turns__", "num_turns"), ("tool_call_counts", "tool_call_counts")):
        if key in nt:
            out.update(mmm(prefix, np.asarray(nt[key], dtype=float)))
    return out


def ref_timing_throughput(t, n_gpus):
    width_r = t["responses"].shape[-1]
    attention = t["attention_mask"].numpy()
    response, total = attention[:, -width_r:].sum(), attention.sum()
    out = {f"timing_s/{k}": v for k, v in TIMING.items()}
    out["timing_per_token_ms/gen"] = TIMING["gen"] * 1000 / response
    for stage in ("ref", "update_actor"):
        out[f"timing_per_token_ms/{stage}"] = TIMING[stage] * 1000 / total
    out.update({"perf/total_num_tokens": float(total), "perf/time_per_step": TIMING["step"],
                "perf/throughput": total / (TIMING["step"] * n_gpus)})  # fmt: skip
    return out


def ref_variance_proxy(t, gradient_norm):
    mask = t["response_mask"].double().numpy()
    a = (t["advantages"].double().numpy() * mask).sum(1) / (mask.sum(1) + 1e-8)
    w = (
        (1 - 2 * np.exp(t["old_log_probs"].double().numpy()) + t["sum_pi_squared"].double().numpy()) * mask
    ).sum(1)
    power = np.mean(a**2 * np.maximum(w, 0))
    signal = gradient_norm**2
    return {
        "variance_proxy/proxy1_signal_strength": signal,
        "variance_proxy/proxy2_total_power": power,
        "variance_proxy/proxy3_pure_noise": max(0.0, (power - signal) / (len(a) - 1)),
        "variance_proxy/expected_a_squared": np.mean(a**2),
        "variance_proxy/expected_w": np.mean(w),
    }


def ref_validation(sources, uids, infos, seed=42, expected=None):
    """verl's process_validation_metrics as a loop: per prompt and variable the values that are not
    None, bootstrap rows drawn with a reseeded RandomState, maj by counting preds in each row."""
    grouped = {}
    for i, (source, uid) in enumerate(zip(sources, uids)):
        entry = grouped.setdefault(source, {}).setdefault(uid, {})
        for var, column in infos.items():
            entry.setdefault(var, []).append(column[i])
    if expected:
        with_acc = {
            s
            for s, by in grouped.items()
            if any(v is not None for e in by.values() for v in e.get("acc", []))
        }
        for (source, uid), count in expected.items():
            if source in with_acc:
                entry = grouped[source].setdefault(uid, {})
                seen = [v for v in entry.get("acc", []) if v is not None]
                entry["acc_success_only"], entry["acc"] = seen, seen + [0.0] * max(count - len(seen), 0)
    out = {}
    for source, by_uid in grouped.items():
        per_name = {}
        for entry in by_uid.values():
            preds = entry.get("pred")
            for var, values in entry.items():
                values = [v for v in values if v is not None]
                if not values or isinstance(values[0], str):
                    continue
                n, x = len(values), np.asarray(values, dtype=float)
                metrics = {f"mean@{n}": x.mean()}
                if n > 1:
                    metrics[f"std@{n}"] = x.std()
                    for k in bootstrap_sizes(n):
                        rows = np.random.RandomState(seed).choice(n, size=(1000, k), replace=True)
                        for name, row_values in (("best", x[rows].max(1)), ("worst", x[rows].min(1))):
                            metrics[f"{name}@{k}/mean"], metrics[f"{name}@{k}/std"] = (
                                row_values.mean(),
                                row_values.std(),
                            )
                        if preds is not None and len(preds) == n and None not in preds:
                            maj = []
                            for row in rows:
                                counts = Counter(preds[i] for i in row)
                                top = max(counts.values())
                                winner = next(preds[i] for i in row if counts[preds[i]] == top)
                                maj.append(x[next(i for i in row if preds[i] == winner)])
                            metrics[f"maj@{k}/mean"], metrics[f"maj@{k}/std"] = np.mean(maj), np.std(maj)
                for name, value in metrics.items():
                    per_name.setdefault(var, {}).setdefault(name, []).append(value)
        out[source] = {
            var: {name: float(np.mean(v)) for name, v in names.items()} for var, names in per_name.items()
        }
    return out


# ---------------------------------------------------------------------------------------- tests
def merged(rank, world_size, name, timeout):
    """Run ``rank(r)`` for every rank on its own thread, then read step 0 of aggregator ``name``."""
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        return verl.connect("local", name=name).result(0, timeout=timeout)
    finally:
        rlmetrics.backends.local.drop_worker(name)


def as_data_proto(tensors, non_tensors, lo=0, hi=None):
    """A DataProto-shaped object (``.batch``, ``.non_tensor_batch``, ``.meta_info``) of rows lo:hi,
    whose meta_info lists the whole batch's tokens (as ``DataProto.chunk`` leaves it)."""
    sl = slice(lo, hi)
    tokens = tensors["attention_mask"].sum(-1).tolist()
    return SimpleNamespace(
        batch={k: v[sl] for k, v in tensors.items()},
        non_tensor_batch={k: v[sl] for k, v in non_tensors.items()},
        meta_info={"global_token_num": tokens},
    )


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_data_metrics_match_numpy_reference(multi_turn):
    """verl's keys and numbers (float32 sums against float64: 1e-5) on a batch with aborted
    responses; tool spans count in the lengths, not in the token metrics."""
    tensors, non_tensors = verl_batch(1, multi_turn=multi_turn, aborted=3)
    for use_critic in (True, False):
        ours = verl.compute_data_metrics(as_data_proto(tensors, non_tensors), use_critic=use_critic)
        expected = ref_data(tensors, non_tensors, use_critic)
        assert set(ours) == set(expected)
        assert_close(ours, expected, 1e-5)
    assert all(isinstance(v, verl.Value) for v in ours.values())


@pytest.mark.parametrize("backend_naming", ["connect", "naming="])
def test_unequal_shards_merge_to_the_full_batch(backend_naming):
    """4 ranks (threads) with 3, 9, 1 and 13 sequences (the single one aborted) submit verl's four
    batch functions of their shard; the merged result is the numpy reference of the full batch,
    with ``timing_s/*`` under its name and no auxiliary name."""
    tensors, non_tensors = verl_batch(2, b=26, multi_turn=True, aborted=3)
    cuts = (0, 3, 12, 13, 26)
    name = f"verl-{uuid.uuid4().hex[:8]}"

    def client(rank):
        if backend_naming == "connect":
            return verl.connect("local", world_size=4, name=name, label=f"rank{rank}")
        return rlmetrics.connect("local", world_size=4, name=name, label=f"rank{rank}", naming=verl.NAMING)

    def rank(r):
        shard = as_data_proto(tensors, non_tensors, cuts[r], cuts[r + 1])
        c = client(r)
        c.submit_metric(verl.compute_data_metrics(shard))
        c.submit_metric(verl.compute_timing_metrics(shard, TIMING))
        c.submit_metric({**verl.compute_throughout_metrics(shard, TIMING, 8),
                         **verl.compute_variance_proxy_metrics(shard, 0.05)})  # fmt: skip
        c.wait_submit()

    result = merged(rank, 4, name, timeout=30)
    expected = {
        **ref_data(tensors, non_tensors),
        **ref_timing_throughput(tensors, 8),
        **ref_variance_proxy(tensors, 0.05),
    }
    assert set(result) == set(expected)
    assert_close(result, expected, 1e-5)


def test_naming_profile_and_siirl_default():
    """With verl's naming: ``timing_s/*`` keeps its name, ``variance_proxy/proxy2_total_power`` and a
    list under a ``.../std`` name are averaged. Without it (siiRL's behaviour, unchanged): renamed,
    summed (``total``) and the pooled std of the list."""
    results = {}
    for naming in (verl.NAMING, None):
        name = f"naming-{uuid.uuid4().hex[:8]}"
        clients = [rlmetrics.connect("local", world_size=2, name=name, naming=naming) for _ in range(2)]
        for c, values in zip(clients, ([1.0, 3.0], [5.0])):
            c.submit_metric({"timing_s/gen": 2.0, "variance_proxy/proxy2_total_power": values[0],
                             "rollout_is_std": values, "actor/minibatch_loss": values})  # fmt: skip
            c.wait_submit()
        results[naming is not None] = clients[0].result(0, timeout=10)
        rlmetrics.backends.local.drop_worker(name)
    assert results[True] == {"timing_s/gen": 2.0, "variance_proxy/proxy2_total_power": 3.0,
                             "rollout_is_std": 3.0, "actor/minibatch_loss": 3.0}  # fmt: skip
    assert results[False]["perf/delta_time/gen"] == 2.0 and "timing_s/gen" not in results[False]
    assert results[False]["variance_proxy/proxy2_total_power"] == 6.0
    assert results[False]["rollout_is_std"] == pytest.approx(np.std([1.0, 3.0, 5.0]))


def test_update_metrics_per_micro_batch_merge_over_all_tokens():
    """Each rank submits ``(value, tokens)`` per micro-batch (token means of unequal micro-batches);
    the merged value is the mean over all tokens of all ranks. verl Metrics submitted once per rank
    merge as ``Metric.aggregate_dp``: mean over ranks of each rank's SUM, min/max over all values."""
    rng = np.random.default_rng(0)
    per_token = [
        [rng.normal(size=int(rng.integers(1, 40))) for _ in range(int(rng.integers(1, 5)))] for _ in range(3)
    ]
    sums = [rng.normal(size=2) for _ in range(3)]
    name = f"update-{uuid.uuid4().hex[:8]}"

    def rank(r):
        c = verl.connect("local", world_size=3, name=name, label=f"rank{r}")
        for mb in per_token[r]:
            c.submit_metric(
                {"actor/pg_loss": (mb.mean(), len(mb)), "actor/entropy": (mb.mean() + 1, len(mb))}
            )
        pg_sum = verl.Metric("sum", sums[r][0])
        pg_sum.append(sums[r][1])
        c.submit_metric(
            {"critic/vf_loss": pg_sum, "actor/ppo_kl_max": verl.Metric("max", float(sums[r].max()))}
        )
        c.wait_submit()

    result = merged(rank, 3, name, timeout=10)
    tokens = np.concatenate([mb for part in per_token for mb in part])
    assert result["actor/pg_loss"] == pytest.approx(tokens.mean(), rel=1e-12)
    assert result["actor/entropy"] == pytest.approx(tokens.mean() + 1, rel=1e-12)
    assert result["critic/vf_loss"] == pytest.approx(np.mean([s.sum() for s in sums]), rel=1e-12)
    assert result["actor/ppo_kl_max"] == max(s.max() for s in sums)


def test_metric_api_against_numpy():
    """Metric keeps verl's API: append (numbers, one-element tensors, Metrics), extend, aggregate,
    aggregate_dp (mean over ranks per micro-batch, then the aggregation), from_dict, init_list."""
    m = verl.Metric(verl.AggregationType.MEAN, 1.0)
    m.append(torch.tensor([3.0]))
    m.append(verl.Metric("mean", 5.0))
    m.extend([7, np.float32(9.0)])
    assert m.values == [1.0, 3.0, 5.0, 7, np.float32(9.0)] and m.aggregate() == 5.0
    table = np.arange(12.0).reshape(4, 3) ** 1.5
    for kind, expected in (
        ("mean", table.mean()),
        ("sum", table.mean(0).sum()),
        ("min", table.min()),
        ("max", table.max()),
    ):
        ranks = [verl.Metric(kind) for _ in range(4)]
        for metric, row in zip(ranks, table):
            metric.extend(row.tolist())
        assert verl.Metric.aggregate_dp(ranks) == pytest.approx(expected, rel=1e-12)
    made = verl.Metric.from_dict({"a": 1.0, "b": 2.0}, "max")
    assert {k: (v.aggregation, v.values) for k, v in made.items()} == {
        "a": (verl.AggregationType.MAX, [1.0]), "b": (verl.AggregationType.MAX, [2.0])}  # fmt: skip
    assert (
        made["a"].init_list().values == [] and made["a"].init_list().aggregation is verl.AggregationType.MAX
    )
    with pytest.raises(ValueError, match="Unsupported value type"):
        m.append([1.0, 2.0])


def test_reduce_metrics_by_whole_tokens():
    """Lists: max/min where the name has that token (max first, as verl), else the mean; Metrics
    aggregate; the argument is left as it was."""
    metrics = {"a/max_b_min": [1.0, 4.0], "x/grad_min": [2.0, 1.0], "actor/minibatch_loss": [1.0, 2.0],
               "m": verl.Metric("sum", 2.0), "scalar": 3.0}  # fmt: skip
    expected = {"a/max_b_min": 4.0, "x/grad_min": 1.0, "actor/minibatch_loss": 1.5, "m": 2.0, "scalar": 3.0}
    assert verl.reduce_metrics(metrics) == expected
    assert metrics["actor/minibatch_loss"] == [1.0, 2.0]


def test_value_pickles_and_serializes_as_a_float():
    v = verl.compute_throughout_metrics({"global_token_num": [3, 5]}, {"step": 2.0}, 2)["perf/throughput"]
    again = pickle.loads(pickle.dumps(v))
    assert again == v == 2.0 and again.stat == v.stat and set(again.aux) == set(v.aux)
    assert json.dumps({"x": v}) == '{"x": 2.0}' and repr(v) == "2.0"


@pytest.mark.parametrize("seed", range(2))
def test_validation_matches_reference_loop_and_merges_across_ranks(seed):
    """Single process: verl's nested return against the reference loop (None values, a None pred,
    expected acc counts). Three ranks (prompts straddling them) merge to verl's trainer keys of the
    single-process result."""
    rng = np.random.default_rng(seed)
    sizes = [16, 5, 8, 1, 3, 16]
    sources = [s for i, n in enumerate(sizes) for s in [("gsm8k", "math")[i % 2]] * n]
    uids = [u for i, n in enumerate(sizes) for u in [f"q{i}"] * n]
    n = len(uids)
    acc = [None if rng.random() < 0.1 else float(rng.integers(0, 2)) for _ in range(n)]
    pred = [None if rng.random() < 0.03 else str(rng.integers(0, 3)) for _ in range(n)]
    infos = {"acc": acc, "reward": rng.normal(size=n).round(2).tolist(), "pred": pred}
    expected = {("gsm8k", "q0"): 18, ("math", "q1"): 2, ("math", "ghost"): 3}
    nested = verl.process_validation_metrics(sources, uids, infos, 3, expected)
    reference = ref_validation(sources, uids, infos, 3, expected)
    assert set(nested) == set(reference)
    for source in reference:
        assert set(nested[source]) == set(reference[source])
        for var, metrics in reference[source].items():
            assert set(nested[source][var]) == set(metrics)
            assert_close(nested[source][var], metrics, 1e-9)
    name = f"val-{uuid.uuid4().hex[:8]}"
    cuts = (0, 10, 40, n)
    for r in range(3):
        c = verl.connect("local", world_size=3, name=name, label=f"rank{r}")
        lo, hi = cuts[r], cuts[r + 1]
        part = {k: v[lo:hi] for k, v in infos.items()}
        verl.submit_validation_metrics(c, sources[lo:hi], uids[lo:hi], part, 3, expected)
        c.wait_submit()
    try:
        merged = verl.connect("local", name=name).result(0, timeout=10)
    finally:
        rlmetrics.backends.local.drop_worker(name)
    flat = {f"{sec}/{s}/{v}/{m}": x for s, by in nested.items() for v, ms in by.items() for m, x in ms.items()
            for sec in ("val-core", "val-aux")}  # fmt: skip
    assert all(k in flat for k in merged) and not any(k.startswith("val/test_score") for k in merged)
    assert_close(merged, {k: flat[k] for k in merged}, 1e-12)
    assert len(merged) == sum(len(ms) for by in nested.values() for ms in by.values())
    assert "val-core/gsm8k/acc/mean@18" in merged and "val-aux/gsm8k/acc_success_only/mean@13" not in merged


def test_imports_and_works_without_verl_torch_or_ray():
    """verl's names and the numpy-only functions work with verl, torch and Ray unavailable; the batch
    functions name the extra they need."""
    from tests.test_package import BLOCK_EXTRAS

    code = BLOCK_EXTRAS + textwrap.dedent(
        """
        class NoVerl:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "verl":
                    raise ImportError(f"blocked {name}")
        sys.meta_path.insert(0, NoVerl())
        from rlmetrics.integrations import verl
        nested = verl.process_validation_metrics(["a", "a"], ["p", "p"], {"acc": [1.0, None]})
        assert nested == {"a": {"acc": {"mean@1": 1.0}}}, nested
        m = verl.Metric("max", 1.0)
        m.append(3)
        assert verl.reduce_metrics({"x": m, "y_min": [2.0, 1.0]}) == {"x": 3.0, "y_min": 1.0}
        try:
            verl.compute_data_metrics({})
        except ImportError as exc:
            assert "rlmetrics[torch]" in str(exc), exc
        else:
            raise AssertionError("compute_data_metrics without torch")
        assert not {"torch", "ray", "verl"} & set(sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_verl_tracking_keeps_a_partial_steps_coverage_and_takes_trackio_and_clearml(tmp_path, monkeypatch):
    """A driver's partial step (a :class:`~rlmetrics.StepResult` with its meta) logged through verl's
    ``Tracking`` carries ``meta/coverage`` (before, the meta was dropped); verl's ``trackio`` and
    ``clearml`` backends are the sinks of those names (before, refused). verl's own file is written at
    ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``, beside the run folder."""
    from rlmetrics import StepMeta, StepResult
    from rlmetrics.sinks import read_jsonl

    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path))
    for var in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "VERL_FILE_LOGGER_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("trackio")
    pytest.importorskip("clearml")
    tracking = verl.Tracking("proj", "exp", default_backend=["file", "trackio", "clearml"])
    partial = StepResult({"critic/score/mean": 0.5}, 1, StepMeta(complete=False, contributions=[3, 4]))
    tracking.log(partial, step=1)
    tracking.log({"val-core/x/acc/mean@1": 0.25}, step=1)
    tracking.finish()
    run = read_jsonl(tmp_path / "proj" / "exp" / "metrics.jsonl")
    assert run.series("meta/coverage")[1].tolist() == [0.75]
    verl_file = read_jsonl(tmp_path / "proj" / "exp.jsonl")  # verl's format, read back
    assert verl_file.steps == [1] and verl_file.series("val-core/x/acc/mean@1")[1].tolist() == [0.25]
    assert (tmp_path / "proj" / "exp" / "trackio").is_dir() and (
        tmp_path / "proj" / "exp" / "clearml"
    ).is_dir()


def test_verl_tracking_with_an_out_dir_writes_verls_file_there_and_a_shared_tensorboard_dir_is_refused(
    tmp_path, monkeypatch
):
    """With ``out_dir`` (and no ``VERL_FILE_LOGGER_PATH``) verl's file is ``<out_dir>/<experiment>.jsonl``,
    not in the working directory (two runs with the same names overwrote each other's file there);
    a new run whose ``TENSORBOARD_DIR`` holds another run's event files is refused, not resumed (its
    first steps were skipped as if logged)."""
    from rlmetrics.sinks import read_jsonl

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    tracking = verl.Tracking("proj", "exp", ["file", "tensorboard"], out_dir=tmp_path / "a")
    tracking.log({"x": 1.0}, step=1)
    tracking.finish()
    assert read_jsonl(tmp_path / "a" / "exp.jsonl").steps == [1] and not (tmp_path / "proj").exists()
    with pytest.raises(FileExistsError, match="holds TensorBoard event files"):
        verl.Tracking("proj", "exp2", ["file", "tensorboard"], out_dir=tmp_path / "b")
