"""Step axes for asynchronous RL: one submission, several clocks.

An *axis* (``policy_version``, ``rollout_id``) is a step space of its own, merged by an aggregator of
its own (``<name>@<axis>``): docs/axes.md, "When an axis step is final".

>>> from rlmetrics.backends.local import drop_worker
>>> trainer = connect("local", axes=("policy_version",), world_size=2, name="axes-doc", label="trainer")
>>> worker = connect("local", axes=("policy_version",), world_size=2, name="axes-doc", label="worker")
>>> for step in range(3):  # the worker generates step s with the weights of version s - 1
...     batch = {"reward/mean": [float(step)] * 2}  # each name from one rank: world_size=1
...     worker.submit_metric(batch, world_size=1, axes={"policy_version": max(step - 1, 0)})
...     worker.wait_submit()
...     trainer.submit_metric({"actor/loss": step / 10}, world_size=1, axes={"policy_version": step})
...     trainer.wait_submit()
>>> trainer.result(2)  # train step 2: the batch of version 1 and the update of version 2
{'reward/mean': 2.0, 'actor/loss': 0.2}
>>> trainer.result(0, axis="policy_version")  # version 0 generated the batches of steps 0 and 1
{'reward/mean': 0.5, 'actor/loss': 0.0}
>>> for client in (trainer, worker):
...     client.stop()
>>> trainer.result(2, axis="policy_version")  # final once both stopped
{'actor/loss': 0.2}
>>> for axis in ("", "@policy_version"):
...     drop_worker("axes-doc" + axis)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rlmetrics.client import ClientCore, _step_arg
from rlmetrics.compute_local import ComputeLocal
from rlmetrics.core.stat import MetricValueError
from rlmetrics.messages import DEFAULT_AXIS, StepResult

AXES = ("policy_version", "rollout_id")
"""The axes :func:`connect` gives a client unless told otherwise (any identifier is an axis)."""

MAX_GAP = 1024
"""How far a value may jump past the lowest step its client left open on an axis."""


def axis_aggregator(name: str, axis: str) -> str:
    """The name of the aggregator that merges ``axis`` for the aggregator ``name``.

    >>> axis_aggregator("default", "policy_version")
    'default@policy_version'
    """
    return f"{name}@{axis}"


def _on_axes(method: Callable[..., None]) -> Callable[..., None]:
    """A ``ComputeLocal`` method that takes ``axes=`` and lands every submission it makes on each axis."""

    @functools.wraps(method)
    def on_axes(self: AxesClient, *args: Any, axes: Mapping[str, int] | None = None, **kwargs: Any) -> None:
        self._call = self._values(axes)
        try:
            method(self, *args, **kwargs)
        finally:
            self._call = None

    return on_axes


class AxesClient(ComputeLocal):
    """A rank's client on several axes (made by :func:`connect`): ``main`` merges ``train_step``,
    ``axes[axis]`` each other axis; the seed's ``compute_local_*`` calls take ``axes=`` too.

    >>> from rlmetrics.backends.local import drop_worker
    >>> client = connect("local", axes=("policy_version",), world_size=1, name="axes-seed")
    >>> client.process_local_validation_metrics(["gsm8k"] * 2, ["q", "q"], {"acc": [1.0, 0.0]},
    ...                                         axes={"policy_version": 4})
    >>> client.stop()
    >>> train, version = client.result(0), client.result(4, axis="policy_version")
    >>> train["val-core/gsm8k/acc/mean@2"], version["val-core/gsm8k/acc/mean@2"]
    (0.5, 0.5)
    >>> for name in ("axes-seed", "axes-seed@policy_version"):
    ...     drop_worker(name)
    """

    def __init__(self, main: ClientCore, axes: Mapping[str, ClientCore]) -> None:
        self.main = main
        self.axes = dict(axes)
        self._newest: dict[str, int | None] = dict.fromkeys(self.axes)
        self._closed_below = dict.fromkeys(self.axes, 0)
        self._call: dict[str, int] | None = None  # the axis values of a seed call under way

    @property
    def step(self) -> int:
        """The current ``train_step``."""
        return self.main.step

    @property
    def nan_strategy(self) -> str:
        """The clients' ``nan_strategy`` (the same on every axis)."""
        return self.main.nan_strategy

    @property
    def client_id(self) -> str:
        """The ``train_step`` client's id."""
        return self.main.client_id

    @property
    def rank(self) -> int | None:
        """The ``train_step`` client's rank (None: none given)."""
        return self.main.rank

    @property
    def world_size(self) -> int | None:
        """The ``train_step`` client's ``world_size`` (None: none given)."""
        return self.main.world_size

    def submit_metric(
        self,
        metrics: Mapping[str, Any],
        world_size: int | None = None,
        step: int | None = None,
        axes: Mapping[str, int] | None = None,
        *,
        group_by: Mapping[str, Any] | None = None,
    ) -> None:
        """:meth:`ClientCore.submit_metric` on ``train_step``, and on each axis at its value in ``axes``
        (``{"policy_version": v}``; an axis left out: this client's newest value on it)."""
        self._on_every_axis(
            lambda client, ws, s: client.submit_metric(metrics, ws, s, group_by=group_by),
            world_size,
            step,
            axes,
        )

    def _submit_state(
        self, name: str, state: Any, world_size: int | None, step: int | None, value: float | None = None
    ) -> None:
        self._on_every_axis(
            lambda client, ws, s: client._submit_state(name, state, ws, s, value), world_size, step
        )

    def _submit_samples(self, record: Any, world_size: int | None, step: int | None) -> None:
        self._on_every_axis(lambda client, ws, s: client._submit_samples(record, ws, s), world_size, step)

    compute_local_data_metric = _on_axes(ComputeLocal.compute_local_data_metric)
    compute_local_timing_metrics = _on_axes(ComputeLocal.compute_local_timing_metrics)
    compute_local_throughout_metrics = _on_axes(ComputeLocal.compute_local_throughout_metrics)
    compute_local_throughput_metrics = compute_local_throughout_metrics
    compute_local_mfu_metrics = _on_axes(ComputeLocal.compute_local_mfu_metrics)
    compute_local_memory_metrics = _on_axes(ComputeLocal.compute_local_memory_metrics)
    process_local_validation_metrics = _on_axes(ComputeLocal.process_local_validation_metrics)
    compute_local_straggler_metrics = _on_axes(ComputeLocal.compute_local_straggler_metrics)

    def _on_every_axis(
        self,
        submit: Callable[[ClientCore, int | None, int | None], None],
        world_size: int | None,
        step: int | None,
        axes: Mapping[str, int] | None = None,
    ) -> None:
        """``submit(client, world_size, step)`` on ``train_step``, then each axis; data errors raised once."""
        values = self._call if self._call is not None else self._values(axes)
        error = None
        try:
            submit(self.main, world_size, step)
        except MetricValueError as exc:  # the other names were queued: they go to every axis too
            error = exc
        for axis, value in values.items():
            try:
                submit(self.axes[axis], 1, value)
            except MetricValueError:
                pass  # the same names as on train_step: raised once, below
            newest = self._newest[axis]
            self._newest[axis] = value if newest is None else max(newest, value)
        if error is not None:
            raise error

    def _values(self, given: Mapping[str, int] | None) -> dict[str, int]:
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.axes))
        if unknown:
            raise ValueError(f"{unknown} are not axes of this client (it has {sorted(self.axes)})")
        values = {}
        for axis in self.axes:
            if axis in given:
                value = _step_arg(given[axis])
            elif self._newest[axis] is not None:
                value = self._newest[axis]
            else:
                raise ValueError(
                    f"pass axes={{{axis!r}: ...}}: this client was given no value on {axis!r} yet"
                )
            self._check(axis, value)
            values[axis] = value
        return values

    def _check(self, axis: str, value: int) -> None:
        below = self._closed_below[axis]
        if value < below:
            raise ValueError(
                f"{axis} {value} is below {below}: this client closed the steps below {below} on that "
                "axis (a client's values on an axis only go up), its data would be dropped"
            )
        if value - below > MAX_GAP:
            raise ValueError(
                f"{axis} {value} jumps {value - below} steps past {below}, the lowest open one; "
                f"values on an axis are consecutive ints (at most {MAX_GAP} apart)"
            )

    def _close(self, axis: str, below: int, block: bool) -> None:
        """Send what is queued on ``axis`` and close its steps below ``below``."""
        low = self._closed_below[axis]
        self.axes[axis].close_steps(range(low, below), block=block)
        self._closed_below[axis] = max(low, below)

    def _close_all(self, through: int, block: bool | None) -> None:
        """:meth:`_close` every axis below its newest value (+ ``through``); a data error raised once."""
        blocking = self.main.blocking if block is None else block
        error = None
        for axis in self.axes:
            newest = self._newest[axis]
            try:
                self._close(axis, 0 if newest is None else newest + through, blocking)
            except MetricValueError as exc:
                error = error or exc
        if error is not None:
            raise error

    def wait_submit(self, step: int | None = None, block: bool | None = None) -> None:
        """:meth:`ClientCore.wait_submit` on ``train_step``; close each axis below its newest value."""
        try:
            self.main.wait_submit(step, block)
        finally:
            self._close_all(0, block)

    def advance(self, axis: str, value: int) -> None:
        """Close this client's steps below ``value`` on ``axis`` (a worker that loaded version ``value``)."""
        if axis not in self.axes:
            raise ValueError(f"{axis!r} is not an axis of this client (it has {sorted(self.axes)})")
        value = _step_arg(value)
        self._check(axis, value)
        newest = self._newest[axis]
        self._newest[axis] = value if newest is None else max(newest, value)
        self._close(axis, value, self.main.blocking)

    def result(
        self, step: int, timeout: float | None = None, axis: str = DEFAULT_AXIS, *, finalize: bool = False
    ) -> StepResult:
        """:meth:`ClientCore.result` of ``step`` on ``axis``."""
        return self._client(axis).result(step, timeout, finalize=finalize)

    def wait_final_res(self, timeout: float | None = None) -> StepResult:
        """The seed's read, on ``train_step``."""
        return self.main.wait_final_res(timeout)

    def _client(self, axis: str) -> ClientCore:
        if axis == DEFAULT_AXIS:
            return self.main
        if axis not in self.axes:
            raise ValueError(f"unknown axis {axis!r}: this client has {[DEFAULT_AXIS, *self.axes]}")
        return self.axes[axis]

    def stop(self) -> None:
        """Close every step this client submitted to, on every axis, and leave them all."""
        try:
            self._close_all(1, True)
        finally:
            for client in (self.main, *self.axes.values()):
                client.stop()


def connect(
    backend: str = "local",
    *,
    axes: Iterable[str] = AXES,
    world_size: int | None = None,
    name: str = "default",
    **options: Any,
) -> AxesClient:
    """``rlmetrics.connect(backend, axes=axes, ...)`` with the default :data:`AXES`."""
    import rlmetrics  # the package, initialized first: no import circle through the backends

    return rlmetrics.connect(backend, axes=tuple(axes), world_size=world_size, name=name, **options)


def connect_axes(
    connect: Callable[..., Any], backend: str, axes: Iterable[str], name: str, **options: Any
) -> AxesClient:
    """An :class:`AxesClient` of aggregator ``name``: a ``connect(**options)`` client per axis."""
    if backend == "torch":
        raise ValueError("step axes need an aggregator process: backend 'local' or 'ray', not 'torch'")
    axes = tuple(axes)
    bad = [a for a in axes if not isinstance(a, str) or not a.isidentifier() or a == DEFAULT_AXIS]
    if bad or len(set(axes)) != len(axes):
        raise ValueError(f"axes must be distinct identifiers other than {DEFAULT_AXIS!r}, got {axes!r}")
    main = connect(backend, name=name, **options)
    return AxesClient(main, {a: connect(backend, name=axis_aggregator(name, a), **options) for a in axes})
