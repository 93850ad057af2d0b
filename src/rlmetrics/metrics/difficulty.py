"""Difficulty groups of GRPO (all correct, all wrong, mixed), decided on each prompt's samples of all ranks.

Ranks send *prompt records*; the aggregator merges them per prompt (:class:`PromptStats`) and classifies
each prompt once. Numpy only. Rules: docs/groups.md, "Difficulty groups of GRPO".

>>> from rlmetrics.core.stat import Stat
>>> groups = [("critic/rewards/mean",), ("response/correct_length/mean",)]
>>> def rows(rewards):  # one prompt's samples: their rewards and correct lengths (length 10)
...     r = np.array(rewards)
...     return np.stack([Stat.of(r).to_array(), Stat.of(np.full((r > 0.5).sum(), 10.0)).to_array()], 1)
>>> rank0 = prompt_record(["p", "q"], groups, np.stack([rows([1.0, 1.0]), rows([0.0])], 1))
>>> rank1 = prompt_record(["q"], groups, rows([1.0])[:, None])  # prompt q's other sample
>>> m = difficulty_metrics([rank0, rank1])
>>> m["difficulty/all_correct_ratio"], m["difficulty/mixed_ratio"], m["difficulty/zero_reward_std_ratio"]
(0.5, 0.5, 0.5)
>>> m["group/difficulty/mixed/critic/rewards/mean"]
0.5
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from rlmetrics.core.groups import group_name
from rlmetrics.core.reduce import Reduction
from rlmetrics.core.stat import Stat, empty_arrays, invalid_column, reduce_parts, reduce_runs
from rlmetrics.core.values import MetricValueError
from rlmetrics.metrics import PROMPT_STATS
from rlmetrics.metrics.assemble import metrics_of_arrays, with_token_block
from rlmetrics.metrics.validation.samples import Samples

TAG = "difficulty"
CLASSES = ("all_correct", "all_wrong", "mixed")
REWARDS = "critic/rewards/mean"
CORRECT = "response/correct_length/mean"


def prompt_record(
    uids: Sequence[str], groups: Sequence[tuple[str, ...]], stats: np.ndarray
) -> dict[str, Any]:
    """One rank's prompt record: prompt ids, name groups and their ``(5, prompts, groups)`` summaries.
    Raises ``MetricValueError`` unless the groups hold the sequence rewards and correct lengths."""
    flat = {name for group in groups for name in group}
    if REWARDS not in flat or CORRECT not in flat:
        raise MetricValueError(
            "difficulty groups need the sequence rewards and response lengths (batch keys "
            "token_level_rewards and response_mask or attention_mask)"
        )
    stats = np.asarray(stats, dtype=np.float64)
    return {"uids": [str(u) for u in uids], "groups": [tuple(g) for g in groups], "stats": stats}


def check_record(record: Any) -> None:
    """ValueError unless ``record`` is ids, name groups and a ``(5, ids, groups)`` float64 array."""
    try:
        uids, groups, stats = record["uids"], record["groups"], record["stats"]
        ok = (
            isinstance(stats, np.ndarray)
            and stats.dtype == np.float64
            and stats.shape == (5, len(uids), len(groups))
            and all(isinstance(u, str) for u in uids)
            and all(isinstance(g, tuple) and g and all(isinstance(n, str) for n in g) for g in groups)
        )
    except (TypeError, KeyError) as exc:
        raise ValueError(f"not a prompt record ({type(exc).__name__}: {exc})") from None
    if not ok:
        raise ValueError("not a prompt record: ids, name groups and a (5, ids, groups) float64 array")


def difficulty_metrics(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The difficulty metrics of the prompt records of all ranks (``{}`` without rewarded prompts)."""
    groups = list(dict.fromkeys(g for r in records for g in r["groups"]))
    column = {g: i for i, g in enumerate(groups)}
    uids = [u for r in records for u in r["uids"]]
    stats = np.empty((5, len(uids), len(groups)))
    stats[:] = empty_arrays(len(groups))[:, None, :]  # a group a rank lacks: no observation
    at = 0
    for r in records:
        n = len(r["uids"])
        stats[:, at : at + n, [column[g] for g in r["groups"]]] = r["stats"]
        at += n
    if not uids:
        return {}
    ids, codes = np.unique(np.array(uids), return_inverse=True)
    order = np.argsort(codes, kind="stable")
    prompts = reduce_runs(stats[:, order], np.searchsorted(codes[order], np.arange(len(ids))))
    rewards = prompts[:, :, _column_of(groups, REWARDS)]
    correct = prompts[0, :, _column_of(groups, CORRECT)]
    samples = rewards[0]
    has = samples > 0
    kinds = np.where(correct >= samples, 0, np.where(correct == 0, 1, 2))
    total = int(has.sum())
    if not total:
        return {}
    out = {f"{TAG}/prompts": float(total)}
    for k, cls in enumerate(CLASSES):
        chosen = has & (kinds == k)
        out[f"{TAG}/{cls}_ratio"] = float(chosen.sum()) / total
        if chosen.any():
            names, arrays = with_token_block(groups, reduce_parts(prompts[:, chosen]), [], np.zeros((5, 0)))
            out.update((group_name(TAG, cls, n), v) for n, v in metrics_of_arrays(names, arrays).items())
    out[f"{TAG}/zero_reward_std_ratio"] = float((has & (rewards[3] == rewards[4])).sum()) / total
    return out


class PromptStats(Samples):
    """``(client id, prompt record)`` pairs, merged as :class:`Samples`, reduced to the difficulty metrics."""

    kind: ClassVar[str] = "prompts"

    @staticmethod
    def check(record: Any) -> None:
        """ValueError unless ``record`` is a prompt record."""
        check_record(record)

    def check_merge(self, other: Samples) -> None:
        """Prompt records of any ranks merge (a group a rank lacks has no observation)."""

    def validate(self) -> None:
        """ValueError unless each record is a valid prompt record with rewards and correct lengths."""
        for _, record in self.records:
            check_record(record)
            names = {name for group in record["groups"] for name in group}
            if REWARDS not in names or CORRECT not in names:
                raise ValueError(f"prompt record: groups without {REWARDS!r} and {CORRECT!r}")
            stats = record["stats"]
            bad = invalid_column(stats.reshape(5, -1))
            if bad is not None:
                uid, group = divmod(bad[0], stats.shape[2])
                raise ValueError(
                    f"prompt record: prompt {record['uids'][uid]!r:.60}, {record['groups'][group]}: {bad[1]}"
                )

    def reduce(self, name: str, reduction: Reduction | None, stat: Stat) -> dict[str, float]:
        return difficulty_metrics([record for _, record in self.records])


def _column_of(groups: list[tuple[str, ...]], name: str) -> int:
    return next(i for i, g in enumerate(groups) if name in g)


__all__ = [
    "CLASSES", "PROMPT_STATS", "TAG", "PromptStats", "check_record", "difficulty_metrics", "prompt_record",
]  # fmt: skip
