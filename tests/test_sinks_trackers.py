"""Each tracker sink logs 10 steps offline; the values are read back with the tracker's own format
(tests/trackers.py: TensorBoard's EventAccumulator, the W&B transaction log parsed with wandb's
protobufs, MLflow's client on a sqlite store, SwanLab's own DataStoreReader) and compared with the
random numbers sent."""

import math
import os
from pathlib import Path

import numpy as np
import pytest

from rlmetrics.core.histogram import Histogram
from rlmetrics.core.stat import Stat
from rlmetrics.messages import StepResult
from rlmetrics.sinks import (
    JsonlSink,
    MLflowSink,
    SwanLabSink,
    TensorBoardSink,
    WandbSink,
    make_sinks,
    read_jsonl,
)
from tests.trackers import (
    one,
    read_mlflow,
    read_swanlab,
    read_tensorboard,
    read_wandb,
    tensorboard_accumulator,
)

pytestmark = pytest.mark.slow

# name -> the name each tracker shows (written out by hand, independent of adapt_name)
NAMES = {
    "critic/score/mean": {},
    "val-core/math/acc/mean@4": {"mlflow": "val-core/math/acc/mean_at_4"},
    "pass@k": {"mlflow": "pass_at_k"},
    "perf/throughput": {},
    "_step": {"wandb": "metric_step"},
}


def shown(name, tracker):
    return NAMES[name].get(tracker, name)


def random_steps(seed, n=10):
    rng = np.random.default_rng(seed)
    steps = {s: {name: float(rng.normal() * 10.0 ** rng.integers(-4, 5)) for name in NAMES} for s in range(n)}
    steps[4]["critic/score/mean"] = math.nan  # a diverging step stays visible
    return steps


def same(a, b, rel=0.0):
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=rel, abs=0)


# ---------------------------------------------------------------------------------- per tracker
def test_tensorboard(tmp_path):
    steps = random_steps(10)
    with TensorBoardSink(tmp_path / "tb") as sink:
        for step, metrics in steps.items():
            sink.log(metrics, step)
    got = read_tensorboard(tmp_path / "tb")
    assert set(got) == {shown(n, "tensorboard") for n in NAMES}
    for name in NAMES:
        series = got[shown(name, "tensorboard")]
        assert sorted(series) == list(range(10))
        for step, metrics in steps.items():  # float32 on disk (simple_value)
            assert same(series[step], float(np.float32(metrics[name])))


def test_make_sinks_honours_wandb_mode(tmp_path, monkeypatch):
    """``WANDB_MODE`` is where W&B users say how a run goes (online on a team's machines): the run
    folder's W&B run takes it. ``disabled``: no W&B files, the run goes on, and it resumes."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    for resume in (False, True):
        with make_sinks(["jsonl", "wandb"], tmp_path, health=None, resume=resume) as tracking:
            tracking.log({"x": 1.0}, int(resume))
            assert tracking.sinks[1].mode == "disabled" and not tracking.failed
    assert not (tmp_path / "wandb").exists() and read_jsonl(tmp_path / "metrics.jsonl").steps == [0, 1]
    import wandb

    wandb.teardown()  # W&B reads WANDB_MODE once per process: the next test's runs must not inherit it


def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    steps = random_steps(11)
    with WandbSink(project="rlmetrics-test", name="t", dir=tmp_path) as sink:
        for step, metrics in steps.items():
            sink.log(metrics, step)
    history = read_wandb(one(tmp_path, "wandb/offline-run-*/run-*.wandb"))
    assert sorted(history) == list(range(10))
    for step, metrics in steps.items():
        row = history[step]
        assert row["_step"] == step  # W&B's own step, not overwritten by the metric "_step"
        for name, value in metrics.items():
            assert same(float(row[shown(name, "wandb")]), value)


def test_mlflow_sqlite(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    steps = random_steps(12)
    with MLflowSink(uri, experiment="rlmetrics-test", run_name="t") as sink:
        for step, metrics in steps.items():
            sink.log(metrics, step)
        sink.log({"x": math.inf}, 10)
    from mlflow.tracking import MlflowClient

    run = MlflowClient(uri).get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "t"
    assert set(run.data.metrics) == {shown(n, "mlflow") for n in NAMES} | {"x"}
    for name in NAMES:
        series = read_mlflow(uri, sink.run_id, shown(name, "mlflow"))
        assert sorted(series) == list(range(10))
        for step, metrics in steps.items():
            assert same(series[step], metrics[name])
    assert read_mlflow(uri, sink.run_id, "x") == {10: 1.7976931348623157e308}  # MLflow clips infinities
    with MLflowSink(uri, experiment="rlmetrics-test") as second:  # the experiment is reused
        assert second.run_id != sink.run_id


def test_swanlab_offline(tmp_path):
    steps = random_steps(13)
    with SwanLabSink(project="rlmetrics-test", logdir=tmp_path / "sw") as sink:
        for step, metrics in steps.items():
            sink.log(metrics, step)
    got = read_swanlab(one(tmp_path, "sw/run-*/run-*.swanlab"))
    assert set(got) == {shown(n, "swanlab") for n in NAMES}
    for name in NAMES:
        series = got[shown(name, "swanlab")]
        assert sorted(series) == list(range(10))
        for step, metrics in steps.items():
            assert same(series[step], metrics[name])


# ------------------------------------------------------------------------------------- safety
UNSAFE = {
    "../../escape": "__/__/escape",
    "/abs/x": "abs/x",
    "a/../../b": "a/__/__/b",
    "ü" * 600 + "/λ@k": None,  # long: adapted per tracker
}


def test_metric_names_never_become_paths(tmp_path):
    root = tmp_path / "root"
    out = root / "deep" / "out"
    out.mkdir(parents=True)
    values = {name: float(i) + 0.5 for i, name in enumerate(UNSAFE)}
    with JsonlSink(out / "m.jsonl") as jsonl, TensorBoardSink(out / "tb") as tb:
        with SwanLabSink(project="rlmetrics-test", logdir=out / "sw") as sw:
            for sink in (jsonl, tb, sw):
                sink.log(values, 0)
    outside = [
        Path(d, f) for d, _, files in os.walk(root) for f in files if not Path(d, f).is_relative_to(out)
    ]
    assert outside == [] and not (tmp_path / "escape").exists() and not Path("/abs/x").exists()
    assert set(os.listdir(out)) == {"m.jsonl", "tb", "sw"}

    run = read_jsonl(out / "m.jsonl")
    assert {n: run.series(n)[1][0] for n in UNSAFE} == values
    tb_got = read_tensorboard(out / "tb")
    sw_got = read_swanlab(one(out, "sw/run-*/run-*.swanlab"))
    long_name = "ü" * 600 + "/λ@k"
    for name, value in values.items():
        if name == long_name:
            assert tb_got[long_name] == {0: value}  # tags have no length limit
            (key,) = [k for k in sw_got if k.startswith("ü" * 500)]
            assert len(key) <= 512 and sw_got[key] == {0: value}
        else:
            assert tb_got[UNSAFE[name]] == {0: value} and sw_got[UNSAFE[name]] == {0: value}


# ---------------------------------------------------------------------------------- make_sinks
def test_make_sinks_all_trackers_offline(tmp_path):
    out = tmp_path / "out"
    rng = np.random.default_rng(14)
    steps = [{"critic/score/mean": float(rng.normal()), "pass@k": float(rng.random())} for _ in range(3)]
    lengths = [[rng.integers(0, 500, size=40 * (r + 1)).astype(float) for r in range(3)] for _ in steps]
    names = ["jsonl", "tensorboard", "wandb", "mlflow", "swanlab"]
    with make_sinks(names, out, project="rlmetrics-test", run_name="demo") as tracking:
        for step, metrics in enumerate(steps):
            ranks = [Stat.of(x, sketch=True) for x in lengths[step]]  # three ranks' data, merged
            merged = Histogram.of(ranks[0].merge(ranks[1]).merge(ranks[2]))
            tracking.log(StepResult(metrics, step, histograms={"response/length/hist": merged}), step)
        assert not tracking.failed  # MLflow and SwanLab have no histogram type: left out, no failure
        mlflow_run = tracking.sinks[3].run_id
    want = [m["pass@k"] for m in steps]
    assert read_jsonl(out / "metrics.jsonl").series("pass@k")[1].tolist() == want
    tb = read_tensorboard(out / "tensorboard")["pass@k"]
    assert [tb[s] for s in range(3)] == [float(np.float32(v)) for v in want]
    wb = read_wandb(one(out, "wandb/offline-run-*/run-*.wandb"))
    assert [wb[s]["pass@k"] for s in range(3)] == want
    ml = read_mlflow(f"sqlite:///{out / 'mlflow.db'}", mlflow_run, "pass_at_k")
    assert [ml[s] for s in range(3)] == want
    sw = read_swanlab(one(out, "swanlab/run-*/run-*.swanlab"))["pass@k"]
    assert [sw[s] for s in range(3)] == want
    hists = read_jsonl(out / "metrics.jsonl").histograms("response/length/hist")[1]
    tb_hists = tensorboard_accumulator(out / "tensorboard").Histograms("response/length/hist")
    for step in range(3):  # numpy's histogram of the concatenated data, as each tracker's reader finds it
        counts, edges = np.histogram(np.concatenate(lengths[step]), 64)
        assert hists[step].edges.tolist() == edges.tolist() and hists[step].counts.tolist() == counts.tolist()
        tb = tb_hists[step].histogram_value
        assert list(tb.bucket) == counts.tolist() and list(tb.bucket_limit) == edges[1:].tolist()
        row = wb[step]  # W&B stores a histogram as nested keys
        assert row["response/length/hist/values"] == counts.tolist()
        assert row["response/length/hist/bins"] == edges.tolist()
    expected = {"metrics.jsonl", "tensorboard", "wandb", "mlflow.db", "swanlab"}
    assert {p.name for p in out.iterdir()} >= expected


# ------------------------------------------------------------------------------------- config
def test_make_sinks_config_in_every_tracker(tmp_path):
    """An OmegaConf config (resolved), its list long enough for two MLflow batches of params, a value
    longer than MLflow's limit: W&B's and SwanLab's run config, MLflow's params as verl flattens them."""
    omegaconf = pytest.importorskip("omegaconf")
    from mlflow.tracking import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    from tests.trackers import swanlab_config, wandb_config

    raw = {
        "optim": {"lr": 0.5, "warmup": None},
        "critic": {"lr": "${optim.lr}", "on": True},
        "ids": list(range(150)),
    }
    raw["prompt"] = "x" * (MAX_PARAM_VAL_LENGTH + 10)
    resolved = {**raw, "critic": {"lr": 0.5, "on": True}}
    names = ["jsonl", "wandb", "mlflow", "swanlab"]
    with make_sinks(names, tmp_path, project="rlmetrics-test", config=omegaconf.OmegaConf.create(raw)) as t:
        t.log({"a": 1.0}, 0)
        run_id = t.sinks[2].run_id
    assert wandb_config(one(tmp_path, "wandb/offline-run-*/run-*.wandb")) == resolved
    assert swanlab_config(one(tmp_path, "swanlab/run-*/run-*.swanlab")) == resolved
    params = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id).data.params
    assert len(params) == 4 + 151 + 1 and params["ids/list_len"] == "150" and params["ids/149"] == "149"
    assert params["critic/lr"] == "0.5" and params["critic/on"] == "True" and params["optim/warmup"] == "None"
    assert params["prompt"] == "x" * MAX_PARAM_VAL_LENGTH
    with pytest.raises(TypeError, match="not str"):
        make_sinks(names, tmp_path / "bad", config="lr=0.5")
    assert not (tmp_path / "bad").exists()


def test_run_config_of_a_dataclass():
    import dataclasses
    import enum

    class Mode(enum.Enum):
        GRPO = "grpo"

    @dataclasses.dataclass
    class Config:
        out: Path = Path("/runs/a")
        mode: Mode = Mode.GRPO
        devices: tuple = (0, 1)

    from rlmetrics.sinks.jsonl import run_config

    assert run_config(Config()) == {"out": "/runs/a", "mode": "grpo", "devices": [0, 1]}
    with pytest.raises(TypeError, match="not type"):
        run_config(Config)


def test_resumed_run_with_a_changed_config(tmp_path, caplog):
    """MLflow keeps a param's first value (params cannot change): one warning naming the key and both
    values, the new keys logged, the run goes on; W&B's and SwanLab's new session holds the new config
    (their earlier sessions set aside: the runs are rebuilt from the journal)."""
    from mlflow.tracking import MlflowClient

    from tests.trackers import swanlab_config, wandb_config

    names = ["jsonl", "wandb", "mlflow", "swanlab"]
    with make_sinks(names, tmp_path, config={"optim": {"lr": 0.1}, "seed": 1}) as tracking:
        tracking.log({"a": 1.0}, 0)
    new = {"optim": {"lr": 0.2}, "seed": 1, "epochs": 3}
    with caplog.at_level("WARNING", logger="rlmetrics.sinks.mlflow"):
        with make_sinks(names, tmp_path, resume=True, config=new) as tracking:
            tracking.log({"a": 2.0}, 1)
            assert not tracking.failed
            run_id = tracking.sinks[2].run_id
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "rlmetrics.sinks.mlflow"]
    assert "'optim/lr'" in warning and "'0.1'" in warning and "'0.2'" in warning
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id)
    assert run.data.params == {"optim/lr": "0.1", "seed": "1", "epochs": "3"}
    assert read_mlflow(f"sqlite:///{tmp_path / 'mlflow.db'}", run_id, "a") == {0: 1.0, 1: 2.0}
    wandb_files = [
        *tmp_path.glob("wandb/replaced/offline-run-*/run-*.wandb"),
        *tmp_path.glob("wandb/offline-*/*.wandb"),
    ]
    swanlab_files = [
        *tmp_path.glob("swanlab/replaced/run-*/run-*.swanlab"),
        *tmp_path.glob("swanlab/run-*/*.swanlab"),
    ]
    assert [wandb_config(f) for f in wandb_files] == [{"optim": {"lr": 0.1}, "seed": 1}, new]
    assert [swanlab_config(f) for f in swanlab_files] == [{"optim": {"lr": 0.1}, "seed": 1}, new]
