"""MLflow, through ``MlflowClient`` on any tracking URI (``sqlite:///path/mlflow.db`` for local runs).

Needs the ``trackers`` extra. A run is created in ``experiment`` (created if missing); each step is
one ``log_batch`` call (chunks of 1000 metrics, MLflow's batch limit); ``close()`` marks the run
FINISHED. ``tracking_uri=None`` uses MLflow's default (``MLFLOW_TRACKING_URI`` or its local store).
MLflow's usage telemetry is switched off (``MLFLOW_DISABLE_TELEMETRY=true``) unless that variable is
already set. Names are adapted by :func:`rlmetrics.sinks.names.adapt_name` (MLflow refuses ``@``).
View with ``mlflow ui --backend-store-uri sqlite:///path/mlflow.db``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from rlmetrics.extras import require
from rlmetrics.sinks.names import NameMap, Sink, as_floats, as_step

_BATCH = 1000


class MLflowSink(Sink):
    """Log each step as a batch of metrics of one MLflow run."""

    def __init__(
        self, tracking_uri: str | None = None, experiment: str = "rlmetrics", run_name: str | None = None
    ) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        tracking = require("mlflow.tracking", "trackers")
        self._Metric = require("mlflow.entities", "trackers").Metric
        self.client = tracking.MlflowClient(tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.names = NameMap("mlflow")
        self._open = True

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if not self._open:
            raise ValueError(f"{self!r} is closed")
        step = as_step(step)
        now = int(time.time() * 1000)
        batch = [self._Metric(k, v, now, step) for k, v in self.names.adapt(as_floats(metrics)).items()]
        for i in range(0, len(batch), _BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i : i + _BATCH])

    def close(self) -> None:
        if self._open:
            self._open = False
            self.client.set_terminated(self.run_id)

    def __repr__(self) -> str:
        return f"MLflowSink(run_id={self.run_id!r})"
