"""What ``exact=True`` adds: ``pass@k``, ``pass^k``, the exact bootstrap expectations and stds of
best@k / worst@k / maj@k, and their unbiased estimators over all k-subsets.

Rules: docs/validation.md, "Why the bootstrap is biased" and "Cost".
"""

from __future__ import annotations

import functools
import math

import numpy as np

from rlmetrics.metrics.validation.bootstrap import CHUNK_BYTES, bootstrap_sizes


def pass_at_k(n: int, c: np.ndarray | int, k: int) -> np.ndarray:
    """Unbiased pass@k, ``1 - C(n - c, k) / C(n, k)`` (``c`` correct of ``n``); ValueError unless 1 <= k <= n.

    >>> pass_at_k(10, np.array([0, 1, 5, 10]), 3).round(6).tolist()
    [0.0, 0.3, 0.916667, 1.0]
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    table = np.ones(n + 1)
    miss = np.arange(n, -1, -1, dtype=np.float64)  # n - c for c = 0..n
    for i in range(k):
        table *= np.clip(miss - i, 0.0, None) / (n - i)
    return 1.0 - table[np.asarray(c, dtype=np.intp)]


def pass_hat_k(n: int, c: np.ndarray | int, k: int) -> np.ndarray:
    """Unbiased pass^k, ``C(c, k) / C(n, k)`` for ``c`` correct of ``n``; ValueError unless ``1 <= k <= n``.

    >>> pass_hat_k(4, np.array([0, 2, 3, 4]), 2).round(6).tolist()
    [0.0, 0.166667, 0.5, 1.0]
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass^k needs 1 <= k <= n, got k={k}, n={n}")
    table = np.ones(n + 1)
    hits = np.arange(n + 1, dtype=np.float64)  # c = 0..n
    for i in range(k):
        table *= np.clip(hits - i, 0.0, None) / (n - i)
    return table[np.asarray(c, dtype=np.intp)]


@functools.lru_cache(maxsize=256)
def subset_weights(n: int, k: int) -> np.ndarray:
    """``w[i] = C(i, k - 1) / C(n, k)``: P(the ``(i + 1)``-th smallest of ``n`` is a ``k``-subset's max).

    >>> subset_weights(4, 2).tolist() == [0.0, 1 / 6, 2 / 6, 3 / 6]
    True
    """
    if not 1 <= k <= n:
        raise ValueError(f"k-subsets need 1 <= k <= n, got k={k}, n={n}")
    total = math.comb(n, k)
    out = np.array([math.comb(i, k - 1) / total for i in range(n)])
    out.flags.writeable = False
    return out


MAJ_MAX_K = 256
"""The largest ``k`` of the exact maj@k keys (their dynamic program grows as about ``k**3``)."""


def exact_group(
    mats: dict[str, np.ndarray],
    dense: np.ndarray | None,
    n_classes: np.ndarray | None,
    n: int,
    tie: str = "first",
) -> dict[tuple[str, str], np.ndarray]:
    """The ``exact=True`` keys per prompt of ``n`` samples; ``tie="none"``: a tied vote reports 0."""
    out: dict[tuple[str, str], np.ndarray] = {}
    ks = bootstrap_sizes(n)
    for v, mat in mats.items():
        ones = np.where((mat == 0) | (mat == 1), mat, 0).sum(axis=1).astype(np.intp)
        for k in (1, *ks):
            out[(v, f"pass@{k}")] = pass_at_k(n, ones, k)
            out[(v, f"pass^{k}")] = pass_hat_k(n, ones, k)
        srt = np.sort(mat, axis=1)  # NaN last: any NaN makes the expectations NaN
        i = np.arange(1, n + 1, dtype=np.float64)
        for k in ks:
            w_best = (i / n) ** k - ((i - 1) / n) ** k  # P(max of k draws is the i-th smallest)
            for metric, w in (("best", w_best), ("worst", w_best[::-1])):
                mean = srt @ w
                out[(v, f"{metric}@{k}/exact_mean")] = mean
                with np.errstate(invalid="ignore"):
                    out[(v, f"{metric}@{k}/exact_std")] = np.sqrt(((srt - mean[:, None]) ** 2) @ w)
            w_subset = subset_weights(n, k)
            out[(v, f"best@{k}/unbiased")] = srt @ w_subset
            out[(v, f"worst@{k}/unbiased")] = srt @ w_subset[::-1]
    maj_ks = [k for k in ks if k <= MAJ_MAX_K]
    if dense is not None and n_classes is not None and maj_ks and mats:
        names = list(mats)
        majority = _exact_majority(mats, names, dense, n_classes, n, maj_ks, tie == "none")
        for k in maj_ks:
            first, second = majority[(k, False)]
            unbiased, _ = majority[(k, True)]
            for j, v in enumerate(names):
                out[(v, f"maj@{k}/exact_mean")] = first[:, j]
                with np.errstate(invalid="ignore"):
                    out[(v, f"maj@{k}/exact_std")] = np.sqrt(np.maximum(second[:, j] - first[:, j] ** 2, 0.0))
                out[(v, f"maj@{k}/unbiased")] = unbiased[:, j]
    return out


def _exact_majority(
    mats: dict[str, np.ndarray],
    names: list[str],
    dense: np.ndarray,
    n_classes: np.ndarray,
    n: int,
    ks: list[int],
    strict: bool = False,
) -> dict[tuple[int, bool], tuple[np.ndarray, np.ndarray]]:
    """``{(k, subsets): (E[maj value], E[maj value**2])}`` per prompt and variable, for ``k`` draws
    with replacement or (``subsets``) a uniform ``k``-subset; ``strict``: a tie wins for no class."""
    n_prompts = len(dense)
    rows = np.arange(n_prompts)[:, None]
    size = np.zeros((n_prompts, n))
    np.add.at(size, (rows, dense), 1.0)
    d_max = int(n_classes.max())
    order = np.argsort(-size, axis=1, kind="stable")[:, :d_max]  # classes by size, largest first
    partitions, which = np.unique(np.take_along_axis(size, order, axis=1), axis=0, return_inverse=True)
    means = []
    for v in names:
        total = np.zeros((n_prompts, n))
        squares = np.zeros((n_prompts, n))
        np.add.at(total, (rows, dense), mats[v])
        np.add.at(squares, (rows, dense), mats[v] ** 2)
        with np.errstate(invalid="ignore", divide="ignore"):  # empty (padding) classes: 0, not NaN
            means.append((np.where(size > 0, total / size, 0.0), np.where(size > 0, squares / size, 0.0)))
    out = {}
    for k in ks:
        for subsets in (False, True):
            win = np.zeros((n_prompts, n))
            np.put_along_axis(
                win, order, _win_probabilities(partitions, n, k, subsets, strict)[which.ravel()], axis=1
            )
            first = np.stack([(win * mean).sum(axis=1) for mean, _ in means], axis=1)
            second = np.stack([(win * square).sum(axis=1) for _, square in means], axis=1)
            out[(k, subsets)] = first, second
    return out


def _win_probabilities(
    partitions: np.ndarray, n: int, k: int, subsets: bool, strict: bool = False
) -> np.ndarray:
    """``P(class c wins)`` per row of class sizes (largest first, 0-padded); ``strict``: c alone on top.
    A dynamic program per winning count, tracking how many classes reached it."""
    n_rows, d_max = partitions.shape
    count = (partitions > 0).sum(axis=1)
    by_count = np.argsort(count, kind="stable")  # similar class counts share a chunk: little padding
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, max(n, k) + 1)))])
    pmf = _hypergeom_pmf if subsets else _binom_pmf
    out = np.zeros((n_rows, d_max))
    per_row = 8 * (d_max * (k // 2 + 1) * (k + 1) + 3 * (k + 1) * (d_max + 1) * (d_max + 1))
    step = max(1, 4 * CHUNK_BYTES // per_row)
    for lo in range(0, n_rows, step):
        idx = by_count[lo : lo + step]
        d = int(count[idx].max())
        chan = np.broadcast_to(np.eye(d, d + 1, 1), (len(idx), d, d + 1))  # channel 0: the mass
        out[idx, :d] = _majority_dp(partitions[idx, :d], chan, n, k, log_fact, pmf, strict)[:, 1:]
    return out


def _binom_pmf(
    r: np.ndarray, j: np.ndarray, size: np.ndarray, pool: np.ndarray, log_fact: np.ndarray
) -> np.ndarray:
    """P(Bin(r, size / pool) = j), broadcasting; 0 where j > r or ``pool`` is 0."""
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(pool > 0, size / pool, 0.0)
    r, j, q = np.broadcast_arrays(r, j, q)
    valid = j <= r
    with np.errstate(divide="ignore", invalid="ignore"):
        log_p = log_fact[r] - log_fact[np.where(valid, j, 0)] - log_fact[np.where(valid, r - j, 0)]
        log_p = log_p + np.where(j > 0, j * np.log(q), 0.0) + np.where(r > j, (r - j) * np.log1p(-q), 0.0)
    with np.errstate(over="ignore"):  # entries where j > r hold any number: set to 0 below
        return np.where(valid, np.exp(log_p), 0.0)


def _hypergeom_pmf(
    r: np.ndarray, j: np.ndarray, size: np.ndarray, pool: np.ndarray, log_fact: np.ndarray
) -> np.ndarray:
    """``C(size, j) C(pool - size, r - j) / C(pool, r)``, broadcasting; 0 where impossible."""
    r, j, size, pool = np.broadcast_arrays(r, j, size, pool)
    r, j, size, pool = (np.asarray(x).astype(np.intp) for x in (r, j, size, pool))
    valid = (j <= size) & (r - j >= 0) & (r - j <= pool - size) & (r <= pool)

    def log_comb(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a, b = np.where(valid, a, 0), np.where(valid, b, 0)
        return log_fact[a] - log_fact[b] - log_fact[a - b]

    log_p = log_comb(size, j) + log_comb(pool - size, r - j) - log_comb(pool, r)
    with np.errstate(over="ignore"):
        return np.where(valid, np.exp(log_p), 0.0)


def _majority_dp(
    size: np.ndarray,
    chan: np.ndarray,
    n: int,
    k: int,
    log_fact: np.ndarray,
    pmf=_binom_pmf,
    strict: bool = False,
) -> np.ndarray:
    """E[channel of the winning class] for prompts of at most ``d`` classes (size 0: padding);
    ``pmf``: :func:`_binom_pmf` or :func:`_hypergeom_pmf`; ``strict``: a tie wins for no class."""
    n_prompts, d = size.shape
    n_chan = chan.shape[-1]
    remaining = n - np.cumsum(size, axis=1) + size  # samples of class c and the classes after it
    half = k // 2
    r_all, j_all = np.arange(k + 1), np.arange(half + 1)
    tables = [
        pmf(
            r_all[None, None, :],
            j_all[None, :, None],
            size[:, c, None, None],
            remaining[:, c, None, None],
            log_fact,
        )
        for c in range(d)
    ]
    result = np.zeros((n_prompts, n_chan))
    for level in range(-(-k // d), k + 1):
        if 2 * level > k:  # only one class can reach the level, and it wins
            at_level = pmf(np.array(k), np.array(level), size, np.array(n), log_fact)  # (P, d)
            result += np.einsum("pd,pdc->pc", at_level, chan)
            continue
        tied = k // level
        acc = np.zeros(
            (n_prompts, k + 1, tied + 1, n_chan)
        )  # [prompt, draws left, classes at level, channel]
        acc[:, k, 0, 0] = 1.0
        for c in range(d):
            new = np.zeros_like(acc)
            r_lo, r_hi = max(0, k - c * level), min(k, (d - c) * level)  # states that can still end at 0
            for j in range(level + 1):
                lo = max(j, r_lo)
                if lo > r_hi:
                    continue
                w = tables[c][:, j, lo : r_hi + 1, None, None]
                if j < level:
                    new[:, lo - j : r_hi + 1 - j] += acc[:, lo : r_hi + 1] * w
                else:
                    src = acc[:, lo : r_hi + 1, :-1]
                    new[:, lo - j : r_hi + 1 - j, 1:] += (src + src[..., :1] * chan[:, None, None, c]) * w
            acc = new
        if strict:
            result += acc[:, 0, 1]
            continue
        ways = np.arange(1, tied + 1, dtype=np.float64)
        result += (acc[:, 0, 1:] / ways[None, :, None]).sum(axis=1)
    return result


__all__ = ["MAJ_MAX_K", "exact_group", "pass_at_k", "pass_hat_k", "subset_weights"]
