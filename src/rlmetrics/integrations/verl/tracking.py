"""verl 0.9.1's ``verl.utils.tracking.Tracking``, writing through rlmetrics' sinks into one run folder.

A verl trainer swaps one import (``from rlmetrics.integrations.verl import Tracking``) and keeps its
calls: ``Tracking(project_name, experiment_name, default_backend, config)``, ``log(data, step,
backend=None)``, ``finish()``. Backends are verl's names, each the sink of that name
(:data:`rlmetrics.sinks.TRACKERS`); verl's variables are honoured (``VERL_FILE_LOGGER_ROOT``,
``VERL_FILE_LOGGER_PATH``, ``MLFLOW_TRACKING_URI``, ``TENSORBOARD_DIR``, ``SWANLAB_LOG_DIR``); the
folder is resumed, so a restarted trainer writes each step once. docs/verl.md, "Logging: verl's
Tracking", says what each backend writes, where, and what a rerun and a second call at a step do.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rlmetrics.health import coverage_metrics
from rlmetrics.messages import StepResult
from rlmetrics.sinks import TRACKERS, make_sinks
from rlmetrics.sinks import Tracking as Fanout
from rlmetrics.sinks.names import as_floats, as_step

logger = logging.getLogger(__name__)

BACKENDS = {
    **{name: name for name in TRACKERS if name not in ("jsonl", "prometheus")},
    "file": "jsonl",
    "tracking": "wandb",
}
"""verl backend name → rlmetrics sink name (:data:`rlmetrics.sinks.TRACKERS`, but the JSONL journal,
which is ``file``, and Prometheus, which verl has not)."""

VERL_ONLY = ("vemlp_wandb", "rl_insight")
"""verl 0.9.1's backends rlmetrics has no sink for."""


def verl_file(project_name: str, experiment_name: str, out_dir: str | os.PathLike | None = None) -> Path:
    """Where verl 0.9.1's ``file`` backend writes: ``$VERL_FILE_LOGGER_PATH``, else
    ``$VERL_FILE_LOGGER_ROOT/<project_name>/<experiment_name>.jsonl``; with an ``out_dir`` of one's
    own (no variable set), ``<out_dir>/<experiment_name>.jsonl``."""
    path = os.environ.get("VERL_FILE_LOGGER_PATH")
    if path:
        return Path(path)
    if out_dir is not None:
        return Path(out_dir) / f"{experiment_name}.jsonl"
    return run_folder(project_name, experiment_name).with_name(f"{experiment_name}.jsonl")


def run_folder(project_name: str, experiment_name: str) -> Path:
    """Where :class:`Tracking` writes without ``out_dir``: ``$VERL_FILE_LOGGER_ROOT`` (default ``.``)
    ``/<project_name>/<experiment_name>``.

    >>> run_folder("gsm8k", "qwen-grpo").as_posix()  # doctest: +SKIP
    'gsm8k/qwen-grpo'
    """
    root = Path(os.path.expanduser(os.environ.get("VERL_FILE_LOGGER_ROOT", ".")))
    return root / str(project_name) / str(experiment_name)


def sink_names(default_backend: str | Iterable[str]) -> dict[str, str]:
    """verl's ``default_backend`` (a name or a list, as verl takes it) → ``{verl name: sink name}``.

    >>> sink_names("file")
    {'file': 'jsonl'}
    >>> sink_names(["console", "vemlp_wandb"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: verl backend 'vemlp_wandb' has no rlmetrics sink; supported: console, tensorboard, ...
    """
    names = [default_backend] if isinstance(default_backend, str) else list(default_backend)
    supported = ", ".join(n for n in BACKENDS if n != "tracking")
    out = {}
    for name in names:
        if name in VERL_ONLY:
            raise ValueError(f"verl backend {name!r} has no rlmetrics sink; supported: {supported}")
        if name not in BACKENDS:
            raise ValueError(f"unknown verl backend {name!r}; supported: {supported}")
        out[name] = BACKENDS[name]
    return out


def _resume_mode(config: Any) -> Any:
    """verl's ``trainer.resume_mode`` in ``config`` (a dict or an OmegaConf config), None if absent."""
    try:
        return config["trainer"].get("resume_mode")
    except (TypeError, KeyError, AttributeError):
        return None


class Tracking:
    """verl's ``Tracking(project_name, experiment_name, default_backend="console", config=None)`` over
    :func:`rlmetrics.sinks.make_sinks` in one run folder (see the module).

    ``out_dir``: the run folder (default :func:`run_folder`). ``resume``: continue the run in the
    folder, skipping the steps it holds (a warning names the last one); False: a folder holding a run is
    refused unless ``overwrite=True``. Default: as the trainer resumes, True unless
    ``config["trainer"]["resume_mode"]`` is ``"disable"`` (a trainer that starts again from step 0
    must not have its steps skipped). ``health``: the rules
    (:class:`rlmetrics.health.Monitor`; True: the defaults). ``config`` (verl's run config: a dict, a
    dataclass or an OmegaConf config; anything else raises TypeError) is kept as :attr:`config` and
    stored as verl stores it: W&B's run config, MLflow's params (flattened as verl flattens them:
    ``trainer/total_epochs``, ``<list>/list_len``, ``<list>/0``, ...), SwanLab's run config. Unlike
    verl, SwanLab's config has no ``FRAMEWORK: "verl"`` key: every tracker gets the config alone. A
    resumed MLflow run keeps the params it holds (a changed value is a warning, see
    :class:`~rlmetrics.sinks.MLflowSink`).

    >>> import tempfile
    >>> out = tempfile.mkdtemp()
    >>> tracking = Tracking("demo", "exp", default_backend="file", out_dir=out)
    >>> tracking.log({"critic/score/mean": 0.5}, step=1)
    >>> tracking.finish()
    >>> from rlmetrics.sinks import read_jsonl
    >>> read_jsonl(f"{out}/metrics.jsonl").series("critic/score/mean")
    (array([1]), array([0.5]))
    """

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        default_backend: str | Iterable[str] = "console",
        config: Any = None,
        *,
        out_dir: str | os.PathLike | None = None,
        resume: bool | None = None,
        overwrite: bool = False,
        health: Any = True,
    ) -> None:
        self._finished = True  # until the sinks exist: __del__ of a failed __init__ does nothing
        self.project_name, self.experiment_name, self.config = project_name, experiment_name, config
        self.backends = sink_names(default_backend)
        if "tracking" in self.backends:
            logger.warning("verl's `tracking` backend is deprecated; it is W&B here (use `wandb`)")
        self.out_dir = Path(out_dir) if out_dir is not None else run_folder(project_name, experiment_name)
        if resume is None:
            resume = _resume_mode(config) != "disable"
        wanted = list(dict.fromkeys(self.backends.values()))
        self.tracking: Fanout = make_sinks(
            wanted,
            self.out_dir,
            project=str(project_name),
            run_name=str(experiment_name),
            resume=resume and not overwrite,
            overwrite=overwrite,
            health=health,
            config=config,
            options={"tensorboard": {"log_dir": os.environ.get("TENSORBOARD_DIR")}},
        )
        self._sink_of = dict(zip(wanted, self.tracking.sinks))
        jsonl = self._sink_of.get("jsonl")
        if jsonl is not None:
            jsonl.overwrite = True  # a later call at the step just logged rewrites its whole record
        self._step: int | None = None  # the last step logged this session
        self._data: dict[str, float] = {}  # its metrics so far
        self._finished = False
        if self.resumed_at is not None:
            logger.warning(
                "resuming the run in %s: steps up to %d are not written again (overwrite=True replaces it)",
                self.out_dir,
                self.resumed_at,
            )
        self._file = None  # verl's own file (the file backend)
        if "file" in self.backends:
            self._file = self._open_verl_file(verl_file(project_name, experiment_name, out_dir))
        logger.info("rlmetrics Tracking: %s in %s", ", ".join(wanted), self.out_dir)

    def _open_verl_file(self, path: Path) -> Any:
        """verl's file at ``path``: new for a new run, appended to for a resumed one (one line says so)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.resolve() == (self.out_dir / "metrics.jsonl").resolve():
            raise ValueError(
                f"verl's file {path} is the run's own metrics.jsonl: set VERL_FILE_LOGGER_PATH elsewhere"
            )
        if self.resumed_at is not None and path.exists():
            logger.warning("verl's file %s: appending after step %d (the run resumed)", path, self.resumed_at)
            data = path.read_bytes()
            file = open(path, "r+b", buffering=0)
            file.truncate(data.rfind(b"\n") + 1)  # a line cut by a crash goes
            file.seek(0, os.SEEK_END)
            return file
        return open(path, "wb", buffering=0)

    def _write_verl(self, data: Mapping[str, Any], step: int) -> None:
        """A line of verl's file: ``{"step", "data"}``, this call's values (JSON numbers, NaN as verl's
        orjson writes it: ``null``)."""
        if self._file is not None and (self.resumed_at is None or step > self.resumed_at):
            values = {k: (v if math.isfinite(v) else None) for k, v in data.items()}
            self._file.write(json.dumps({"step": step, "data": values}).encode() + b"\n")

    @property
    def resumed_at(self) -> int | None:
        """The last step the resumed run folder holds (None: a new run)."""
        return self.tracking.resumed_at

    def log(self, data: Mapping[str, Any], step: int, backend: str | Iterable[str] | None = None) -> None:
        """Log ``data`` (``{name: number}``: floats, ints, numpy or torch scalars) at ``step`` to every
        backend, or to those named in ``backend`` (verl's filter)."""
        if self._finished:
            raise ValueError("Tracking is finished")
        values = as_floats(data)
        step = as_step(step)
        only = None
        if backend is not None:
            names = [backend] if isinstance(backend, str) else list(backend)
            only = {BACKENDS[n] for n in names if n in BACKENDS}
        if self._step is not None and step < self._step:
            logger.warning("step %d after step %d dropped: trackers keep steps in order", step, self._step)
            return
        if only is None or "jsonl" in only:
            self._write_verl(values, step)
        if step != self._step:
            self._step, self._data = step, {}
            if only is None:
                self._data.update(values)
                self._data.update(
                    coverage_metrics(getattr(data, "meta", None))
                )  # a later call's record keeps it
                # a StepResult keeps its meta (a partial step gets its meta/coverage), histograms, lists
                self.tracking.log(data if isinstance(data, StepResult) else values, step)
                return
        # a second call at the step (or one for some backends): no health rules (they saw the step),
        # each chosen sink gets ``values``, the JSONL file the step's metrics so far
        self._data.update(values)
        for name, sink in self._sink_of.items():
            if only is None or name in only:
                self.tracking.write(sink, dict(self._data) if name == "jsonl" else values, step)

    def finish(self, exit_code: int = 0) -> None:
        """Close every sink, once (verl's ``finish``; ``exit_code`` is accepted and unused)."""
        if getattr(self, "_finished", True):
            return
        self._finished = True
        if self._file is not None:
            self._file.close()
        self.tracking.close()

    def __del__(self) -> None:
        try:
            self.finish()
        except Exception:  # an interpreter shutting down may have torn down what close() needs
            pass

    def __repr__(self) -> str:
        return f"Tracking({list(self.backends)!r}, out_dir={str(self.out_dir)!r})"
