"""The straggler report: per stage, min / median / max of the ranks' own seconds and the slowest ranks.

Each rank's seconds travel as a :class:`StageTimes` state. Rules: docs/stragglers.md, "How it travels".

>>> report = straggler_metrics({"rank0": {"gen": 1.0}, "rank1": {"gen": 1.2}, "rank2": {"gen": 3.0}})
>>> report["perf/straggler/gen/p50"], report["perf/straggler/gen/max_over_p50"]
(1.2, 2.5)
>>> report["perf/straggler/gen/slowest"]
['rank2', 'rank1', 'rank0']
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from rlmetrics.core.reduce import Reduction
from rlmetrics.core.stat import Stat
from rlmetrics.metrics import STAGE_TIMES
from rlmetrics.metrics.validation.samples import Samples

PREFIX = "perf/straggler/"
SLOWEST = 3
"""How many ranks ``perf/straggler/<stage>/slowest`` names."""
STATS = ("min", "p50", "max", "max_over_p50")
"""The float values of a stage, after its name."""


def straggler_metrics(
    times: Mapping[str, Mapping[str, float]], slowest: int = SLOWEST
) -> dict[str, float | list[str]]:
    """Per stage of ``{rank: {stage: seconds}}``: :data:`STATS` and the ``slowest`` ranks (ties by name)."""
    stages = sorted({stage for per_rank in times.values() for stage in per_rank})
    out: dict[str, float | list[str]] = {}
    for stage in stages:
        ranks = sorted(r for r in times if stage in times[r])
        seconds = np.array([times[r][stage] for r in ranks], dtype=np.float64)
        p50 = float(np.median(seconds))
        top = float(seconds.max())
        head = f"{PREFIX}{stage}/"
        out[head + "min"], out[head + "p50"], out[head + "max"] = float(seconds.min()), p50, top
        if p50 > 0:
            out[head + "max_over_p50"] = top / p50
        order = sorted(range(len(ranks)), key=lambda i: (-seconds[i], ranks[i]))
        out[head + "slowest"] = [ranks[i] for i in order[:slowest]]
    return out


class StageTimes(Samples):
    """``(rank name, {stage: seconds})`` pairs, merging as :class:`Samples`; reducing adds up a rank's
    pairs per stage and gives :func:`straggler_metrics`.

    >>> a, b = StageTimes([("r0", {"gen": 1.0})]), StageTimes([("r1", {"gen": 4.0})])
    >>> both = StageTimes.from_array(a.merge(b).to_array())
    >>> both.reduce(STAGE_TIMES, None, Stat())["perf/straggler/gen/max_over_p50"]
    1.6
    """

    kind: ClassVar[str] = "stage_times"

    @staticmethod
    def check(record: Any) -> None:
        """ValueError unless ``record`` is ``{stage: seconds}``: string stages, finite float seconds."""
        if not isinstance(record, dict):
            raise ValueError(f"stage times must be a dict, got {type(record).__name__}")
        for stage, seconds in record.items():
            if not isinstance(stage, str) or not stage or "/" in stage:
                raise ValueError(f"stage times: stage {stage!r:.60} is not a name")
            if not isinstance(seconds, float) or not math.isfinite(seconds):
                raise ValueError(f"stage times: {stage}: {seconds!r:.60} is not a finite float")

    def check_merge(self, other: Samples) -> None:
        """Stage times of any ranks merge."""

    def validate(self) -> None:
        """ValueError unless each pair is ``(rank name, {stage: seconds})`` (:meth:`check`)."""
        for key, record in self.records:
            if not isinstance(key, str):
                raise ValueError(f"stage times: rank name {key!r:.60} is not a string")
            self.check(record)

    def reduce(self, name: str, reduction: Reduction | None, stat: Stat) -> dict[str, Any]:
        times: dict[str, dict[str, float]] = {}
        for rank, record in sorted(self.records, key=lambda p: (p[0], sorted(p[1].items()))):  # one order
            mine = times.setdefault(rank, {})
            for stage, seconds in record.items():
                mine[stage] = mine.get(stage, 0.0) + seconds
        return straggler_metrics(times)


__all__ = ["PREFIX", "SLOWEST", "STAGE_TIMES", "STATS", "StageTimes", "straggler_metrics"]
