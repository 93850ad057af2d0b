"""Submitting with verl's naming: :data:`NAMING`, :func:`connect`, :func:`submit_validation_metrics`
(docs/verl.md, "Across data-parallel ranks")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlmetrics.core.reduce import MEAN, STD, Reduction, resolve
from rlmetrics.core.stat import Stat
from rlmetrics.integrations.verl.batch import VERL_REDUCTIONS, Value
from rlmetrics.integrations.verl.worker import is_metric, metric_stat


class Naming:
    """verl's naming for a client: what ``submit_metric`` sends in place of verl's values, and the
    reductions verl's names need; ``renames`` is empty (``timing_s/*`` stays)."""

    renames: dict[str, str] = {}

    def prepare(self, metrics: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Reduction]]:
        """``metrics`` with :class:`Value` and :class:`Metric` entries replaced by Stats (and the
        auxiliary Stats a Value carries), and the reductions that differ from the names' own."""
        out: dict[str, Any] = {}
        reductions: dict[str, Reduction] = {}
        for name, value in metrics.items():
            if isinstance(value, Value):
                out[name] = value.stat
                out.update(value.aux)
            elif is_metric(value):
                out[name], reductions[name] = metric_stat(value)
            else:
                out[name] = value
                if isinstance(name, str) and resolve(name) is STD and not isinstance(value, Stat):
                    reductions[name] = MEAN  # a std per micro-batch or rank: verl takes the mean
            if isinstance(name, str) and name in VERL_REDUCTIONS:
                reductions[name] = VERL_REDUCTIONS[name]
        return out, reductions


NAMING = Naming()
"""verl's naming: ``rlmetrics.connect(..., naming=NAMING)``."""


def connect(backend: str = "local", *, world_size: int | None = None, name: str = "default", **options: Any):
    """:func:`rlmetrics.connect` with verl's naming (:data:`NAMING`).

    >>> import rlmetrics
    >>> client = connect("local", world_size=1, name="verl-doc")
    >>> client.submit_metric({"timing_s/gen": 0.5, "rollout_is_std": [0.1, 0.3]})
    >>> client.wait_submit()
    >>> dict(client.result(0))
    {'timing_s/gen': 0.5, 'rollout_is_std': 0.2}
    >>> rlmetrics.backends.local.drop_worker("verl-doc")
    """
    from rlmetrics.backends import connect as connect_backend

    return connect_backend(backend, world_size=world_size, name=name, naming=NAMING, **options)


def submit_validation_metrics(
    client: Any,
    data_sources: Sequence[Any],
    sample_uids: Sequence[Any],
    infos_dict: Mapping[str, Sequence[Any]],
    seed: int = 42,
    expected_acc_counts: Mapping[tuple[Any, Any], int] | None = None,
    *,
    sample_turns: Sequence[Any] = (),
    world_size: int | None = None,
    step: int | None = None,
) -> None:
    """Send this rank's validation samples with verl's semantics; the aggregator computes the keys
    verl's trainer logs (``val-core/...``, ``val-aux/...``) once over every rank's samples."""
    client.process_local_validation_metrics(
        data_sources,
        sample_uids,
        infos_dict,
        sample_turns,
        world_size,
        step,
        style="verl",
        seed=seed,
        expected_counts=expected_acc_counts,
    )


__all__ = ["NAMING", "Naming", "connect", "submit_validation_metrics"]
