"""Group breakdowns: every grouped number equals the loop reference (or numpy) on that group's
sequences of all ranks concatenated, with groups spread unevenly over ranks (a group on one rank
only, ranks without some groups); grouped names reach the trackers unchanged."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import rlmetrics
from rlmetrics.backends import local
from rlmetrics.core.groups import group_name, segment
from rlmetrics.core.reduce import resolve
from rlmetrics.core.stat import MetricValueError
from rlmetrics.metrics import VF_RESIDUAL_STD, VF_RETURNS_STD, VF_TOKENS
from rlmetrics.metrics.data import compute_data_metric, compute_data_stats
from rlmetrics.sinks import TRACKERS, JsonlSink, TensorBoardSink, adapt_name, read_jsonl
from tests.test_metrics_data import (
    CLIP,
    CountHostMoves,
    assert_matches,
    concatenate,
    make_batch,
    reference,
    to_tensordict,
)
from tests.trackers import read_tensorboard

pytestmark = pytest.mark.torch

# rank -> (batch size, prompt width, response width, its sequences' data sources): "math" sits on
# rank 0 only, rank 2 has no "gsm8k", rank 1 mostly "code"
LAYOUT = [
    (9, 3, 6, ["gsm8k", "math", "gsm8k", "code", "math", "gsm8k", "gsm8k", "math", "code"]),
    (5, 5, 9, ["code", "gsm8k", "code", "code", "code"]),
    (4, 2, 4, ["code", "code", "code", "code"]),
]
SOURCES = ("code", "gsm8k", "math")
TOKEN_KEYS = ("response_mask", "token_level_scores", "token_level_rewards", "advantages", "returns", "values")


# each rank's data sources (LAYOUT's sizes): missing ones (None, NaN), a literal "None", mixed types,
# labels to change, the empty string; a numpy object array (verl's non_tensor_batch), lists
ODD = [
    np.array(["gsm8k", None, "None", "openai/gsm8k", "", "gsm8k", None, 3, "openai/gsm8k"], dtype=object),
    [float("nan"), "gsm8k", 3.0, "3", None],
    ["None", "", "openai/gsm8k", None],
]
ODD_GROUPS = {
    "gsm8k": "gsm8k",
    "None": "None",
    "openai/gsm8k": "openai_gsm8k--444783eb",
    "": "--empty",
    "3": "3",
}


def group_of(label, names: dict[str, str] = ODD_GROUPS) -> str:
    """The documented group of a label (docs/groups.md), given the names of its texts."""
    if label is None or (isinstance(label, float) and math.isnan(label)):
        return "--missing"
    return names[str(int(label)) if isinstance(label, (int, float)) else label]


def rank_batches(seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for b, p, r, sources in LAYOUT:
        batch = make_batch(rng, b, p, r, dtype=torch.float64)
        batch["data_source"] = np.array(sources, dtype=object)  # as verl's non_tensor_batch holds it
        out.append(batch)
    return out


def rows(batch: dict, idx: np.ndarray) -> dict:
    """The sequences ``idx`` of a batch (every per-sequence key)."""
    t = torch.as_tensor(idx, dtype=torch.long)
    out = {k: v[t] for k, v in batch.items() if isinstance(v, torch.Tensor)}
    out["__num_turns__"] = np.asarray(batch["__num_turns__"])[idx]
    return out


def expected(batches: list[dict], source: str) -> dict[str, float]:
    """The loop reference on ``source``'s sequences of all ranks concatenated."""
    parts = [rows(b, np.nonzero(b["data_source"] == source)[0]) for b in batches]
    return reference(concatenate([p for p in parts if len(p["responses"])]))


def grouped(result, tag: str, value: str) -> dict[str, float]:
    prefix = f"group/{tag}/{value}/"
    return {n[len(prefix) :]: v for n, v in result.items() if n.startswith(prefix)}


def check_groups(result, batches: list[dict]) -> None:
    for source in SOURCES:
        assert_matches(grouped(result, "data_source", source), expected(batches, source), skip=CLIP)
    assert not [n for n in result if n.startswith("group/") and "/_aux/" in n]  # ingredients dropped


# ------------------------------------------------------------------------------------------- names
def test_grouped_names_reach_every_tracker_unchanged():
    names = [
        group_name("data_source", segment(label), metric)
        for label in ("openai/gsm8k", "../x", "a b@c:d", "ü-math.v2", ".", 3.0, None, "", "--missing", "a\tb")
        for metric in ("critic/score/mean", "val-core/math/acc/mean@4", "custom/latency/p95")
    ]
    for tracker in TRACKERS:
        if tracker == "prometheus":  # [a-zA-Z0-9_] only: every name changes there, and none meet
            assert len({adapt_name(n, tracker) for n in names}) == len(names)
            continue
        if tracker == "mlflow":  # '@' is outside MLflow's set: metrics with it change there, grouped or not
            names = [n for n in names if "@" not in n]
        assert [adapt_name(n, tracker) for n in names] == names, tracker


def test_a_grouped_name_resolves_as_its_metric():
    assert resolve("group/data_source/max_set/actor/minibatch_loss").name == "mean"
    assert resolve("group/env/min/response/length/max").name == "max"
    assert resolve("group/turn/2/custom/latency/p95").name == "p95"
    rlmetrics.register_reduction("actor/kl", "max")
    assert resolve("group/data_source/a/actor/kl").name == "max"


# labels that read alike but differ, the reserved names literally, missing ones and mixed types
TRICKY = ["a b", "a_b", "a--b", "a_b--7faae47c", "--missing", "missing", "None", "", "_", ".", "_hidden",
          ".hidden", "openai/gsm8k", "openai_gsm8k", "3", "3.5", "True", "ü", b"\xff", b"\xfe"]  # fmt: skip


def test_different_labels_have_different_names_and_one_label_one_name_in_every_process():
    names = [segment(label) for label in TRICKY]
    assert len(set(names)) == len(names), names  # "a b" and "a_b" were both 'a_b'
    assert names[:5] == [
        "a_b--7faae47c",
        "a_b",
        "a--b--505385af",
        "a_b--7faae47c--e6f438de",
        "--missing--36155884",
    ]
    assert segment(None) == segment(float("nan")) == segment(np.float32("nan")) == "--missing"
    assert segment(3) == segment(3.0) == segment(np.int64(3)) == segment("3") == segment(b"3") == "3"
    assert segment("") == "--empty" and segment(True) == segment("True") == "True"
    # the same in every process (a per-process hash() would not be): interpreters with other hash seeds
    code = f"from rlmetrics.core.groups import segment; print([segment(x) for x in {TRICKY!r}])"
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == str([segment(x) for x in TRICKY])


def test_two_labels_of_a_call_whose_names_collide_are_refused_and_the_rest_goes_through(request):
    a, b = "a/:/=;", "a/?/!^"  # found by a search: the same readable part and the same 32-bit hash
    assert segment(a) == segment(b) == "a_____--b3fa27ed"
    batch = make_batch(np.random.default_rng(0), 2, 2, 3)
    batch["data_source"] = [a, b]
    with pytest.raises(
        MetricValueError, match=re.escape(f"labels {a!r} and {b!r} both name group 'a_____--b3fa27ed'")
    ):
        compute_data_stats(batch, group_by="data_source")
    try:
        client = rlmetrics.connect("local", world_size=1, name=request.node.name)
        with pytest.raises(MetricValueError, match="group tag 'data_source': labels"):
            client.compute_local_data_metric(batch, group_by="data_source")
        client.wait_submit()
        result = client.wait_final_res()
    finally:
        local.drop_worker(request.node.name)
    assert_matches(dict(result), reference(batch))  # every other metric, no group


# ------------------------------------------------------------------------------------ one process
def test_grouped_data_metrics_equal_the_reference_on_each_group():
    (batch,) = rank_batches(1)[:1]
    got = compute_data_metric(batch, group_by="data_source")
    assert_matches({n: v for n, v in got.items() if not n.startswith("group/")}, reference(batch))
    check_groups(got, [batch])


def test_group_by_a_function_and_a_tensor_key_with_one_host_transfer():
    batch = make_batch(np.random.default_rng(2), 12, 4, 7, dtype=torch.float64)
    batch["turn"] = torch.tensor([0, 1, 2] * 4)

    def long_prompt(b):
        return (b["attention_mask"][:, :4].sum(-1) > 2).numpy()

    stats = compute_data_stats(to_tensordict(batch), group_by=["turn", long_prompt])  # warm-up
    with CountHostMoves() as moves:
        stats = compute_data_stats(batch, group_by={"turn": "turn"})
    assert len(moves.moves) == 1, moves.moves  # the label tensor travels with the summaries
    got = compute_data_metric(batch, group_by=["turn", long_prompt])
    for turn in range(3):
        want = reference(rows(batch, np.arange(turn, 12, 3)))
        assert_matches(grouped(got, "turn", str(turn)), want)
    flags = long_prompt(batch)
    for flag in (False, True):
        assert_matches(
            grouped(got, "long_prompt", str(flag)), reference(rows(batch, np.nonzero(flags == flag)[0]))
        )
    assert "group/turn/1/critic/advantages/mean" in stats


@pytest.mark.parametrize("nan_strategy", ["propagate", "drop"])
def test_non_finite_values_in_a_group_follow_nan_strategy_as_the_group_alone(nan_strategy):
    batch = rank_batches(8)[0]
    batch["advantages"][1, 0] = float("nan")  # on a response token of sequence 1 ("math")
    batch["response_mask"][1, 0] = 1
    batch["token_level_rewards"][6, 2] = float("inf")
    got = compute_data_metric(batch, nan_strategy=nan_strategy, group_by="data_source")
    for source in SOURCES:
        want = compute_data_metric(
            rows(batch, np.nonzero(batch["data_source"] == source)[0]), nan_strategy=nan_strategy
        )
        want.pop("perf/process_cpu_mem_used_gb")
        mine = grouped(got, "data_source", source)
        assert sorted(mine) == sorted(want)
        np.testing.assert_allclose([mine[n] for n in want], list(want.values()), rtol=1e-9, equal_nan=True)
    assert math.isnan(got["group/data_source/math/critic/advantages/mean"]) == (nan_strategy == "propagate")


def test_a_batch_without_sequences_gives_every_name_and_no_group():
    batch = make_batch(np.random.default_rng(0), 0, 2, 3)
    batch["data_source"] = []
    stats = compute_data_stats(batch, group_by="data_source")
    assert stats.keys() == compute_data_stats(batch).keys()
    assert all(
        s.count == 0 for n, s in stats.items() if not n.startswith(("perf/", "_aux/vf_explained_var/tokens"))
    )


@pytest.mark.parametrize("labels", ["plain", "odd"])
def test_verl_data_metrics_by_data_source_equal_each_source_alone(labels):
    from rlmetrics.integrations.verl import compute_data_metrics

    batch = rank_batches(12)[0]
    names = {s: s for s in SOURCES}
    if labels == "odd":  # None, a literal "None", labels to change, "" (issue 28.7: a TypeError)
        batch["data_source"], names = ODD[0], ODD_GROUPS
    group = np.array([group_of(x, names) for x in batch["data_source"]])
    got = compute_data_metrics(batch, group_by="data_source")
    assert {n.split("/")[2] for n in got if n.startswith("group/")} == set(group)
    for source in set(group):
        want = compute_data_metrics(rows(batch, np.nonzero(group == source)[0]))
        mine = grouped(got, "data_source", source)
        assert sorted(mine) == sorted(want)
        np.testing.assert_allclose([mine[n] for n in want], list(want.values()), rtol=1e-9, equal_nan=True)
    assert not [n for n in got if "_aux/" in n]
    prefix = f"group/data_source/{group[0]}/"
    assert set(got[prefix + "critic/vf_explained_var"].aux) == {
        prefix + n for n in (VF_RETURNS_STD, VF_RESIDUAL_STD, VF_TOKENS)
    }


# --------------------------------------------------------------------------------- across ranks
def run_threads(name: str, batches: list, submit, final: bool = False) -> rlmetrics.StepResult:
    """Each rank a thread with its own local client: ``submit(client, its batch)``, then wait_submit;
    ``final``: then a driver reads ``wait_final_res()`` (the seed's DAGWorker loop)."""
    world = len(batches)
    clients = [
        rlmetrics.connect("local", world_size=world, name=name, label=f"rank{r}") for r in range(world)
    ]

    def rank(r):
        submit(clients[r], batches[r])
        clients[r].wait_submit()

    with ThreadPoolExecutor(world) as pool:
        list(pool.map(rank, range(world)))  # re-raises a rank's error
    if final:
        return rlmetrics.connect("local", name=name).wait_final_res()
    return clients[0].result(0, timeout=5)


def expected_group(batches: list[dict], group: str, key: str = "data_source") -> dict[str, float]:
    """The loop reference on the sequences of all ranks whose ``key`` label is in ``group``."""
    parts = [
        rows(b, np.array([i for i, x in enumerate(b[key]) if group_of(x) == group], int)) for b in batches
    ]
    return reference(concatenate([p for p in parts if len(p["responses"])]))


def ungrouped(result) -> dict[str, float]:
    return {n: v for n, v in result.items() if not n.startswith("group/")}


def test_local_ranks_with_uneven_groups_equal_the_concatenation(request):
    batches = rank_batches(3)
    try:
        result = run_threads(
            request.node.name, batches, lambda c, b: c.compute_local_data_metric(b, group_by="data_source")
        )
    finally:
        local.drop_worker(request.node.name)
    assert result.meta.complete, result.meta  # a group missing on a rank does not hold the step
    check_groups(result, batches)
    assert_matches(
        {n: v for n, v in result.items() if not n.startswith("group/")},
        {k: v for k, v in reference(concatenate(batches)).items()},
        skip=CLIP,
    )
    # the test can fail: the mean of the ranks' own "code" means is not the global one
    own = [
        compute_data_metric(b, group_by="data_source")["group/data_source/code/critic/score/mean"]
        for b in batches
    ]
    assert not np.isclose(np.mean(own), result["group/data_source/code/critic/score/mean"], rtol=1e-6)


def by_data_source_in_the_seed_loop(name: str, batches: list[dict]) -> rlmetrics.StepResult:
    """Each rank ``compute_local_data_metric(batch, group_by="data_source")`` and ``wait_submit()``,
    then the driver's ``wait_final_res()``: the step, complete."""
    try:
        result = run_threads(
            name, batches, lambda c, b: c.compute_local_data_metric(b, group_by="data_source"), final=True
        )
    finally:
        local.drop_worker(name)
    assert result.meta.complete, result.meta
    return result


def test_missing_and_mixed_labels_are_groups_of_their_own_in_the_seed_loop(request):
    """Issue 28.7: one None in ``data_source`` raised numpy's TypeError and 0 names reached the step.
    Each rank runs ``compute_local_data_metric(batch, group_by="data_source")`` and ``wait_submit()``,
    the driver ``wait_final_res()``: every group (the missing labels' too) is its sequences of all
    ranks, the batch's names are the concatenation's."""
    batches = rank_batches(13)
    for batch, labels in zip(batches, ODD):
        batch["data_source"] = labels
    result = by_data_source_in_the_seed_loop(request.node.name, batches)
    groups = {n.split("/")[2] for n in result if n.startswith("group/")}
    assert groups == {"--missing", "--empty", "3", "None", "gsm8k", "openai_gsm8k--444783eb"}
    for group in groups:
        assert_matches(grouped(result, "data_source", group), expected_group(batches, group), skip=CLIP)
    assert_matches(ungrouped(result), reference(concatenate(batches)), skip=CLIP)


def test_labels_that_read_alike_stay_two_series_across_ranks(request):
    """Issue 28.2: ``"a b"`` on one rank and ``"a_b"`` on another were both ``a_b``: one series of
    both ranks' sequences. Now each is its own rank's sequences; one label on both ranks is one group."""
    batches = rank_batches(14)[:2]
    batches[0]["data_source"] = np.array(["a b"] * 5 + ["openai/gsm8k"] * 4, dtype=object)
    batches[1]["data_source"] = np.array(["a_b"] * 3 + ["openai/gsm8k"] * 2, dtype=object)
    result = by_data_source_in_the_seed_loop(request.node.name, batches)
    assert_matches(grouped(result, "data_source", "a_b--7faae47c"), reference(rows(batches[0], np.arange(5))))
    assert_matches(grouped(result, "data_source", "a_b"), reference(rows(batches[1], np.arange(3))))
    both = [rows(batches[0], np.arange(5, 9)), rows(batches[1], np.arange(3, 5))]
    assert_matches(
        grouped(result, "data_source", "openai_gsm8k--444783eb"), reference(concatenate(both)), skip=CLIP
    )


def test_submit_metric_group_by_equals_numpy_on_the_concatenation(request):
    rng = np.random.default_rng(4)
    data = [
        (rng.normal(size=n), rng.choice(sources, size=n))
        for n, sources in ((7, ["a", "b"]), (3, ["a"]), (5, ["c", "b"]))
    ]

    def submit(client, item):
        reward, env = item
        client.submit_metric(
            {"reward/mean": reward, "reward/max": reward, "reward/p50": reward, "loss": 0.5},
            group_by={"env": env},
        )

    try:
        result = run_threads(request.node.name, data, submit)
    finally:
        local.drop_worker(request.node.name)
    assert result.meta.complete, result.meta
    reward = np.concatenate([r for r, _ in data])
    env = np.concatenate([e for _, e in data])
    for value in "abc":
        x = reward[env == value]
        assert result[f"group/env/{value}/reward/mean"] == pytest.approx(x.mean(), rel=1e-12)
        assert result[f"group/env/{value}/reward/max"] == x.max()
        assert result[f"group/env/{value}/reward/p50"] == pytest.approx(np.quantile(x, 0.5), rel=1e-12)
        assert f"group/env/{value}/loss" not in result  # a number is not per sample
    assert result["reward/mean"] == pytest.approx(reward.mean(), rel=1e-12) and result["loss"] == 0.5


def test_submit_metric_refuses_a_value_of_another_length_alone(request):
    try:
        client = rlmetrics.connect("local", world_size=1, name=request.node.name)
        with pytest.raises(MetricValueError, match="metric 'short': 2 values, group tag 'env' has 3 labels"):
            client.submit_metric(
                {"short": [1.0, 2.0], "ok": [1.0, 2.0, 4.0]}, group_by={"env": ["a", "b", "a"]}
            )
        client.wait_submit()
        result = client.result(0, timeout=5)
    finally:
        local.drop_worker(request.node.name)
    assert result["group/env/a/ok"] == 2.5 and result["short"] == 1.5 and "group/env/a/short" not in result


def test_submit_metric_groups_missing_labels_and_refuses_a_bad_tag_alone(request):
    """``submit_metric(..., group_by=...)`` with None, NaN, mixed types and labels that read alike:
    each group is numpy's on its values of all ranks; a tag whose labels are not one per sample is
    refused (naming it) and the call's other names, ungrouped and grouped, are queued."""
    rng = np.random.default_rng(5)
    envs = [[None, "a", float("nan"), 1, "a b"], np.array(["a_b", None, "a"], dtype=object), [1.0, "", "a"]]
    names = {"a": "a", "1": "1", "a b": "a_b--7faae47c", "a_b": "a_b", "": "--empty"}
    data = [(rng.normal(size=len(env)), env) for env in envs]

    def submit(client, item):
        reward, env = item
        with pytest.raises(MetricValueError, match=r"group tag 'bad': labels must be 1-D .* got \(\d, 2\)"):
            client.submit_metric(
                {"reward/mean": reward, "reward/max": reward, "loss": 0.5},
                group_by={"env": env, "bad": [[0, 1]] * len(env)},
            )

    try:
        result = run_threads(request.node.name, data, submit, final=True)
    finally:
        local.drop_worker(request.node.name)
    assert result.meta.complete, result.meta
    reward = np.concatenate([r for r, _ in data])
    env = [x for _, e in data for x in e]
    group = np.array([group_of(x, names) for x in env])
    assert {n.split("/")[2] for n in result if n.startswith("group/")} == set(group)
    for g in set(group):
        x = reward[group == g]
        assert result[f"group/env/{g}/reward/mean"] == pytest.approx(x.mean(), rel=1e-12)
        assert result[f"group/env/{g}/reward/max"] == x.max()
    assert result["reward/mean"] == pytest.approx(reward.mean(), rel=1e-12) and result["loss"] == 0.5
    assert not [n for n in result if n.startswith("group/bad/")]


def test_a_dict_of_grouped_names_expects_one_contribution_in_every_step(request):
    """Names starting with ``group/`` submitted as they are, step after step: each step completes
    with the one rank that has the group, also once the client knows the names (the steady path
    that packs known names as one vector must not treat them as ungrouped)."""
    try:
        a = rlmetrics.connect("local", world_size=2, name=request.node.name, label="a")
        b = rlmetrics.connect("local", world_size=2, name=request.node.name, label="b")
        for step in range(3):
            a.submit_metric({"group/env/x/reward/mean": float(step), "reward/mean": 1.0})
            a.submit_metric({"group/env/x/len/mean": 2.0 * step})  # grouped names alone
            b.submit_metric({"reward/mean": 3.0})
            a.wait_submit()
            b.wait_submit()
            res = a.result(step, timeout=5)
            assert res.meta.complete, (step, res.meta)
            assert (res["group/env/x/reward/mean"], res["group/env/x/len/mean"]) == (step, 2.0 * step)
            assert res["reward/mean"] == 2.0
    finally:
        local.drop_worker(request.node.name)


# ----------------------------------------------------------------------------------------- docs
# ------------------------------------------------------------------------------------- trackers
def test_grouped_names_through_jsonl_and_tensorboard(tmp_path):
    batch = rank_batches(5)[0]
    got = compute_data_metric(batch, group_by="data_source")
    with JsonlSink(tmp_path / "m.jsonl") as jsonl, TensorBoardSink(tmp_path / "tb") as tb:
        jsonl.log(got, 3)
        tb.log(got, 3)
    run = read_jsonl(tmp_path / "m.jsonl")
    tb_got = read_tensorboard(tmp_path / "tb")
    names = [n for n in got if n.startswith("group/")]
    assert len(names) > 60
    for name in names:
        assert run.series(name)[1].tolist() == [got[name]]
        assert tb_got[name] == {3: pytest.approx(got[name], rel=1e-6)}  # TensorBoard stores float32


# ------------------------------------------------------------------------------------ difficulty
def grpo_batches(seed: int) -> list[dict]:
    """Three ranks of a GRPO step: 4 prompts of up to 6 samples, spread over ranks (as after a
    batch balancing): prompt "p0" all correct, "p1" all wrong, "p2" mixed only across ranks (its
    correct samples on rank 0, its wrong ones on rank 2), "p3" mixed on rank 1 with equal rewards
    elsewhere."""
    rng = np.random.default_rng(seed)
    plan = [  # rank -> (uid, correct) per sample
        [("p0", 1), ("p2", 1), ("p0", 1), ("p2", 1), ("p1", 0)],
        [("p3", 1), ("p3", 0), ("p0", 1), ("p1", 0), ("p1", 0)],
        [("p2", 0), ("p2", 0), ("p1", 0)],
    ]
    out = []
    for samples in plan:
        batch = make_batch(rng, len(samples), 3, 5, dtype=torch.float64)
        rewards = torch.zeros_like(batch["token_level_rewards"])
        rewards[:, 0] = torch.tensor([float(c) for _, c in samples], dtype=torch.float64)
        batch["token_level_rewards"] = batch["token_level_scores"] = rewards
        batch["uid"] = np.array([u for u, _ in samples], dtype=object)
        out.append(batch)
    return out


def expected_difficulty(batches: list[dict]) -> dict[str, float]:
    """Each prompt classified on its samples of all ranks; each class's data metrics by the loop
    reference; the samples without a prompt id (None) in no prompt, and a group of their own."""
    uids = np.concatenate([b["uid"] for b in batches])
    correct = np.concatenate([b["token_level_rewards"].sum(-1).numpy() > 0.5 for b in batches])
    reward = np.concatenate([b["token_level_rewards"].sum(-1).numpy() for b in batches])
    kinds = {}
    for u in sorted({u for u in uids if u is not None}):
        c = correct[uids == u]
        kinds[u] = "all_correct" if c.all() else "all_wrong" if not c.any() else "mixed"
    out = {"difficulty/prompts": float(len(kinds))}
    for cls in ("all_correct", "all_wrong", "mixed", None):
        members = [u for u, k in kinds.items() if k == cls] if cls else [None]
        if cls:
            out[f"difficulty/{cls}_ratio"] = len(members) / len(kinds)
        parts = [rows(b, np.array([i for i, u in enumerate(b["uid"]) if u in members], int)) for b in batches]
        parts = [p for p in parts if len(p["responses"])]
        if parts:
            group = f"group/difficulty/{cls or '--missing'}/"
            out.update({group + n: v for n, v in reference(concatenate(parts)).items()})
    same = [u for u in kinds if np.ptp(reward[uids == u]) == 0]
    out["difficulty/zero_reward_std_ratio"] = len(same) / len(kinds)
    return out


def check_difficulty(result, batches):
    want = expected_difficulty(batches)
    got = {n: v for n, v in result.items() if n.startswith(("difficulty/", "group/difficulty/"))}
    skip = [
        f"group/difficulty/{c}/{n}" for c in ("all_correct", "all_wrong", "mixed", "--missing") for n in CLIP
    ]
    assert_matches(got, {n: v for n, v in want.items()}, skip=tuple(skip))
    assert want["difficulty/mixed_ratio"] == 0.5  # p2 and p3: p2 is mixed only across ranks


def test_difficulty_groups_of_one_batch_equal_the_reference():
    batch = concatenate(grpo_batches(9))
    batch["uid"] = np.concatenate([b["uid"] for b in grpo_batches(9)])
    got = compute_data_metric(batch, difficulty=True)
    check_difficulty(got, [batch])


def test_difficulty_groups_across_local_ranks_decide_on_every_rank_s_samples(request):
    batches = grpo_batches(10)
    try:
        result = run_threads(
            request.node.name, batches, lambda c, b: c.compute_local_data_metric(b, difficulty=True)
        )
    finally:
        local.drop_worker(request.node.name)
    assert result.meta.complete, result.meta
    check_difficulty(result, batches)
    # the test can fail: deciding per rank calls p2 all correct on rank 0 and all wrong on rank 2
    per_rank = [compute_data_metric(b, difficulty=True)["difficulty/mixed_ratio"] for b in batches]
    assert per_rank[0] == 0.0 and per_rank[2] == 0.0


def test_samples_without_a_prompt_id_are_a_difficulty_group_of_their_own_across_ranks(request):
    """Issue 28.7: a None ``uid`` with ``difficulty=True`` raised numpy's TypeError and lost the
    batch. Such samples belong to no prompt: the prompts are classified without them, and they are
    reported as ``group/difficulty/--missing/...``, over every rank's."""
    batches = grpo_batches(11)
    batches[0]["uid"][4] = None  # a failed session of p1: p1 stays all wrong
    batches[2]["uid"][0] = None  # one of p2's wrong samples: p2 stays mixed (its other one on rank 2)
    try:
        result = run_threads(
            request.node.name,
            batches,
            lambda c, b: c.compute_local_data_metric(b, difficulty=True),
            final=True,
        )
    finally:
        local.drop_worker(request.node.name)
    assert result.meta.complete, result.meta
    check_difficulty(result, batches)
    assert "group/difficulty/--missing/critic/rewards/mean" in result
    assert_matches(
        {n: v for n, v in ungrouped(result).items() if not n.startswith("difficulty/")},
        reference(concatenate(batches)),
        skip=CLIP,
    )


def test_a_refused_name_of_the_call_leaves_its_difficulty_groups(request):
    """A name refused by ``submit_metric`` (here a NaN advantage under ``nan_strategy="error"``, on
    every rank) raised before the prompt records of ``difficulty=True`` were queued: the step had
    no difficulty metrics, or ratios of the other ranks' prompts only."""
    batches = grpo_batches(12)
    for batch in batches:
        i, j = torch.nonzero(batch["response_mask"])[0]  # a response token
        batch["advantages"][i, j] = float("nan")
    try:
        for batch in batches:
            client = rlmetrics.connect("local", world_size=3, name=request.node.name, nan_strategy="error")
            with pytest.raises(MetricValueError, match="metric 'critic/advantages/mean'"):
                client.compute_local_data_metric(batch, difficulty=True)
            client.wait_submit()
        result = rlmetrics.connect("local", name=request.node.name).wait_final_res()
    finally:
        local.drop_worker(request.node.name)
    assert result.meta.complete, result.meta
    want = {n: v for n, v in expected_difficulty(batches).items() if n.startswith("difficulty/")}
    assert_matches({n: v for n, v in result.items() if n.startswith("difficulty/")}, want)


def test_a_malformed_prompt_record_is_refused_when_it_arrives():
    from rlmetrics.core.states import decode_state, encode_state
    from rlmetrics.metrics.difficulty import PromptStats

    record = {"uids": ["p"], "groups": [("critic/rewards/mean",)], "stats": np.zeros((5, 1, 1))}
    assert decode_state(*encode_state(PromptStats([("c", record)]))).records[0][1] is record
    for bad in ({"uids": ["p"]}, {**record, "stats": np.zeros((5, 2, 1))}, {**record, "groups": ["x"]}):
        with pytest.raises(ValueError, match="not a prompt record"):
            decode_state(*encode_state(PromptStats([("c", bad)])))
