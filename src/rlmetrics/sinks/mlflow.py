"""MLflow, through ``MlflowClient`` on any tracking URI (``sqlite:///path/mlflow.db`` for local runs)."""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from glob import escape
from pathlib import Path
from typing import Any

from rlmetrics.extras import require
from rlmetrics.health import Alert
from rlmetrics.sinks.base import Row, Sink, resume_id
from rlmetrics.sinks.compat import mlflow_dispose, mlflow_store_has_experiment
from rlmetrics.sinks.jsonl import run_config
from rlmetrics.sinks.names import NameMap, path_safe

logger = logging.getLogger(__name__)

_BATCH, _PARAM_BATCH = 1000, 100  # MLflow's MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH
REQUEST_BYTES = 1_000_000
"""MLflow's limit on a LogBatch request (``MAX_BATCH_LOG_REQUEST_SIZE``, used when MLflow has it)."""
METRIC_BYTES = 160
"""A metric's entry in a LogBatch request, its key left out: at most 144 bytes in MLflow 3.17, rounded up."""
PARAM_BYTES = 64
"""A param's entry in a LogBatch request, its key and value left out (44 bytes, rounded up)."""
REQUEST_HEAD = 256
"""A LogBatch request without its entries (some 70 bytes, rounded up)."""
_BAD = re.compile(r"[^\w/.\- :]")  # the complement of MLflow's own check (str patterns: \w is Unicode)


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``config`` (JSON-safe) as MLflow params, the keys verl 0.9.1 logs.

    >>> flat_params({"trainer": {"lr": 0.1, "devices": [0, {"id": 1}], "extra": {}}, "seed": None})
    ... # doctest: +NORMALIZE_WHITESPACE
    {'trainer/lr': 0.1, 'trainer/devices/list_len': 2, 'trainer/devices/0': 0,
     'trainer/devices/1/id': 1, 'seed': None}
    """
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, list):
            value = {"list_len": len(value), **{str(i): v for i, v in enumerate(value)}}
        if isinstance(value, Mapping):
            out.update(flat_params(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def json_size(text: str) -> int:
    """The bytes of ``text`` as MLflow's client writes it (``json.dumps``: non-ASCII as ``\\uXXXX``).

    >>> json_size("acc"), json_size('a"b'), json_size("验证")
    (5, 6, 14)
    """
    return len(json.dumps(text))


def _metric_size(metric: Any) -> int:
    return json_size(metric.key) + METRIC_BYTES


def _param_size(param: Any) -> int:
    return json_size(param.key) + json_size(param.value) + PARAM_BYTES


def batches(items: list, size: Callable[[Any], int], most: int, limit: int = REQUEST_BYTES) -> Iterator[list]:
    """``items`` in batches of at most ``most`` items, ``size`` summing to ``limit`` - :data:`REQUEST_HEAD`.

    >>> [len(b) for b in batches(list(range(7)), lambda i: 300, most=3, limit=REQUEST_HEAD + 700)]
    [2, 2, 2, 1]
    """
    room = limit - REQUEST_HEAD
    batch: list = []
    used = 0
    for item in items:
        n = size(item)
        if batch and (len(batch) == most or used + n > room):
            yield batch
            batch, used = [], 0
        batch.append(item)
        used += n
    if batch:
        yield batch


class MLflowSink(Sink):
    """Log each step as a batch of metrics of one MLflow run."""

    tracker = "mlflow"
    background = True  # written from its own thread (Tracking)
    name_limit = 250

    @staticmethod
    def map_name(name: str) -> str:
        """Path-safe; ``@`` → ``_at_``; a character outside letters, digits, ``_ - . space : /`` → ``_``.

        >>> MLflowSink.adapt_name("val-core/math/acc/mean@4"), MLflowSink.adapt_name("acc (%)")
        ('val-core/math/acc/mean_at_4', 'acc ___')
        """
        return _BAD.sub("_", path_safe(name).replace("@", "_at_"))

    folder_files = (
        "mlflow.db",
        "mlflow.db-journal",
        "mlflow.db.*.init*",
    )  # the store, its journal, killed starts
    takes_config = catches_up = True

    @classmethod
    def in_folder(
        cls, out_dir: Path, project: str, run_name: str | None, resume: bool | str, **options: Any
    ) -> MLflowSink:
        uri = (
            os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{(out_dir / 'mlflow.db').resolve().as_posix()}"
        )
        return cls(uri, project, run_name, resume=resume_id(resume), **options)

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "rlmetrics",
        run_name: str | None = None,
        resume: str | None = None,
        config: Any = None,
    ) -> None:
        config = run_config(config)
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        tracking = require("mlflow.tracking", "trackers")
        entities = require("mlflow.entities", "trackers")
        self._Metric, self._RunTag = entities.Metric, entities.RunTag
        validation = require("mlflow.utils.validation", "trackers")
        self._request_bytes = getattr(validation, "MAX_BATCH_LOG_REQUEST_SIZE", REQUEST_BYTES)
        uri = tracking_uri or tracking.get_tracking_uri()
        store = _sqlite_path(uri)
        if store is None:
            self.client = tracking.MlflowClient(uri)
        else:
            _finish_store(tracking, uri, store)
            self.client = _open_store(tracking, uri, store)
        self._start = (experiment, run_name, resume, config, entities.Param, uri)
        if store is not None:  # a file: nothing to wait for
            self._started()

    def _started(self) -> str:
        """The run's id, the run created or opened first (on a server: at the first call that needs it)."""
        if self._start is None:
            return self.run_id
        experiment, run_name, resume, config, Param, uri = self._start
        if resume and not self._holds(resume, uri):
            resume = None
        if resume:
            run = self.client.get_run(resume)
            self.run_id = run.info.run_id
            if run.info.status != "RUNNING":
                self.client.update_run(self.run_id, status="RUNNING")
            latest = run.data.to_proto().metrics
            self.resumed_at = max((m.step for m in latest if not m.key.startswith("alert/")), default=None)
            self._alerted = {
                (m.step, m.key)
                for key in {m.key for m in latest if m.key.startswith("alert/")}
                for m in self.client.get_metric_history(self.run_id, key)
            }
        else:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            self._start = (experiment, run_name, self.run_id, config, Param, uri)  # a retry opens it
        if config:
            self._log_params(config, Param, resume)
        self._start = None
        if self.on_run_id is not None:
            try:
                self.on_run_id(self.run_id)
            except Exception as exc:  # the run goes on; a restart would start another run
                logger.error("MLflow run %s could not be saved for a restart: %r", self.run_id, exc)
        return self.run_id

    def _holds(self, run_id: str, uri: str) -> bool:
        """The store holds the run ``run_id`` (else one warning: a new run continues it)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException as exc:
            if getattr(exc, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
                raise
            logger.warning(
                "MLflow run %s is not in %s (a new store?): a new run continues it, caught up from the "
                "run folder's metrics.jsonl", run_id, uri,
            )  # fmt: skip
            return False
        return True

    def _log_params(self, config: dict[str, Any], Param: type, resume: str | None) -> None:
        """``config``'s params the run lacks; a warning for each one it holds with another value."""
        limit = require("mlflow.utils.validation", "trackers").MAX_PARAM_VAL_LENGTH
        held = self.client.get_run(self.run_id).data.params if resume else {}
        names, params = NameMap(type(self)), []  # params and metrics are apart: names of their own
        for key, value in flat_params(config).items():
            key, value = names(key), str(value)[:limit]
            if key not in held:
                params.append(Param(key, value))
            elif held[key] != value:
                logger.warning(
                    "MLflow param %r of run %s stays %r, the config now has %r (MLflow params cannot change)",
                    key,
                    self.run_id,
                    held[key],
                    value,
                )
        for batch in batches(params, _param_size, _PARAM_BATCH, self._request_bytes):
            self.client.log_batch(self.run_id, params=batch)

    def write(self, row: Row) -> None:
        run_id, now = self._started(), int(time.time() * 1000)
        if row.axis is None and self.skips(row.step):  # held by the run resumed just now
            return
        batch = [self._Metric(k, v, now, row.step) for k, v in row.scalars.items()]
        for request in batches(batch, _metric_size, _BATCH, self._request_bytes):
            self.client.log_batch(run_id, metrics=request)
        if row.texts:  # a tag holds its latest value: the slowest ranks of the newest step
            self.client.log_batch(run_id, tags=[self._RunTag(k, t) for k, t in row.texts.items()])

    def alert_key(self, alert: Alert) -> Any:
        return alert.step, self.names(f"alert/{alert.rule}")  # one point per rule and step

    def alert(self, alert: Alert) -> None:
        """The point ``alert/<rule> = 1`` once per rule and step; the tag ``alert/<rule>``: its message."""
        self.check_open()
        run_id, (step, key) = self._started(), self.alert_key(alert)  # started: the alerts it holds
        with self.alert_once((step, key)) as new:
            metrics = [self._Metric(key, 1.0, int(time.time() * 1000), step)] if new else []
            self.client.log_batch(run_id, metrics=metrics, tags=[self._RunTag(key, str(alert))])

    @staticmethod
    def transient(exc: Exception) -> bool:
        """Not a request MLflow refused as bad (HTTP 4xx but 429)."""
        status = getattr(exc, "get_http_status_code", None)
        if status is not None and 400 <= status() < 500 and status() != 429:
            return False
        return Sink.transient(exc)

    def finish(self) -> None:
        if self.run_id is not None:  # a run never created has nothing to end
            self.client.set_terminated(self.run_id)

    def __repr__(self) -> str:
        return f"MLflowSink(run_id={self.run_id!r})"


def _sqlite_path(uri: str) -> Path | None:
    """The file of an SQLite ``uri`` (None: not a file store)."""
    if not uri.startswith("sqlite"):
        return None
    from sqlalchemy.engine import make_url

    database = make_url(uri).database
    return Path(database) if database and database != ":memory:" else None


def _finish_store(tracking, uri: str, path: Path) -> None:
    """Make ``path`` a store MLflow finished creating: made under a temporary name, then linked in place."""
    if path.exists():
        if _holds_experiment(path):
            return
        Path(f"{path}-journal").unlink(missing_ok=True)  # first: SQLite would replay it on the new store
        path.unlink()
    from sqlalchemy.engine import make_url

    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.init")  # new: MLflow caches stores by URI
    tmp_uri = make_url(uri).set(database=str(tmp)).render_as_string(hide_password=False)
    tracking.MlflowClient(tmp_uri).search_experiments(max_results=1)  # MLflow creates its tables
    try:
        os.link(tmp, path)
    except (FileExistsError, FileNotFoundError):  # another process linked its store first (and removed ours)
        pass
    for leftover in path.parent.glob(f"{escape(path.name)}.*.init*"):  # ours, and those of killed starts
        leftover.unlink(missing_ok=True)
    mlflow_dispose(uri)  # MLflow's connections to the store ``uri`` named before (overwrite=True)


def _holds_experiment(path: Path) -> bool:
    """Whether the SQLite file ``path`` holds an MLflow experiment; RuntimeError if it is no database."""
    try:
        return mlflow_store_has_experiment(path)
    except sqlite3.DatabaseError as exc:
        raise RuntimeError(_refusal(path, exc)) from None


def _open_store(tracking, uri: str, path: Path):
    """A client of the store at ``path`` (migrated if older); RuntimeError if MLflow cannot open it."""
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    try:
        client = tracking.MlflowClient(uri)
        client.search_experiments(max_results=1)
    except (MlflowException, SQLAlchemyError) as exc:
        raise RuntimeError(_refusal(path, getattr(exc, "orig", None) or exc)) from None
    return client


def _refusal(path: Path, reason: BaseException) -> str:
    first = (str(reason).splitlines() or [repr(reason)])[0].split(". ")[0]  # MLflow's advice does not apply
    return (
        f"cannot open the MLflow store {path} ({first}); it is left as it is: restore it from a backup,"
        " or move it away to start a new store"
    )
