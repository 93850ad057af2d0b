"""The command line, run as a user would: a real demo run (examples/grpo), then report / plot / compare /
bench on it."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from examples.grpo.demo import PLOTS, SOURCES, simulate_batch, simulate_validation
from examples.grpo.demo import main as demo_main

pytestmark = [pytest.mark.torch, pytest.mark.slow]

STEPS, WORKERS, VAL_EVERY = 6, 3, 3
ROOT = Path(__file__).resolve().parents[1]
DEMO = [sys.executable, "-m", "examples.grpo"]  # run from ROOT, as make demo runs it


def rlmetrics_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "rlmetrics", *args], capture_output=True, text=True, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A simulated local-backend demo run (threads as ranks), as ``python -m examples.grpo --simulate
    --backend local`` makes it."""
    out = tmp_path_factory.mktemp("demo")
    args = [
        "--simulate",
        "--backend",
        "local",
        "--steps",
        str(STEPS),
        "--workers",
        str(WORKERS),
        "--out",
        str(out),
        "--val-every",
        str(VAL_EVERY),
        "--sinks",
        "jsonl,tensorboard",
        "--pace",
        "0",
    ]
    assert demo_main(args) == 0
    return out


def expected_step(step: int) -> dict[str, float]:
    """Numpy on the concatenated batches of all ranks (not our metric code)."""
    batches = [simulate_batch(r, step, STEPS) for r in range(WORKERS)]
    seq_score = np.concatenate([b["token_level_scores"].double().sum(-1).numpy() for b in batches])
    lengths = np.concatenate([b["response_mask"].sum(-1).numpy() for b in batches])
    adv = np.concatenate(
        [b["advantages"].double().numpy()[b["response_mask"].numpy().astype(bool)] for b in batches]
    )
    turns = np.concatenate([b["__num_turns__"].numpy() for b in batches])
    return {
        "critic/score/mean": seq_score.mean(),
        "response/length/mean": lengths.mean(),
        "response/length/max": lengths.max(),
        "response/clip_ratio/mean": (lengths == batches[0]["response_mask"].shape[1]).mean(),
        "critic/advantages/mean": adv.mean(),
        "critic/advantages/min": adv.min(),
        "num_turns/mean": turns.mean(),
    }


def expected_validation(step: int) -> dict[str, float]:
    everything = simulate_validation(0, 1, step, STEPS, 32, 8)  # one rank holds every sample
    src = np.asarray(everything["data_sources"])
    acc = np.asarray(everything["infos_dict"]["acc"])
    return {f"val-core/{s}/acc/mean@8": acc[src == s].mean() for s in SOURCES}


def test_demo_logs_every_step_exactly(run_dir):
    from rlmetrics.sinks import read_jsonl

    run = read_jsonl(run_dir / "metrics.jsonl")
    assert run.steps == list(range(STEPS)) and run.truncated is None
    for record in run.records:
        for name, want in expected_step(record["step"]).items():
            assert record["metrics"][name] == pytest.approx(want, rel=1e-6), (record["step"], name)
    val_steps = [s for s in range(STEPS) if (s + 1) % VAL_EVERY == 0]
    for record in run.records:
        has_val = any(k.startswith("val-core/") for k in record["metrics"])
        assert has_val == (record["step"] in val_steps)
    for step in val_steps:
        metrics = run.records[step]["metrics"]
        for name, want in expected_validation(step).items():
            assert metrics[name] == pytest.approx(want, rel=1e-12)
        assert any("/pass@" in k for k in metrics) and any("/maj@8/" in k for k in metrics)


def test_demo_writes_tensorboard_and_readable_plots(run_dir):
    import matplotlib.image

    assert list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    for name in ("actor", "tasks"):  # a simulated run has no update metrics and no tasks
        assert not (run_dir / f"{name}.png").exists()
    for name in PLOTS.keys() - {"actor", "tasks"}:
        png = matplotlib.image.imread(run_dir / f"{name}.png")
        assert png.shape[0] > 200 and png.shape[1] > 300
        assert png[..., :3].std() > 0.01, f"{name}.png is blank"


def test_report_filters_by_glob_and_matches_the_log(run_dir):
    out = rlmetrics_cli("report", str(run_dir), "-m", "response/length/*").stdout
    assert "response/length/mean" in out and "critic/score/mean" not in out
    lengths = [expected_step(s)["response/length/max"] for s in range(STEPS)]
    assert f"{max(lengths):.4g}" in out  # the max over steps of response/length/max


def test_plot_and_compare_write_pngs(run_dir, tmp_path):
    import matplotlib.image

    rlmetrics_cli("plot", str(run_dir), "-m", "critic/score/*", "-o", str(tmp_path / "p.png"))
    out = rlmetrics_cli(
        "compare",
        str(run_dir),
        str(run_dir / "metrics.jsonl"),
        "-m",
        "critic/score/mean",
        "-o",
        str(tmp_path / "c.png"),
    ).stdout
    assert "critic/score/mean" in out
    for name in ("p.png", "c.png"):
        png = matplotlib.image.imread(tmp_path / name)
        assert png.shape[1] > 300 and png[..., :3].std() > 0.01


def test_demo_histograms_equal_numpy_and_plot_hist_draws_them(run_dir, tmp_path):
    """The demo's length and score histograms (all ranks' data) are numpy's of the concatenated
    batches; the demo drew them, and ``rlmetrics plot --hist`` draws one."""
    import matplotlib.image

    from rlmetrics.sinks import read_jsonl
    from tests.test_histograms import check

    run = read_jsonl(run_dir / "metrics.jsonl")
    for name in ("response/length/hist", "critic/score/hist"):
        steps, hists = run.histograms(name)
        assert steps.tolist() == list(range(STEPS))
        for step, h in zip(steps, hists):
            batches = [simulate_batch(r, int(step), STEPS) for r in range(WORKERS)]
            if name == "response/length/hist":
                data = np.concatenate([b["response_mask"].numpy().sum(-1) for b in batches]) * 1.0
            else:  # the row sums, as torch adds them
                data = np.concatenate([b["token_level_scores"].sum(-1).double().numpy() for b in batches])
            check(h, data)
    rlmetrics_cli("plot", str(run_dir), "--hist", "response/length/hist", "-o", str(tmp_path / "h.png"))
    for png in (tmp_path / "h.png", run_dir / "histograms.png"):
        image = matplotlib.image.imread(png)
        assert image.shape[0] > 200 and image[..., :3].std() > 0.01


def logged_run(out: Path, steps: int, metrics, histograms=lambda step: {}):
    """The JsonlRun of ``steps`` steps logged through the JSONL sink: ``metrics(step)`` and
    ``histograms(step)`` (``{name: Histogram}``) of each."""
    from rlmetrics.messages import StepResult
    from rlmetrics.sinks import make_sinks, read_jsonl

    with make_sinks(["jsonl"], out, health=None) as tracking:
        for step in range(steps):
            tracking.log(StepResult(metrics(step), step, histograms=histograms(step)), step)
    return read_jsonl(out / "metrics.jsonl")


def test_plot_breaks_lines_at_missing_steps_and_names_constant_metrics(tmp_path):
    from rlmetrics.cli.plot import plot_runs, runs_figure

    def metrics(step):
        out = {"actor/lr": 3e-3, "val-aux/exact/pass@8": 0.0, "response/length/mean": 5.0 - step / 30}
        if step not in (10, 12):  # a missing step, then one point between two gaps
            out["critic/score/mean"] = step / 30
        if step % 10 == 9:
            out["val-core/reward/mean@8"] = step / 40  # every 10 steps: one line, no gap
        return out

    run = logged_run(tmp_path, 30, metrics)
    fig = runs_figure([("demo", run)], ["*"], title="t")
    panels = {ax.get_title(): ax for ax in fig.axes if ax.axison}
    assert sorted(panels) == ["critic/score/mean", "response/length/mean", "val-core/reward/mean@8"]
    assert "actor/lr = 0.003" in fig.get_supxlabel() and "val-aux/exact/pass@8 = 0" in fig.get_supxlabel()
    (score,) = panels["critic/score/mean"].get_lines()
    x, y = score.get_xdata(), score.get_ydata()
    assert np.isnan(y).sum() == 2 and x[~np.isnan(x)].tolist() == [s for s in range(30) if s not in (10, 12)]
    assert x[np.flatnonzero(np.isnan(y)) - 1].tolist() == [9, 11]  # the line breaks after 9 and after 11
    marked = np.flatnonzero(score.get_markevery())
    assert x[marked].tolist() == [11]  # 28 points: only the one without a neighbour has a marker
    (val,) = panels["val-core/reward/mean@8"].get_lines()
    assert val.get_xdata().tolist() == [9, 19, 29] and not np.isnan(val.get_ydata()).any()
    assert panels["response/length/mean"].get_ylabel() == "tokens"
    assert panels["critic/score/mean"].get_ylabel() == "critic/score/mean"
    assert plot_runs([("demo", run)], ["*"], tmp_path / "p.png").stat().st_size > 10_000  # it renders


def test_plot_hist_of_integer_data_has_one_row_per_integer(tmp_path):
    from rlmetrics.cli.plot import histograms_figure, plot_histograms
    from rlmetrics.core.histogram import Histogram

    rng = np.random.default_rng(0)

    def hist(step):  # lengths 1..7 (then 2..6), binned as the histogram metrics bin them: 64 bins
        lengths = rng.integers(1, 8, 256) if step < 5 else rng.integers(2, 7, 256)
        counts, edges = np.histogram(lengths, 64)
        return {"response/length/hist": Histogram(edges, counts.astype(float))}

    run = logged_run(tmp_path, 10, lambda step: {"critic/score/mean": 0.5}, hist)
    fig = histograms_figure(run, ["response/length/hist"])
    ax = fig.axes[0]
    (mesh,) = ax.collections
    grid = mesh.get_array()
    assert grid.shape == (7, 10)  # rows: the lengths 1..7; columns: the steps
    assert mesh.get_coordinates()[:, 0, 1].tolist() == [0.5 + k for k in range(8)]  # integer-centred rows
    assert (~np.ma.getmaskarray(grid)).sum(axis=1).min() >= 5  # no empty row between the values
    assert ax.get_ylabel() == "tokens"
    assert plot_histograms(run, ["response/length/hist"], tmp_path / "h.png").stat().st_size > 10_000


def test_plot_without_a_match_fails_clearly(run_dir, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlmetrics",
            "plot",
            str(run_dir),
            "-m",
            "nope/*",
            "-o",
            str(tmp_path / "x.png"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "no metric matches" in out.stderr
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("keys", ["core,critic/**", ","])
def test_demo_refuses_keys_that_mix_words_and_globs_before_any_file(tmp_path, keys):
    args = ["--backend", "local", "--simulate", "--keys", keys, "--out", str(tmp_path / "run")]
    out = subprocess.run([*DEMO, *args], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0 and f"--keys {keys!r}: 'all', 'core' or comma-separated globs" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--steps", "0"], "--steps 0: must be >= 1"),
        (["--pace", "-1"], "--pace -1.0: must be >= 0"),
        (["--val-every", "-1"], "--val-every -1: must be >= 0"),
        (["--sinks", "jsonl,foo"], "--sinks foo: not a tracker; choose from jsonl, console"),
        (["--address", "auto"], "--address is for --backend ray"),
    ],
)
def test_the_demo_refuses_a_bad_option_in_one_line_before_it_starts(tmp_path, args, says):
    cmd = [*DEMO, "--simulate", "--backend", "local", "--out", str(tmp_path / "run"), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 1 and out.stderr.startswith(f"python -m examples.grpo: {says}")
    assert len(out.stderr.splitlines()) == 1 and out.stdout == "" and not (tmp_path / "run").exists()


@pytest.mark.timeout(90)  # the read's deadline is 120 s: the error comes within a second of the rank's
def test_a_rank_that_fails_stops_the_demo_with_its_error(tmp_path, monkeypatch):
    from examples.grpo import demo

    run = demo.DemoRank.run

    def fails_on_rank_1(self, *args):
        if self.rank == 1:
            raise RuntimeError("rank 1 broke")
        return run(self, *args)

    monkeypatch.setattr(demo.DemoRank, "run", fails_on_rank_1)
    args = ["--simulate", "--backend", "local", "--steps", "3", "--workers", "2", "--pace", "0"]
    with pytest.raises(RuntimeError, match="rank 1 broke"):
        demo_main([*args, "--sinks", "jsonl", "--out", str(tmp_path)])


def test_rlmetrics_demo_says_where_the_demo_went():
    out = subprocess.run([sys.executable, "-m", "rlmetrics", "demo"], capture_output=True, text=True)
    assert out.returncode == 2 and "make demo" in out.stderr and "python -m examples.grpo" in out.stderr


@pytest.mark.ray
@pytest.mark.timeout(900)  # 50 real steps: over 300 s on a 2-core machine under heavy load
def test_demo_as_make_demo_runs_it(tmp_path):
    """``make demo``'s run with its defaults (tests/test_demo_grpo.py checks its numbers): it announces
    every phase, raises no alert, and its reward curve lies where README.md and docs/demo.md say
    (the ranges of seeds 0-4; the exact values depend on the machine's CPU kernels)."""
    from rlmetrics.sinks import read_jsonl

    out = subprocess.run([*DEMO, "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    phases = ("starting Ray...", "starting the aggregator and 4 ranks", "4 ranks ready in ",
              "closing the sinks and stopping Ray...", "writing the plots...", "metrics: ", "tensorboard: ",
              "plots: ", "time: ")  # fmt: skip
    lines = out.stdout.splitlines()
    at = [next(i for i, line in enumerate(lines) if line.startswith(p)) for p in phases]
    assert at == sorted(at), out.stdout
    assert "health alert" not in out.stderr
    run = read_jsonl(tmp_path / "metrics.jsonl")
    assert run.steps == list(range(50)) and not run.events
    score = run.series("critic/score/mean")[1]
    assert 19 <= np.argmax(score >= 0.2) <= 26, score.round(3).tolist()  # the first step at 0.2
    assert 0.35 <= score[49] <= 0.47, score.round(3).tolist()
    assert all((tmp_path / f"{name}.png").stat().st_size > 10_000 for name in PLOTS)


@pytest.mark.ray
def test_demo_joins_an_existing_cluster(tmp_path, ray_session):
    """``--address``: the demo joins the pytest worker's running Ray instead of starting one."""
    address = ray_session.get_runtime_context().gcs_address
    args = ["--simulate", "--address", address, "--steps", "3", "--workers", "2",
            "--val-every", "0", "--sinks", "jsonl", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run([*DEMO, *args], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    from rlmetrics.sinks import read_jsonl

    run = read_jsonl(tmp_path / "metrics.jsonl")
    assert run.steps == [0, 1, 2] and not (tmp_path / "tensorboard").exists()
    assert not any(name.startswith("val-") for name in run.names())


def test_the_benchmark_runner_runs_a_named_benchmark():
    """``python benchmarks/run.py NAME`` from a checkout (the benchmarks do not ship with the package)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    cmd = [sys.executable, "benchmarks/run.py", "merge", "--quick"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env).stdout
    assert "## bench_merge" in out and "|" in out


def test_plot_never_turns_a_metric_name_into_a_path(tmp_path):
    from rlmetrics.sinks import JsonlSink

    run_dir = tmp_path / "runs" / "evil"
    with JsonlSink(run_dir / "metrics.jsonl") as sink:
        for step in range(3):
            sink.log({"../../escape": float(step), "/abs/x": 2.0 * step}, step)
    cwd = tmp_path / "a" / "b"  # where "../../escape" would land: inside tmp_path, seen below
    cwd.mkdir(parents=True)
    before = {p for p in tmp_path.rglob("*")}
    rlmetrics_cli("plot", str(run_dir), "-m", "*", "-o", str(tmp_path / "out.png"), cwd=cwd)
    assert {p for p in tmp_path.rglob("*")} - before == {tmp_path / "out.png"}
