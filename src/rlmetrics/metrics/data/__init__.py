"""Data metrics of a PPO / GRPO batch: the seed's ``compute_data_metric``, exact under merging.

:func:`compute_data_stats` gives mergeable Stats, :func:`compute_data_metric` the seed's ``{name: float}``;
submodules ``sequences``, ``tokens`` (response tokens), ``grouped`` (breakdowns), ``verl_style``.
Rules: docs/metrics.md, "What the data metrics summarize".
"""

from __future__ import annotations

import functools
import os
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import psutil

from rlmetrics.core.groups import GroupBy
from rlmetrics.core.reduce import resolve, rules_version
from rlmetrics.core.stat import FIELDS, Stat
from rlmetrics.core.summary import NAN_STRATEGIES
from rlmetrics.metrics import is_aux
from rlmetrics.metrics.data.grouped import Breakdowns
from rlmetrics.metrics.data.sequences import (
    CORRECT_THRESHOLD,
    column_values,
    fetch,
    metrics_of_arrays,
    sequence_parts,
    sequence_tensors,
)
from rlmetrics.metrics.data.tokens import TokenSummaries, triple
from rlmetrics.metrics.data.verl_style import (
    compute_variance_proxy_stats,
    compute_verl_data_stats,
    verl_data_arrays,
    verl_lengths,
)
from rlmetrics.metrics.difficulty import difficulty_metrics
from rlmetrics.metrics.tensors import Batch, BatchTensors

HISTOGRAMS = {
    "response_mask": "response/length/hist",
    "prompt_mask": "prompt/length/hist",
    "token_level_scores": "critic/score/hist",
    "advantages": "critic/advantages/hist",
}
"""Batch key (a mask: its lengths; ``advantages``: its response tokens) → histogram name."""
DEFAULT_HISTOGRAMS = ("response/length/hist", "prompt/length/hist", "critic/score/hist")
"""The histograms :func:`compute_data_stats` (and ``compute_local_data_metric``) give by default."""
_HIST_KEYS = ("_hist/advantages", "_hist/response_mask")  # the token tensors, moved with the others


# ----------------------------------------------------------------------------------------- public
def compute_data_stats(
    batch: Batch,
    *,
    aux: bool = True,
    torch_compile: bool = False,
    nan_strategy: str = "propagate",
    group_by: GroupBy = None,
    histograms: bool | Collection[str] = True,
) -> dict[str, Stat]:
    """One mergeable :class:`Stat` per data metric of ``batch``. ``nan_strategy``, ``torch_compile``:
    docs/reductions.md; ``aux=False``: without the explained variance's ``_aux/`` Stats; ``histograms``:
    names of :data:`HISTOGRAMS` as sketched Stats (True: the defaults); ``group_by``: docs/groups.md.

    >>> import torch
    >>> attention_mask = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])  # prompt 2, response 3
    >>> advantages = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
    >>> batch = {"responses": torch.zeros(2, 3), "attention_mask": attention_mask, "advantages": advantages}
    >>> stats = compute_data_stats(batch)
    >>> s = stats["critic/advantages/mean"]
    >>> (s.count, s.mean, stats["response/length/mean"].count)
    (5.0, 3.0, 2.0)
    """
    return data_stats_and_prompts(
        batch, aux=aux, torch_compile=torch_compile, nan_strategy=nan_strategy, group_by=group_by,
        histograms=histograms,
    )[0]  # fmt: skip


def data_stats_and_prompts(
    batch: Batch,
    *,
    aux: bool = True,
    torch_compile: bool = False,
    nan_strategy: str = "propagate",
    group_by: GroupBy = None,
    difficulty: bool | str = False,
    histograms: bool | Collection[str] = True,
    errors: dict[str, str] | None = None,
) -> tuple[dict[str, Stat], dict[str, Any] | None]:
    """:func:`compute_data_stats` and the difficulty prompt record (or None), from one transfer; with
    ``errors``, a ``group_by`` tag whose labels are refused is left out, its message under its tag."""
    wanted = DEFAULT_HISTOGRAMS if histograms is True else () if histograms is False else tuple(histograms)
    unknown = set(wanted) - set(HISTOGRAMS.values())
    if unknown:
        raise ValueError(f"unknown histogram(s) {sorted(unknown)}; built in: {sorted(HISTOGRAMS.values())}")
    names, arrays, record, hists = _data_arrays(
        batch, torch_compile, nan_strategy, group_by, difficulty, wanted, errors=errors
    )
    stats = {name: Stat(*column) for name, column in zip(names, arrays.T.tolist())}
    stats.update(hists)
    if not aux:
        for name in [n for n in stats if is_aux(n)]:
            stats.pop(name, None)
    return stats, record


def compute_data_metric(
    batch: Batch,
    *,
    torch_compile: bool = False,
    nan_strategy: str = "propagate",
    group_by: GroupBy = None,
    difficulty: bool | str = False,
) -> dict[str, float]:
    """The seed's data metrics of ``batch`` as ``{name: float}`` (arguments as :func:`compute_data_stats`);
    ``difficulty``: also GRPO's difficulty groups, prompt ids from the ``uid`` key (``True``) or that key.

    >>> import torch
    >>> attention_mask = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])  # prompt 2, response 3
    >>> rewards = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    >>> batch = {"responses": torch.zeros(2, 3), "attention_mask": attention_mask}
    >>> batch["token_level_rewards"] = rewards
    >>> m = compute_data_metric(batch)
    >>> m["response/length/mean"], m["prompt/length/max"], m["response/clip_ratio/mean"]
    (2.5, 2.0, 0.5)
    >>> m["critic/rewards/mean"], m["response/correct_length/mean"], m["response/wrong_length/mean"]
    (0.5, 3.0, 2.0)
    >>> batch["data_source"] = ["gsm8k", "math"]
    >>> m = compute_data_metric(batch, group_by="data_source")
    >>> m["group/data_source/gsm8k/response/length/mean"], m["group/data_source/math/critic/rewards/mean"]
    (2.0, 1.0)
    >>> batch["uid"] = ["p", "p"]  # one prompt, one of its two samples correct
    >>> compute_data_metric(batch, difficulty=True)["difficulty/mixed_ratio"]
    1.0
    """
    names, arrays, record, _ = _data_arrays(
        batch,
        torch_compile,
        nan_strategy,
        group_by,
        difficulty,
        m2=_m2_read(rules_version()),  # by default no reported metric reads them
    )
    out = metrics_of_arrays(names, arrays)
    if record is not None:
        out.update(difficulty_metrics([record]))
    return out


def data_metrics_from_stats(stats: Mapping[str, Stat]) -> dict[str, float]:
    """(Merged) data Stats as ``{name: float}``, as the aggregator reduces them; histograms left out.

    >>> import torch
    >>> a = compute_data_stats({"advantages": torch.tensor([[1.0, 2.0]]), "response_mask": torch.ones(1, 2)})
    >>> b = compute_data_stats({"advantages": torch.tensor([[6.0, 0.0]]), "response_mask": torch.eye(2)[:1]})
    >>> merged = {n: a[n].merge(b[n]) for n in a}
    >>> data_metrics_from_stats(merged)["critic/advantages/mean"]
    3.0
    """
    stats = {name: s for name, s in stats.items() if not resolve(name).histogram}
    names = list(stats)
    arrays = np.array([[s.count, s.sum, s.m2, s.min, s.max] for s in stats.values()]).T
    return metrics_of_arrays(names, arrays.reshape(5, len(names)), stats)


# -------------------------------------------------------------------------------------- internals
@functools.lru_cache(maxsize=8)
def _m2_read(rules: int) -> bool:
    """Whether a (registered) reduction of an advantages or values name reads M2."""
    names = [*triple("critic/advantages"), *triple("critic/values")]
    return any(FIELDS.index("m2") in resolve(n).fields for n in names)


_PROCESS: dict[int, psutil.Process] = {}  # one per pid: a forked child reads its own memory


def _rss_bytes() -> int:
    """This process's resident set size, through a kept ``psutil.Process`` (a new one costs twice)."""
    pid = os.getpid()
    process = _PROCESS.get(pid) or _PROCESS.setdefault(pid, psutil.Process(pid))
    return process.memory_info().rss


def _data_arrays(
    batch: Batch,
    torch_compile: bool,
    nan_strategy: str,
    group_by: GroupBy,
    difficulty: bool | str,
    histograms: Collection[str] = (),
    m2: bool = True,
    errors: dict[str, str] | None = None,
) -> tuple[list[str], np.ndarray, dict[str, Any] | None, dict[str, Stat]]:
    """Names and ``(5, K)`` array, prompt record, sketched ``histograms``; ``m2=False``: M2 may be NaN."""
    if nan_strategy not in NAN_STRATEGIES:
        raise ValueError(f"nan_strategy must be one of {NAN_STRATEGIES}, got {nan_strategy!r}")
    t = BatchTensors(batch)
    prompts = ("uid" if difficulty is True else difficulty) or None
    breakdowns = Breakdowns(group_by, t.batch, batch, prompts, errors)
    seq = sequence_tensors(t)
    mask = t.response_mask
    if HISTOGRAMS["advantages"] in histograms and mask is not None:
        advantages = t.get("advantages")
        if advantages is not None:
            seq = {**seq, _HIST_KEYS[0]: advantages, _HIST_KEYS[1]: mask}
    tokens = None if mask is None else TokenSummaries.of(t, mask, torch_compile, rows=bool(breakdowns), m2=m2)
    host, block, moved = fetch(seq, tokens, breakdowns.tensors)
    hists = _histogram_stats(host, nan_strategy, histograms) if histograms else {}
    if nan_strategy != "propagate" and tokens is not None:
        block = tokens.finite(block, nan_strategy)
    parts = sequence_parts(host, t, nan_strategy)
    names, arrays, record = breakdowns.assemble(moved, parts, tokens, block, nan_strategy)
    rss_gb = _rss_bytes() / 1024**3
    names.append("perf/process_cpu_mem_used_gb")
    return (
        names,
        np.concatenate([arrays, np.array([(1.0, rss_gb, 0.0, rss_gb, rss_gb)]).T], axis=1),
        record,
        hists,
    )


def _histogram_stats(
    host: dict[str, np.ndarray], nan_strategy: str, histograms: Collection[str]
) -> dict[str, Stat]:
    """Stats with sketches of the ``histograms`` whose vectors are in ``host``."""
    if _HIST_KEYS[0] in host:
        tokens = host.pop(_HIST_KEYS[0])[host.pop(_HIST_KEYS[1]) != 0]
        host = {**host, "advantages": tokens}
    return {
        name: Stat.of(host[key], sketch=True, nan_strategy=nan_strategy, name=name)
        for key, name in HISTOGRAMS.items()
        if key in host and name in histograms
    }


__all__ = [
    "CORRECT_THRESHOLD",
    "DEFAULT_HISTOGRAMS",
    "HISTOGRAMS",
    "compute_data_metric",
    "compute_data_stats",
    "compute_variance_proxy_stats",
    "column_values",
    "compute_verl_data_stats",
    "data_metrics_from_stats",
    "data_stats_and_prompts",
    "verl_data_arrays",
    "verl_lengths",
]
