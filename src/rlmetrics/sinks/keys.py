"""A key budget and a core view: what each tracker gets of a step, and warnings near W&B's limits.

>>> view = KeyView(["critic/*/mean"], overview=True)
>>> dict(view({"critic/score/mean": 0.5, "critic/vf_explained_var": 0.7, "actor/grad_norm": 2.0}))
{'critic/score/mean': 0.5, 'overview/critic/score/mean': 0.5, 'overview/actor/grad_norm': 2.0}
>>> dict(KeyView("core")({"critic/score/mean": 0.5, "timing_s/gen": 1.0}))
{'critic/score/mean': 0.5}
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlmetrics.globs import compile_globs, glob_regex
from rlmetrics.messages import StepResult
from rlmetrics.sinks.names import histograms_of, lists_of

logger = logging.getLogger(__name__)

CORE_KEYS: tuple[str, ...] = (
    "critic/score/mean",  # score (compute_data_metric)
    "critic/rewards/mean",  # reward
    "response/length/mean",  # response length (ours)
    "response_length/mean",  # response length (verl's names)
    "actor/ppo_kl",  # KL (verl's actor)
    "actor/kl_loss",
    "actor/entropy",  # entropy (verl's actor)
    "actor/entropy/mean",
    "actor/grad_norm",  # grad norm
    "perf/throughput",  # tokens per second per GPU
    "val-core/**/mean@*",  # validation core: each source's (verl's "openai/gsm8k" too) variable's mean@n
)
"""The core set, as globs over the built-in names (docs/metrics.md) and verl's actor names."""

OVERVIEW = "overview/"
"""The prefix of the core set's copy (``overview=True``): its own section in each tracker."""

KEYS = ("all", "core")
"""The words ``keys=`` takes besides a list of globs."""


def check_keys(keys: Any) -> tuple[str, ...] | None:
    """``keys`` as globs (None: every key), or a ValueError naming it and what is accepted."""
    if isinstance(keys, str) and keys in KEYS:
        return None if keys == "all" else ()
    ok = (
        not isinstance(keys, str | bytes)
        and isinstance(keys, Iterable)
        and (globs := tuple(keys))
        and all(isinstance(g, str) and g for g in globs)
    )
    if not ok:
        raise ValueError(
            f"keys={keys!r}: pass 'all' (every key), 'core' (the core set, CORE_KEYS) or a non-empty "
            "list of globs such as ['critic/**', 'actor/grad_norm'] (a list, even of one glob)"
        )
    return globs


class KeyView:
    """What one tracker gets of each step: the keys ``keys`` selects, and ``overview`` copies of ``core``."""

    def __init__(self, keys: Any = "all", core: Sequence[str] = CORE_KEYS, overview: bool = False) -> None:
        self.globs = check_keys(keys)
        if isinstance(core, str):
            raise ValueError(f"core={core!r}: a list of globs, e.g. core=(*CORE_KEYS, {core!r})")
        core = tuple(core)
        if not all(isinstance(g, str) and g for g in core):
            raise ValueError(f"core={core!r}: a list of non-empty globs such as CORE_KEYS")
        self.core = compile_globs(core)
        wanted = core if self.globs == () else self.globs or ()
        self._keep = [compile_globs([g]) for g in wanted]
        self._matched = [False] * len(self._keep)
        self.overview = overview and self.globs != ()  # "core": every key is a core key already
        self._seen: dict[str, tuple[bool, bool]] = {}  # name -> (kept, copied to the overview)

    @property
    def keys(self) -> str | list[str]:
        """``keys`` as given, a list of globs as a list (an iterator read once)."""
        return "all" if self.globs is None else "core" if not self.globs else list(self.globs)

    @property
    def everything(self) -> bool:
        """Every key goes through unchanged (``keys="all"`` without the overview)."""
        return self.globs is None and not self.overview

    def _decide(self, name: str) -> tuple[bool, bool]:
        kept = self.globs is None
        for i, rx in enumerate(self._keep):
            if rx.fullmatch(name):
                kept = self._matched[i] = True
        decision = self._seen[name] = (kept, self.overview and self.core.fullmatch(name) is not None)
        return decision

    def __call__(self, metrics: Mapping[str, Any], copies: bool = True) -> Mapping[str, Any]:
        """The keys of ``metrics`` this view keeps, and (``copies``) the overview's copies."""
        if self.everything or (self.globs is None and not copies):
            return metrics
        seen, decide = self._seen, self._decide
        if self.globs is None:  # every key, and the copies
            values = dict(metrics)
            values.update({OVERVIEW + n: v for n, v in metrics.items() if (seen.get(n) or decide(n))[1]})
        else:
            values = {n: v for n, v in metrics.items() if (seen.get(n) or decide(n))[0]}
            if copies and self.overview:
                values.update({OVERVIEW + n: v for n, v in metrics.items() if seen[n][1]})
        hists, lists = histograms_of(metrics), lists_of(metrics)
        if not hasattr(metrics, "meta") and not hists and not lists:
            return values
        keep = {n for n in (*hists, *lists) if (seen.get(n) or decide(n))[0]}
        return StepResult(
            values,
            getattr(metrics, "step", 0),
            getattr(metrics, "meta", None),
            {n: h for n, h in hists.items() if n in keep},
            {n: v for n, v in lists.items() if n in keep},
        )

    def unmatched(self) -> list[str]:
        """The globs of ``keys`` that matched no key so far (none before a first step)."""
        if not self.globs or not self._seen:
            return []
        return [g for g, hit in zip(self.globs, self._matched) if not hit]

    @property
    def seen(self) -> list[str]:
        """The keys of the steps so far (what :meth:`unmatched` was matched against)."""
        return list(self._seen)


@dataclass(frozen=True)
class Limits:
    """A tracker's documented limits: keys per project, values per minute, histogram points per metric."""

    keys: int
    values_per_minute: int
    histogram_points: int
    source: str


LIMITS: dict[str, Limits] = {
    "wandb": Limits(
        keys=100_000,
        values_per_minute=100_000,
        histogram_points=10_000,
        source="W&B's guidance (docs.wandb.ai, 'Experiments limits and performance')",
    ),
}
"""Tracker name → its documented limits, what :class:`KeyLimits` watches."""


class KeyLimits:
    """Warn once as what a tracker gets nears ``share`` of its :class:`Limits`; ``clock``: seconds.

    >>> now = [0.0]
    >>> watch = KeyLimits("wandb", Limits(10, 100, 3, "test"), clock=lambda: now[0])
    >>> watch.observe({f"k{i}": 0.0 for i in range(8)})  # 8 keys: 80 % of 10
    >>> watch.warned
    ['keys']
    """

    WINDOW = 60.0

    def __init__(
        self,
        tracker: str,
        limits: Limits | None = None,
        share: float = 0.8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tracker = tracker
        self.limits = limits or LIMITS[tracker]
        self.share, self.clock = share, clock
        self.keys: set[str] = set()
        self.recent: deque[tuple[float, int]] = deque()
        self.in_window = 0
        self.points: dict[str, int] = {}
        self.warned: list[str] = []  # "keys", "rate", "histogram:<name>"

    def observe(self, metrics: Mapping[str, Any]) -> None:
        """Count one logged step (its scalars, histograms and lists of names)."""
        hists = histograms_of(metrics)
        names = [*metrics, *hists, *lists_of(metrics)]
        lim, fix = self.limits, "log fewer keys: make_sinks(..., keys='core') or a list of globs"
        if "keys" not in self.warned:
            self.keys.update(names)
            if len(self.keys) >= self.share * lim.keys:
                self._warn(
                    "keys",
                    f"{len(self.keys)} distinct keys, {self.share:.0%} of the {lim.keys} per project"
                    f" of {lim.source}; {fix}",
                )
        if "rate" not in self.warned:
            now = self.clock()
            self.recent.append((now, len(names)))
            self.in_window += len(names)
            while self.recent and self.recent[0][0] <= now - self.WINDOW:
                self.in_window -= self.recent.popleft()[1]
            if self.in_window > self.share * lim.values_per_minute:
                self._warn(
                    "rate",
                    f"{self.in_window} values in the last 60 s, over {self.share:.0%} of the "
                    f"{lim.values_per_minute} per minute of {lim.source}; {fix}, or log less often",
                )
        for name in hists:
            n = self.points[name] = self.points.get(name, 0) + 1
            if n == lim.histogram_points:
                self._warn(
                    f"histogram:{name}",
                    f"histogram {name!r} logged {n} times, the {lim.histogram_points} "
                    f"points per metric of {lim.source}; log it less often or leave it out with keys=",
                )

    def _warn(self, what: str, message: str) -> None:
        self.warned.append(what)
        logger.warning("%s: %s", self.tracker, message)


__all__ = ["CORE_KEYS", "LIMITS", "OVERVIEW", "KeyLimits", "KeyView", "Limits", "check_keys", "glob_regex"]
