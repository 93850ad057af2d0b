"""The vectorised bootstrap of best@k / worst@k / maj@k over the seed's rows, all prompts of ``n`` at once.

Rules: docs/validation.md, "Semantics, and how it is computed" and "Cost".
"""

from __future__ import annotations

import functools

import numpy as np

N_BOOTSTRAP = 1000
"""Bootstrap rows per ``(n, k)``, as in the seed."""
CHUNK_BYTES = 16 << 20
"""Rough size of the largest temporary array; prompts are processed in chunks that fit it."""
CACHE_BYTES = 2 << 20
"""Rough size of one chunk's vote counts in the majority vote (to stay in cache)."""

SHARED_MAX = 16 << 20
"""Bytes a ``(n, k)``'s kept indices and tie-break words may take; beyond, :func:`_bootstrap_rows`."""

TABLE_MAX_N = 16
"""Up to this many samples, best@k / worst@k come from ``2**n``-entry tables (:func:`_miss_table`)."""

_WORD = 32  # bootstrap positions per float64 tie-break word (weights 2**31 .. 2**0, plus counts * 2**32)
_SHORT_K = 19  # up to this many draws, one float32 word holds count * 2**k + the k position bits (< 2**24)
_GEMM_MAX = 1 << 18  # multiply-adds per matrix product of the majority vote (see _products)
_EXTREMES = (("best", "mean"), ("best", "std"), ("worst", "mean"), ("worst", "std"))


def bootstrap_sizes(n: int) -> list[int]:
    """Subset sizes for a prompt of ``n`` samples: 2, 4, 8, ... below ``n``, then ``n`` (none if ``n < 2``).

    >>> bootstrap_sizes(16), bootstrap_sizes(5), bootstrap_sizes(2), bootstrap_sizes(1)
    ([2, 4, 8, 16], [2, 4, 5], [2], [])
    """
    if n < 2:
        return []
    sizes = [2**i for i in range(1, max(1, (n - 1).bit_length())) if 2**i < n]
    return [*sizes, n]


def bootstrap_indices(n: int, k: int, n_bootstrap: int = N_BOOTSTRAP, seed: int = 42) -> np.ndarray:
    """The seed's ``(n_bootstrap, k)`` indices, from a private generator (the global one is untouched).

    >>> np.random.seed(7); a = np.random.choice(5, size=(3, 2), replace=True)
    >>> bool((bootstrap_indices(5, 2, 3, seed=7) == a).all())
    True
    """
    return np.random.RandomState(seed).choice(n, size=(n_bootstrap, k), replace=True)


def dense_codes(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, codes relabelled 0..d-1 (d = distinct codes of the row), and d per row."""
    srt = np.argsort(codes, axis=1, kind="stable")
    vals = np.take_along_axis(codes, srt, axis=1)
    new = np.ones(vals.shape, dtype=bool)
    new[:, 1:] = vals[:, 1:] != vals[:, :-1]
    rank = np.cumsum(new, axis=1) - 1
    dense = np.empty_like(rank)
    np.put_along_axis(dense, srt, rank, axis=1)
    return dense, rank[:, -1] + 1


def bootstrap_group(
    mats: dict[str, np.ndarray],
    dense: np.ndarray | None,
    n_classes: np.ndarray | None,
    n: int,
    seed: int,
    n_bootstrap: int,
    tie: str = "first",
) -> dict[tuple[str, str], np.ndarray]:
    """best/worst/maj @k mean and std per prompt of ``n`` samples (rows of ``mats``); ``tie="none"``:
    a tied row reports 0."""
    out: dict[tuple[str, str], np.ndarray] = {}
    if not mats:
        return out
    ranked = {v: _ranked(mat) for v, mat in mats.items()} if n <= TABLE_MAX_N else {}
    for k in bootstrap_sizes(n):
        if _shared_bytes(n, k, n_bootstrap, dense is not None and k > 2) > SHARED_MAX:
            out.update(_bootstrap_rows(mats, dense, n, k, n_bootstrap, seed, tie))
            continue
        idx = _indices(n, k, n_bootstrap, seed)
        for v, mat in mats.items():
            if v in ranked:
                stats = _extremes_by_table(*ranked[v], _miss_table(n, k, n_bootstrap, seed), n_bootstrap)
                nan_rows = np.flatnonzero(np.isnan(mat).any(axis=1))
                if len(nan_rows):
                    for whole, part in zip(stats, _extremes_by_rows(mat[nan_rows], idx)):
                        whole[nan_rows] = part
            else:
                stats = _extremes_by_rows(mat, idx)
            for (name, stat), values in zip(_EXTREMES, stats):
                out[(v, f"{name}@{k}/{stat}")] = values
        if dense is not None and n_classes is not None:
            winners = _winner_histogram(dense, n_classes, idx, n, seed)
            if tie == "none":  # the tied rows move to an extra column of value 0
                tied = _tied_counts(dense, idx, n)
                winners = np.concatenate([winners - tied[:, :n], tied[:, n:]], axis=1)
            for v, mat in mats.items():
                x = np.concatenate([mat, np.zeros((len(mat), 1))], axis=1) if tie == "none" else mat
                out[(v, f"maj@{k}/mean")], out[(v, f"maj@{k}/std")] = _row_stats(x, winners, n_bootstrap)
    return out


def _shared_bytes(n: int, k: int, n_bootstrap: int, votes: bool = True) -> int:
    """Bytes of the kept indices of ``(n, k)`` and, with ``votes``, its tie-break words."""
    words = -(-k // (k if k <= _SHORT_K else _WORD)) if votes else 0
    return n_bootstrap * 8 * (k + n * words)


def _bootstrap_rows(
    mats: dict[str, np.ndarray],
    dense: np.ndarray | None,
    n: int,
    k: int,
    n_bootstrap: int,
    seed: int,
    tie: str,
) -> dict[tuple[str, str], np.ndarray]:
    """:func:`bootstrap_group`'s keys of one ``k``, the seed's rows drawn a chunk at a time and nothing
    kept (memory a few :data:`CHUNK_BYTES`); the vectorised numbers, to float rounding."""
    prompts = len(next(iter(mats.values())))
    d = 0 if dense is None else int(dense.max()) + 1
    width = 8 * (k + d) * (len(mats) + 1)  # bytes of one bootstrap row of one prompt in flight
    block = max(1, min(CHUNK_BYTES // (16 * n_bootstrap * len(mats)), CHUNK_BYTES // width))
    if prompts > block:
        parts = [
            _bootstrap_rows(
                {v: m[lo : lo + block] for v, m in mats.items()},
                None if dense is None else dense[lo : lo + block],
                n,
                k,
                n_bootstrap,
                seed,
                tie,
            )  # fmt: skip
            for lo in range(0, prompts, block)
        ]
        return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    step = max(1, CHUNK_BYTES // (width * prompts))  # bootstrap rows per chunk
    best = {v: np.empty((n_bootstrap, prompts)) for v in mats}
    worst = {v: np.empty((n_bootstrap, prompts)) for v in mats}
    wins, tied = np.zeros((prompts, n)), np.zeros((prompts, n + 1))
    offsets = (np.arange(prompts) * n)[:, None]
    draws = np.random.RandomState(seed)  # bootstrap_indices' stream, a chunk of rows at a time
    for lo in range(0, n_bootstrap, step):
        idx = draws.choice(n, size=(min(step, n_bootstrap - lo), k), replace=True)
        hi, r = lo + len(idx), len(idx)
        for v, mat in mats.items():
            x = mat[:, idx]  # (prompts, r, k)
            best[v][lo:hi], worst[v][lo:hi] = x.max(axis=2).T, x.min(axis=2).T
        if dense is None:
            continue
        first, is_tied = _votes(dense[:, idx].reshape(prompts * r, k), d)  # a row per (prompt, row)
        sample = offsets + idx[np.tile(np.arange(r), prompts), first].reshape(prompts, r)
        wins += np.bincount(sample.ravel(), minlength=prompts * n).reshape(prompts, n)
        if tie == "none":
            is_tied = is_tied.reshape(prompts, r)
            tied[:, :n] += np.bincount(sample[is_tied], minlength=prompts * n).reshape(prompts, n)
            tied[:, n] += is_tied.sum(axis=1)
    out: dict[tuple[str, str], np.ndarray] = {}
    for v, mat in mats.items():
        stats = (best[v].mean(axis=0), best[v].std(axis=0), worst[v].mean(axis=0), worst[v].std(axis=0))
        out.update({(v, f"{name}@{k}/{stat}"): val for (name, stat), val in zip(_EXTREMES, stats)})
        if dense is not None:
            x, w = mat, wins
            if tie == "none":  # the tied rows move to an extra column of value 0, as in bootstrap_group
                x, w = (
                    np.concatenate([mat, np.zeros((len(mat), 1))], axis=1),
                    np.concatenate([wins - tied[:, :n], tied[:, n:]], axis=1),
                )
            out[(v, f"maj@{k}/mean")], out[(v, f"maj@{k}/std")] = _row_stats(x, w, n_bootstrap)
    return out


def _row_stats(x: np.ndarray, rows: np.ndarray, n_bootstrap: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean and population std over bootstrap rows, ``rows[p, j]`` of which take ``x[p, j]``."""
    taken = rows > 0
    with np.errstate(invalid="ignore"):
        mean = np.where(taken, rows * x, 0.0).sum(axis=1) / n_bootstrap
        dev = np.where(taken, x - mean[:, None], 0.0)
        return mean, np.sqrt((rows * dev * dev).sum(axis=1) / n_bootstrap)


def _ranked(mat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per prompt: its sorted values and the bitmasks of positions of rank <= / >= each rank."""
    order = np.argsort(mat, axis=1, kind="stable")
    bits = np.left_shift(np.int64(1), order)
    below = np.bitwise_or.accumulate(bits, axis=1)
    above = np.bitwise_or.accumulate(bits[:, ::-1], axis=1)[:, ::-1]
    return np.take_along_axis(mat, order, axis=1), below, above


def _extremes_by_table(
    srt: np.ndarray, below: np.ndarray, above: np.ndarray, miss: np.ndarray, n_bootstrap: int
) -> list[np.ndarray]:
    """best mean, best std, worst mean, worst std per prompt, from the miss table."""
    reach_up = n_bootstrap - miss[above]  # rows drawing a position of rank >= i
    reach_down = n_bootstrap - miss[below]  # rows drawing a position of rank <= i
    zero = np.zeros((len(srt), 1), np.int64)
    top = reach_up - np.concatenate([reach_up[:, 1:], zero], axis=1)
    bottom = reach_down - np.concatenate([zero, reach_down[:, :-1]], axis=1)
    return [*_row_stats(srt, top, n_bootstrap), *_row_stats(srt, bottom, n_bootstrap)]


def _extremes_by_rows(mat: np.ndarray, idx: np.ndarray) -> list[np.ndarray]:
    """best mean, best std, worst mean, worst std per prompt by gathering every row (NaN propagates)."""
    n_prompts, k = len(mat), idx.shape[1]
    out = [np.empty(n_prompts) for _ in range(4)]
    chunk = max(1, CHUNK_BYTES // (8 * len(idx) * 8))
    idx_t = np.ascontiguousarray(idx.T)
    transposed = np.ascontiguousarray(mat.T)  # (n, P): a sample is a row
    for lo in range(0, n_prompts, chunk):
        hi = min(n_prompts, lo + chunk)
        x = np.ascontiguousarray(transposed[:, lo:hi])
        best = np.take(x, idx_t[0], axis=0)
        worst = best.copy()
        buf = np.empty_like(best)
        for t in range(1, k):
            np.take(x, idx_t[t], axis=0, out=buf)
            np.maximum(best, buf, out=best)
            np.minimum(worst, buf, out=worst)
        for i, rows in enumerate((best, worst)):
            out[2 * i][lo:hi] = rows.mean(axis=0)
            out[2 * i + 1][lo:hi] = rows.std(axis=0)
    return out


@functools.lru_cache(maxsize=16)
def _indices(n: int, k: int, n_bootstrap: int, seed: int) -> np.ndarray:
    """:func:`bootstrap_indices`, drawn once per shape (read-only)."""
    idx = bootstrap_indices(n, k, n_bootstrap, seed)
    idx.flags.writeable = False
    return idx


@functools.lru_cache(maxsize=64)
def _miss_table(n: int, k: int, n_bootstrap: int, seed: int) -> np.ndarray:
    """``miss[M]``: how many bootstrap rows draw no position of bitmask ``M`` (a sum over subsets)."""
    idx = _indices(n, k, n_bootstrap, seed)
    within = np.bincount(np.bitwise_or.reduce(np.left_shift(np.int64(1), idx), axis=1), minlength=1 << n)
    for bit in range(n):
        pairs = within.reshape(-1, 2, 1 << bit)
        pairs[:, 1] += pairs[:, 0]
    miss = np.ascontiguousarray(within[::-1])  # complement of M: (2**n - 1) - M
    miss.flags.writeable = False
    return miss


def _winner_histogram(
    dense: np.ndarray, n_classes: np.ndarray, idx: np.ndarray, n: int, seed: int
) -> np.ndarray:
    """``(P, n)``: per prompt, in how many rows maj@k reports each position (``k == 2``: the first draw)."""
    n_boot, k = idx.shape
    if k == 2:
        first = np.bincount(idx[:, 0], minlength=n).astype(np.float64)
        return np.broadcast_to(first, (len(dense), n))
    words = _words(n, k, n_boot, seed)
    out = np.empty((len(dense), n))
    chunk = max(1, CHUNK_BYTES // (8 * n_boot * 2))
    for lo in range(0, len(dense), chunk):
        hi = min(len(dense), lo + chunk)
        winners = _majority_winners(dense[lo:hi], n_classes[lo:hi], words, idx)  # (m, n_bootstrap)
        flat = (winners + n * np.arange(hi - lo)[:, None]).ravel()
        out[lo:hi] = np.bincount(flat, minlength=(hi - lo) * n).reshape(hi - lo, n)
    return out


def _tied_counts(dense: np.ndarray, idx: np.ndarray, n: int) -> np.ndarray:
    """``(P, n + 1)``: per prompt, the tied rows by reported position (``:n``) and in all (``n``)."""
    n_boot, k = idx.shape
    d = int(dense.max()) + 1
    out = np.zeros((len(dense), n + 1))
    chunk = max(1, CHUNK_BYTES // (8 * n_boot * (k + d)))
    rows = np.tile(np.arange(n_boot), chunk)
    for lo in range(0, len(dense), chunk):
        m = len(dense[lo : lo + chunk])
        first, tied = _votes(dense[lo : lo + m][:, idx].reshape(m * n_boot, k), d)
        sample = (idx[rows[: m * n_boot], first] + n * np.repeat(np.arange(m), n_boot))[tied]
        out[lo : lo + m, :n] = np.bincount(sample, minlength=m * n).reshape(m, n)
        out[lo : lo + m, n] = tied.reshape(m, n_boot).sum(axis=1)
    return out


def _votes(codes: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of dense pred codes ``(R, k)``: the position maj@k reports, and whether the vote ties."""
    counts = np.bincount((np.arange(len(codes))[:, None] * d + codes).ravel(), minlength=len(codes) * d)
    counts = counts.reshape(-1, d)
    top = counts.max(axis=1)
    first = (np.take_along_axis(counts, codes, axis=1) == top[:, None]).argmax(axis=1)
    return first, (counts == top[:, None]).sum(axis=1) > 1


@functools.lru_cache(maxsize=16)
def _words(n: int, k: int, n_bootstrap: int, seed: int) -> list[np.ndarray]:
    """:func:`_tie_words` of the bootstrap indices, once per shape."""
    return _tie_words(_indices(n, k, n_bootstrap, seed), n)


def _tie_words(idx: np.ndarray, n: int) -> list[np.ndarray]:
    """``(n_bootstrap, n)`` matrices; times a one-hot class matrix, per row and class
    ``count * 2**w + sum of 2**(w - 1 - t)`` over its positions ``t < w`` (exact; float32 words up to
    :data:`_SHORT_K` draws, float64 words of 32 positions beyond)."""
    n_boot, k = idx.shape
    width, dtype = (k, np.float32) if k <= _SHORT_K else (_WORD, np.float64)
    flat = (np.arange(n_boot)[:, None] * n + idx).ravel()
    count = np.bincount(flat, minlength=n_boot * n).reshape(n_boot, n).astype(np.float64)
    weight = np.ldexp(1.0, width - 1 - np.arange(k) % width)
    word_of = np.arange(k) // width
    words = []
    for w in range(word_of[-1] + 1):
        cols = word_of == w
        weights = np.broadcast_to(weight[cols], (n_boot, int(cols.sum()))).ravel()
        sel = (np.arange(n_boot)[:, None] * n + idx[:, cols]).ravel()
        words.append(np.bincount(sel, weights=weights, minlength=n_boot * n).reshape(n_boot, n))
    words[0] += count * float(2**width)
    return [w.astype(dtype) for w in words]


def _majority_winners(
    dense: np.ndarray, n_classes: np.ndarray, words: list[np.ndarray], idx: np.ndarray
) -> np.ndarray:
    """``(c, n_bootstrap)``: per prompt and bootstrap row, the sample whose value maj@k reports."""
    n_boot, k = idx.shape
    c, n = dense.shape
    width = k if words[0].dtype == np.float32 else _WORD
    words_t = [np.ascontiguousarray(w.T) for w in words]  # (n, n_bootstrap)
    row_start = np.arange(n_boot, dtype=np.int64) * k  # idx[b, t] is idx.flat[b * k + t]
    first_of = _first_positions(k) if width == k and k <= TABLE_MAX_N else None
    out = np.empty((c, n_boot), dtype=np.intp)
    # chunks whose vote counts stay in cache, of prompts with the same number of classes (they come
    # sorted by it): no padding classes
    budget = max(1, min(CHUNK_BYTES, CACHE_BYTES) // (words[0].itemsize * n_boot * int(n_classes.max())))
    cuts = np.flatnonzero(np.diff(n_classes)) + 1
    bounds = sorted({*range(0, c, budget), *cuts.tolist(), c})
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        m, d = hi - lo, int(n_classes[lo:hi].max())
        if d == 1:  # one class: the first draw's sample
            out[lo:hi] = idx[:, 0]
            continue
        onehot = np.zeros((d, m, n), dtype=words[0].dtype)
        onehot[dense[lo:hi], np.arange(m)[:, None], np.arange(n)[None, :]] = 1.0
        onehot = onehot.reshape(d * m, n)
        key = _products(onehot, words_t[0]).reshape(d, m, n_boot)
        top = key.max(axis=0)  # (m, n_bootstrap): the winning class's key
        if first_of is not None:  # its first position, looked up from the whole key
            pos = first_of[top.astype(np.int32)]
        else:
            ints = top.astype(np.int32 if width < 31 else np.int64)  # exact: float32 keys stay below 2**24
            low = (ints & (2**width - 1)).astype(top.dtype)  # the winner's positions < width, as bits
            pos = width - np.frexp(low)[1]  # its highest bit is its first position; width when it has none
            if len(words) > 1:
                found = low > 0
                cand = key == top[None]  # same count, same positions among the first words
                for w in range(1, len(words)):
                    if found.all():
                        break
                    kw = np.where(cand, _products(onehot, words_t[w]).reshape(d, m, n_boot), -1.0)
                    tw = kw.max(axis=0)
                    new = ~found & (tw > 0)
                    pos = np.where(new, w * width + width - np.frexp(tw)[1], pos)
                    found |= new
                    cand &= kw == tw[None]
        out[lo:hi] = np.take(idx, row_start + pos)  # idx[b, pos]
    return out


@functools.lru_cache(maxsize=32)
def _first_positions(k: int) -> np.ndarray:
    """For every float32 tie-break key of ``k`` draws, the first position among its bits."""
    bits = np.arange((k + 1) << k, dtype=np.int64) & ((1 << k) - 1)
    first = (k - np.frexp(bits.astype(np.float64))[1]).astype(np.uint8)
    first.flags.writeable = False
    return first


def _products(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` in row blocks of at most :data:`_GEMM_MAX` multiply-adds (BLAS then stays on one thread)."""
    out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
    step = max(1, _GEMM_MAX // (a.shape[1] * b.shape[1]))
    for lo in range(0, len(a), step):
        np.matmul(a[lo : lo + step], b, out=out[lo : lo + step])
    return out


__all__ = [
    "CACHE_BYTES", "CHUNK_BYTES", "N_BOOTSTRAP", "TABLE_MAX_N", "bootstrap_group", "bootstrap_indices",
    "bootstrap_sizes", "dense_codes",
]  # fmt: skip
