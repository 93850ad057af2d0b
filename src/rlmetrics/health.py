"""Health monitors: rules evaluated on every merged step, and an :class:`Alert` when one starts to hold.

Over 400 lines on purpose: the built-in rules, the Monitor that runs them and the Alert they raise,
each rule a few lines beside its documentation (docs/health.md, "The rules and their defaults").

>>> monitor = Monitor()
>>> [a.rule for a in monitor.observe(0, {"actor/grad_norm": 1.5, "critic/score/mean": 0.2})]
[]
>>> for a in monitor.observe(1, {"actor/grad_norm": float("nan"), "critic/score/mean": 0.2}):
...     print(a)
step 1 error non_finite: actor/grad_norm is nan
step 1 error grad_norm: actor/grad_norm is nan
>>> monitor.observe(2, {"actor/grad_norm": float("nan"), "critic/score/mean": 0.2})  # still: no repeat
[]
>>> def low_score(step, metrics):  # a user rule: a message while it holds
...     if metrics.get("critic/score/mean", 1.0) < 0.1:
...         return "mean score below 0.1"
>>> monitor = Monitor([*default_rules(silent=None), low_score])
>>> [str(a) for a in monitor.observe(0, {"critic/score/mean": 0.05})]
['step 0 warning low_score: mean score below 0.1']
"""

from __future__ import annotations

import logging
import math
import re
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from rlmetrics.globs import compile_globs
from rlmetrics.messages import rank_name

logger = logging.getLogger(__name__)

LEVELS = ("warning", "error")


@dataclass(frozen=True)
class Alert:
    """One rule starting to hold at ``step``: ``metric`` (None: the whole step) and its ``value`` there."""

    rule: str
    step: int
    message: str
    level: str = "warning"
    metric: str | None = None
    value: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return f"step {self.step} {self.level} {self.rule}: {self.message}"


def rule_name(rule: Callable) -> str:
    return str(getattr(rule, "name", None) or getattr(rule, "__name__", None) or type(rule).__name__)


class _Globs:
    """Names matching a glob of ``patterns``, none of ``ignore``: ``globs(name)``, ``globs.select(metrics)``.

    >>> globs = _Globs(["*grad_norm*", "actor/kl"], ignore=["val/*"])
    >>> globs.select({"actor/grad_norm": 1.0, "val/grad_norm": 1.0, "actor/kl": 1.0, "actor/kl/mean": 1.0})
    ['actor/grad_norm', 'actor/kl']
    """

    def __init__(self, patterns: Iterable[str], ignore: Iterable[str] = ()) -> None:
        self._want, self._skip = _regex(patterns), _regex(ignore)
        self._known: dict[str, bool] = {}

    def __call__(self, name: str) -> bool:
        return self._want(name) is not None and self._skip(name) is None

    def select(self, metrics: Mapping[str, Any]) -> list[str]:
        names = metrics.keys()
        new = names - self._known.keys()
        if new:
            if len(self._known) + len(new) > 2 * len(names) + 1024:
                self._known.clear()
                new = names
            hits = set(filter(self._want, new))
            self._known.update(dict.fromkeys(new, False))
            self._known.update(dict.fromkeys(hits.difference(filter(self._skip, hits)), True))
        return list(filter(self._known.__getitem__, names))


def _regex(patterns: Iterable[str]) -> Callable[[str], re.Match | None]:
    """The ``fullmatch`` of one regex for the globs (none: a regex that matches nothing)."""
    return compile_globs(patterns).fullmatch


class Rule:
    """Base of the built-in rules: class attributes are the defaults, keyword arguments override them."""

    name = "rule"
    level = "warning"
    patterns: tuple[str, ...] = ("*",)
    ignore: tuple[str, ...] = ()

    def __init__(self, **options: Any) -> None:
        for key, value in options.items():
            if not hasattr(type(self), key) or key.startswith("_"):
                raise TypeError(f"{type(self).__name__} has no option {key!r}")
            setattr(self, key, tuple(value) if key in ("patterns", "ignore") else value)
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")
        self.matches = _Globs(self.patterns, self.ignore)

    def watched(self, metrics: Mapping[str, float]) -> Iterable[tuple[str, float]]:
        return ((n, metrics[n]) for n in self.matches.select(metrics))

    def __call__(self, step: int, metrics: Mapping[str, float]) -> Mapping[str, str] | str | None:
        raise NotImplementedError  # pragma: no cover - interface

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class NonFinite(Rule):
    """A value is NaN or infinite."""

    name, level = "non_finite", "error"

    def __call__(self, step, metrics):
        return {n: f"{n} is {v}" for n, v in metrics.items() if not math.isfinite(v) and self.matches(n)}


class ZeroStdGroups(Rule):
    """The share of GRPO groups whose rewards are all equal is above ``threshold`` (docs/health.md)."""

    name = "zero_std_groups"
    patterns = ("critic/zero_var_groups/mean",)
    threshold = 0.5

    def __call__(self, step, metrics):
        return {
            n: f"{n} = {v:.3g}: a share of groups above {self.threshold:g} gives no gradient"
            for n, v in self.watched(metrics)
            if v > self.threshold
        }


class GradNorm(Rule):
    """A gradient norm is 0 (no update) or not finite."""

    name, level = "grad_norm", "error"
    patterns = ("*grad_norm*",)

    def __call__(self, step, metrics):
        return {n: f"{n} is {v:g}" for n, v in self.watched(metrics) if v == 0 or not math.isfinite(v)}


class WindowRule(Rule):
    """A rule on each watched metric's finite values: :meth:`check` sees one and up to ``window`` before."""

    window = 10
    max_names = 1000

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        if self.window < 2:
            raise ValueError(f"window must be >= 2, got {self.window}")
        if self.max_names < 1:
            raise ValueError(f"max_names must be >= 1, got {self.max_names}")
        self._history: OrderedDict[str, deque] = OrderedDict()  # least recently logged first

    def __call__(self, step, metrics):
        out = {}
        for n, v in self.watched(metrics):
            if not math.isfinite(v):
                continue
            history = self._history.get(n)
            if history is None:
                history = self._history[n] = deque(maxlen=self.window)
                if len(self._history) > self.max_names:
                    self._history.popitem(last=False)
            else:
                self._history.move_to_end(n)
            message = self.check(n, v, step, history)
            history.append((step, v))
            if message:
                out[n] = message
        return out

    def check(self, name: str, value: float, step: int, history: deque) -> str | None:
        """What is wrong with ``value`` at ``step``, given the ``(step, value)`` before it."""
        raise NotImplementedError  # pragma: no cover - interface


class EntropyCollapse(WindowRule):
    """An entropy's slope over its last ``window`` values is below ``-max_fall`` x their mean."""

    name = "entropy_collapse"
    patterns = ("actor/entropy", "*policy_entropy*")
    max_fall = 0.05

    def check(self, name, value, step, history):
        if len(history) + 1 < self.window:
            return None
        slope, mean = _slope([*history, (step, value)][-self.window :])
        if mean != 0 and slope < -self.max_fall * abs(mean):
            return (
                f"{name} falls by {-slope / abs(mean):.1%} of its mean per step over the last "
                f"{self.window} values (limit {self.max_fall:.1%})"
            )
        return None


def _slope(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope of ``y`` against ``x``, and the mean of ``y``.

    >>> _slope([(0, 1.0), (1, 3.0), (2, 5.0)])
    (2.0, 3.0)
    """
    xs, ys = zip(*points)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return (sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0), my


class Spike(WindowRule):
    """A value above ``ceiling``, or above ``floor`` and ``factor`` x the mean of its recent values."""

    name = "spike"
    factor = 3.0
    floor = 0.0
    ceiling: float | None = None
    min_history = 3

    def check(self, name, value, step, history):
        if self.ceiling is not None and value > self.ceiling:
            return f"{name} = {value:.4g} is above {self.ceiling:g}"
        if len(history) >= self.min_history and value > self.floor:
            base = sum(v for _, v in history) / len(history)
            if value > self.factor * base:
                return f"{name} = {value:.4g} is above {self.factor:g}x its recent mean {base:.4g}"
        return None


class ClipRatioSpike(Spike):
    """The PPO clip fraction jumps."""

    name = "clip_ratio_spike"
    patterns = ("*clipfrac*",)
    floor = 0.05


class ResponseClipSpike(Spike):
    """The share of responses cut at the maximum length jumps."""

    name = "response_clip_spike"
    patterns = ("response/clip_ratio/mean", "response_length/clip_ratio")
    floor = 0.1


class KLBlowup(Spike):
    """The KL to the old or reference policy blows up."""

    name, level = "kl_blowup", "error"
    patterns = ("*ppo_kl", "*kl_loss", "*/kl")
    factor = 10.0
    floor = 0.01
    ceiling = 1.0


class Silent(Rule):
    """A metric logged on ``regular`` consecutive logged steps, then absent from the next ``steps``.

    >>> rule = Silent(steps=2, regular=2)
    >>> logged = [{"a": 1.0, "b": 1.0}, {"a": 1.0}, {"a": 1.0}, {}, {}, {}]
    >>> [rule(step, metrics) for step, metrics in enumerate(logged)]
    [{}, {}, {}, {}, {'a': 'a not logged since step 2 (2 logged steps)'}, {}]
    """

    name = "silent"
    steps = 5
    regular = 5
    ignore = ("val/*", "val-*", "group/*", "response/correct_length/*", "response/wrong_length/*")

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        for option in ("steps", "regular"):
            if getattr(self, option) < 1:
                raise ValueError(f"{option} must be >= 1, got {getattr(self, option)}")
        self._seen = 0  # logged steps so far
        self._steps: deque[tuple[int, int, dict[str, None]]] = deque()  # (index, step, watched names)
        self._last: dict[str, int] = {}  # name -> index of the logged step where it was last logged
        self._start: dict[str, int] = {}  # name -> index where its run of consecutive steps started

    def __call__(self, step, metrics):
        now = self._seen = self._seen + 1
        names = dict.fromkeys(self.matches.select(metrics))
        before = self._steps[-1][2] if self._steps else {}
        self._start.update(dict.fromkeys(names.keys() - before.keys(), now))
        self._last.update(dict.fromkeys(names, now))
        self._steps.append((now, step, names))
        out = {}
        if len(self._steps) > self.steps:
            index, at, old = self._steps.popleft()
            for n in old:
                if self._last[n] == index:  # not logged since
                    del self._last[n]
                    if index - self._start.pop(n) + 1 >= self.regular:
                        out[n] = f"{n} not logged since step {at} ({self.steps} logged steps)"
        return out


class Straggler(Rule):
    """A stage's ``max_over_p50 >= factor`` with the same slowest rank on ``steps`` consecutive logged steps.

    >>> from rlmetrics.messages import StepResult
    >>> def step(i, ratio, rank):
    ...     lists = {"perf/straggler/gen/slowest": [rank, "rank0"]}
    ...     return StepResult({"perf/straggler/gen/max_over_p50": ratio}, i, lists=lists)
    >>> rule = Straggler(steps=2)
    >>> for i, ratio in enumerate([3.0, 2.5, 1.1]):
    ...     print(i, list(rule(i, step(i, ratio, "rank7")).values()))
    0 []
    1 ['rank7 took 2.5x the median gen time on 2 consecutive steps (>= 2x)']
    2 []
    """

    name = "straggler"
    patterns = ("perf/straggler/*/max_over_p50",)
    factor = 2.0
    steps = 3

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        self._runs: dict[str, tuple[str | None, int]] = {}  # watched name -> (slowest rank, run length)

    def __call__(self, step, metrics):
        lists = getattr(metrics, "lists", None) or {}
        runs, out = {}, {}
        for n, v in self.watched(metrics):
            if not (math.isfinite(v) and v >= self.factor):
                continue
            stage = n[len("perf/straggler/") : -len("/max_over_p50")]
            rank = (list(lists.get(f"perf/straggler/{stage}/slowest") or ()) or [None])[0]
            before = self._runs.get(n)
            count = before[1] + 1 if before is not None and before[0] == rank else 1
            runs[n] = (rank, count)
            if count >= self.steps:
                who = "the slowest rank" if rank is None else rank
                out[n] = (
                    f"{who} took {v:.3g}x the median {stage} time on {count} consecutive steps "
                    f"(>= {self.factor:g}x)"
                )
        self._runs = runs
        return out


class LostRank(Rule):
    """A rank whose process is gone (``meta.lost``), reported once, at the step it did not close.

    >>> from rlmetrics.messages import StepMeta, StepResult
    >>> meta = StepMeta.of(missing_ranks=["rank2@vm:1:0123456789abcdef"],
    ...                    lost={"rank2@vm:1:0123456789abcdef": "its Ray actor 5e1f0c2a is dead"})
    >>> print(LostRank()(7, StepResult({}, 7, meta))["rank2"])
    rank2 is gone (its Ray actor 5e1f0c2a is dead): step 7 is partial without it, later steps do not expect it
    """

    name = "lost_rank"
    level = "error"

    def __call__(self, step, metrics):
        lost = getattr(getattr(metrics, "meta", None), "lost", None) or {}
        return {
            rank_name(c): f"{rank_name(c)} is gone ({why}): step {step} is partial without it, later "
            "steps do not expect it"
            for c, why in lost.items()
        }


DEFAULT_RULES: dict[str, type[Rule]] = {
    r.name: r
    for r in (
        NonFinite, ZeroStdGroups, GradNorm, EntropyCollapse, ClipRatioSpike, ResponseClipSpike, KLBlowup,
        Silent, Straggler, LostRank,
    )
}  # fmt: skip
"""The default rules by name, in the order they run."""


def default_rules(**options: Mapping[str, Any] | None) -> list[Rule]:
    """Fresh default rules; ``options`` per rule name: a dict of keyword arguments, or None to drop it.

    >>> [r.name for r in default_rules(silent=None, grad_norm=None, zero_std_groups=None, straggler=None)]
    ['non_finite', 'entropy_collapse', 'clip_ratio_spike', 'response_clip_spike', 'kl_blowup', 'lost_rank']
    """
    unknown = sorted(set(options) - set(DEFAULT_RULES))
    if unknown:
        raise ValueError(f"unknown rule(s) {unknown}; default rules: {list(DEFAULT_RULES)}")
    kept = {name: options.get(name, {}) for name in DEFAULT_RULES}
    return [DEFAULT_RULES[name](**opts) for name, opts in kept.items() if opts is not None]


class Monitor:
    """Runs ``rules`` (default: :func:`default_rules`) on each step; ``on_alert(alert)`` is called once
    every sink wrote the step (docs/health.md, "The callback: stop the run, save a checkpoint")."""

    def __init__(
        self, rules: Iterable[Callable] | None = None, on_alert: Callable[[Alert], Any] | None = None
    ) -> None:
        self.rules = list(default_rules() if rules is None else rules)
        self.on_alert = on_alert
        self.disabled: dict[str, BaseException] = {}  # rule name -> the exception that disabled it
        self._holding: dict[int, set[str]] = {}  # rule index -> metrics (or "") where it held last step

    def observe(self, step: int, metrics: Mapping[str, float]) -> list[Alert]:
        """The alerts of ``step``: the conditions that hold now and did not at the previous step."""
        alerts = []
        for i, rule in enumerate(self.rules):
            name = rule_name(rule)
            if name in self.disabled:
                continue
            try:
                found = _conditions(rule(step, metrics))
            except Exception as exc:
                self.disabled[name] = exc
                logger.error("rule %r failed at step %d and is disabled: %r", name, step, exc, exc_info=exc)
                continue
            before = self._holding.get(i, set())
            level = getattr(rule, "level", "warning")
            for metric, message in found.items():
                if metric not in before:
                    value = metrics.get(metric) if metric else None
                    alerts.append(Alert(name, step, message, level, metric or None, value))
            if found:
                self._holding[i] = set(found)
            else:
                self._holding.pop(i, None)
        return alerts


def _conditions(found: Any) -> dict[str, str]:
    if not found:
        return {}
    if isinstance(found, str):
        return {"": found}
    if isinstance(found, Mapping):
        return {str(k): str(v) for k, v in found.items()}
    raise TypeError(f"a health rule returns None, a message or {{metric: message}}, got {found!r:.80}")


def coverage_metrics(meta: Any) -> dict[str, float]:
    """``meta/coverage`` and ``meta/late`` of a :class:`~rlmetrics.StepMeta` (docs/health.md).

    >>> from rlmetrics.messages import StepMeta
    >>> coverage_metrics(StepMeta(complete=False, contributions=[3, 4], late=2))
    {'meta/coverage': 0.75, 'meta/late': 2.0}
    >>> coverage_metrics(StepMeta()), coverage_metrics(None)
    ({'meta/coverage': 1.0, 'meta/late': 0.0}, {})
    """
    if meta is None:
        return {}
    out = {}
    counts = meta.contributions
    if counts and counts[1] > 0:
        out["meta/coverage"] = counts[0] / counts[1]
    elif meta.complete:
        out["meta/coverage"] = 1.0
    out["meta/late"] = float(meta.late)
    return out
