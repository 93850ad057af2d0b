"""Backend-neutral client logic: step counter, coalescing, sequence ids.

A client summarizes each ``submit_metric`` call at once (so a bad value raises in the caller, naming
the metric), buffers the result, and sends everything of a step in one call to its
:class:`Transport` when the step is closed by ``wait_submit()``. Backends supply the transport.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from rlmetrics.aggregator import Packed, StepResult, pack
from rlmetrics.stat import NAN_STRATEGIES, MetricValueError

Submission = tuple[int, int, int, Packed]  # (step, seq, world_size, packed)


class Transport(Protocol):
    """What a backend provides to a client."""

    def send(self, client_id: str, items: list[Submission], close: list[int]) -> dict:
        """Deliver submissions and step closings; reply ``{"errors": {...}}``."""

    def result(self, step: int, timeout: float | None) -> StepResult:
        """The step's result once complete, or partial at the deadline."""

    def final(self) -> StepResult:
        """Finalize everything pending (the seed's ``wait_final_res``)."""

    def depart(self, client_id: str) -> None:
        """The client will send nothing more."""


def new_client_id(label: str | None = None) -> str:
    """A unique id; ``label`` (e.g. ``"rank3"``) leads it so that ``meta`` stays readable."""
    suffix = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    return f"{label}@{suffix}" if label else suffix


class ClientCore:
    """The client state machine shared by every backend.

    ``world_size``: default number of contributions expected per metric name and step.
    ``nan_strategy``: ``"propagate"`` (default), ``"drop"`` or ``"error"`` for non-finite values.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        world_size: int | None = None,
        nan_strategy: str = "propagate",
        label: str | None = None,
    ) -> None:
        if nan_strategy not in NAN_STRATEGIES:
            raise ValueError(f"nan_strategy must be one of {NAN_STRATEGIES}, got {nan_strategy!r}")
        self.transport = transport
        self.world_size = world_size
        self.nan_strategy = nan_strategy
        self.client_id = new_client_id(label)
        self.step = 0
        self._seq = 0
        self._buffer: list[Submission] = []
        self._schemas: dict = {}

    def submit_metric(
        self, metrics: Mapping[str, Any], world_size: int | None = None, step: int | None = None
    ) -> None:
        """Summarize ``metrics`` and queue them for ``step`` (default: the current step).

        Returns at once; nothing is sent before :meth:`wait_submit`. A value that cannot be
        summarized raises :class:`~rlmetrics.stat.MetricValueError` naming it, after the other
        metrics of the call were queued.
        """
        ws = self.world_size if world_size is None else world_size
        if ws is None:
            raise ValueError("submit_metric needs world_size (or a client created with world_size=...)")
        if not isinstance(metrics, Mapping):
            raise MetricValueError(
                f"metrics must be a mapping of name to value, got {type(metrics).__name__}"
            )
        errors: dict[str, str] = {}
        packed = pack(metrics, self.nan_strategy, self._schemas, errors)
        if packed.schema.names:
            self._buffer.append((self.step if step is None else int(step), self._seq, int(ws), packed))
            self._seq += 1
        if errors:
            raise MetricValueError("; ".join(errors.values()))

    def _flush(self, close: list[int]) -> None:
        if not self._buffer and not close:
            return
        items, self._buffer = self._buffer, []
        reply = self.transport.send(self.client_id, items, close)
        if reply.get("errors"):
            raise MetricValueError("; ".join(reply["errors"].values()))

    def wait_submit(self) -> None:
        """Send everything queued in one call, close the current step and advance to the next."""
        steps = {item[0] for item in self._buffer} | {self.step}
        self._flush(sorted(steps))
        self.step += 1

    def result(self, step: int, timeout: float | None = None) -> StepResult:
        """The result of ``step`` as soon as it is complete; at ``timeout`` (seconds) the partial
        result, whose ``meta`` names the missing ranks and metrics."""
        self._flush([])
        return self.transport.result(step, timeout)

    def wait_final_res(self) -> StepResult:
        """Aggregate everything pending now and return the newest step's result (seed semantics)."""
        self._flush([])
        return self.transport.final()

    def stop(self) -> None:
        """Send what is queued and leave: no step waits for this client afterwards."""
        self._flush([])
        self.transport.depart(self.client_id)
