"""``rlmetrics.integrations.verl.Tracking`` against verl 0.9.1's ``verl.utils.tracking.Tracking``: the same
calls with verl's variables set (each its own folders), read back with verl's format and each tracker's
own reader (tests/trackers.py), the same lines and values per step; and a trainer restarted from a
checkpoint, where verl's file backend truncates and its TensorBoard run doubles the replayed steps, and
ours holds every step once."""

import numpy as np
import pytest

pytest.importorskip("verl.utils.tracking")
pytest.importorskip("tensorboard")
torch = pytest.importorskip("torch")

from verl.utils.tracking import Tracking as VerlTracking  # noqa: E402

from rlmetrics.integrations.verl import Tracking  # noqa: E402
from rlmetrics.integrations.verl.tracking import sink_names  # noqa: E402
from rlmetrics.sinks import read_jsonl  # noqa: E402
from tests.trackers import read_tensorboard, tensorboard_steps  # noqa: E402

pytestmark = pytest.mark.torch


def step_data(step, session=0):
    """What a verl trainer logs: floats, ints and numpy scalars under verl's names."""
    return {
        "critic/score/mean": 0.25 * step + 100 * session,
        "actor/pg_loss": np.float32(-0.5 * step),
        "response_length/mean": np.float64(10 + step),
        "training/global_step": step,
        "val-core/gsm8k/acc/mean@4": 1 / (step + 3),
    }


@pytest.fixture
def verl_env(tmp_path, monkeypatch):
    """The working directory tmp_path (verl's defaults are relative to it); ``env(who)`` sets verl's
    variables to send the file backend and TensorBoard under ``tmp_path/<who>``."""
    monkeypatch.chdir(tmp_path)

    def env(who):
        (tmp_path / who).mkdir(exist_ok=True)
        monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / who / "tb"))
        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / who / "run.jsonl"))

    return tmp_path, env


def run(cls, steps, session=0, **kw):
    tracking = cls("proj", "exp", default_backend=["console", "file", "tensorboard"], **kw)
    for step in steps:
        tracking.log(data=step_data(step, session), step=step)
    tracking.finish()


def verl_file(path):
    """verl's file backend: one ``{"step": s, "data": {...}}`` per line."""
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


def test_same_files_and_values_as_verl_with_its_variables_set(verl_env, capsys):
    """verl's variables honoured (before, ours warned that it ignored them): the file backend writes
    verl's format at ``VERL_FILE_LOGGER_PATH`` (the same lines as verl's), TensorBoard writes in
    ``TENSORBOARD_DIR`` (the same values), and ``read_jsonl`` (``rlmetrics report``) reads verl's file."""
    root, env = verl_env
    env("verl")
    run(VerlTracking, range(1, 4))
    env("ours")
    run(Tracking, range(1, 4), out_dir=root / "ours" / "folder")
    printed = capsys.readouterr().out
    assert "critic/score/mean" in printed  # both consoles printed the steps

    theirs, mine = verl_file(root / "verl" / "run.jsonl"), verl_file(root / "ours" / "run.jsonl")
    assert [r["step"] for r in mine] == [r["step"] for r in theirs] == [1, 2, 3]
    for a, b in zip(mine, theirs):
        assert a.keys() == b.keys() == {"step", "data"} and a["data"] == pytest.approx(b["data"], rel=1e-7)
    journal = read_jsonl(root / "ours" / "folder" / "metrics.jsonl")
    read_back = read_jsonl(root / "verl" / "run.jsonl")  # verl's own file, as rlmetrics report reads it
    for name in step_data(0):
        assert read_back.series(name)[1] == pytest.approx(journal.series(name)[1], rel=1e-7)

    tb_theirs, tb_mine = read_tensorboard(root / "verl" / "tb"), read_tensorboard(root / "ours" / "tb")
    assert tb_mine.keys() == tb_theirs.keys() == step_data(0).keys()
    for tag in tb_theirs:
        assert tb_mine[tag] == pytest.approx(tb_theirs[tag], rel=1e-6)


def test_restart_from_checkpoint_logs_each_step_once(verl_env):
    """Session 0 logs steps 1-5 and dies; the trainer resumes from its step-3 checkpoint and logs 4-7."""
    root, env = verl_env
    ours_dir = root / "ours" / "folder"
    for session, steps in enumerate([range(1, 6), range(4, 8)]):
        env("verl")
        run(VerlTracking, steps, session)
        env("ours")
        run(Tracking, steps, session, out_dir=ours_dir)

    # verl: the file backend reopened its file with "wb": steps 1-3 are gone
    assert [r["step"] for r in verl_file(root / "verl" / "run.jsonl")] == [4, 5, 6, 7]
    # verl: a second event file in the same folder, steps 4 and 5 twice in the run
    steps = tensorboard_steps(root / "verl" / "tb")["critic/score/mean"]  # files read in name order
    assert sorted(steps) == [1, 2, 3, 4, 4, 5, 5, 6, 7]

    # ours: every step once; the replayed 4 and 5 are skipped (the first session's values stay), in
    # verl's file too (appended after the steps the run held)
    assert [r["step"] for r in verl_file(root / "ours" / "run.jsonl")] == [1, 2, 3, 4, 5, 6, 7]
    run_ = read_jsonl(ours_dir / "metrics.jsonl")
    assert run_.steps == [1, 2, 3, 4, 5, 6, 7]
    steps, values = run_.series("critic/score/mean")
    assert values.tolist() == [0.25, 0.5, 0.75, 1.0, 1.25, 101.5, 101.75]
    assert read_jsonl(root / "ours" / "run.jsonl").series("critic/score/mean")[1].tolist() == values.tolist()
    assert sorted(tensorboard_steps(root / "ours" / "tb")["critic/score/mean"]) == [1, 2, 3, 4, 5, 6, 7]
    assert read_tensorboard(root / "ours" / "tb")["critic/score/mean"] == pytest.approx(
        dict(zip(steps.tolist(), values.tolist()))
    )


def test_torch_scalars_and_several_calls_per_step(tmp_path):
    """A 0-d tensor is a number; a second call at the step just logged (verl's fully-async trainer logs
    timings, metrics and validation at one step) adds to the step, an older step is dropped."""
    tracking = Tracking("p", "e", ["file", "tensorboard"], out_dir=tmp_path)
    tracking.log({"timing_s/gen": torch.tensor(1.5)}, step=1)
    tracking.log({"critic/score/mean": torch.tensor(0.5, dtype=torch.float64)}, step=1)
    tracking.log({"val-core/x/acc/mean@1": 0.25}, step=1, backend=["tensorboard"])
    tracking.log({"timing_s/gen": 2.0}, step=2)
    tracking.log({"timing_s/gen": 9.0}, step=1)  # goes back: dropped
    tracking.finish()
    tracking.finish()  # once, as verl's

    run_ = read_jsonl(tmp_path / "metrics.jsonl")
    assert run_.series("timing_s/gen")[1].tolist() == [1.5, 2.0]
    assert run_.series("critic/score/mean")[1].tolist()[0] == 0.5
    assert "val-core/x/acc/mean@1" not in run_.names()  # logged to tensorboard only
    tb = read_tensorboard(tmp_path / "tensorboard")
    assert tb["timing_s/gen"] == {1: 1.5, 2: 2.0}
    assert tb["critic/score/mean"] == {1: 0.5} and tb["val-core/x/acc/mean@1"] == {1: 0.25}
    assert tensorboard_steps(tmp_path / "tensorboard")["timing_s/gen"] == [1, 2]
    with pytest.raises(ValueError, match="finished"):
        tracking.log({"a": 1.0}, step=3)


def test_backends_as_verl_takes_them(tmp_path, monkeypatch):
    """A str or a list; verl's backends without an rlmetrics sink, and unknown ones, raise naming ours
    (verl: AssertionError ``... is not supported`` for an unknown one)."""
    assert sink_names("tensorboard") == {"tensorboard": "tensorboard"}
    assert sink_names(["file", "wandb"]) == {"file": "jsonl", "wandb": "wandb"}
    assert sink_names(["trackio", "clearml"]) == {"trackio": "trackio", "clearml": "clearml"}
    for name in ("vemlp_wandb", "rl_insight"):
        with pytest.raises(ValueError, match=f"'{name}' has no rlmetrics sink; supported: console, "):
            Tracking("p", "e", name, out_dir=tmp_path / name)
    with pytest.raises(ValueError, match="unknown verl backend 'nope'"):
        Tracking("p", "e", ["file", "nope"], out_dir=tmp_path / "nope")
    with pytest.raises(AssertionError, match="nope is not supported"):
        VerlTracking("p", "e", ["file", "nope"])
    with pytest.raises(TypeError, match="config must be a mapping, a dataclass or an OmegaConf .*, not list"):
        Tracking("p", "e", "file", config=[("lr", 1e-6)], out_dir=tmp_path / "config")
    assert not list(tmp_path.iterdir())  # nothing was created

    # without out_dir: $VERL_FILE_LOGGER_ROOT/<project>/<experiment>, default the working directory
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VERL_FILE_LOGGER_ROOT", raising=False)
    Tracking("proj", "exp", "file").finish()
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "root"))
    Tracking("proj", "exp", "file").finish()
    assert (tmp_path / "proj" / "exp" / "metrics.jsonl").exists()
    assert (tmp_path / "root" / "proj" / "exp" / "metrics.jsonl").exists()


CONFIG = {  # a run config as verl's trainer passes it: OmegaConf.to_container(config, resolve=True)
    "trainer": {"total_epochs": 2, "project_name": "proj", "val_before_train": False, "wandb_proxy": None},
    "actor": {"optim": {"lr": 1e-6, "betas": [0.9, 0.999]}, "strategy": "fsdp"},
    "data": {"train_files": ["gsm8k/train.parquet"], "max_prompt_length": 512, "filter": {}},
}


@pytest.mark.slow
def test_trackers_same_as_verl(verl_env, monkeypatch):
    """W&B, MLflow and SwanLab, verl's run offline too: the same keys and values per step, the same run
    config (SwanLab's but verl's ``FRAMEWORK`` key), the same MLflow params."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("swanlab")
    import json

    from mlflow.tracking import MlflowClient

    from tests.trackers import one, read_mlflow, read_swanlab, read_wandb, swanlab_config, wandb_config

    root, _ = verl_env
    theirs, ours = root / "verl", root / "ours"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(theirs))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{theirs / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    import wandb

    wandb.teardown()  # W&B reads WANDB_MODE once per process: an earlier test's setup would stay
    backends = ["wandb", "mlflow", "swanlab"]
    for cls, kw, where in ((VerlTracking, {}, theirs), (Tracking, {"out_dir": ours}, ours)):
        monkeypatch.setenv("SWANLAB_LOG_DIR", str(where / "swanlog"))  # honoured by both
        tracking = cls("proj", "exp", default_backend=backends, config=CONFIG, **kw)
        for step in range(1, 4):
            tracking.log(data=step_data(step), step=step)
        tracking.finish()
    names = list(step_data(0))

    wb_theirs = read_wandb(one(theirs, "wandb/offline-run-*/run-*.wandb"))
    wb_mine = read_wandb(one(ours, "wandb/offline-run-*/run-*.wandb"))
    assert wandb_config(one(ours, "wandb/offline-run-*/run-*.wandb")) == CONFIG
    assert wandb_config(one(theirs, "wandb/offline-run-*/run-*.wandb")) == CONFIG
    assert sorted(wb_mine) == sorted(wb_theirs) == [1, 2, 3]
    for step in wb_theirs:
        mine = {k: v for k, v in wb_mine[step].items() if not k.startswith("_")}
        assert mine == pytest.approx({k: v for k, v in wb_theirs[step].items() if not k.startswith("_")})
        assert sorted(mine) == sorted(names)

    uri_theirs = uri_mine = f"sqlite:///{theirs / 'mlflow.db'}"  # MLFLOW_TRACKING_URI: both runs there
    run_mine = json.loads((ours / "run_ids.json").read_text())["mlflow"]
    assert not (ours / "mlflow.db").exists()
    (run_theirs,) = [
        run
        for run in MlflowClient(uri_theirs).search_runs(
            [MlflowClient(uri_theirs).get_experiment_by_name("proj").experiment_id]
        )
        if run.info.run_id != run_mine
    ]
    keys_theirs = sorted(run_theirs.data.metrics)
    keys_mine = sorted(MlflowClient(uri_mine).get_run(run_mine).data.metrics)
    assert keys_mine == keys_theirs and "val-core/gsm8k/acc/mean_at_4" in keys_mine
    params = MlflowClient(uri_mine).get_run(run_mine).data.params
    assert params == run_theirs.data.params  # verl's flattening: "/", list_len, an empty dict left out
    assert params["actor/optim/betas/list_len"] == "2" and params["actor/optim/lr"] == "1e-06"
    assert params["trainer/wandb_proxy"] == "None" and "data/filter" not in params
    for key in keys_theirs:
        expected = read_mlflow(uri_theirs, run_theirs.info.run_id, key)
        assert read_mlflow(uri_mine, run_mine, key) == pytest.approx(expected)

    sw_theirs = read_swanlab(one(theirs, "swanlog/run-*/run-*.swanlab"))
    sw_mine = read_swanlab(one(ours, "swanlog/run-*/run-*.swanlab"))
    assert swanlab_config(one(ours, "swanlog/run-*/run-*.swanlab")) == CONFIG
    assert swanlab_config(one(theirs, "swanlog/run-*/run-*.swanlab")) == {"FRAMEWORK": "verl", **CONFIG}
    assert sorted(sw_mine) == sorted(sw_theirs) == sorted(names)
    for key in sw_theirs:
        assert sw_mine[key] == pytest.approx(sw_theirs[key])


def test_resume_follows_the_trainers_resume_mode(tmp_path, caplog):
    """verl's ``trainer.resume_mode: disable`` starts again from step 0: its folder is refused, not
    resumed (resuming would skip its steps)."""
    run(Tracking, range(1, 3), out_dir=tmp_path)
    with caplog.at_level("WARNING"):
        Tracking(
            "proj", "exp", "file", config={"trainer": {"resume_mode": "auto"}}, out_dir=tmp_path
        ).finish()
    assert "steps up to 2 are not written again" in caplog.text
    with pytest.raises(FileExistsError, match="holds a run"):
        Tracking("proj", "exp", "file", config={"trainer": {"resume_mode": "disable"}}, out_dir=tmp_path)
    disable = {"trainer": {"resume_mode": "disable"}}
    Tracking("proj", "exp", "file", config=disable, out_dir=tmp_path, overwrite=True).finish()
    assert read_jsonl(tmp_path / "metrics.jsonl").steps == []
