"""The per-prompt metrics of a record and their averages per data source (:func:`compute`).

Rules: docs/validation.md, "Semantics, and how it is computed" and "Confidence intervals".
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlmetrics.metrics.validation.bootstrap import bootstrap_group, bootstrap_sizes, dense_codes
from rlmetrics.metrics.validation.exact import exact_group
from rlmetrics.metrics.validation.records import SampleRecord
from rlmetrics.metrics.validation.views import View, seed_view, verl_views

logger = logging.getLogger("rlmetrics.metrics.validation")


Z95 = 1.959963984540054
"""The standard normal's 97.5 % quantile: a two-sided 95 % interval."""


def _has_ci(name: str) -> bool:
    """The estimators that get a confidence interval: pass@k, exact means, unbiased estimators."""
    return name.startswith(("pass@", "pass^")) or name.endswith(("/exact_mean", "/unbiased"))


class _Sums:
    """Per data source sums, counts and sums of squares of per-prompt values, by (var, metric name)."""

    def __init__(self, n_sources: int) -> None:
        self.n = n_sources
        self.data: dict[tuple[str, str], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def add(self, var: str, name: str, src: np.ndarray, values: np.ndarray) -> None:
        entry = self.data.get((var, name))
        if entry is None:
            entry = self.data[(var, name)] = (np.zeros(self.n), np.zeros(self.n), np.zeros(self.n))
        entry[0][:] += np.bincount(src, weights=values, minlength=self.n)
        entry[1][:] += np.bincount(src, minlength=self.n)
        entry[2][:] += np.bincount(src, weights=values * values, minlength=self.n)

    def mean(self, var: str, name: str, s: int) -> float | None:
        entry = self.data.get((var, name))
        if entry is None or entry[1][s] == 0:
            return None
        return float(entry[0][s] / entry[1][s])

    def interval(self, var: str, name: str, s: int) -> tuple[float, float] | None:
        """The 95 % confidence interval of :meth:`mean` across prompts (None below two prompts)."""
        entry = self.data.get((var, name))
        if entry is None or entry[1][s] < 2:
            return None
        total, count, squares = (float(e[s]) for e in entry)
        mean = total / count
        var_ = max(squares - count * mean * mean, 0.0) / (count - 1)
        half = Z95 * math.sqrt(var_ / count)
        return mean - half, mean + half


class Result:
    def __init__(self) -> None:
        self.metrics: dict[tuple[Any, str], dict[str, float]] = {}  # the seed's names, in its order
        self.extras: dict[tuple[Any, str], dict[str, float]] = {}
        self.n_max: dict[tuple[Any, str], int] = {}
        self.pooled_std: dict[tuple[Any, str], float] = {}
        self.test_score: dict[Any, float] = {}


def _seed_names(n: int, has_pred: bool) -> list[str]:
    names = [f"mean@{n}"]
    if n > 1:
        names.append(f"std@{n}")
    for k in bootstrap_sizes(n):
        names += [f"best@{k}/mean", f"best@{k}/std", f"worst@{k}/mean", f"worst@{k}/std"]
        if has_pred:
            names += [f"maj@{k}/mean", f"maj@{k}/std"]
    return names


def _extra_names(n: int, has_pred: bool) -> list[str]:
    names = [f"pass{sign}{k}" for k in (1, *bootstrap_sizes(n)) for sign in "@^"]
    for k in bootstrap_sizes(n):
        for metric in ("best", "worst", "maj") if has_pred else ("best", "worst"):
            names += [f"{metric}@{k}/exact_mean", f"{metric}@{k}/exact_std", f"{metric}@{k}/unbiased"]
    return names


def at_n(name: str) -> int:
    return int(name.split("@")[-1].split("/")[0])


def compute(record: SampleRecord, seed: int, n_bootstrap: int, exact: bool) -> Result:
    sources = record.sources
    n_src = len(sources)
    verl = record.style == "verl"
    if verl:
        views, group_source, variables = verl_views(record)
    else:
        views, group_source = [seed_view(record)], np.asarray(record.group_source, dtype=np.intp)
        variables = list(views[0].values)
    run = _Run(group_source, _Sums(n_src), seed, n_bootstrap, exact, record.tie)
    run.pooled = {v: (np.zeros(n_src), np.zeros(n_src)) for v in variables}
    run.binary = {v: np.zeros(n_src) for v in variables}
    per_var: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # used groups and group sizes
    for view in views:
        per_var.update(_add_view(view, run))
    sums, pooled, binary = run.sums, run.pooled, run.binary

    res = Result()
    for s, src_name in enumerate(sources):
        in_src = group_source == s
        for v in variables:
            if v not in per_var:
                continue
            used, counts = per_var[v]
            sel = np.flatnonzero(in_src & used)
            if not len(sel):
                continue
            seq = counts[sel]
            ns = seq[np.sort(np.unique(seq, return_index=True)[1])].tolist()  # order of first appearance
            key = (src_name, v)
            res.n_max[key] = max(ns)
            metrics = res.metrics[key] = {}
            for n in ns:
                for name in _seed_names(n, True):
                    value = sums.mean(v, name, s)
                    if name not in metrics and value is not None:  # maj: where prompts voted
                        metrics[name] = value
            if pooled[v][1][s] > 0:
                res.pooled_std[key] = float(np.sqrt(pooled[v][0][s] / pooled[v][1][s]))
            if exact:
                extras = res.extras[key] = {}
                for n in ns:
                    for name in _extra_names(n, True):
                        if name.startswith("pass") and binary[v][s] > 0:
                            continue
                        value = sums.mean(v, name, s)
                        if name not in extras and value is not None:
                            extras[name] = value
                            ci = sums.interval(v, name, s) if _has_ci(name) else None
                            if ci is not None:
                                extras[f"{name}/ci_low"], extras[f"{name}/ci_high"] = ci
    reward = record.values.get("reward")
    if reward is not None and not verl:
        group = np.asarray(record.group, dtype=np.intp)
        masks = record.numeric
        sample_src = group_source[group]
        weight = masks["reward"].astype(np.float64) if "reward" in masks else np.ones(len(reward))
        total = np.bincount(sample_src, weights=reward, minlength=n_src)
        size = np.bincount(sample_src, minlength=n_src)
        numbers_in = np.bincount(sample_src, weights=weight, minlength=n_src)
        for s, src_name in enumerate(sources):
            if numbers_in[s] > 0:
                res.test_score[src_name] = float(total[s] / size[s])
    return res


@dataclass
class _Run:
    """One computation: the groups' data sources, its settings, and what the views add up."""

    group_source: np.ndarray
    sums: _Sums
    seed: int
    n_bootstrap: int
    exact: bool
    tie: str = "first"
    pooled: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # sum of squares, dof
    binary: dict[str, np.ndarray] = field(default_factory=dict)  # prompts with a value outside {0, 1}


def _add_view(view: View, run: _Run) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Add a view's per-prompt metrics to ``run``; per variable, the groups using it and group sizes."""
    n_groups = len(run.group_source)
    counts = np.bincount(view.group, minlength=n_groups)
    order = np.argsort(view.group, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.intp)
    has = counts > 0
    first = order[np.minimum(starts, max(len(order) - 1, 0))] if len(order) else starts
    # a variable counts for a prompt when the prompt's first value is a number
    used = {v: has & (view.numeric[v][first] if v in view.numeric else True) for v in view.values}
    for v, mask in view.numeric.items():
        bad = int((used[v][view.group] & ~mask).sum())
        if bad:
            logger.warning("validation variable %r: %d non-numeric values counted as NaN", v, bad)
    for n in np.unique(counts[has]).tolist():
        gids = np.flatnonzero(counts == n)
        rows = order[starts[gids][:, None] + np.arange(n)]  # (P, n) slots, input order
        votes = np.full(len(gids), view.pred is not None)
        if view.pred is not None and view.vote is not None:
            votes = view.vote[gids]
        for sel, voting in ((votes, True), (~votes, False)):
            if sel.any():
                _add_prompts(view, gids[sel], rows[sel], voting, used, run)
    return {v: (used[v], counts) for v in view.values}


def _add_prompts(
    view: View, gids: np.ndarray, rows: np.ndarray, voting: bool, used: dict[str, np.ndarray], run: _Run
) -> None:
    """The metrics of prompts with ``n`` slots each (``rows``, ``(P, n)``), maj@k when ``voting``."""
    n_src, n = run.sums.n, rows.shape[1]
    pooled, binary = run.pooled, run.binary
    dense = n_classes = None
    if voting and view.pred is not None:
        dense, n_classes = dense_codes(view.pred[rows])
        perm = np.argsort(n_classes, kind="stable")  # similar class counts share a chunk
        gids, rows, dense, n_classes = gids[perm], rows[perm], dense[perm], n_classes[perm]
    src = run.group_source[gids]
    keep = {v: used[v][gids] for v in view.values}
    mats = {v: vals[rows] for v, vals in view.values.items() if keep[v].any()}
    per_prompt: dict[tuple[str, str], np.ndarray] = {}
    for v, mat in mats.items():
        per_prompt[(v, f"mean@{n}")] = mat.mean(axis=1)
        if n > 1:
            std = mat.std(axis=1)
            per_prompt[(v, f"std@{n}")] = std
            ss = np.bincount(src[keep[v]], weights=(std**2 * n)[keep[v]], minlength=n_src)
            pooled[v][0][:] += ss
            pooled[v][1][:] += np.bincount(src[keep[v]], minlength=n_src) * (n - 1)
    if n > 1:
        per_prompt.update(bootstrap_group(mats, dense, n_classes, n, run.seed, run.n_bootstrap, run.tie))
    if run.exact:
        per_prompt.update(exact_group(mats, dense, n_classes, n, run.tie))
        for v, mat in mats.items():
            nonbinary = ~np.all((mat == 0) | (mat == 1), axis=1)
            binary[v] += np.bincount(src[keep[v]], weights=nonbinary[keep[v]], minlength=n_src)
    for (v, name), vals in per_prompt.items():
        run.sums.add(v, name, src[keep[v]], vals[keep[v]])


__all__ = ["Z95", "Result", "at_n", "compute"]
