"""The torch.distributed backend with 4 real gloo processes, checked against numpy on the concatenation.

The processes are started once for the module (``torch.multiprocessing``, from a subprocess that
runs this file as a script, so the workers can import it); every scenario runs in them and each rank
pickles what it saw. The tests regenerate every rank's data here and compare.
"""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
import threading
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORLD = 4
STEPS = 8
NEW_KEY_STEP = 3  # rank 2 starts a new name; "early/mean" disappears on every rank
NAN_STEPS = {5: 1, 6: 3}  # step: the rank whose batch holds a NaN
VALIDATION_STEP = 7
RELAYOUT_STEPS = {0, NEW_KEY_STEP, VALIDATION_STEP}
EXCHANGES = ("auto", "reduce")  # auto gathers at these sizes; reduce is the form of large W x M


# ------------------------------------------------------------------------------------------------ data
def batch(rank: int, step: int) -> dict[str, np.ndarray]:
    """One rank's raw data of one step of the main scenario (unequal sizes across ranks)."""
    rng = np.random.default_rng(1000 * step + rank)
    n = 3 + 29 * rank + 7 * step
    x = rng.normal(step, 1 + rank, size=n)
    if NAN_STEPS.get(step) == rank:
        x[n // 2] = np.nan
    return {
        "x": x,
        "w": rng.uniform(0.5, 2.0, size=n),
        "lat": rng.lognormal(0.0, 2.0, size=1500),  # 6000 values on 4 ranks: bucket mode
        "stage": rng.normal(size=5 + rank),
        # both signs over 60 decades: more buckets than max_buckets (folded), zeros and infinities
        "wide": np.concatenate(
            [
                rng.choice([-1.0, 1.0], 1200) * 10 ** rng.uniform(-30, 30, 1200),
                [0.0, -0.0, np.inf, -np.inf][rank:],
            ]
        ),
    }


def validation_split():
    """Validation samples as one process sees them, and cut into one part per rank."""
    rng = np.random.default_rng(4)
    n = 32
    infos = {"acc": rng.integers(0, 2, n).astype(float).tolist(), "reward": rng.random(n).tolist(),
             "pred": [str(v) for v in rng.integers(0, 3, n)]}  # fmt: skip
    # every prompt's samples lie on several ranks
    whole = (
        ["gsm8k"] * 16 + ["math"] * 16,
        [f"p{i % 3}" for i in range(n)],
        infos,
        rng.integers(1, 4, n).tolist(),
    )

    def cut(v, a: int, b: int):
        return {k: x[a:b] for k, x in v.items()} if isinstance(v, dict) else v[a:b]

    bounds = [0, 5, 13, 22, n]
    return whole, [tuple(cut(v, a, b) for v in whole) for a, b in zip(bounds, bounds[1:])]


def group_batch(rank: int, step: int) -> tuple[np.ndarray, list[str], np.ndarray, list[str]]:
    """Values with a source label (source "c" on rank 2 only, rank 1 without "b") and a GRPO batch's
    sequence rewards with prompt ids (prompt "q" on ranks 0 and 3: all its samples decide it)."""
    rng = np.random.default_rng(500 + 10 * step + rank)
    sources = [["a", "b", "a"], ["a"] * 5, ["c", "b"], ["b"] * 4][rank]
    rewards, uids = [([1.0, 1.0], ["p", "q"]), ([0.0], ["r"]), ([1.0, 0.0], ["s", "s"]), ([0.0], ["q"])][rank]
    return rng.normal(size=len(sources)), sources, np.array(rewards), uids


def drop_batch(rank: int, step: int) -> np.ndarray:
    x = np.random.default_rng(77 + 10 * step + rank).normal(size=4 + 3 * rank)
    x[rank % len(x)] = [np.nan, np.inf, -np.inf, np.nan][rank]
    return x


# ----------------------------------------------------------------------------- the spawned workers
def _main_scenario(rank: int, exchange: str) -> dict:
    import rlmetrics
    from rlmetrics import Stat

    client = rlmetrics.connect("torch", exchange=exchange)
    out: dict = {"results": {}, "relayout": {}, "bytes": {}, "collectives": {}}
    for step in range(STEPS):
        d = batch(rank, step)
        x = d["x"]
        plain = {"reward/max": x, "reward/min": x, "reward/p95": x, "reward/median": x, "big/std": 1e9 + x}
        if rank == 1:  # two calls with the same names: merged on the rank first
            client.submit_metric({"reward/mean": x[:3], "reward/std": x[:3]})
            client.submit_metric({"reward/mean": x[3:], "reward/std": x[3:], **plain})
        else:
            client.submit_metric({"reward/mean": x, "reward/std": x, **plain})
        scalars = {"perf/total_num_tokens": float(len(x)), "timing_s/gen": 0.1 * (rank + 1) + step}
        client.submit_metric(scalars)
        client.submit_metric(
            {"lat/p50": d["lat"], "w/mean": (x, d["w"]), "w/p90": Stat.of(x, weight=d["w"], sketch=True)}
        )
        client.submit_metric({"lat/hist": d["lat"]})  # a histogram (rlmetrics.core.histogram)
        client.submit_metric({"wide/p99": d["wide"], "wide/p10": d["wide"], "wide/median": d["wide"]})
        if rank == 0:  # a rank-0-only timing, below zero: must not become max(0, ...)
            client.submit_metric({"only0/latency/max": -(1.0 + step + np.arange(3.0))})
        if rank == 3:
            client.submit_metric({"only3/gap/min": [2.0 + step, 5.0]})
        if rank in (1, 2):  # a pipeline stage held by two ranks
            client.submit_metric({"stage/loss": d["stage"]})
        if step < NEW_KEY_STEP:
            client.submit_metric({"early/mean": float(rank)})
        elif rank == 2:
            client.submit_metric({"late/score/mean": float(step)})
        if step == VALIDATION_STEP:
            client.process_local_validation_metrics(*validation_split()[1][rank])
        client.wait_submit()
        res = client.result(step)
        out["results"][step] = res
        out["relayout"][step] = res.meta.relayout
        out["bytes"][step] = client.transport.bytes_last_step
        out["collectives"][step] = client.transport.collectives_last_step
    out["final"] = client.wait_final_res()
    out["again"] = client.result(2)
    out["relayouts"] = client.transport.relayouts
    try:
        client.result(STEPS)
    except RuntimeError as exc:
        out["future"] = str(exc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["future_timeout"] = client.result(STEPS, timeout=0.05).meta
    return out


def _choices_scenario(rank: int) -> dict:
    """pass^k, tie="none" and missing="count_as_zero" (issue 33 point 4) on each rank's part."""
    import rlmetrics

    root = str(Path(__file__).resolve().parents[1])  # the spawned worker runs this file as a script
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.test_validation_choices import CHOICES, choices_split

    client = rlmetrics.connect("torch")
    client.process_local_validation_metrics(*choices_split()[1][rank], **CHOICES)
    client.wait_submit()
    return client.result(0)


def _drop_scenario(rank: int, exchange: str) -> dict:
    import rlmetrics

    client = rlmetrics.connect("torch", nan_strategy="drop", exchange=exchange)
    out = {}
    for step in range(2):
        x = drop_batch(rank, step)
        client.submit_metric({"d/mean": x, "d/max": x, "d/min": x, "d/std": x, "d/p50": x, "d/n/sum": [1.0]})
        client.wait_submit()
        out[step] = client.result(step)
    return out


def _groups_scenario(rank: int) -> dict:
    import torch

    import rlmetrics

    client = rlmetrics.connect("torch")
    out = {}
    for step in range(2):
        x, sources, rewards, uids = group_batch(rank, step)
        client.submit_metric({"g/mean": x, "g/max": x, "g/std": x}, group_by={"src": sources})
        n = len(uids)
        token_rewards = torch.zeros(n, 2, dtype=torch.float64)
        token_rewards[:, 1] = torch.as_tensor(rewards)
        grpo = {"responses": torch.zeros(n, 2), "attention_mask": torch.ones(n, 3, dtype=torch.long)}
        grpo.update(token_level_rewards=token_rewards, uid=np.array(uids, dtype=object))
        client.compute_local_data_metric(grpo, difficulty=True)
        client.wait_submit()
        out[step] = client.result(step)
    return out


def _result_on_scenario(rank: int) -> dict:
    import rlmetrics

    client = rlmetrics.connect("torch", result_on=0, world_size=WORLD)
    client.submit_metric({"r/mean": float(rank), "r/max": float(rank)})
    client.wait_submit()
    return {"result": client.result(0), "final": client.wait_final_res()}


def _subgroup_scenario(rank: int) -> dict:
    """A client on a subgroup: ranks 2 and 3 form their own group and merge only their data."""
    import torch.distributed as dist

    import rlmetrics

    pair = dist.new_group([2, 3])  # every rank takes part in creating it
    if rank < 2:
        return {}
    client = rlmetrics.connect("torch", group=pair)
    out = {}
    for step in range(2):
        x = batch(rank, step)["x"]
        client.submit_metric({"s/mean": x, "s/std": x, "s/min": x, "s/p50": x})
        client.wait_submit()
        out[step] = client.result(step)
    return out


def _failure_scenario(rank: int) -> dict:
    """Misuse raises on the ranks concerned; no rank hangs and the group keeps working."""
    import rlmetrics

    out: dict = {}
    client = rlmetrics.connect("torch")
    client.wait_submit()  # a step without any submission on any rank
    out["empty"] = client.result(0)
    if rank == 0:  # a late submission: refused, raised after the collective
        client.submit_metric({"late/mean": 1.0}, step=0)
    client.submit_metric({"ok/mean": float(rank)})
    try:
        client.wait_submit()
    except ValueError as exc:
        out["late"] = str(exc)
    out["after_late"] = client.result(1)
    bad = rlmetrics.connect("torch")
    bad.step = 2 if rank == 1 else 0  # two steps apart (one is realigned): every rank raises, none hangs
    bad.submit_metric({"a/mean": 1.0})
    try:
        bad.wait_submit()
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    client.submit_metric({"ok/mean": float(rank)})
    client.wait_submit()
    out["after_mismatch"] = client.result(2)
    box: dict = {}  # a reader thread waits for the step the training thread collects
    reader = threading.Thread(target=lambda: box.update(res=client.result(3, timeout=60)))
    reader.start()
    client.submit_metric({"ok/mean": float(rank)})
    client.wait_submit()
    reader.join()
    out["threaded"] = box["res"]
    return out


def _worker(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir}/store",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        out = {
            "main": {e: _main_scenario(rank, e) for e in EXCHANGES},
            "drop": {e: _drop_scenario(rank, e) for e in EXCHANGES},
            "groups": _groups_scenario(rank),
            "result_on": _result_on_scenario(rank),
            "failure": _failure_scenario(rank),
            "subgroup": _subgroup_scenario(rank),
            "choices": _choices_scenario(rank),
        }
    finally:
        dist.destroy_process_group()
    (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(out))


def _spawn(out_dir: str) -> None:
    """Start the 4 ranks with ``torch.multiprocessing.spawn``: fresh interpreters, as torchrun's."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(out_dir,), nprocs=WORLD, join=True)


# ----------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("torch_backend")
    proc = subprocess.run([sys.executable, __file__, str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]


def same(a: float, b: float, rel: float = 0.0) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or math.isclose(a, b, rel_tol=rel, abs_tol=0.0)


def lower_median(v: np.ndarray) -> float:
    """torch.median: the lower middle value, NaN when there is one."""
    return math.nan if np.isnan(v).any() else float(np.sort(v)[(len(v) - 1) // 2])


def merged_sketch(parts):
    from rlmetrics import Sketch

    out = Sketch()
    for p in parts:
        out = out.merge(p)
    return out


def expected_main(step: int) -> dict[str, float]:
    """Every reported value of a step, from numpy on the concatenated data of all ranks."""
    from rlmetrics import Sketch

    data = [batch(r, step) for r in range(WORLD)]
    x = np.concatenate([d["x"] for d in data])
    w = np.concatenate([d["w"] for d in data])
    lat = np.concatenate([d["lat"] for d in data])
    exp = {
        "reward/mean": x.mean(),
        "reward/std": x.std(),
        "reward/max": x.max(),
        "reward/min": x.min(),
        "reward/p95": np.quantile(x, 0.95),
        "reward/median": lower_median(x),
        "big/std": (1e9 + x).std(),
        "perf/total_num_tokens": float(len(x)),
        "perf/delta_time/gen": np.mean([0.1 * (r + 1) + step for r in range(WORLD)]),
        "lat/p50": merged_sketch(Sketch.of(d["lat"]) for d in data).quantile(0.5),
        "w/mean": np.average(x, weights=w),
        "w/p90": merged_sketch(Sketch.of(d["x"], d["w"]) for d in data).quantile(0.9),
        "only0/latency/max": -(1.0 + step),
        "only3/gap/min": min(2.0 + step, 5.0),
        "stage/loss": np.concatenate([data[1]["stage"], data[2]["stage"]]).mean(),
    }
    wide = merged_sketch(Sketch.of(d["wide"]) for d in data)  # what the in-process aggregator merges
    exp.update(
        {"wide/p99": wide.quantile(0.99), "wide/p10": wide.quantile(0.1), "wide/median": wide.median()}
    )
    assert not np.isnan(lat).any() and abs(exp["lat/p50"] / np.sort(lat)[(len(lat) - 1) // 2] - 1) <= 0.005
    if step < NEW_KEY_STEP:
        exp["early/mean"] = np.mean(range(WORLD))
    else:
        exp["late/score/mean"] = float(step)
    return {k: float(v) for k, v in exp.items()}


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("step", range(STEPS))
def test_every_rank_gets_numpy_on_the_concatenated_data(ranks, step, exchange):
    exp = expected_main(step)
    # big/std: values near 1e9 carry ~1e-7 absolute rounding in each rank's mean; a sum of squares
    # would lose everything (test_m2_is_merged_exactly_where_a_sum_of_squares_cancels)
    tolerance = {"reward/std": 1e-12, "big/std": 1e-7, "reward/p95": 1e-12, "w/mean": 1e-12}
    for r in range(WORLD):
        got = dict(ranks[r]["main"][exchange]["results"][step])
        if step == VALIDATION_STEP:
            got = {k: v for k, v in got.items() if not k.startswith(("val-", "val/"))}
        assert set(got) == set(exp), (r, set(got) ^ set(exp))  # absent names are absent, not zero
        bad = {k: (got[k], exp[k]) for k in exp if not same(got[k], exp[k], tolerance.get(k, 1e-13))}
        assert not bad, (r, bad)
        meta = ranks[r]["main"][exchange]["results"][step].meta
        assert meta.complete and meta.exchange == ("gather" if exchange == "auto" else exchange)


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_histograms_equal_numpy_on_the_concatenated_data(ranks, exchange):
    from tests.test_histograms import check

    for step in range(STEPS):
        lat = np.concatenate([batch(r, step)["lat"] for r in range(WORLD)])  # 6000 values: bucket mode
        for r in range(WORLD):
            res = ranks[r]["main"][exchange]["results"][step]
            assert list(res.histograms) == ["lat/hist"] and "lat/hist" not in res
            check(res.histograms["lat/hist"], lat)


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_m2_is_merged_exactly_where_a_sum_of_squares_cancels(ranks, exchange):
    for step in range(NEW_KEY_STEP):
        big = 1e9 + np.concatenate([batch(r, step)["x"] for r in range(WORLD)])
        naive = math.sqrt(abs((big * big).sum() / len(big) - big.mean() ** 2))
        got = ranks[0]["main"][exchange]["results"][step]["big/std"]
        assert abs(got / big.std() - 1) < 1e-7 < abs(naive / big.std() - 1)


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_nan_propagates_from_any_rank(ranks, exchange):
    for step, rank in NAN_STEPS.items():
        res = ranks[0]["main"][exchange]["results"][step]
        for name in ("reward/mean", "reward/std", "reward/max", "reward/min", "reward/p95", "reward/median"):
            assert math.isnan(res[name]), (step, rank, name)
        assert not math.isnan(res["perf/total_num_tokens"]) and not math.isnan(res["lat/p50"])
    assert not math.isnan(ranks[0]["main"][exchange]["results"][0]["reward/max"])


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_relayout_only_when_a_key_set_changes(ranks, exchange):
    for r in range(WORLD):
        main = ranks[r]["main"][exchange]
        assert {s for s, flag in main["relayout"].items() if flag} == RELAYOUT_STEPS
        assert main["relayouts"] == len(RELAYOUT_STEPS)
    # steady steps: a handful of float64 vectors, the same size on every rank
    assert len({ranks[r]["main"][exchange]["bytes"][4] for r in range(WORLD)}) == 1
    # dominated by the 3 wide sketches, folded to 2 x 4096 buckets each; 6 quantile names in all
    assert 8 * 3 * 4096 < ranks[0]["main"][exchange]["bytes"][2] < 8 * (6 * 2 * 4096 + 1000)


def test_a_steady_step_is_one_exchange_and_one_sketch_sum(ranks):
    """Gather: one all_gather, then one SUM of the sketches (the layout has quantile names). Reduce:
    SUM, MAX and the all_gather of the std names issued together, then the sketches; a step with a
    NaN extreme adds one MAX. A re-layout adds one all_gather_object and the exchange on the old
    layout (in the reduce form, without the std all_gather while the old layout is empty)."""
    for r in range(WORLD):
        gather, reduce = ranks[r]["main"]["auto"]["collectives"], ranks[r]["main"]["reduce"]["collectives"]
        for step in range(STEPS):
            relayout = step in RELAYOUT_STEPS
            records = int(step == VALIDATION_STEP)
            assert gather[step] == 2 + 2 * relayout + records, (r, step)
            old_exchange = 2 if step == 0 else 3
            expected = 4 + relayout * (1 + old_exchange) + records + int(step in NAN_STEPS)
            assert reduce[step] == expected, (r, step)


def test_validation_metrics_equal_the_single_process_result(ranks):
    from rlmetrics.metrics.validation import process_validation_metrics

    expected = process_validation_metrics(*validation_split()[0])
    assert any(k.startswith("val-core/gsm8k/acc/maj@") for k in expected)
    for r in range(WORLD):
        for exchange in EXCHANGES:
            got = ranks[r]["main"][exchange]["results"][VALIDATION_STEP]
            assert {k: got[k] for k in expected} == expected
            assert not any(k.startswith("_aux/") for k in got)


def test_validation_choices_equal_the_single_process_result(ranks):
    from rlmetrics.metrics.validation import process_validation_metrics
    from tests.test_validation_choices import CHOICES, choices_split

    expected = process_validation_metrics(*choices_split()[0], **CHOICES)
    assert "val-core/gsm8k/acc:count_as_zero/maj_strict@6/mean" in expected
    for r in range(WORLD):
        got = ranks[r]["choices"]
        assert {k: got[k] for k in expected} == expected


def test_reads_of_collected_steps(ranks):
    main = ranks[1]["main"]["auto"]
    assert main["final"].step == STEPS - 1 and dict(main["final"]) == dict(main["results"][STEPS - 1])
    assert dict(main["again"]) == dict(main["results"][2])
    assert "not collected yet" in main["future"]
    assert main["future_timeout"].complete is False


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_drop_strategy_ignores_non_finite_values(ranks, exchange):
    for step in range(2):
        x = np.concatenate([drop_batch(r, step) for r in range(WORLD)])
        f = x[np.isfinite(x)]
        exp = {"d/mean": f.mean(), "d/max": f.max(), "d/min": f.min(), "d/std": f.std(),
               "d/p50": np.quantile(f, 0.5), "d/n/sum": float(WORLD)}  # fmt: skip
        for r in range(WORLD):
            got = ranks[r]["drop"][exchange][step]
            assert set(got) == set(exp)
            assert all(same(got[k], float(v), 1e-12) for k, v in exp.items()), (got, exp)


def test_a_subgroup_merges_its_own_ranks_only(ranks):
    for step in range(2):
        x = np.concatenate([batch(r, step)["x"] for r in (2, 3)])
        exp = {"s/mean": x.mean(), "s/std": x.std(), "s/min": x.min(), "s/p50": np.quantile(x, 0.5)}
        for r in (2, 3):
            got = ranks[r]["subgroup"][step]
            assert set(got) == set(exp)
            assert all(same(got[k], float(v), 1e-12) for k, v in exp.items()), (got, exp)
    assert ranks[0]["subgroup"] == {}


def test_group_breakdowns_and_difficulty_groups_equal_the_concatenation(ranks):
    for step in range(2):
        data = [group_batch(r, step) for r in range(WORLD)]
        x = np.concatenate([d[0] for d in data])
        src = np.concatenate([d[1] for d in data])
        for rank in ranks:
            res = rank["groups"][step]
            assert res.meta.complete
            for group in "abc":
                v = x[src == group]
                assert res[f"group/src/{group}/g/mean"] == pytest.approx(v.mean(), rel=1e-12)
                assert res[f"group/src/{group}/g/max"] == v.max()
                assert res[f"group/src/{group}/g/std"] == pytest.approx(v.std(), rel=1e-9)
            # prompts p (1), q (1 on rank 0, 0 on rank 3: mixed), r (0), s (1 and 0: mixed)
            assert res["difficulty/prompts"] == 4
            assert (res["difficulty/all_correct_ratio"], res["difficulty/all_wrong_ratio"]) == (0.25, 0.25)
            assert (res["difficulty/mixed_ratio"], res["difficulty/zero_reward_std_ratio"]) == (0.5, 0.5)
            assert res["group/difficulty/mixed/critic/rewards/mean"] == 0.5


def test_result_on_rank_zero_only(ranks):
    assert dict(ranks[0]["result_on"]["result"]) == {"r/mean": 1.5, "r/max": 3.0}
    for r in range(1, WORLD):
        res = ranks[r]["result_on"]["result"]
        assert dict(res) == {} and res.meta.result_on == 0 and res.step == 0
        assert dict(ranks[r]["result_on"]["final"]) == {}


def test_misuse_raises_where_it_happened_and_never_hangs(ranks):
    for r in range(WORLD):
        fail = ranks[r]["failure"]
        assert dict(fail["empty"]) == {} and fail["empty"].meta.complete
        assert ("late" in fail) == (r == 0)
        assert dict(fail["after_late"]) == {"ok/mean": 1.5}
        assert "different steps" in fail["mismatch"]
        assert dict(fail["after_mismatch"]) == {"ok/mean": 1.5}
        assert fail["threaded"].step == 3 and dict(fail["threaded"]) == {"ok/mean": 1.5}
    assert "already collected" in ranks[0]["failure"]["late"]


def test_layout_fingerprint_is_stable_and_order_free():
    from rlmetrics.backends.torch_dist import Layout

    a = Layout.of({"x/max": "max", "y/mean": "mean"})
    assert a.fingerprint == Layout.of({"y/mean": "mean", "x/max": "max"}).fingerprint
    assert a.fingerprint != Layout.of({"x/max": "max", "y/mean": "sum"}).fingerprint
    assert a.fingerprint == float(int(a.fingerprint)) < 2.0**53  # exact in a float64 collective


def test_connect_without_a_process_group_says_what_to_do():
    import torch.distributed as dist

    import rlmetrics

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        rlmetrics.connect("torch")


if __name__ == "__main__":
    _spawn(sys.argv[1])
