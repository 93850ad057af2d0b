"""Quantiles (``median``, ``pNN``) equal numpy on the concatenation of all ranks' values up to the exact
bound (1,000,000 values per name and step by default, ``RLMETRICS_EXACT_QUANTILES``), on the local
backend, Ray rank actors (one client per process) and torch.distributed gloo processes; beyond the
bound they are approximate and ``meta.approximate`` names them (issue 45, point 5).

The cases are the issue's: 4 ranks of 2,000 normal values (p95 read 1.62416 against numpy's 1.62344
at the old bound of 4,096 values) and a token-level p95 over 6,400-7,500 response tokens at 5 steps
(it read 4.928333 at every step). The references are numpy's, ``np.quantile(method="linear")`` for
percentiles and the lower middle value for the median, to 1e-12 relative (our interpolation is
torch's, which rounds the rank and the lerp otherwise than numpy), and torch's ``torch.quantile`` /
``torch.median`` of the concatenation, to the bit (where torch's lerp fuses multiply-add, as on
AVX2 / AVX-512 CPUs; else to 4e-16).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import uuid
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import rlmetrics
from rlmetrics.backends import local
from rlmetrics.core.sketch import EXACT_QUANTILES_ENV, Sketch, default_exact_limit

WORLD = 4
TOKEN_STEPS = 5
NORMAL_NAMES = ("x/median", "x/p95", "x/p99")
REL = 1e-12  # numpy's linear interpolation against torch's (rank and lerp rounded otherwise)


# ------------------------------------------------------------------------------------------------ data
def normal_values(rank: int, step: int = 0, n: int = 2000) -> np.ndarray:
    """The issue's first case: ``n`` standard normal values per rank."""
    return np.random.default_rng([45, step, rank]).normal(size=n)


def token_batch(rank: int, step: int):
    """One rank's token-level values of a PPO step: ``(16, 128)`` advantages-like values and the
    response mask (16 responses of 80-140 tokens: 6,400-7,500 tokens on 4 ranks)."""
    import torch

    rng = np.random.default_rng([46, step, rank])
    lengths = rng.integers(80, 141, 16)
    mask = torch.from_numpy((np.arange(128)[None, :] < lengths[:, None]).astype(np.float32))
    values = torch.from_numpy(rng.gamma(2.0, 1.0, (16, 128)).astype(np.float32))
    return values, mask


def normal_metrics(rank: int, step: int = 0, n: int = 2000) -> dict:
    x = normal_values(rank, step, n)
    return {name: x for name in NORMAL_NAMES}


def token_metrics(rank: int, step: int) -> dict:
    return {"tok/p95": token_batch(rank, step)}  # (values, weight): the mask's 0s leave padding out


def normal_reference(step: int = 0, sizes=(2000,) * WORLD) -> dict[str, float]:
    x = np.concatenate([normal_values(r, step, n) for r, n in enumerate(sizes)])
    return {
        "x/median": float(np.quantile(x, 0.5, method="lower")),
        "x/p95": float(np.quantile(x, 0.95)),
        "x/p99": float(np.quantile(x, 0.99)),
        "torch": {
            "x/median": torch_quantile(x, None),
            "x/p95": torch_quantile(x, 0.95),
            "x/p99": torch_quantile(x, 0.99),
        },
    }


def token_reference(step: int) -> tuple[float, float, int]:
    """numpy's and torch's p95 of the step's response tokens of all ranks, and their number."""
    parts = [token_batch(r, step) for r in range(WORLD)]
    x = np.concatenate([v.numpy()[m.numpy() != 0] for v, m in parts]).astype(np.float64)
    return float(np.quantile(x, 0.95)), torch_quantile(x, 0.95), x.size


def torch_quantile(x: np.ndarray, q: float | None) -> float:
    """``torch.median`` (q None) or ``torch.quantile`` of ``x`` in float64."""
    import torch

    t = torch.from_numpy(x)
    return float(torch.median(t) if q is None else torch.quantile(t, q))


def assert_torchs(ours: float, theirs: float) -> None:
    """Bit-exact where torch's vectorised lerp fuses multiply-add (AVX2/AVX512), else within ~1 ulp."""
    import torch

    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert ours == theirs, (ours, theirs)
    else:  # pragma: no cover - other CPUs may round a + t * (b - a) twice
        assert ours == pytest.approx(theirs, rel=4e-16), (ours, theirs)


def assert_exact(got, want: dict) -> None:
    """numpy's and torch's values of ``want`` (:func:`normal_reference`), not flagged approximate."""
    for name, value in want.items():
        if name != "torch":
            assert got[name] == pytest.approx(value, rel=REL, abs=0.0), (name, got[name], value)
            assert_torchs(got[name], want["torch"][name])
    assert not got.meta.approximate, got.meta


def assert_token_p95(got, step: int) -> None:
    numpy_p95, torch_p95, n = token_reference(step)
    assert 6_400 <= n <= 7_500
    assert got["tok/p95"] == pytest.approx(numpy_p95, rel=REL, abs=0.0), (step, got["tok/p95"], numpy_p95)
    assert_torchs(got["tok/p95"], torch_p95)
    assert not got.meta.approximate, got.meta


# ------------------------------------------------------------------------------------------------ units
def test_the_default_bound_is_a_million_values_and_the_environment_sets_it(monkeypatch):
    assert default_exact_limit() == 1_000_000 and Sketch().exact_limit == 1_000_000
    monkeypatch.setenv(EXACT_QUANTILES_ENV, "2_000_000")
    assert Sketch.of([1.0]).exact_limit == 2_000_000
    monkeypatch.setenv(EXACT_QUANTILES_ENV, "many")
    with pytest.raises(ValueError, match="RLMETRICS_EXACT_QUANTILES='many'.*an integer >= 0"):
        Sketch()


def test_sketches_of_different_bounds_merge_under_the_smaller_one_in_any_order():
    a, b = Sketch.of(np.arange(5.0), exact_limit=10), Sketch.of(np.arange(5.0), exact_limit=100)
    c = Sketch.of([1.0])
    assert a.merge(b).exact_limit == b.merge(a).exact_limit == 10 and a.merge(b).is_exact
    for merged in (a.merge(b).merge(c), a.merge(b.merge(c)), c.merge(b).merge(a)):
        assert not merged.is_exact and merged.exact_limit == 10
        np.testing.assert_array_equal(merged.to_array(), a.merge(b).merge(c).to_array())
    wide = Sketch.of(np.arange(200_000.0))  # more than the old 65,536 cap on exact values travels
    wide.validate()
    assert Sketch.from_array(wide.to_array()).median() == 99_999.0


def test_a_merge_of_many_exact_sketches_is_the_sketch_of_their_concatenation():
    """Exact merges keep sorted runs and sort once when read (the aggregator merges W contributions)."""
    parts = [normal_values(r, n=n) for r, n in enumerate((0, 3, 1000, 1, 2500))] + [
        np.array([np.inf, -np.inf])
    ]
    merged = Sketch()
    for part in parts:
        merged = merged.merge(Sketch.of(part))
    whole = Sketch.of(np.concatenate(parts))
    assert merged.is_exact and merged.count == whole.count and repr(merged) == repr(whole)
    np.testing.assert_array_equal(merged.to_array(), whole.to_array())
    assert merged.median() == whole.median() and merged.quantile(0.95) == whole.quantile(0.95)
    halves = Sketch.of(parts[2]).merge(Sketch.of(parts[4]))
    np.testing.assert_array_equal(
        halves.merge(halves).values, np.sort(np.concatenate([parts[2], parts[4]] * 2))
    )


# ------------------------------------------------------------------------------------------------ local
def run_local(steps: dict[int, list[dict]]) -> list:
    """Each step's per-rank metrics submitted by its rank's client; the driver's results."""
    name = f"quant-{uuid.uuid4().hex[:8]}"
    clients = [rlmetrics.connect("local", world_size=WORLD, rank=r, name=name) for r in range(WORLD)]
    driver = rlmetrics.connect("local", name=name)
    try:
        out = []
        for step, per_rank in steps.items():
            for client, metrics in zip(clients, per_rank):
                client.submit_metric(metrics, step=step)
                client.wait_submit(step=step)
            out.append(driver.result(step, timeout=30))
        return out
    finally:
        local.drop_worker(name)


def test_local_4_ranks_of_2000_normal_values_equal_numpy():
    (res,) = run_local({0: [normal_metrics(r) for r in range(WORLD)]})
    assert res.meta.complete
    assert_exact(res, normal_reference())


def test_local_token_level_p95_over_7000_tokens_equals_numpy_at_every_step():
    pytest.importorskip("torch")
    results = run_local({s: [token_metrics(r, s) for r in range(WORLD)] for s in range(TOKEN_STEPS)})
    for step, res in enumerate(results):
        assert_token_p95(res, step)
    assert len({res["tok/p95"] for res in results}) == TOKEN_STEPS  # it moves with the data


def test_beyond_the_bound_meta_flags_the_names_the_reader_is_warned_once_and_jsonl_keeps_it(
    monkeypatch, tmp_path
):
    from rlmetrics.sinks import make_sinks

    monkeypatch.setenv(EXACT_QUANTILES_ENV, "5000")  # 8,000 values: beyond
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = run_local({s: [normal_metrics(r, s) for r in range(WORLD)] for s in range(2)})
    for step, res in enumerate(results):
        assert res.meta.approximate == sorted(NORMAL_NAMES) and res.meta.complete
        for name in NORMAL_NAMES:  # the sketch's bound (and the rank's rounding)
            assert res[name] == pytest.approx(normal_reference(step)[name], rel=0.006)
    approximate = [w for w in caught if issubclass(w.category, rlmetrics.ApproximateWarning)]
    assert len(approximate) == 1, [str(w.message) for w in caught]  # once per name, not per step
    text = str(approximate[0].message)
    assert "x/p95" in text and "RLMETRICS_EXACT_QUANTILES" in text and "meta.approximate" in text
    with make_sinks(["jsonl"], tmp_path, health=None) as tracking:
        tracking.log(results[0], 0)
    (path,) = tmp_path.rglob("*.jsonl")
    (record,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert record["meta"]["approximate"] == sorted(NORMAL_NAMES)
    assert rlmetrics.StepMeta.from_dict(record["meta"]) == results[0].meta


def test_one_rank_of_a_smaller_bound_makes_the_step_approximate():
    """The bound of a step is its ranks' smallest: a rank started without the environment variable
    of the others lowers it, and meta says so (no merge error)."""
    x = normal_values(0)
    own = rlmetrics.Stat.from_array(rlmetrics.Stat.of(x).to_array(), Sketch.of(x, exact_limit=1000))
    per_rank = [{"x/p95": own}] + [{"x/p95": normal_values(r)} for r in range(1, WORLD)]
    (res,) = run_local({0: per_rank})
    assert res.meta.approximate == ["x/p95"]


# ------------------------------------------------------------------------------------------------ Ray
def ray_rank_actors(ray, env: dict[str, str] | None = None) -> list:
    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, rank: int, name: str) -> None:
            self.rank = rank
            self.client = rlmetrics.connect("ray", name=name, world_size=WORLD, rank=rank)

        def step(self, step: int, which: str) -> None:
            metrics = normal_metrics(self.rank, step) if which == "normal" else token_metrics(self.rank, step)
            self.client.submit_metric(metrics, step=step)
            self.client.wait_submit(step=step)

    return Rank, (None if env is None else {"env_vars": env})


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("bound", [None, "5000"])
def test_ray_rank_actors_equal_numpy_and_beyond_the_bound_meta_flags(ray_session, bound):
    pytest.importorskip("torch")
    ray = ray_session
    name = f"quant-{uuid.uuid4().hex[:8]}"
    worker = rlmetrics.get_metric_worker(name=name)
    driver = rlmetrics.MetricClient(worker)
    Rank, runtime_env = ray_rank_actors(ray, None if bound is None else {EXACT_QUANTILES_ENV: bound})
    options = {} if runtime_env is None else {"runtime_env": runtime_env}
    ranks = [Rank.options(**options).remote(r, name) for r in range(WORLD)]
    try:
        ray.get([a.step.remote(0, "normal") for a in ranks])
        res = driver.result(0, timeout=60)
        assert res.meta.complete
        if bound is not None:
            assert res.meta.approximate == sorted(NORMAL_NAMES)
            return
        assert_exact(res, normal_reference())
        for step in range(1, 3):
            ray.get([a.step.remote(step, "tokens") for a in ranks])
            assert_token_p95(driver.result(step, timeout=60), step)
    finally:
        for a in ranks:
            ray.kill(a)
        ray.kill(worker)


# ------------------------------------------------------------------------------------------------ torch
UNBALANCED = (6000, 10, 0, 1990)  # rank 2 without a value: the offsets of every rank's values


def _torch_rank(rank: int, out_dir: str) -> None:
    """One gloo process: each exchange form, the normal case, an unbalanced one, the token-level
    steps, then the normal case beyond a bound of 5,000 values; its results pickled."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir}/store",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    results = {}
    try:
        for exchange in ("gather", "reduce"):
            client = rlmetrics.connect("torch", exchange=exchange)
            client.submit_metric(normal_metrics(rank), step=0)
            client.wait_submit(step=0)
            results[exchange, "normal"] = client.result(0)
            client.submit_metric(normal_metrics(rank, 1, UNBALANCED[rank]), step=1)
            client.wait_submit(step=1)
            results[exchange, "unbalanced"] = client.result(1)
            for step in range(2, 2 + TOKEN_STEPS):
                client.submit_metric(token_metrics(rank, step - 2), step=step)
                client.wait_submit(step=step)
                results[exchange, "tokens", step - 2] = client.result(step)
            os.environ[EXACT_QUANTILES_ENV] = "5000"
            try:
                client.submit_metric(normal_metrics(rank), step=2 + TOKEN_STEPS)
                client.wait_submit(step=2 + TOKEN_STEPS)
                results[exchange, "beyond"] = client.result(2 + TOKEN_STEPS)
            finally:
                del os.environ[EXACT_QUANTILES_ENV]
    finally:
        dist.destroy_process_group()
    (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))


@pytest.mark.torch
@pytest.mark.slow
def test_torch_gloo_ranks_equal_numpy_and_beyond_the_bound_meta_flags(tmp_path):
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != EXACT_QUANTILES_ENV}
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    for rank in range(WORLD):
        results = pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes())
        for exchange in ("gather", "reduce"):
            assert_exact(results[exchange, "normal"], normal_reference())
            assert_exact(results[exchange, "unbalanced"], normal_reference(1, UNBALANCED))
            for step in range(TOKEN_STEPS):
                assert_token_p95(results[exchange, "tokens", step], step)
            beyond = results[exchange, "beyond"]
            assert beyond.meta.approximate == sorted(NORMAL_NAMES)
            for name in NORMAL_NAMES:
                assert beyond[name] == pytest.approx(normal_reference()[name], rel=0.006)


if __name__ == "__main__":  # the torch test's processes
    import torch.multiprocessing as mp

    mp.spawn(_torch_rank, args=(sys.argv[1],), nprocs=WORLD, join=True)
