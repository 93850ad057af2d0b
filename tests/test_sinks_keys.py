"""The key budget and the core view (rlmetrics.sinks.keys, make_sinks(keys=, core=, overview=)):
each tracker's own reader (tests/trackers.py) finds the overview section holding exactly the core
keys with the same values, keys="core" and glob lists filter what the trackers get while
metrics.jsonl keeps every key, a resumed run's catch-up gives every kept key, the W&B limit warnings
fire once at counts computed here, and a bad keys= is refused. The tests that open W&B, MLflow or
SwanLab are marked slow; the rest is pure logic."""

import logging

import pytest

from rlmetrics.messages import StepResult
from rlmetrics.sinks import CORE_KEYS, KeyLimits, KeyView, Sink, Tracking, make_sinks, read_jsonl
from rlmetrics.sinks import TRACKERS as SINK_CLASSES
from rlmetrics.sinks.keys import Limits
from tests.trackers import read_swanlab, read_tensorboard, read_wandb

CORE = [  # the core keys of a verl-like step, picked out by hand from CORE_KEYS' description
    "critic/score/mean", "critic/rewards/mean", "response_length/mean", "actor/ppo_kl", "actor/entropy",
    "actor/grad_norm", "perf/throughput", "val-core/math/acc/mean@4",
]  # fmt: skip
OTHER = [
    "critic/score/max", "critic/vf_explained_var", "timing_s/gen", "actor/pg_loss", "actor/entropy/std",
    "val-core/math/acc/best@4/mean", "val-aux/math/acc/mean@2", "response_length/max",
]  # fmt: skip
MLFLOW = {  # MLflow's '@' rule, by hand
    "val-core/math/acc/mean@4": "val-core/math/acc/mean_at_4",
    "val-core/math/acc/best@4/mean": "val-core/math/acc/best_at_4/mean",
    "val-aux/math/acc/mean@2": "val-aux/math/acc/mean_at_2",
}
TRACKERS = ["tensorboard", "wandb", "mlflow", "swanlab"]


def step_values(step):
    """Values exact in float32 (TensorBoard's simple_value), distinct per key and step."""
    return {name: step + i / 8 for i, name in enumerate(CORE + OTHER)}


def mlflow_name(name):
    prefix = "overview/" if name.startswith("overview/") else ""
    key = name.removeprefix(prefix)
    return prefix + MLFLOW.get(key, key)


def tracker_series(out, tracker, run_id=None):
    """{name as logged: {step: value}} of one tracker's files, read with its own reader."""
    if tracker == "tensorboard":
        return read_tensorboard(out / "tensorboard")
    if tracker == "swanlab":
        runs = sorted(out.glob("swanlab/run-*/run-*.swanlab"))
        got: dict = {}
        for run in runs:
            for name, series in read_swanlab(run).items():
                got.setdefault(name, {}).update(series)
        return got
    if tracker == "wandb":
        got = {}
        for run in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):
            for step, row in read_wandb(run).items():
                for name, value in row.items():
                    if not name.startswith("_"):
                        got.setdefault(name, {})[step] = value
        return got
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    back = {mlflow_name(n): n for n in [*CORE, *OTHER, *("overview/" + c for c in CORE)]}
    return {  # keyed by the name logged (MLflow's own name mapped back by hand)
        back.get(n, n): {m.step: m.value for m in client.get_metric_history(run_id, n)}
        for n in client.get_run(run_id).data.metrics
    }


def run(out, names, steps, **kw):
    with make_sinks(names, out, project="rlmetrics-test", health=None, **kw) as tracking:
        for step in steps:
            tracking.log(step_values(step), step)
        assert not tracking.failed
        return {n: s.run_id for n, s in zip(names, tracking.sinks)}


def check(out, steps, want, run_id):
    """Every tracker holds exactly ``want`` (names; an overview/ name holds its key's values) at
    ``steps``; metrics.jsonl every key at every step, no copies."""
    for tracker in TRACKERS:
        got = tracker_series(out, tracker, run_id)
        assert set(got) == set(want), tracker
        for name in want:
            key = name.removeprefix("overview/")
            assert got[name] == {s: step_values(s)[key] for s in steps}, (tracker, name)
    journal = read_jsonl(out / "metrics.jsonl")
    for name in CORE + OTHER:
        assert journal.series(name)[1].tolist() == [step_values(s)[name] for s in steps]
    assert not [n for r in journal.records for n in r["metrics"] if n.startswith("overview/")]


# ------------------------------------------------------------------- trackers (slow: W&B, MLflow, SwanLab)
@pytest.mark.slow
@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({}, CORE + OTHER),  # the default: today's keys, no copies
        ({"overview": True}, CORE + OTHER + ["overview/" + c for c in CORE]),
        ({"keys": "core"}, CORE),
        (
            {"keys": ["critic/**", "actor/grad_norm"]},
            [
                "critic/score/mean",
                "critic/rewards/mean",
                "critic/score/max",
                "critic/vf_explained_var",
                "actor/grad_norm",
            ]
            + ["overview/" + c for c in CORE],
        ),  # fmt: skip
        ({"keys": ["timing_s/*"], "overview": False}, ["timing_s/gen"]),
    ],
    ids=["all", "all+overview", "core", "globs", "globs-no-overview"],
)
def test_trackers_get_the_view_and_jsonl_every_key(tmp_path, monkeypatch, kw, want):
    monkeypatch.setenv("WANDB_SILENT", "true")
    ids = run(tmp_path, ["jsonl", *TRACKERS], range(3), **kw)
    check(tmp_path, range(3), want, ids["mlflow"])


@pytest.mark.slow
def test_resume_catches_the_trackers_up_with_every_kept_key(tmp_path, monkeypatch):
    """Steps 0-1 reach every tracker, 2-3 only metrics.jsonl (the trackers lag, as after a crash),
    then a resume with keys= catches them up from the JSONL file through the same view."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    keys = ["critic/**", "val-*/**"]
    ids = run(tmp_path, ["jsonl", *TRACKERS], range(2), keys=keys)
    run(tmp_path, ["jsonl"], range(2, 4), resume=True, keys=keys)
    run(tmp_path, ["jsonl", *TRACKERS], range(4, 5), resume=True, keys=keys)
    kept = [n for n in CORE + OTHER if n.startswith(("critic/", "val-"))]
    check(tmp_path, range(5), kept + ["overview/" + c for c in CORE], ids["mlflow"])


# ---------------------------------------------------------------------------------------- pure logic
class Recorder(Sink):
    tracker = "recorder"

    def __init__(self, tracker=None):
        if tracker:  # stands in for that tracker's sink: its name and which keys it gets
            self.tracker = tracker
            self.all_keys = SINK_CLASSES[tracker].all_keys
            self.overview_copies = SINK_CLASSES[tracker].overview_copies
        self.steps, self.axes = [], []

    def log(self, metrics, step):
        self.steps.append((step, dict(metrics), dict(getattr(metrics, "histograms", {}) or {})))

    def log_axis(self, metrics, step, axis):
        self.axes.append((axis, step, dict(metrics)))

    def close(self):
        pass


@pytest.mark.parametrize(
    ("keys", "said"),
    [
        ("cor", "'cor'"),
        ("critic/*", "'critic/*'"),
        ([], "[]"),
        (["a", ""], "['a', '']"),
        (3, "3"),
        (None, "None"),
    ],
)
def test_bad_keys_are_refused_before_any_file(tmp_path, keys, said):
    with pytest.raises(ValueError) as err:
        make_sinks(["jsonl"], tmp_path / "run", keys=keys)
    message = str(err.value)
    assert (
        f"keys={said}" in message
        and "'all'" in message
        and "'core'" in message
        and "list of globs" in message
    )
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="core="):
        make_sinks(["jsonl"], tmp_path / "run", core=[""])
    with pytest.raises(ValueError, match=r"core='my/metric': a list of globs, e\.g\. core=\(\*CORE_KEYS"):
        make_sinks(["jsonl"], tmp_path / "run", core="my/metric")  # not one glob per character


def test_keys_may_be_any_iterable_of_globs(tmp_path):
    with make_sinks(["jsonl"], tmp_path, keys=(g for g in ["critic/**"])) as tracking:
        assert tracking.view.globs == ("critic/**",)


def test_globs():
    """One dialect (rlmetrics.globs, fnmatch's): ``*``, ``**`` any characters, '/' too; ``?`` one."""
    view = KeyView(["critic/*", "val-core/**/mean@*", "actor/entropy?", "x/[ab]"])
    names = [
        "critic/score/mean",
        "critic/a/b/mean",
        "val-core/x/acc/mean@4",
        "actor/entropy2",
        "x/b",
        "actor/entropy",
        "critic",
        "val-core/x/best@4/mean",
        "x/[ab]",
    ]
    assert list(view(dict.fromkeys(names, 1.0))) == names[:5]
    assert view.unmatched() == []
    assert KeyView(["critic.score"])({"criticXscore": 1.0}) == {}  # '.' is literal


def test_core_keys_match_the_built_in_names():
    """Each default glob names a key our metric functions or verl's actor produce; the core set
    keeps the headline, not its relatives."""
    view = KeyView("core")
    assert set(view(dict.fromkeys(CORE + OTHER, 0.0))) == set(CORE)
    assert set(view({"response/length/mean": 1.0, "val-core/gsm8k/reward:drop/mean@8": 1.0})) == {
        "response/length/mean", "val-core/gsm8k/reward:drop/mean@8"
    }  # fmt: skip
    verl_sources = {
        "val-core/openai/gsm8k/reward/mean@1": 1.0,
        "val-core/HuggingFaceH4/MATH-500/acc/mean@4": 1.0,
    }
    assert set(view(verl_sources)) == set(verl_sources)  # verl's data sources hold a '/'
    assert view({"val-core/openai/gsm8k/reward/best@4/mean": 1.0}) == {}
    assert len(CORE_KEYS) == 11


def test_histograms_lists_and_axes_follow_the_view():
    sink, journal = Recorder("tensorboard"), Recorder("jsonl")
    tracking = Tracking([sink, journal], health=None, keys=["critic/**"], overview=True)
    result = StepResult(
        {"critic/score/mean": 1.0, "x": 2.0}, 0, histograms={"critic/score/hist": "h", "x/hist": "h"},
        lists={"perf/straggler/gen/slowest": ["r3"]},
    )  # fmt: skip
    tracking.log(result, 0)
    tracking.log_axis({"critic/score/mean": 3.0, "x": 4.0}, 7, "policy_version")
    assert sink.steps == [
        (0, {"critic/score/mean": 1.0, "overview/critic/score/mean": 1.0}, {"critic/score/hist": "h"})
    ]
    assert sink.axes == [("policy_version", 7, {"critic/score/mean": 3.0})]  # no copies on other axes
    assert set(journal.steps[0][1]) == {"critic/score/mean", "x", "meta/coverage", "meta/late"}  # no copy
    assert len(journal.steps[0][2]) == 2


def test_an_unmatched_glob_warns_once_at_close(caplog):
    tracking = Tracking([Recorder()], health=None, keys=["critic/**", "critc/score/*"])
    with caplog.at_level("WARNING", logger="rlmetrics.sinks"):
        for step in range(3):
            tracking.log(step_values(step), step)
        tracking.close()
        tracking.close()
    (message,) = [r.getMessage() for r in caplog.records]
    assert "'critc/score/*'" in message and "matched no key" in message
    assert "did you mean 'critic/score/*' (2 metrics)?" in message


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_w_and_b_key_limit_warns_once_at_80_percent(caplog):
    """W&B's guidance: 100,000 keys per project; 80 % is 80,000 distinct keys."""
    now = [0.0]
    clock = lambda: now.__setitem__(0, now[0] + 61.0) or now[0]  # noqa: E731 - a minute per step: no rate warning
    tracking = Tracking([Recorder("wandb"), Recorder()], health=None, clock=clock)
    with caplog.at_level("WARNING", logger="rlmetrics.sinks.keys"):
        tracking.log({f"k/{i}": 0.0 for i in range(79_999)}, 0)
        assert warnings_of(caplog) == []
        tracking.log({"k/0": 0.0, "k/79999": 0.0}, 1)  # the 80,000th distinct key
        tracking.log({"k/80000": 0.0, "k/80001": 0.0}, 2)
    (message,) = warnings_of(caplog)
    assert "80000 distinct keys" in message and "100000" in message and "keys='core'" in message


def test_w_and_b_rate_warns_once_over_80_percent_in_a_sliding_minute(caplog):
    """100,000 values per minute; more than 80,000 in the last 60 s warns. The clock is injected."""
    now = [0.0]
    tracking = Tracking([Recorder("wandb")], health=None, clock=lambda: now[0])
    names = {f"k/{i}": 0.0 for i in range(40_000)}
    with caplog.at_level("WARNING", logger="rlmetrics.sinks.keys"):
        for t, values in [(0.0, names), (30.0, names), (60.0, {"a": 0.0})]:  # t=0 leaves the window at 60
            now[0] = t
            tracking.log(values, int(t))
        assert warnings_of(caplog) == []  # 80,000 then 40,001: never over 80,000
        now[0] = 70.0
        tracking.log(names, 70)  # 40,000 + 1 + 40,000 = 80,001 in (10 s, 70 s]
        now[0] = 71.0
        tracking.log(names, 71)
    (message,) = warnings_of(caplog)
    assert "80001 values in the last 60 s" in message and "100000 per minute" in message


def test_histogram_points_warn_once_per_metric_at_the_limit(caplog):
    watch = KeyLimits("wandb", Limits(keys=10**9, values_per_minute=10**9, histogram_points=50, source="t"))
    with caplog.at_level("WARNING", logger="rlmetrics.sinks.keys"):
        for step in range(60):
            hists = {"a/hist": "h"} if step < 49 else {"a/hist": "h", "b/hist": "h"}
            watch.observe(StepResult({}, step, histograms=hists))
            assert len(warnings_of(caplog)) == (step >= 49)  # a/hist's 50th histogram, at step 49
    (message,) = warnings_of(caplog)
    assert "'a/hist' logged 50 times" in message and watch.warned == ["histogram:a/hist"]
    assert watch.limits.histogram_points == 50 and KeyLimits("wandb").limits.histogram_points == 10_000
