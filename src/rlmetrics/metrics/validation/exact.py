"""What ``exact=True`` adds (beyond the seed): ``pass@k`` (Chen et al. 2021) and the exact expectation
and std of the best@k / worst@k / maj@k bootstrap distributions, without sampling noise.
"""

from __future__ import annotations

import numpy as np

from rlmetrics.metrics.validation.bootstrap import CHUNK_BYTES, bootstrap_sizes


def pass_at_k(n: int, c: np.ndarray | int, k: int) -> np.ndarray:
    """Unbiased pass@k (Chen et al. 2021): ``1 - C(n - c, k) / C(n, k)`` for ``c`` correct of ``n``
    samples, as the product ``prod_{i<k} (n - c - i) / (n - i)`` (no large binomials).

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


def exact_group(
    mats: dict[str, np.ndarray], dense: np.ndarray | None, n_classes: np.ndarray | None, n: int
) -> dict[tuple[str, str], np.ndarray]:
    """pass@k and the exact best/worst/maj expectations and stds per prompt (``n`` samples each)."""
    out: dict[tuple[str, str], np.ndarray] = {}
    ks = bootstrap_sizes(n)
    for v, mat in mats.items():
        ones = np.where((mat == 0) | (mat == 1), mat, 0).sum(axis=1).astype(np.intp)
        for k in (1, *ks):
            out[(v, f"pass@{k}")] = pass_at_k(n, ones, k)
        srt = np.sort(mat, axis=1)  # NaN last: any NaN makes the expectations NaN
        i = np.arange(1, n + 1, dtype=np.float64)
        for k in ks:
            w_best = (i / n) ** k - ((i - 1) / n) ** k  # P(max of k draws is the i-th smallest)
            for metric, w in (("best", w_best), ("worst", w_best[::-1])):
                mean = srt @ w
                out[(v, f"{metric}@{k}/exact_mean")] = mean
                with np.errstate(invalid="ignore"):
                    out[(v, f"{metric}@{k}/exact_std")] = np.sqrt(((srt - mean[:, None]) ** 2) @ w)
    if dense is not None and n_classes is not None and ks and mats:
        names = list(mats)
        for k in ks:
            first, second = _exact_majority(mats, names, dense, n_classes, n, k)
            for j, v in enumerate(names):
                out[(v, f"maj@{k}/exact_mean")] = first[:, j]
                with np.errstate(invalid="ignore"):
                    out[(v, f"maj@{k}/exact_std")] = np.sqrt(np.maximum(second[:, j] - first[:, j] ** 2, 0.0))
    return out


def _exact_majority(
    mats: dict[str, np.ndarray], names: list[str], dense: np.ndarray, n_classes: np.ndarray, n: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """E[maj value] and E[maj value**2] per prompt and variable, under ``k`` draws with replacement.

    Given the vote counts, the reported value is that of a uniform member of the winning class, and
    among tied classes each wins with probability 1/(number tied). So E = sum over classes c of
    P(c wins) * (mean of c). P(c wins) comes from a dynamic program per level L (the winning count):
    classes are visited in turn, each taking j <= L of the remaining r draws (binomial), tracking how
    many classes reached exactly L; the channel sums carry the class means of those that did."""
    n_prompts = len(dense)
    rows = np.arange(n_prompts)[:, None]
    size = np.zeros((n_prompts, n))
    np.add.at(size, (rows, dense), 1.0)
    chans = [np.zeros_like(size)]  # channel 0: the probability mass itself (adds no class value)
    for v in names:
        total = np.zeros((n_prompts, n))
        squares = np.zeros((n_prompts, n))
        np.add.at(total, (rows, dense), mats[v])
        np.add.at(squares, (rows, dense), mats[v] ** 2)
        with np.errstate(invalid="ignore", divide="ignore"):  # empty (padding) classes: 0, not NaN
            chans += [np.where(size > 0, total / size, 0.0), np.where(size > 0, squares / size, 0.0)]
    chan = np.stack(chans, axis=-1).astype(np.float64)  # (P, classes, 1 + 2 * vars)
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, k + 1)))])
    out = np.empty((n_prompts, chan.shape[-1]))
    d_max = int(n_classes.max())
    per_prompt = 8 * (d_max * (k // 2 + 1) * (k + 1) + 3 * (k + 1) * (d_max + 1) * chan.shape[-1])
    step = max(1, 4 * CHUNK_BYTES // per_prompt)
    for lo in range(0, n_prompts, step):  # prompts come sorted by class count: little padding
        d = int(n_classes[lo : lo + step].max())
        out[lo : lo + step] = _majority_dp(size[lo : lo + step, :d], chan[lo : lo + step, :d], n, k, log_fact)
    return out[:, 1::2], out[:, 2::2]


def _binom_pmf(r: np.ndarray, j: np.ndarray, q: np.ndarray, log_fact: np.ndarray) -> np.ndarray:
    """P(Bin(r, q) = j), broadcasting; 0 where j > r, exact 0/1 at q in {0, 1}."""
    r, j, q = np.broadcast_arrays(r, j, q)
    valid = j <= r
    with np.errstate(divide="ignore", invalid="ignore"):
        log_p = log_fact[r] - log_fact[np.where(valid, j, 0)] - log_fact[np.where(valid, r - j, 0)]
        log_p = log_p + np.where(j > 0, j * np.log(q), 0.0) + np.where(r > j, (r - j) * np.log1p(-q), 0.0)
    return np.where(valid, np.exp(log_p), 0.0)


def _majority_dp(size: np.ndarray, chan: np.ndarray, n: int, k: int, log_fact: np.ndarray) -> np.ndarray:
    """E[channel of the winning class] for prompts with (at most) ``d`` classes of the given sizes;
    empty classes (size 0) are padding."""
    n_prompts, d = size.shape
    n_chan = chan.shape[-1]
    prob = size / n
    remaining = n - np.cumsum(size, axis=1) + size
    with np.errstate(invalid="ignore", divide="ignore"):
        cond = np.where(remaining > 0, size / remaining, 0.0)  # P(class c | not one of the classes before)
    half = k // 2
    r_all, j_all = np.arange(k + 1), np.arange(half + 1)
    tables = [
        _binom_pmf(r_all[None, None, :], j_all[None, :, None], cond[:, c, None, None], log_fact)
        for c in range(d)
    ]
    result = np.zeros((n_prompts, n_chan))
    for level in range(-(-k // d), k + 1):
        if 2 * level > k:  # only one class can reach the level, and it wins
            pmf = _binom_pmf(np.array(k), np.array(level), prob, log_fact)  # (P, d)
            result += np.einsum("pd,pdc->pc", pmf, chan)
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
        ways = np.arange(1, tied + 1, dtype=np.float64)
        result += (acc[:, 0, 1:] / ways[None, :, None]).sum(axis=1)
    return result


__all__ = ["exact_group", "pass_at_k"]
