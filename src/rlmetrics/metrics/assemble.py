"""Names and stat arrays of built-in metrics, assembled and reduced as the aggregator reports them
(numpy only: the aggregator assembles group breakdowns that are merged there, see
:mod:`rlmetrics.metrics.difficulty`).

A computation gives its metrics as *name groups* (a tuple of names sharing one summary, e.g.
``critic/score/mean|max|min``) and a ``(5, K)`` stat array, one column per group;
:func:`with_token_block` spreads them to one column per name and adds the explained variance's
token count and fallback value; :func:`metrics_of_arrays` reduces them to ``{name: float}``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlmetrics.core.reduce import resolve, rules_version
from rlmetrics.core.stat import Stat
from rlmetrics.metrics import VF_RESIDUAL_STD, VF_RETURNS_STD, VF_TOKENS, derive_metrics, vf_explained_var

VF_AUX = (VF_RETURNS_STD, VF_RESIDUAL_STD, VF_TOKENS)


def with_token_block(
    groups: list[tuple[str, ...]], arrays: np.ndarray, token_names: list[tuple[str, ...]], block: np.ndarray
) -> tuple[list[str], np.ndarray]:
    """Names and ``(5, K)`` stat array of the per-sequence summaries, the token summaries and, with
    returns and values, the explained variance (its token count and this batch's value)."""
    names, take, vf = _spread(tuple(groups), tuple(token_names))
    arrays = np.concatenate([arrays, block], axis=1)[:, take]
    if vf is None:
        return list(names), arrays
    n = arrays[0, vf[0]]
    stds = resolve(VF_RETURNS_STD).apply_arrays(arrays[:, vf])
    ev = vf_explained_var(dict(zip(VF_AUX, [*stds.tolist(), n])))
    extra = [(1.0, n, 0.0, n, n)]  # one observation: the rank's token count
    # fallback value for merges without derive_metrics: this rank's value, weighted by its tokens
    extra += [(0.0, 0.0, 0.0, math.inf, -math.inf) if ev is None else (n, ev * n, 0.0, ev, ev)]
    return [*names, VF_TOKENS, "critic/vf_explained_var"], np.concatenate([arrays, np.array(extra).T], axis=1)


@functools.lru_cache(maxsize=256)
def _spread(
    groups: tuple[tuple[str, ...], ...], token_names: tuple[tuple[str, ...], ...]
) -> tuple[tuple[str, ...], np.ndarray, list[int] | None]:
    """The names of the name groups, the column of each name's group, and the columns of the
    explained variance's two stds (None without both): the same every step."""
    groups += token_names
    names = tuple(name for group in groups for name in group)
    take = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    if VF_RETURNS_STD not in names or VF_RESIDUAL_STD not in names:
        return names, take, None
    return names, take, [names.index(k) for k in VF_AUX[:2]]


# ------------------------------------------------------------------------------------ reduced
def metrics_of_arrays(
    names: list[str], arrays: np.ndarray, stats: Mapping[str, Stat] | None = None
) -> dict[str, float]:
    """``{name: float}`` of a ``(5, K)`` stat array as the aggregator reports it: each name by its
    reduction (one vectorised reduction per kind; quantiles from the sketches of ``stats``, the
    Stats of the array), names without observations left out, then
    :func:`rlmetrics.metrics.derive_metrics`."""
    values = column_values(names, arrays, stats)
    has = (arrays[0] > 0).tolist()
    return derive_metrics({name: v for name, v, h in zip(names, values.tolist(), has) if h})


def column_values(
    names: Sequence[str], arrays: np.ndarray, stats: Mapping[str, Stat] | None = None
) -> np.ndarray:
    """The value of each column of a ``(5, K)`` stat array by its name's reduction (NaN where it
    holds no observation), one vectorised reduction per kind; quantiles from the sketches of ``stats``.

    >>> column_values(["x/max", "x/mean"], Stat.of([1.0, 3.0]).to_array()[:, None].repeat(2, 1)).tolist()
    [3.0, 2.0]
    """
    values = np.empty(len(names))
    for reduction, idx in _reductions(tuple(names), rules_version()):
        if reduction.needs_sketch:  # only a user's merged Stats carry sketches
            values[idx] = [reduction.apply(stats[names[i]]) for i in idx]
        else:
            values[idx] = reduction.apply_arrays(arrays[:, idx])
    return values


@functools.lru_cache(maxsize=256)
def _reductions(names: tuple[str, ...], rules: int) -> list[tuple[Any, np.ndarray]]:
    """The names' reductions and the indices of the names each one reduces (names repeat per call;
    ``rules``: :func:`~rlmetrics.core.reduce.rules_version`, so a reduction registered later counts)."""
    groups: dict[Any, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(resolve(name), []).append(i)
    return [(reduction, np.array(idx)) for reduction, idx in groups.items()]


__all__ = ["VF_AUX", "column_values", "metrics_of_arrays", "with_token_block"]
