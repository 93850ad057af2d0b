"""Derived metrics: values computed after the merge from several merged values, as a declared table.

Ingredients travel under :data:`AUX_PREFIX` names; the engine's table is ``Aggregator(derived=...)``,
default :data:`DERIVED` (docs/reductions.md, "Derived metrics: ratios are computed from merged sums").

>>> ratio = Derived("perf/ratio", ("_aux/ratio/a/sum", "_aux/ratio/b/sum"),
...                 lambda v: v["_aux/ratio/a/sum"] / v["_aux/ratio/b/sum"])
>>> derive({"_aux/ratio/a/sum": 3.0, "_aux/ratio/b/sum": 4.0, "loss": 0.5}, [ratio])
{'loss': 0.5, 'perf/ratio': 0.75}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from rlmetrics.core.groups import GROUP_PREFIX, split_group_name

AUX_PREFIX = "_aux/"
"""Names under this prefix carry the ingredients of derived metrics; they are not reported."""


class Derived(NamedTuple):
    """``name``, its ``ingredients`` (under :data:`AUX_PREFIX`) and ``fn(merged)``: the value, or None."""

    name: str
    ingredients: tuple[str, ...]
    fn: Callable[[Mapping[str, float]], float | None]


DERIVED: list[Derived] = []
"""The engine's default table (``Aggregator(derived=None)``): the metric families append theirs."""


def is_aux(name: str) -> bool:
    """Whether ``name`` carries an ingredient of a derived metric (also in a group).

    >>> is_aux("_aux/x/sum"), is_aux("group/src/a/_aux/x/sum"), is_aux("critic/score/mean")
    (True, True, False)
    """
    grouped = split_group_name(name) if name.startswith(GROUP_PREFIX) else None
    return (name if grouped is None else grouped[1]).startswith(AUX_PREFIX)


def derive(values: Mapping[str, float], table: Iterable[Derived]) -> dict[str, float]:
    """The reported metrics of a merged result: ``table`` computed (per group), auxiliary names dropped.

    >>> n = "_aux/x/n/sum"
    >>> mean = Derived("x/mean", (n,), lambda v: v["x/sum"] / v[n] if v.get(n) else None)
    >>> derive({"group/src/a/x/sum": 6.0, "group/src/a/_aux/x/n/sum": 3.0}, [mean])
    {'group/src/a/x/sum': 6.0, 'group/src/a/x/mean': 2.0}
    """
    out: dict[str, float] = {}
    prefixes: dict[str, None] = {}  # groups with ingredients ("": no group), in order
    for name, v in values.items():
        if AUX_PREFIX in name and is_aux(name):
            grouped = split_group_name(name) if name.startswith(GROUP_PREFIX) else None
            prefixes[grouped[0] if grouped else ""] = None
        else:
            out[name] = v
    table = list(table)
    for prefix in prefixes:
        group = _Group(values, prefix)
        for item in table:
            v = item.fn(group)
            if v is not None:
                out[prefix + item.name] = v
    return out


class _Group(Mapping):
    """The names of one group of a result, without the group's prefix (a view)."""

    def __init__(self, values: Mapping[str, float], prefix: str) -> None:
        self._values, self._prefix = values, prefix

    def __getitem__(self, name: str) -> float:
        return self._values[self._prefix + name]

    def get(self, name: str, default: Any = None) -> Any:  # no KeyError raised for the usual miss
        return self._values.get(self._prefix + name, default)

    def __iter__(self) -> Any:
        n = len(self._prefix)
        return (name[n:] for name in self._values if name.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def without_reserved(
    metrics: Mapping[str, Any], errors: dict[str, str], table: Iterable[Derived] | None = None
) -> Mapping[str, Any]:
    """``metrics`` without the :data:`AUX_PREFIX` names that are no ingredient of ``table`` (default
    :data:`DERIVED`), their messages in ``errors``; ``metrics`` itself when there are none.

    >>> errors = {}
    >>> without_reserved({"_aux/mine": 1.0, "_aux/x/n/sum": 3.0, "loss": 0.5}, errors,
    ...                  [Derived("x/mean", ("_aux/x/n/sum",), lambda v: None)])
    {'_aux/x/n/sum': 3.0, 'loss': 0.5}
    >>> print(errors["_aux/mine"])
    metric '_aux/mine': the prefix '_aux/' is reserved for the ingredients of derived metrics, which are \
never reported; rename it (e.g. 'aux/mine')
    """
    refused = [n for n in metrics if isinstance(n, str) and AUX_PREFIX in n and is_aux(n)]
    if not refused:
        return metrics
    taken = {name for item in (DERIVED if table is None else table) for name in item.ingredients}
    refused = [n for n in refused if (split_group_name(n) or ("", n))[1] not in taken]
    for name in refused:
        prefix, metric = split_group_name(name) or ("", name)
        errors[name] = (
            f"metric {name!r}: the prefix {AUX_PREFIX!r} is reserved for the ingredients of derived metrics, "
            f"which are never reported; rename it (e.g. {prefix + 'aux/' + metric[len(AUX_PREFIX) :]!r})"
        )
    return {n: v for n, v in metrics.items() if n not in refused} if refused else metrics


__all__ = ["AUX_PREFIX", "DERIVED", "Derived", "derive", "is_aux", "without_reserved"]
