"""Names and ``(5, K)`` stat arrays of built-in metrics, assembled and reduced as the aggregator does.

Numpy only (the aggregator uses it too). A *name group* is a tuple of names sharing one summary
(``critic/score/mean|max|min``); :func:`with_token_block` spreads groups to one column per name,
:func:`metrics_of_arrays` reduces the columns to ``{name: float}``.
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
    """Names and ``(5, K)`` array of the summaries, plus the explained variance's token count and value."""
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
    """Names, each name's group column, and the explained variance's two std columns (or None)."""
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
    """``{name: float}`` as reported: :func:`column_values`, empty names left out, then derived."""
    values = column_values(names, arrays, stats)
    has = (arrays[0] > 0).tolist()
    return derive_metrics({name: v for name, v, h in zip(names, values.tolist(), has) if h})


def column_values(
    names: Sequence[str], arrays: np.ndarray, stats: Mapping[str, Stat] | None = None
) -> np.ndarray:
    """Each column reduced by its name's reduction (NaN when empty); quantiles read ``stats``' sketches.

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
    """Each reduction with its names' indices; ``rules`` keys the cache on later registrations."""
    groups: dict[Any, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(resolve(name), []).append(i)
    return [(reduction, np.array(idx)) for reduction, idx in groups.items()]


__all__ = ["VF_AUX", "column_values", "metrics_of_arrays", "with_token_block"]
