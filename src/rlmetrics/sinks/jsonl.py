"""JSON Lines: one object per step, the format every other rlmetrics tool reads back (docs/trackers.md).

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "run", "metrics.jsonl")
>>> with JsonlSink(path) as sink:
...     sink.log({"critic/score/mean": 0.5, "perf/throughput": 1200.0}, step=1)
...     sink.log({"critic/score/mean": 0.75}, step=2)
>>> run = read_jsonl(path)
>>> run.steps, run.names()
([1, 2], ['critic/score/mean', 'perf/throughput'])
>>> run.series("perf/throughput")
(array([1, 2]), array([1200.,   nan]))
>>> with JsonlSink(path, append=True) as sink:  # doctest: +ELLIPSIS
...     sink.log({"critic/score/mean": 0.1}, step=2)
Traceback (most recent call last):
...
ValueError: step 2 is already in .../metrics.jsonl; pass overwrite=True to log it again ...
"""

from __future__ import annotations

import dataclasses
import json
import logging
import numbers
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from rlmetrics.core.histogram import Histogram
from rlmetrics.health import Alert
from rlmetrics.messages import MAX_STEP, StepResult
from rlmetrics.sinks.base import Sink
from rlmetrics.sinks.names import as_floats, as_step, histograms_of, lists_of

logger = logging.getLogger(__name__)


def json_safe(obj: Any) -> Any:
    """``obj`` with JSON types only: a dataclass as its fields, an Enum as its value, an OmegaConf
    config resolved, tuples and sets as lists, any other object as its ``str``.

    >>> json_safe({"missing_ranks": ("rank1",), 3: {2, 1}, "n": np.int64(4), "path": Path("/a")})
    {'missing_ranks': ['rank1'], '3': [1, 2], 'n': 4, 'path': '/a'}
    """
    omegaconf = sys.modules.get("omegaconf")  # an OmegaConf config exists only once it is imported
    if omegaconf is not None and isinstance(obj, omegaconf.Container):
        return json_safe(omegaconf.OmegaConf.to_container(obj, resolve=True))
    if isinstance(obj, Enum):
        return json_safe(obj.value)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return json_safe(dataclasses.asdict(obj))
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((json_safe(v) for v in obj), key=lambda v: (type(v).__name__, repr(v)))
    if isinstance(obj, np.ndarray):
        return json_safe(obj.tolist())
    return str(obj)


def run_config(config: Any) -> dict[str, Any] | None:
    """A run's config (a mapping, a dataclass, an OmegaConf config or None) as a JSON-safe dict.

    >>> run_config({"trainer": {"lr": 1e-6, "devices": (0, 1)}})
    {'trainer': {'lr': 1e-06, 'devices': [0, 1]}}
    >>> run_config(["lr", 1e-6])
    Traceback (most recent call last):
    ...
    TypeError: config must be a mapping, a dataclass or an OmegaConf DictConfig, not list
    """
    if config is None:
        return None
    dataclass = dataclasses.is_dataclass(config) and not isinstance(config, type)
    if not (isinstance(config, Mapping) or dataclass):
        raise TypeError(
            f"config must be a mapping, a dataclass or an OmegaConf DictConfig, not {type(config).__name__}"
        )
    return json_safe(config)


def _dumps(record: dict) -> bytes:
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate in a name: \u-escaped, still read back exactly
        return (json.dumps(record) + "\n").encode("ascii")


def _parse(line: bytes) -> dict:
    """A record of the file (verl's too, null as NaN); ValueError for a line neither writes."""
    try:
        record = json.loads(line.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deep") from None
    if isinstance(record, dict) and "metrics" not in record and isinstance(record.get("data"), dict):
        data = record.pop("data")  # verl's file: {"step", "data"}, NaN written as null
        record["metrics"] = {k: float("nan") if v is None else v for k, v in data.items() if _number(v, None)}
        record["verl"] = True
    if not (
        isinstance(record, dict)
        and isinstance(record.get("step"), int)
        and not isinstance(record["step"], bool)
        and (isinstance(record.get("metrics"), dict) or isinstance(record.get("event"), dict))
        and isinstance(record.get("axis", ""), str)
    ):
        raise ValueError("not an object with an integer 'step' and a 'metrics' or 'event' object")
    if not 0 <= record["step"] <= MAX_STEP:
        raise ValueError(f"step {record['step']} is outside [0, {MAX_STEP}]")
    for name, value in record.get("metrics", {}).items():
        if not _number(value):
            raise ValueError(f"metric {name!r} is {str(value)[:40]!r}, not a number")
    event = record.get("event")
    if event is not None and not (
        isinstance(event.get("rule"), str) and isinstance(event.get("message"), str)
    ):
        raise ValueError("an event without its rule and message")
    return record


def _number(value: Any, *allowed: Any) -> bool:
    """``value`` is a number a float holds (no bool, no int of 400 digits), or one of ``allowed``."""
    if value in allowed and not isinstance(value, (int, float)):
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _scan(path: Path) -> tuple[list[dict], str | None, int]:
    """The records, the truncation note and the byte offset just after the last good record."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records: list[dict] = []
    truncated = None
    pos = good_end = 0
    for i, line in enumerate(lines):
        end = pos + len(line) + (i < len(lines) - 1)
        if line.strip():
            try:
                records.append(_parse(line))
            except ValueError as exc:
                if i != last or not isinstance(exc, json.JSONDecodeError):  # a whole line: not ours, refused
                    logger.warning("%s: line %d is no record of a run, refused (the others are kept): %s",
                                   path, i + 1, exc)  # fmt: skip
                    good_end = end
                    pos = end
                    continue
                truncated = f"{path}: line {i + 1} (the last, {len(line)} bytes) is incomplete: {exc}"
                logger.warning("%s; ignored", truncated)
                break
            good_end = end
        pos = end
    return records, truncated, good_end


@dataclass
class JsonlRun:
    """A JSONL file's records in file order: ``records`` (``train_step``), ``axis_records``, ``events``."""

    path: Path
    records: list[dict]
    truncated: str | None = None
    events: list[dict] = field(default_factory=list)
    axis_records: list[dict] = field(default_factory=list)

    @property
    def axes(self) -> list[str]:
        """The other axes the file has records of, sorted."""
        return sorted({r["axis"] for r in self.axis_records})

    def on_axis(self, axis: str) -> JsonlRun:
        """The records of ``axis`` as a run of their own (steps: that axis's values).

        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
        >>> with JsonlSink(path) as sink:
        ...     sink.log({"actor/loss": 0.5}, step=7)
        ...     sink.log_axis({"reward/mean": 0.25}, step=5, axis="policy_version")
        >>> run = read_jsonl(path)
        >>> run.steps, run.axes, run.on_axis("policy_version").series("reward/mean")
        ([7], ['policy_version'], (array([5]), array([0.25])))
        """
        return JsonlRun(self.path, [r for r in self.axis_records if r["axis"] == axis], self.truncated)

    @property
    def steps(self) -> list[int]:
        """The step of every record, in file order (a step logged with ``overwrite`` appears twice)."""
        return [r["step"] for r in self.records]

    def names(self) -> list[str]:
        """Every metric name in the file, sorted."""
        return list(self._names)

    def series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` over the distinct steps, ascending; NaN where a step lacks ``name``."""
        steps, latest = self._latest
        return steps, np.array([_as_float(m.get(name)) for m in latest], dtype=np.float64)

    def histogram_names(self) -> list[str]:
        """Every histogram name in the file, sorted."""
        return sorted({name for r in self.records for name in r.get("histograms", {})})

    def histograms(self, name: str) -> tuple[np.ndarray, list[Histogram]]:
        """``(steps, histograms)`` of the distinct steps that have histogram ``name``, ascending."""
        latest = {r["step"]: r["histograms"][name] for r in self.records if name in r.get("histograms", {})}
        steps = sorted(latest)
        return np.array(steps, dtype=np.int64), [Histogram.from_dict(latest[s]) for s in steps]

    # Built once per run (records are not changed after reading): a report or plot asks per name.
    @cached_property
    def _names(self) -> tuple[str, ...]:
        return tuple(sorted({name for r in self.records for name in r["metrics"]}))

    @cached_property
    def _latest(self) -> tuple[np.ndarray, list[dict]]:
        latest = {r["step"]: r["metrics"] for r in self.records}
        steps = sorted(latest)
        return np.array(steps, dtype=np.int64), [latest[s] for s in steps]


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _alert_key(step: int, event: Mapping) -> tuple:
    return step, event.get("rule"), event.get("metric")


def _ends_with_newline(path: Path, end: int) -> bool:
    with open(path, "rb") as f:
        f.seek(end - 1)
        return f.read(1) == b"\n"


def record_result(record: Mapping[str, Any]) -> StepResult:
    """A metric record as the :class:`~rlmetrics.StepResult` that was logged (without its ``meta``)."""
    histograms = {name: Histogram.from_dict(d) for name, d in record.get("histograms", {}).items()}
    return StepResult(record["metrics"], record["step"], histograms=histograms, lists=record.get("lists"))


def read_jsonl(path: str | os.PathLike) -> JsonlRun:
    """Read a metrics JSONL file back (``json.loads`` only; docs/trackers.md, "Sinks").

    Args:
        path: the file, as :class:`JsonlSink` or verl's file logger (a step's lines merged) wrote it.

    Returns:
        A :class:`JsonlRun`, in file order. An incomplete last line (a crash mid-write) is left out,
        named in ``truncated`` and logged; any other line that is no record is left out with a logged warning.

    Raises:
        FileNotFoundError: no file at ``path``.

    Example:
    >>> import os, tempfile
    >>> from rlmetrics.sinks import JsonlSink, read_jsonl
    >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
    >>> with JsonlSink(path) as sink:
    ...     sink.log({"critic/score/mean": 0.5}, step=1)
    >>> with open(path, "a") as f:
    ...     _ = f.write('{"step": 2, "metr')  # a crash mid-write
    >>> run = read_jsonl(path)
    >>> run.steps, run.series("critic/score/mean"), run.truncated is not None
    ([1], (array([1]), array([0.5])), True)
    """
    path = Path(path)
    records, truncated, _ = _scan(path)
    if any(r.get("verl") for r in records):  # verl's file: a line per call, the calls of a step merged
        steps: dict[int, dict] = {}
        for r in records:
            if r.get("verl"):
                steps.setdefault(r["step"], {"step": r["step"], "metrics": {}})["metrics"].update(
                    r["metrics"]
                )
        records = [r for r in records if not r.get("verl")] + list(steps.values())
    metrics = [r for r in records if "metrics" in r and "axis" not in r]
    events = [r for r in records if "metrics" not in r]
    return JsonlRun(path, metrics, truncated, events, [r for r in records if "metrics" in r and "axis" in r])


class JsonlSink(Sink):
    """One JSON line per step to ``path`` (its folders created); ``append``, ``resume``: docs/trackers.md."""

    tracker = "jsonl"  # names as they are: JSON strings, never paths

    folder_files = ("metrics.jsonl",)
    all_keys = True  # the record a resumed run catches its trackers up from

    @classmethod
    def in_folder(cls, out_dir: Path, project: str, run_name: str | None, resume: bool | str) -> JsonlSink:
        return cls(out_dir / "metrics.jsonl", resume=bool(resume))

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        append: bool = False,
        overwrite: bool = False,
        fsync: bool = False,
        resume: bool = False,
    ) -> None:
        self.path = Path(path)
        self.overwrite = overwrite
        self.fsync = fsync
        self._steps: set[tuple[str | None, int]] = set()  # (axis, step), axis None: train_step
        self._resumed: dict[str, int] = {}  # other axes: the last step a resumed file holds
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if (append or resume) and self.path.exists():
            records, truncated, good_end = _scan(self.path)
            self._steps.update((r.get("axis"), r["step"]) for r in records if "metrics" in r)
            self._alerted = {_alert_key(r["step"], r["event"]) for r in records if "event" in r}
            if resume:
                for axis, step in self._steps:
                    if axis is None:
                        self.resumed_at = max(step, -1 if self.resumed_at is None else self.resumed_at)
                    else:
                        self._resumed[axis] = max(step, self._resumed.get(axis, -1))
            if truncated:
                os.truncate(self.path, good_end)
            self._file = open(self.path, "ab")
            if good_end and not _ends_with_newline(self.path, good_end):
                self._file.write(b"\n")
        else:
            self._file = open(self.path, "wb")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._log(metrics, step, None)

    def log_axis(self, metrics: Mapping[str, float], step: int, axis: str) -> None:
        """Log ``step`` of ``axis`` (a line with ``"axis"``; names as they are)."""
        self._log(metrics, step, axis)

    def _log(self, metrics: Mapping[str, float], step: int, axis: str | None) -> None:
        self.check_open()
        step = as_step(step)
        values = as_floats(metrics)
        if self.skips(step) if axis is None else step <= self._resumed.get(axis, -1):
            return
        if (axis, step) in self._steps and not self.overwrite:
            where = "" if axis is None else f" of axis {axis!r}"
            raise ValueError(
                f"step {step}{where} is already in {self.path}; pass overwrite=True to log it again "
                "(the later record wins)"
            )
        record: dict[str, Any] = {"step": step, "time": time.time(), "metrics": values}
        if axis is not None:
            record["axis"] = axis
        meta = getattr(metrics, "meta", None)
        if meta is not None and (not meta.complete or meta.approximate):  # what it lacks, what is approximate
            record["meta"] = json_safe(meta.to_dict())
        histograms = histograms_of(metrics)
        if histograms:
            record["histograms"] = {name: h.to_dict() for name, h in histograms.items()}
        lists = lists_of(metrics)
        if lists:
            record["lists"] = lists
        self._write(record)
        self._steps.add((axis, step))

    def alert_key(self, alert: Alert) -> Any:
        return _alert_key(alert.step, alert.as_dict())

    def write_alert(self, alert: Alert) -> None:
        event = {k: v for k, v in alert.as_dict().items() if k != "step"}
        self._write({"step": alert.step, "time": time.time(), "event": json_safe(event)})

    def _write(self, record: dict) -> None:
        self._file.write(_dumps(record))
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def finish(self) -> None:
        self._file.close()

    def __repr__(self) -> str:
        return f"JsonlSink({str(self.path)!r})"
