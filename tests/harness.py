"""The differential harness, the one entry point for "merged equals the single-process computation
on the concatenated batch": every metric family of :data:`METRICS` runs on every backend of
:data:`BACKENDS`, with its read patterns, and each merged number is compared with the family's
reference on the concatenation of all ranks' inputs (``tests/test_differential.py`` parametrizes
over the tables; the idea of TorchMetrics' ``MetricTester``).

Adding a metric family is one row of :data:`METRICS`: a name, what one rank submits from its shard
(``submit(client, shard, world, step)``) and the single-process reference on the shards of all ranks
in rank order (``reference(shards, nan_strategy) -> {name: value}``). A family over inputs of its
own draws them with ``inputs(rng)`` (the shard is then what it returns, the same on the rank and in
the reference); for example, one row::

    Metric("entropy", lambda c, x, w, step: c.submit_metric({"entropy/mean": x}, w, step),
           lambda xs, ns: {"entropy/mean": np.concatenate(xs).mean()}, inputs=lambda rng: rng.normal(size=3)),

Without ``inputs`` the shard is :func:`rank_step`'s (a PPO batch with data sources, phase timings,
GPUs, a validation share and plain metrics). ``when(spec)`` says in which steps the family runs,
``rel`` its tolerance (float64 data, float32 data). Every scenario then runs it: local threads
(hypothesis, many scenarios), Ray actors and torch.distributed gloo processes; the names a step holds
must be exactly the families' names.

Adding a backend is one row of :data:`BACKENDS`: a name, a runner ``run(request, scenarios, read)``
that starts ``scenario["world"]`` ranks on it, has each rank call :func:`run_rank` for every step and
yields ``(scenario, step, result)`` as the driver reads it (``read(i, step)``: ``"final"`` for
``wait_final_res()``, ``"result"`` for ``result(step)``), how many scenarios it runs in one go
(``None``: hypothesis draws them one at a time, 15 per read pattern), its world size if fixed, its
read patterns and its pytest marks; for example, the local row::

    Backend("local", run_local, draws=None, reads=(FINAL, RESULT)),

A *scenario* (drawn by hypothesis) is W ranks and two steps. In every step each rank has its own
batch (unequal sizes, empty shards too; single- or multi-turn; float32 or float64; a NaN or an
infinity in the rewards where the scenario says so; data sources, missing or of mixed types, for
``group_by``), its own phase timings and GPUs, its share of a validation round and a few plain
metrics. Each rank runs the seed's calls on its shard (the rows of :data:`METRICS`, in order):
``compute_local_data_metric`` (with ``group_by="data_source"``), ``compute_local_timing_metrics``,
``compute_local_throughout_metrics``, ``compute_local_mfu_metrics`` (the actor's from the model's
size, the reference model's from a FLOPs-per-token number), ``compute_local_straggler_metrics``
(each rank's own stage times), ``process_local_validation_metrics`` and ``submit_metric``
(plain metrics; then values grouped by env with ``group_by={"env": ...}`` and a number, on inputs of
the row's own; values under quantile names, more than 4,096 of them from 2 ranks on), then
``wait_submit()``.

The references are one process on the concatenation: ``compute_data_metric`` (with ``group_by``),
``compute_timing_metrics`` (each stage's seconds averaged over ranks, as every rank times the same
step), ``compute_throughput_metrics`` (the ranks' GPUs summed), the MFU by hand (all sequences' FLOPs over
the mean seconds times all GPUs times the peak), numpy's min, median and max of
each stage's seconds over ranks (the straggler report), ``process_validation_metrics`` (the
samples in rank order) and numpy for the plain metrics and for each env's values (the number never
per group), numpy's lower median and linear percentiles (1e-12 relative: torch's interpolation,
which ours is, rounds its rank and its lerp otherwise). Tolerance: 1e-9 relative for float64 data;
for float32 tensors ``1e-5`` relative (a row's float32 sum may differ from the concatenation's in
its last bits, ~ width * 2**-24); 1e-12 for the grouped values.
"""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import rlmetrics
from rlmetrics.backends import local

torch = pytest.importorskip("torch")

from rlmetrics.metrics.data import compute_data_metric  # noqa: E402
from rlmetrics.metrics.timing import compute_throughput_metrics, compute_timing_metrics  # noqa: E402
from rlmetrics.metrics.validation import process_validation_metrics  # noqa: E402

STEPS = 2
STAGES = ("gen", "ref", "update_actor", "step")
UNCHECKABLE = {"perf/process_cpu_mem_used_gb"}  # each process's own memory: no concatenation of it
CHECKED: list[int] = []  # how many names each checked step compared
SOURCES = ("gsm8k", "math")
LABELS = ("gsm8k", "openai/gsm8k", None, float("nan"), "", 3)  # per-sequence data sources: missing, mixed
DTYPE_REL = (1e-9, 1e-5)  # relative tolerance: float64 data, float32 data


# ------------------------------------------------------------------------------------------- scenarios
@st.composite
def scenarios(draw, world=None, n_steps=STEPS):
    """A JSON-able description; the tensors are built from it (:func:`rank_step`)."""
    w = world or draw(st.integers(1, 4))
    steps = []
    for _ in range(n_steps):
        steps.append(
            {
                "sizes": draw(st.lists(st.integers(0, 5), min_size=w, max_size=w)),
                "prompt": draw(st.integers(1, 4)),
                "response": draw(st.integers(1, 6)),
                "multi_turn": draw(st.booleans()),
                "float64": draw(st.booleans()),
                "bad": draw(st.sampled_from([None, math.nan, math.inf])),
                "val": draw(st.lists(st.integers(0, 4), min_size=w, max_size=w)),
                "val_choices": draw(st.booleans()),  # the validation_choices family instead of validation
            }
        )
    return {
        "world": w,
        "nan_strategy": draw(st.sampled_from(["propagate", "drop"])),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "steps": steps,
    }


def draw_scenarios(n: int, world: int | None = None, n_steps: int = STEPS) -> list[dict]:
    """``n`` scenarios drawn by hypothesis (for the backends that run them all in one go): the last
    of ``5 n`` draws, past the simplest ones hypothesis starts with."""
    out: list[dict] = []

    @settings(max_examples=5 * n, database=None, derandomize=True, phases=[Phase.generate])
    @given(scenarios(world, n_steps))
    def collect(sc):
        out.append(sc)

    collect()
    return out[-n:]


def rank_step(sc: dict, rank: int, step: int) -> dict:
    """One rank's inputs of one step: batch, timing, GPUs, validation share and plain metrics."""
    spec = sc["steps"][step]
    g = torch.Generator().manual_seed(sc["seed"] * 7919 + step * 101 + rank)
    rng = np.random.default_rng([sc["seed"], step, rank])
    b, p, r = spec["sizes"][rank], spec["prompt"], spec["response"]
    dtype = torch.float64 if spec["float64"] else torch.float32
    lengths = torch.randint(0, r + 1, (b,), generator=g)  # 0: an aborted (empty) response
    mask = (torch.arange(r)[None, :] < lengths[:, None]).long()
    prompt_len = torch.randint(1, p + 1, (b,), generator=g)
    prompt_mask = (torch.arange(p)[None, :] >= (p - prompt_len)[:, None]).long()  # left-padded
    scores = torch.zeros(b, r, dtype=dtype)
    ends = (lengths - 1).clamp(min=0)
    scores[torch.arange(b), ends] = torch.randint(0, 2, (b,), generator=g).to(dtype) * (lengths > 0)
    rewards = scores - 0.05 * mask.to(dtype)
    if spec["bad"] is not None and b and rank == (step % sc["world"]):
        rewards[0, 0] = spec["bad"]
    batch = {
        "responses": torch.randint(0, 9, (b, r), generator=g),
        "prompts": torch.randint(0, 9, (b, p), generator=g),
        "attention_mask": torch.cat([prompt_mask, mask], 1),
        "response_mask": mask,
        "token_level_scores": scores,
        "token_level_rewards": rewards,
        "advantages": torch.randn(b, r, generator=g, dtype=dtype) * mask,
        "returns": torch.randn(b, r, generator=g, dtype=dtype) * mask,
        "values": torch.randn(b, r, generator=g, dtype=dtype) * mask,
    }
    if spec["multi_turn"]:
        batch["__num_turns__"] = torch.randint(1, 4, (b,), generator=g)
    batch["data_source"] = [LABELS[i] for i in rng.integers(0, len(LABELS), b)]  # group_by's labels
    n_val = spec["val"][rank]
    infos = {"acc": rng.integers(0, 2, n_val).astype(float).tolist()}
    infos["pred"] = [str(v) for v in rng.integers(0, 3, n_val)]
    val = (
        [SOURCES[i % 2] for i in range(n_val)],
        [f"q{(rank + i) % 3}" for i in range(n_val)],  # a prompt's samples sit on several ranks
        infos,
        rng.integers(1, 3, n_val).tolist(),
    )
    return {
        "batch": batch,
        "timing": {s: float(rng.uniform(0.1, 2.0)) for s in STAGES},
        "gpus": int(rng.integers(1, 3)),
        "val": val,
        "plain": {"x": rng.normal(size=int(rng.integers(1, 5))), "w": rng.uniform(0.5, 2.0), "n": 1.0 + rank},
    }


def cat_batch(parts: list[dict]) -> dict:
    """The concatenation of the shards' batches, in rank order."""
    batch = {k: torch.cat([p["batch"][k] for p in parts]) for k in parts[0]["batch"] if k != "data_source"}
    batch["data_source"] = sum((p["batch"]["data_source"] for p in parts), [])
    return batch


def mean_timing(parts: list[dict]) -> dict[str, float]:
    """Each stage's seconds averaged over ranks (every rank times the same step)."""
    return {s: float(np.mean([p["timing"][s] for p in parts])) for s in STAGES}


def straggler_reference(parts: list[dict]) -> dict[str, float]:
    """Each stage's seconds over ranks, by numpy: min, median, max and max / median."""
    out = {}
    for s in STAGES:
        t = np.array([p["timing"][s] for p in parts])
        head = f"perf/straggler/{s}/"
        out |= {head + "min": t.min(), head + "p50": np.median(t), head + "max": t.max()}
        out[head + "max_over_p50"] = t.max() / np.median(t)
    return out


def cat_validation(parts: list[dict]) -> tuple:
    """The validation samples of all ranks in rank order: sources, prompts, infos, turns."""
    cat = [sum((list(p["val"][i]) for p in parts), []) for i in (0, 1, 3)]
    infos = {k: sum((p["val"][2][k] for p in parts), []) for k in parts[0]["val"][2]}
    return cat[0], cat[1], infos, cat[2]


def plain_metrics(d: dict) -> dict:
    """What a rank submits with ``submit_metric``: lists, a tensor, an array, a weighted value, a count."""
    x = d["plain"]["x"]
    return {"x/mean": x.tolist(), "x/max": torch.as_tensor(x), "x/std": x, "x/p90": x.tolist(),
            "wx/mean": (x, d["plain"]["w"]), "n/total": d["plain"]["n"]}  # fmt: skip


def plain_reference(parts: list[dict]) -> dict[str, float]:
    x = np.concatenate([p["plain"]["x"] for p in parts])
    wx = np.concatenate([np.full(p["plain"]["x"].size, p["plain"]["w"]) for p in parts])
    return {"x/mean": x.mean(), "x/max": x.max(), "x/std": x.std(), "x/p90": float(np.quantile(x, 0.9)),
            "wx/mean": float(np.average(x, weights=wx)),
            "n/total": sum(p["plain"]["n"] for p in parts)}  # fmt: skip


MFU_MODEL = {"num_params": 4.9e8, "num_hidden_layers": 24, "hidden_size": 896}  # about Qwen2.5-0.5B
MFU_FLOPS_PER_TOKEN = 3.1e9  # the ref stage's, given as a number


def mfu_submit(client, d: dict, world: int, step: int) -> None:
    """The actor's MFU from the model's size (each sequence's length from the batch, H100 by name) and
    the reference model's from a number of tokens and a FLOPs-per-token number (A100 by number)."""
    client.compute_local_mfu_metrics(
        d["batch"], d["timing"], d["gpus"], world, step, model=MFU_MODEL, peak_flops="NVIDIA H100 80GB HBM3"
    )
    tokens = int(d["batch"]["attention_mask"].sum())
    client.compute_local_mfu_metrics(tokens, d["timing"], d["gpus"], world, step, stage="ref",
                                     flops_per_token=MFU_FLOPS_PER_TOKEN, peak_flops=312e12)  # fmt: skip


def mfu_reference(parts: list[dict]) -> dict[str, float]:
    """By hand on the concatenation: sum over sequences of s (6 N + 12 L H s) FLOPs, over the mean
    seconds of the ranks' timers times all GPUs times the peak."""
    s = np.concatenate([p["batch"]["attention_mask"].sum(-1).numpy() for p in parts]).astype(np.float64)
    n, layers, hidden = MFU_MODEL.values()
    gpus = sum(p["gpus"] for p in parts)
    actor = (s * (6 * n + 12 * layers * hidden * s)).sum() / (
        mean_timing(parts)["update_actor"] * gpus * 989e12
    )
    ref = s.sum() * MFU_FLOPS_PER_TOKEN / (mean_timing(parts)["ref"] * gpus * 312e12)
    return {"perf/mfu/actor": actor, "perf/mfu/ref": ref}


CHOICES = {"exact": True, "tie": "none", "missing": "drop"}  # issue 33.4's estimators, one record option set


def choices_inputs(rng: np.random.Generator) -> tuple:
    """A rank's validation samples of the ``validation_choices`` family: 0 to 5, a failed score
    (None) now and then, votes drawn from two answers (ties happen), prompts shared over ranks."""
    n = int(rng.integers(0, 6))
    acc = [None if rng.random() < 0.2 else float(rng.integers(0, 2)) for _ in range(n)]
    infos = {"acc": acc, "pred": [str(v) for v in rng.integers(0, 2, n)]}
    prompts = [f"q{int(rng.integers(0, 3))}" for _ in range(n)]
    return [SOURCES[i % 2] for i in range(n)], prompts, infos, rng.integers(1, 3, n).tolist()


def by_group(tag: str, labels: list, columns: dict[str, tuple[np.ndarray, Callable]]) -> dict[str, float]:
    """numpy per group: ``name: (values, fn)`` gives ``fn(values)`` of all samples under ``name``
    and of each label's under ``group/<tag>/<label>/<name>``; a name without samples is absent."""
    labels = np.array(labels, dtype=object)
    subsets = [("", np.ones(len(labels), bool))] + [(f"group/{tag}/{g}/", labels == g) for g in set(labels)]
    return {
        prefix + name: float(fn(values[keep]))
        for prefix, keep in subsets
        if keep.any()
        for name, (values, fn) in columns.items()
    }


def grouped_inputs(rng: np.random.Generator) -> dict:
    """A rank's inputs of the ``group_by`` family: 0 to 5 values, each of one of three envs, and a
    number (a loss)."""
    n = int(rng.integers(0, 6))
    envs = [("a", "b", "c")[i] for i in rng.integers(0, 3, n)]
    return {"x": rng.normal(size=n), "env": envs, "loss": float(rng.uniform())}


def grouped_reference(parts: list[dict]) -> dict[str, float]:
    x = np.concatenate([p["x"] for p in parts])
    median = lambda v: np.quantile(v, 0.5)  # noqa: E731
    columns = {"gx/mean": (x, np.mean), "gx/max": (x, np.max), "gx/p50": (x, median)}
    loss = {"gloss": float(np.mean([p["loss"] for p in parts]))}  # a number: never per group
    return by_group("env", sum((p["env"] for p in parts), []), columns) | loss


def quantile_inputs(rng: np.random.Generator) -> np.ndarray:
    """2,400-2,600 values per rank: more than the old exact bound (4,096) from 2 ranks on."""
    return rng.normal(size=int(rng.integers(2400, 2601)))


def quantile_reference(parts: list[np.ndarray]) -> dict[str, float]:
    """numpy on all ranks' values: the lower middle value (torch.median's), linear percentiles."""
    x = np.concatenate(parts)
    return {"qx/median": np.quantile(x, 0.5, method="lower"), "qx/p95": np.quantile(x, 0.95),
            "qx/p99.9": np.quantile(x, 0.999)}  # fmt: skip


# ------------------------------------------------------------------------------------------- metrics
@dataclass(frozen=True)
class Metric:
    """One metric family: what a rank submits from its shard, and the reference on all shards."""

    name: str
    submit: Callable[[Any, Any, int, int], None]  # (client, shard, world, step): one rank's calls
    reference: Callable[[list, str], dict]  # (the shards of all ranks in rank order, nan_strategy)
    inputs: Callable[[np.random.Generator], Any] | None = None  # the family's own shard; else rank_step's
    when: Callable[[dict], Any] = lambda spec: True  # the steps (their spec) in which it runs
    rel: tuple[float, float] = DTYPE_REL  # relative tolerance: float64 data, float32 data


METRICS: list[Metric] = [
    Metric("data",
           lambda c, d, w, step: c.compute_local_data_metric(d["batch"], w, step, group_by="data_source"),
           lambda ps, ns: compute_data_metric(cat_batch(ps), nan_strategy=ns, group_by="data_source")),
    Metric("timing",
           lambda c, d, w, step: c.compute_local_timing_metrics(d["batch"], d["timing"], w, step),
           lambda ps, ns: {k.replace("timing_s/", "perf/delta_time/"): v for k, v in
                           compute_timing_metrics(cat_batch(ps), mean_timing(ps), nan_strategy=ns).items()}),
    Metric("throughput",
           lambda c, d, w, step: c.compute_local_throughout_metrics(
               d["batch"], d["timing"], d["gpus"], w, step),
           lambda ps, ns: compute_throughput_metrics(
               cat_batch(ps), mean_timing(ps), sum(p["gpus"] for p in ps), nan_strategy=ns)),
    Metric("mfu", mfu_submit, lambda ps, ns: mfu_reference(ps)),
    Metric("stragglers", lambda c, d, w, step: c.compute_local_straggler_metrics(d["timing"], w, step),
           lambda ps, ns: straggler_reference(ps)),
    # a step's validation records share their options: a step runs one of the two validation families
    Metric("validation",
           lambda c, d, w, step: c.process_local_validation_metrics(*d["val"], world_size=w, step=step),
           lambda ps, ns: process_validation_metrics(*cat_validation(ps), nan_strategy=ns),
           when=lambda spec: sum(spec["val"]) and not spec.get("val_choices")),
    Metric("validation_choices",
           lambda c, d, w, step: c.process_local_validation_metrics(*d, world_size=w, step=step, **CHOICES),
           lambda ps, ns: process_validation_metrics(*cat_validation([{"val": p} for p in ps]),
                                                     nan_strategy=ns, **CHOICES),
           inputs=choices_inputs, when=lambda spec: spec.get("val_choices")),
    Metric("plain", lambda c, d, w, step: c.submit_metric(plain_metrics(d), w, step),
           lambda ps, ns: plain_reference(ps)),
    Metric("group_by", lambda c, d, w, step: c.submit_metric(
               {"gx/mean": d["x"], "gx/max": d["x"], "gx/p50": d["x"], "gloss": d["loss"]}, w, step,
               group_by={"env": d["env"]}),
           lambda ps, ns: grouped_reference(ps), inputs=grouped_inputs, rel=(1e-12, 1e-12)),
    # exact quantiles up to the bound: numpy's, but for torch's rounding of the interpolation
    Metric("quantiles",
           lambda c, x, w, step: c.submit_metric({"qx/median": x, "qx/p95": x, "qx/p99.9": x}, w, step),
           lambda ps, ns: quantile_reference(ps), inputs=quantile_inputs, rel=(1e-12, 1e-12)),
]  # fmt: skip


def shard(metric: Metric, sc: dict, rank: int, step: int, common: dict | None = None) -> Any:
    """What ``metric`` submits on ``rank`` at ``step``: its own inputs, or the common shard."""
    if metric.inputs is None:
        return rank_step(sc, rank, step) if common is None else common
    return metric.inputs(np.random.default_rng([sc["seed"], step, rank, zlib.crc32(metric.name.encode())]))


def run_rank(client, sc: dict, rank: int, step: int, base: int | None = 0) -> None:
    """The calls of one rank for scenario step ``step``: every family of :data:`METRICS` that runs
    in it, then ``wait_submit()``. ``base``: the trainer's step of scenario step 0, passed to every
    call (verl's ``global_steps``: 1); None: no step is passed, the client counts (the seed's loop)."""
    common = rank_step(sc, rank, step)
    spec = sc["steps"][step]
    at = None if base is None else base + step
    for metric in METRICS:
        if metric.when(spec):
            metric.submit(client, shard(metric, sc, rank, step, common), sc["world"], at)
    client.wait_submit(step=at)


SLOW_RANK_S = 0.5  # slow_last_rank's delay at every step


def slow_last_rank(client, sc: dict, rank: int, step: int) -> None:
    """:func:`run_rank`, the last rank ``SLOW_RANK_S`` late."""
    if rank == sc["world"] - 1:
        time.sleep(SLOW_RANK_S)
    run_rank(client, sc, rank, step)


# ------------------------------------------------------------------------------------------- reference
def expected_by_metric(
    sc: dict, step: int, ranks: list[int] | None = None, metrics: tuple[str, ...] | None = None
) -> dict[str, dict[str, float]]:
    """Each family's (of ``metrics``, else all) single-process computation on the concatenation of
    the inputs of ``step`` of all ranks (or of ``ranks``); no name in two families."""
    ranks = list(range(sc["world"])) if ranks is None else ranks
    spec = sc["steps"][step]
    common = [rank_step(sc, r, step) for r in ranks]
    out: dict[str, dict[str, float]] = {}
    seen: set[str] = set()
    for metric in METRICS:
        if metric.when(spec) and (metrics is None or metric.name in metrics):
            parts = [shard(metric, sc, r, step, c) for r, c in zip(ranks, common)]
            want = metric.reference(parts, sc["nan_strategy"])
            out[metric.name] = {k: float(v) for k, v in want.items() if k not in UNCHECKABLE}
            assert not seen & set(out[metric.name]), (metric.name, sorted(seen & set(out[metric.name])))
            seen |= set(out[metric.name])
    return out


def expected(
    sc: dict, step: int, ranks: list[int] | None = None, metrics: tuple[str, ...] | None = None
) -> dict[str, float]:
    """The families' references of ``step`` (over ``ranks``), in one dict."""
    return {k: v for want in expected_by_metric(sc, step, ranks, metrics).values() for k, v in want.items()}


def check(
    sc: dict,
    step: int,
    got,
    ranks: list[int] | None = None,
    *,
    at: int | None = None,
    whole: bool | None = None,
) -> None:
    """``got`` is ``step`` of ``sc`` (read as trainer step ``at``, default ``step``): complete and
    equal to the reference, or with ``ranks`` final, partial and equal to the reference over those
    ranks alone. ``whole``: whether it is complete, when that is not ``ranks is None`` (a step after
    a rank was lost: over the survivors, complete)."""
    assert got.step == (step if at is None else at), (got.step, step, at)
    whole = ranks is None if whole is None else whole
    assert got.meta.complete == whole and not got.meta.provisional, got.meta
    by_metric = expected_by_metric(sc, step, ranks)
    want = {k: v for w in by_metric.values() for k, v in w.items()}
    names = set(got) - UNCHECKABLE - {"meta/coverage", "meta/late"}
    assert names == set(want), ("names differ", sorted(names ^ set(want)))
    CHECKED.append(len(want))
    f64 = sc["steps"][step]["float64"]
    bad = {}
    for metric in METRICS:
        rel = metric.rel[0] if f64 else metric.rel[1]
        for k, v in by_metric.get(metric.name, {}).items():
            g = got[k]
            if math.isnan(v) or math.isnan(g):
                ok = math.isnan(v) and math.isnan(g)
            else:
                ok = math.isclose(g, v, rel_tol=rel, abs_tol=rel * 1e-3) or g == v
            if not ok:
                bad[k] = (g, v)
    assert not bad, bad


# ------------------------------------------------------------------------------------------- backends
Read = Callable[[int, int], str]  # (scenario index, step) -> "final" (wait_final_res) or "result"


def FINAL(i: int, step: int) -> str:
    return "final"


def RESULT(i: int, step: int) -> str:
    return "result"


def BY_SCENARIO(i: int, step: int) -> str:
    """Scenarios alternate: the seed's ``wait_final_res()``, then ``result(step)``."""
    return ("final", "result")[i % 2]


def BY_STEP(i: int, step: int) -> str:
    """Steps alternate within a scenario: ``result(step)``, then ``wait_final_res()``."""
    return ("result", "final")[step % 2]


def read_step(driver, read: str, step: int, timeout: float):
    """The driver's read of ``step``: the seed's ``wait_final_res()``, or ``result(step)``."""
    return driver.wait_final_res() if read == "final" else driver.result(step, timeout=timeout)


def run_local(request, scs: list[dict], read: Read) -> Iterator[tuple[dict, int, Any]]:
    """Threads as ranks of one in-process aggregator per scenario."""
    for i, sc in enumerate(scs):
        name = f"diff-{uuid.uuid4().hex[:8]}"
        w = sc["world"]
        opts = {"nan_strategy": sc["nan_strategy"], "blocking": read(i, 0) == "final", "name": name}
        clients = [
            rlmetrics.connect("local", world_size=w, label=f"rank{r}", rank=r, **opts) for r in range(w)
        ]
        driver = rlmetrics.connect("local", name=name)
        try:
            for step in range(STEPS):
                threads = [
                    threading.Thread(target=run_rank, args=(c, sc, r, step)) for r, c in enumerate(clients)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                yield sc, step, read_step(driver, read(i, step), step, timeout=30)
        finally:
            local.drop_worker(name)


def ray_ranks(ray, n: int) -> list:
    """``n`` rank actors; each connects once per aggregator name, as the options of its first step say."""

    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, rank):
            self.rank = rank
            self.clients = {}

        def client(self, name, sc, blocking=True, hierarchy=None):
            if name not in self.clients:
                self.clients[name] = rlmetrics.connect(
                    "ray", name=name, world_size=sc["world"], label=f"rank{self.rank}", rank=self.rank,
                    nan_strategy=sc["nan_strategy"], blocking=blocking, hierarchy=hierarchy,
                )  # fmt: skip
            return self.clients[name].client_id

        def step(self, name, sc, step, blocking=True, slow=False):
            (slow_last_rank if slow else run_rank)(self.clients[name], sc, self.rank, step)

        def run(self, name, fn, *args):
            """``fn(client, *args)`` with this rank's client of aggregator ``name`` (a test's own loop)."""
            return fn(self.clients[name], *args)

    return [Rank.remote(r) for r in range(n)]


def run_ray(request, scs: list[dict], read: Read) -> Iterator[tuple[dict, int, Any]]:
    """One actor per rank (made once for all scenarios), one aggregator actor per scenario."""
    ray = request.getfixturevalue("ray_session")
    actors = ray_ranks(ray, max(sc["world"] for sc in scs))
    for i, sc in enumerate(scs):
        name = f"diff-{uuid.uuid4().hex[:8]}"
        worker = rlmetrics.get_metric_worker(name=name)
        driver = rlmetrics.MetricClient(worker)
        ranks = actors[: sc["world"]]
        try:
            ray.get([a.client.remote(name, sc, read(i, 0) == "final") for a in ranks])
            for step in range(STEPS):
                ray.get([a.step.remote(name, sc, step) for a in ranks])
                yield sc, step, read_step(driver, read(i, step), step, timeout=60)
        finally:
            ray.kill(worker)
    for a in actors:
        ray.kill(a)


def _torch_rank(rank: int, out_dir: str) -> None:
    """One gloo process: the scenarios of ``out_dir/scenarios.pkl`` in turn, its reads pickled."""
    import torch.distributed as dist

    scs, world, read_name = pickle.loads((Path(out_dir) / "scenarios.pkl").read_bytes())
    read = globals()[read_name]
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    results = []
    try:
        for i, sc in enumerate(scs):
            client = rlmetrics.connect("torch", nan_strategy=sc["nan_strategy"])
            for step in range(STEPS):
                run_rank(client, sc, rank, step)
                results.append(client.wait_final_res() if read(i, step) == "final" else client.result(step))
    finally:
        dist.destroy_process_group()
    (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))


def run_torch(request, scs: list[dict], read: Read) -> Iterator[tuple[dict, int, Any]]:
    """torch.distributed gloo processes (one per rank, all scenarios of one world size); every rank
    reads every step, and each rank's reads are checked."""
    (world,) = {sc["world"] for sc in scs}
    out_dir = request.getfixturevalue("tmp_path")
    (out_dir / "scenarios.pkl").write_bytes(pickle.dumps((scs, world, read.__name__)))
    proc = subprocess.run(
        [sys.executable, __file__, str(out_dir), str(world)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    for rank in range(world):
        results = iter(pickle.loads((out_dir / f"rank{rank}.pkl").read_bytes()))
        for sc in scs:
            for step in range(STEPS):
                yield sc, step, next(results)


@dataclass(frozen=True)
class Backend:
    """One backend: a runner of scenarios on it, and how the harness drives it."""

    name: str
    run: Callable[[Any, list[dict], Read], Iterator[tuple[dict, int, Any]]]  # (request, scenarios, read)
    draws: int | None  # scenarios per run, drawn up front; None: hypothesis draws them one at a time
    world: int | None = None  # every scenario's world size, if the backend fixes it
    reads: tuple[Read, ...] = (FINAL, RESULT)  # the read patterns, each a test of its own
    marks: tuple = ()


EXAMPLES = 15  # hypothesis scenarios per read pattern of a backend with draws=None
BACKENDS: list[Backend] = [
    Backend("local", run_local, draws=None, reads=(FINAL, RESULT)),
    Backend("ray", run_ray, draws=4, reads=(BY_SCENARIO,), marks=(pytest.mark.ray, pytest.mark.slow)),
    Backend("torch", run_torch, draws=4, world=3, reads=(BY_STEP,), marks=(pytest.mark.slow,)),
]


def backend(name: str) -> Backend:
    (row,) = [b for b in BACKENDS if b.name == name]
    return row


def cases() -> list:
    """Every (backend, read pattern) pair, a pytest param with the backend's marks."""
    return [
        pytest.param(b, read, marks=b.marks, id=f"{b.name}-{read.__name__.lower()}")
        for b in BACKENDS
        for read in b.reads
    ]


def check_run(b: Backend, request, scs: list[dict], read: Read) -> None:
    """Run ``scs`` on ``b``; every step it reads equals the reference."""
    for sc, step, got in b.run(request, scs, read):
        check(sc, step, got)


if __name__ == "__main__":  # run_torch's processes
    import torch.multiprocessing as mp

    mp.spawn(_torch_rank, args=(sys.argv[1],), nprocs=int(sys.argv[2]), join=True)
