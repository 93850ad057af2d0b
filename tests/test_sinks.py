"""Sinks without a tracker: name adaptation, the console tables, Tracking fan-out, make_sinks."""

import io
import logging
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics import StepMeta, StepResult
from rlmetrics.sinks import (
    SINKS,
    TRACKERS,
    ConsoleSink,
    JsonlSink,
    NameMap,
    Sink,
    TensorBoardSink,
    Tracking,
    WandbSink,
    adapt_name,
    make_sinks,
    read_jsonl,
    render_table,
    summary_table,
)
from tests.trackers import read_tensorboard

# ------------------------------------------------------------------------------------------ names
TABLE = [
    # name, tensorboard, wandb, mlflow, swanlab
    ("val-core/math/acc/mean@4", "val-core/math/acc/mean@4", "val-core/math/acc/mean@4",
     "val-core/math/acc/mean_at_4", "val-core/math/acc/mean@4"),
    ("pass@k", "pass@k", "pass@k", "pass_at_k", "pass@k"),
    ("../../escape", "__/__/escape", "metric__/__/escape", "__/__/escape", "__/__/escape"),
    ("/abs/x", "abs/x", "abs/x", "abs/x", "abs/x"),
    ("a//b/", "a/b", "a/b", "a/b", "a/b"),
    ("_step", "_step", "metric_step", "_step", "_step"),
    (".hidden.", "_hidden_", "metric_hidden_", "_hidden_", "_hidden_"),
    ("x\ny", "x_y", "x_y", "x_y", "x_y"),
    ("acc (%)", "acc (%)", "acc (%)", "acc ___", "acc (%)"),
    ("λ/ü", "λ/ü", "λ/ü", "λ/ü", "λ/ü"),
    ("a\ud800b", "a_b", "a_b", "a_b", "a_b"),
    ("", "_", "metric_", "_", "_"),
]  # fmt: skip


@pytest.mark.parametrize("row", TABLE, ids=[repr(r[0]) for r in TABLE])
def test_adapt_name_table(row):
    name, *expected = row
    assert [adapt_name(name, t) for t in ("tensorboard", "wandb", "mlflow", "swanlab")] == expected
    assert adapt_name(name, "jsonl") == adapt_name(name, "console") == name


def test_adapt_name_long_names_stay_distinct():
    a, b = "x/" + "a" * 300 + "1", "x/" + "a" * 300 + "2"
    for tracker, limit in (("mlflow", 250), ("swanlab", 512)):
        ma, mb = adapt_name(a, tracker), adapt_name(b, tracker)
        assert len(ma) <= limit and len(mb) <= limit and ma != mb
    assert adapt_name("x" * 600, "swanlab").startswith("x" * 500)
    with pytest.raises(ValueError, match="unknown tracker"):
        adapt_name("a", "neptune")


names = st.text(st.characters(codec="utf-8"), max_size=300) | st.text("ab/.@_ -:", max_size=12)


@pytest.mark.slow  # imports the trackers
@settings(max_examples=300, deadline=None)
@given(names)
def test_adapted_names_pass_the_trackers_own_checks(name):
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_metric_name
    from swanlab.sdk.internal.run.fmt import validate_key

    try:
        _validate_metric_name(adapt_name(name, "mlflow"))
    except MlflowException as exc:  # pragma: no cover - the assertion message
        pytest.fail(f"{name!r}: {exc}")
    assert len(adapt_name(name, "mlflow")) <= 250
    swan = adapt_name(name, "swanlab")
    assert validate_key(swan) == swan  # SwanLab keeps it as is (no silent trimming)
    for tracker in ("tensorboard", "wandb", "mlflow", "swanlab"):
        adapted = adapt_name(name, tracker)
        segments = adapted.split("/")
        assert all(s and s.strip(".") for s in segments), adapted  # no empty, "." or ".." segment
        assert not re.search(r"[\x00-\x1f\x7f\ud800-\udfff]", adapted)
        adapted.encode("utf-8")
    assert not adapt_name(name, "wandb").startswith("_")


@settings(max_examples=200, deadline=None)
@given(st.lists(names, max_size=30), st.sampled_from(["tensorboard", "wandb", "mlflow", "swanlab"]))
def test_name_map_is_stable_and_never_merges_two_names(names_, tracker):
    m = NameMap(TRACKERS[tracker])
    first = {n: m(n) for n in names_}
    assert {n: m(n) for n in reversed(names_)} == first
    fold = str.lower if tracker == "wandb" else str
    assert len({fold(v) for v in first.values()}) == len(first)


def test_name_map_collision_suffix_and_warning(caplog):
    m = NameMap(WandbSink)
    with caplog.at_level(logging.WARNING, logger="rlmetrics.sinks.names"):
        assert [m("Loss"), m("loss"), m("/loss"), m("Loss")] == ["Loss", "loss__2", "loss__3", "Loss"]
    assert sum("already used" in r.getMessage() for r in caplog.records) == 2
    assert m.adapt({"loss": 1.0, "pass@k": 2.0}) == {"loss__2": 1.0, "pass@k": 2.0}


# ---------------------------------------------------------------------------------------- console
def printed(sink_out: io.StringIO) -> str:
    return sink_out.getvalue()


def test_console_sink_groups_by_prefix_and_formats_4_significant_digits():
    rng = np.random.default_rng(1)
    names = ["critic/score/mean", "critic/score/max", "response/length/mean", "perf/throughput", "loss"]
    values = {n: float(rng.normal() * 10.0 ** rng.integers(-5, 6)) for n in names}
    out = io.StringIO()
    with ConsoleSink(file=out) as sink:
        sink.log(values, 12)
    text = printed(out)
    assert "step 12" in text
    rows = [line for line in text.splitlines() if line.startswith("│")]
    cells = {r.split("│")[1].strip(): r.split("│")[2].strip() for r in rows}
    assert set(cells) == set(names)
    for name, value in values.items():
        shown = cells[name]
        assert len(re.sub(r"e[+-]\d+$", "", shown).replace("-", "").replace(".", "").lstrip("0")) <= 4
        assert float(shown) == pytest.approx(value, rel=5e-4)
    # one section per prefix: "" (loss), critic, perf, response -> 3 separators, critic rows adjacent
    assert sum(line.startswith("├") for line in text.splitlines()) == 3
    order = [r.split("│")[1].strip() for r in rows]
    assert abs(order.index("critic/score/mean") - order.index("critic/score/max")) == 1


def test_console_sink_every_max_rows_markup_and_partial_steps():
    out = io.StringIO()
    sink = ConsoleSink(every=2, file=out, max_rows=2)
    for step in range(5):
        sink.log({"[bold]x[/bold]": 1.0, "a/b": 2.0, "a/c": 3.0, "z": 4.0}, step)
    sink.log(StepResult({"a": 1.0}, 6, StepMeta(complete=False, missing_ranks=["rank1"])), 6)
    sink.close()
    text = printed(out)
    assert re.findall(r"step \d+", text) == ["step 0", "step 2", "step 4", "step 6"]
    assert "[bold]x[/bold]" in text  # not interpreted as markup
    assert text.count("… 2 more") == 3
    assert "partial step: missing ranks ['rank1']" in " ".join(text.split())
    with pytest.raises(ValueError):
        ConsoleSink(every=0)


def test_summary_table_groups_rows_by_first_column_prefix():
    from rich.console import Console

    rows = [("b/x", "1", "2"), ("a/y", "3", "4"), ("b/z", "5", "6"), ("top", "7", "8")]
    table = summary_table(rows, ["metric", "mean", "max"], title="summary")
    out = io.StringIO()
    Console(file=out, width=100).print(table)
    lines = out.getvalue().splitlines()
    order = [line.split("│")[1].strip() for line in lines if line.startswith("│")]
    assert order == ["b/x", "b/z", "a/y", "top"]
    assert sum(line.startswith("├") for line in lines) == 2
    assert table.row_count == 4 and [c.header for c in table.columns] == ["metric", "mean", "max"]
    assert render_table({"b/x": 1.0, "a/y": 0.5}, "t").row_count == 2


# --------------------------------------------------------------------------------------- tracking
class Collect(Sink):
    def __init__(self):
        self.steps, self.closed = [], False

    def log(self, metrics, step):
        self.steps.append((step, dict(metrics)))

    def close(self):
        self.closed = True


class Broken(Collect):
    calls = 0

    def log(self, metrics, step):
        self.calls += 1
        if step >= 3:
            raise OSError(f"disk gone at {step}")
        super().log(metrics, step)

    def close(self):
        raise RuntimeError("cannot close")


def test_a_sink_with_a_log_of_its_own_gets_a_step_axis_through_it_unskipped(tmp_path):
    """A sink of one's own (and a tracker's subclass) that implements ``log()`` gets a step axis's
    steps through it, under ``<axis>/``; its ``skips()`` is about train steps only, so a resumed
    sink still writes the axis's low steps (they are not train steps it held)."""

    class Resumed(Collect):
        resumed_at = 10

        def log(self, metrics, step):
            if not self.skips(step):
                super().log(metrics, step)

    class NoDebug(TensorBoardSink):
        def log(self, metrics, step):
            super().log({k: v for k, v in metrics.items() if "debug" not in k}, step)

    sink = Resumed()
    sink.log({"a": 1.0}, 3)
    sink.log_axis({"reward": 0.5}, 3, "policy_version")
    assert sink.steps == [(3, {"policy_version/reward": 0.5})]
    with NoDebug(tmp_path / "tb") as tb:
        tb.log_axis({"debug/x": 1.0, "r": 2.0}, 1, "pv")
    assert set(read_tensorboard(tmp_path / "tb")) == {"pv/r"}


def test_tracking_isolates_a_failing_sink(tmp_path, caplog):
    good, broken, jsonl = Collect(), Broken(), JsonlSink(tmp_path / "m.jsonl")
    rng = np.random.default_rng(2)
    steps = [{"a": float(rng.normal()), "b/c": float(rng.normal())} for _ in range(10)]
    with caplog.at_level(logging.ERROR, logger="rlmetrics.sinks"):
        with Tracking([good, broken, jsonl]) as tracking:
            for step, metrics in enumerate(steps):
                tracking.log(metrics, step)
            assert tracking.active == [good, jsonl] and isinstance(tracking.failed[1], OSError)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert [e for e in errors if "disk gone" in e] == [e for e in errors if "disabled" in e]
    assert len([e for e in errors if "disabled" in e]) == 1 and "Broken" in errors[0] and "at 3" in errors[0]
    assert broken.calls == 4  # never called again once disabled
    assert any("cannot close" in e for e in errors)
    assert good.steps == list(enumerate(steps)) and good.closed
    assert broken.steps == list(enumerate(steps))[:3]
    assert read_jsonl(tmp_path / "m.jsonl").series("b/c")[1].tolist() == [m["b/c"] for m in steps]
    with pytest.raises(ValueError, match="closed"):
        jsonl.log({"a": 1.0}, 11)  # closed by Tracking.close despite the failing close before it


def test_tracking_refuses_bad_values_before_any_sink():
    good = Collect()
    tracking = Tracking([good])
    with pytest.raises(TypeError, match="'a'"):
        tracking.log({"a": "oops"}, 0)
    tracking.log({"a": 1.0}, 1)
    assert good.steps == [(1, {"a": 1.0})] and not tracking.failed
    tracking.close()
    tracking.close()  # idempotent


def test_make_sinks(tmp_path):
    with pytest.raises(ValueError) as err:
        make_sinks(["jsonl", "neptune"], tmp_path)
    assert "neptune" in str(err.value) and all(name in str(err.value) for name in SINKS)
    assert set(SINKS) == {
        "jsonl",
        "console",
        "tensorboard",
        "wandb",
        "mlflow",
        "swanlab",
        "trackio",
        "clearml",
        "prometheus",
    }
    assert [type(s).__name__ for s in make_sinks(" console, ", tmp_path).sinks] == ["ConsoleSink"]
    tracking = make_sinks("jsonl,,console,jsonl".split(","), tmp_path / "out")
    assert [type(s).__name__ for s in tracking.sinks] == ["JsonlSink", "ConsoleSink"]
    tracking.sinks[1].console.file = io.StringIO()
    tracking.log({"a": 0.5}, 0)
    tracking.close()
    assert read_jsonl(tmp_path / "out" / "metrics.jsonl").records[0]["metrics"] == {"a": 0.5}


def test_import_is_light_and_missing_trackers_name_the_extra(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        import rlmetrics
        before = set(sys.modules)
        import rlmetrics.sinks as sinks
        heavy = ("torch", "rich", "tqdm", "wandb", "mlflow", "swanlab", "tensorboard")
        assert not [m for m in set(sys.modules) - before if m.split(".")[0] in heavy]
        for blocked in heavy:
            sys.modules[blocked] = None
        cases = [
            (lambda: sinks.ConsoleSink(), "console"),
            (lambda: sinks.TensorBoardSink({str(tmp_path)!r}), "tensorboard"),
            (lambda: sinks.WandbSink(dir={str(tmp_path)!r}), "trackers"),
            (lambda: sinks.MLflowSink(), "trackers"),
            (lambda: sinks.SwanLabSink(), "trackers"),
        ]
        for make, extra in cases:
            try:
                make()
            except ImportError as exc:
                assert f"pip install 'rlmetrics[{{extra}}]'" in str(exc), exc
            else:
                raise AssertionError(extra)
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
