"""JsonlSink and read_jsonl: round trip, meta, append/overwrite rules, crash tolerance, safety."""

import json
import logging
import math

import numpy as np
import pytest

from rlmetrics import StepMeta, StepResult
from rlmetrics.sinks import JsonlSink, read_jsonl

NAMES = ["critic/score/mean", "val-core/math/acc/mean@4", "perf/throughput", "pass@k"]


def random_steps(seed, n=10):
    rng = np.random.default_rng(seed)
    return {
        step: {name: float(rng.normal() * 10.0 ** rng.integers(-4, 5)) for name in NAMES} for step in range(n)
    }


def test_round_trip_random_values(tmp_path):
    steps = random_steps(0)
    path = tmp_path / "a" / "b" / "metrics.jsonl"  # parents are created
    with JsonlSink(path) as sink:
        for step, metrics in steps.items():
            sink.log(metrics, step)
    run = read_jsonl(path)
    assert run.truncated is None
    assert run.steps == list(range(10))
    assert run.names() == sorted(NAMES)
    for name in NAMES:
        s, v = run.series(name)
        assert s.tolist() == list(range(10))
        assert v.tolist() == [steps[i][name] for i in range(10)]  # exact: JSON floats round-trip
    for rec in run.records:
        assert isinstance(rec["time"], float) and abs(rec["time"] - run.records[0]["time"]) < 60
        assert "meta" not in rec


def test_non_finite_values_and_missing_metrics(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonlSink(path) as sink:
        sink.log({"x": float("nan"), "y": float("inf")}, 0)
        sink.log({"x": -math.inf}, 5)
    text = path.read_text()
    assert "NaN" in text and "Infinity" in text and "-Infinity" in text
    run = read_jsonl(path)
    steps, x = run.series("x")
    assert steps.tolist() == [0, 5] and math.isnan(x[0]) and x[1] == -math.inf
    assert run.series("y")[1][0] == math.inf and math.isnan(run.series("y")[1][1])
    assert np.isnan(run.series("never-logged")[1]).all()


def test_meta_of_a_partial_step_is_json_safe(tmp_path):
    meta = StepMeta(
        complete=False,
        missing_ranks=("rank3",),
        missing_metrics={"critic/score/mean": [3, 4]},
        contributors=[{2, 1}, np.int64(7), object()],
    )
    with JsonlSink(tmp_path / "m.jsonl") as sink:
        sink.log(StepResult({"a": 1.0}, 4, meta), 4)
        sink.log(StepResult({"a": 2.0}, 5), 5)  # a complete step: no key
        sink.log(StepResult({"a": 3.0}, 6, StepMeta(contributors=["rank0"])), 6)
    first, second, third = read_jsonl(tmp_path / "m.jsonl").records
    assert first["meta"]["complete"] is False
    assert first["meta"]["missing_ranks"] == ["rank3"]
    assert first["meta"]["missing_metrics"] == {"critic/score/mean": [3, 4]}
    ids, n, obj = first["meta"]["contributors"]
    assert ids == [1, 2] and n == 7 and obj.startswith("<object object")
    assert "meta" not in second and "meta" not in third  # a complete step: nothing to say


def test_flushed_every_step(tmp_path):
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path)
    for step in range(3):
        sink.log({"a": float(step)}, step)
        assert read_jsonl(path).steps == list(range(step + 1))  # visible before close
    sink.close()


def test_default_mode_truncates(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("old content\n")
    with JsonlSink(path) as sink:
        sink.log({"a": 1.0}, 9)
    assert read_jsonl(path).steps == [9]


def test_step_logged_twice_in_a_session(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonlSink(path) as sink:
        sink.log({"a": 1.0}, 3)
        with pytest.raises(ValueError, match=r"step 3 .*m\.jsonl"):
            sink.log({"a": 2.0}, 3)
    assert read_jsonl(path).series("a")[1].tolist() == [1.0]
    with JsonlSink(path, overwrite=True) as sink:
        sink.log({"a": 1.0}, 3)
        sink.log({"a": 2.0}, 3)
    run = read_jsonl(path)
    assert run.steps == [3, 3]
    assert run.series("a")[0].tolist() == [3] and run.series("a")[1].tolist() == [2.0]  # later wins


def test_append_refuses_steps_already_in_the_file(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonlSink(path) as sink:
        for step in range(3):
            sink.log({"a": float(step)}, step)
    with JsonlSink(path, append=True) as sink:
        with pytest.raises(ValueError) as err:
            sink.log({"a": 9.0}, 1)
        assert "step 1" in str(err.value) and str(path) in str(err.value)
        sink.log({"a": 3.0}, 3)
    assert read_jsonl(path).series("a")[1].tolist() == [0.0, 1.0, 2.0, 3.0]
    with JsonlSink(path, append=True, overwrite=True) as sink:
        sink.log({"a": 10.0}, 1)
    steps, values = read_jsonl(path).series("a")
    assert steps.tolist() == [0, 1, 2, 3] and values.tolist() == [0.0, 10.0, 2.0, 3.0]


def test_append_to_missing_file_creates_it(tmp_path):
    with JsonlSink(tmp_path / "new" / "m.jsonl", append=True) as sink:
        sink.log({"a": 1.0}, 0)
    assert read_jsonl(tmp_path / "new" / "m.jsonl").steps == [0]


def test_incomplete_last_line_is_tolerated_and_cut_on_append(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    with JsonlSink(path) as sink:
        sink.log({"a": 1.0}, 0)
        sink.log({"a": 2.0}, 1)
    full = path.read_bytes()
    path.write_bytes(full + full.splitlines(keepends=True)[1][:17])  # a crash mid-write of step 2
    with caplog.at_level(logging.WARNING, logger="rlmetrics.sinks.jsonl"):
        run = read_jsonl(path)
    assert run.steps == [0, 1]
    assert run.truncated is not None and "line 3" in run.truncated
    assert any("line 3" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    with JsonlSink(path, append=True) as sink:
        sink.log({"a": 3.0}, 2)
    run = read_jsonl(path)
    assert run.truncated is None and run.series("a")[1].tolist() == [1.0, 2.0, 3.0]


def test_last_record_without_newline_is_kept_and_append_adds_one(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0, "time": 1.0, "metrics": {"a": 1.5}}')
    assert read_jsonl(path).steps == [0]
    with JsonlSink(path, append=True) as sink:
        sink.log({"a": 2.5}, 1)
    assert read_jsonl(path).series("a")[1].tolist() == [1.5, 2.5]


@pytest.mark.parametrize(
    "bad",
    [
        "not json", '{"step": "1", "metrics": {}}', '{"step": 1}', "[1, 2]", '{"step": true, "metrics": {}}',
        '{"step": 1000000000000000000, "metrics": {"a": 1.0}}', '{"step": -1, "metrics": {"a": 1.0}}',
        '{"step": 1, "metrics": {"a": "oops"}}', '{"step": 1, "metrics": {"a": true}}',
    ],
)  # fmt: skip
@pytest.mark.parametrize("last", [False, True])
def test_a_line_that_is_no_record_is_refused_naming_it_and_the_rest_kept(tmp_path, caplog, bad, last):
    """Run files read back are checked like wire messages (issue 46): a line no run writes (a step
    planted at 10**18 silenced every later step of a resumed run; a string value disabled TensorBoard
    when a resume caught it up) is refused with one warning naming the file and line, the rest kept."""
    path = tmp_path / "m.jsonl"
    good = '{"step": %d, "time": 0.0, "metrics": {"a": 1.0}}\n'
    path.write_text(good % 0 + good % 2 + bad + "\n" if last else good % 0 + bad + "\n" + good % 2)
    with caplog.at_level(logging.WARNING, logger="rlmetrics.sinks"):
        assert read_jsonl(path).steps == [0, 2]
        with JsonlSink(path, append=True, resume=True) as sink:
            assert sink.resumed_at == 2
            sink.log({"a": 3.0}, 3)
    assert read_jsonl(path).steps == [0, 2, 3]
    line = 3 if last else 2
    refused = [r.getMessage() for r in caplog.records if "no record of a run" in r.getMessage()]
    if bad.endswith("}") or not last:
        assert refused and all(f"m.jsonl: line {line} is no record" in m for m in refused)


def test_reader_treats_code_as_data(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "m.jsonl"
    key = f"__import__('os').system('touch {marker}')"
    path.write_text(json.dumps({"step": 1, "metrics": {key: 1}}) + "\n")
    run = read_jsonl(path)
    assert run.names() == [key] and run.series(key)[1].tolist() == [1.0]
    assert not marker.exists()


def test_unusual_names_are_just_strings(tmp_path):
    names = ["../../escape", "/abs/x", "ü" * 300 + "/λ@k", "bad\ud800surrogate", "tab\tname"]
    with JsonlSink(tmp_path / "m.jsonl") as sink:
        sink.log({n: float(i) for i, n in enumerate(names)}, 0)
    run = read_jsonl(tmp_path / "m.jsonl")
    assert run.names() == sorted(names)
    assert [run.series(n)[1][0] for n in names] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]


def test_bad_values_and_steps_are_refused(tmp_path):
    with JsonlSink(tmp_path / "m.jsonl") as sink:
        with pytest.raises(TypeError, match="'a'"):
            sink.log({"a": "1.0"}, 0)
        with pytest.raises(TypeError):
            sink.log({"a": 1.0}, 1.5)
        sink.log({"a": np.float32(0.25), "b": np.int64(3)}, np.int64(2))
    assert read_jsonl(tmp_path / "m.jsonl").records[0]["metrics"] == {"a": 0.25, "b": 3.0}
    with pytest.raises(ValueError, match="closed"):
        sink.log({"a": 1.0}, 3)


def test_verls_file_and_ours_mixed_and_a_cut_last_line(tmp_path):
    """A verl line among rlmetrics records merges only with verl lines (an alert and an axis record
    stay as they are), a verl line's non-numbers are left out (the numbers kept), and a last line
    cut inside its JSON is a crash's cut (``truncated``), not a refused record."""
    path = tmp_path / "m.jsonl"
    lines = [
        '{"step": 1, "data": {"a": 1, "note": "x", "b": null}}',
        '{"step": 1, "data": {"c": 2}}',
        '{"step": 1, "time": 0, "event": {"rule": "r", "message": "m"}}',
        '{"step": 3, "time": 0, "axis": "policy_version", "metrics": {"v": 1.0}}',
        '{"step": 2, "time": 0, "metrics": {"a": 2.0}',
    ]
    path.write_text("\n".join(lines))
    run = read_jsonl(path)
    assert [(r["step"], r["metrics"]) for r in run.records][0][1]["c"] == 2
    assert run.series("a")[1][0] == 1 and math.isnan(run.series("b")[1][0]) and "note" not in run.names()
    assert [e["event"]["rule"] for e in run.events] == ["r"] and run.on_axis("policy_version").steps == [3]
    assert run.truncated is not None and "line 5" in run.truncated
