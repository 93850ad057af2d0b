"""The response-token summaries of a batch: ``critic/advantages|returns|values/*`` and the explained
variance's ingredients, over the tokens where ``response_mask != 0``.

:mod:`rlmetrics.core.summary`'s kernel specialised for millions of CPU tokens (hence its size): integer
masking of float bits, per-thread scratch, no data-dependent shape.
Rules: docs/reductions.md, "``torch_compile=True``".
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlmetrics.core.host import to_host
from rlmetrics.core.summary import divisor, extremes, square_, total
from rlmetrics.core.values import MetricValueError
from rlmetrics.extras import require
from rlmetrics.metrics import VF_RESIDUAL_STD, VF_RETURNS_STD
from rlmetrics.metrics.batch import key_error
from rlmetrics.metrics.tensors import BatchTensors, floating

torch = require("torch", "torch")

TOKEN_METRICS = (  # batch key and metric prefix
    ("advantages", "critic/advantages"),
    ("returns", "critic/returns"),
    ("values", "critic/values"),
)
_MMM = ("mean", "max", "min")


@functools.lru_cache(maxsize=256)
def triple(prefix: str) -> tuple[str, ...]:
    """``prefix/mean``, ``prefix/max``, ``prefix/min``."""
    return tuple(f"{prefix}/{r}" for r in _MMM)


class TokenSummaries:
    """``names[k]`` name column ``k`` of the ``(5, K)`` device ``block`` (``rows``: ``(5, K, B)``)."""

    def __init__(
        self, names: list[tuple[str, ...]], block: Any, inputs: Any = None, rows: bool = False
    ) -> None:
        self.names = names
        self.block = block
        self.rows = rows
        self._inputs = inputs  # (keys, tensors, residual, mask) of the block
        self._columns: list[int] | None = None  # the block's column of each name group (None: the same)

    @classmethod
    def of(
        cls,
        t: BatchTensors,
        mask: Any,
        torch_compile: bool,
        keys: Sequence[str] = ("advantages", "returns", "values"),
        *,
        rows: bool = False,
        m2: bool = True,
    ) -> TokenSummaries | None:
        """Summaries of the batch's ``keys`` (and explained-variance ingredients) over ``mask``, or None;
        ``m2=False`` (eager, no ``rows``): NaN M2 where unread. Raises on a shape mismatch."""
        found = {}
        for key, _ in TOKEN_METRICS:
            x = t.get(key) if key in keys else None
            if x is not None:
                if tuple(x.shape) != tuple(mask.shape):
                    raise key_error(
                        key, f"shape {tuple(x.shape)}, the response mask's is {tuple(mask.shape)}"
                    )
                found[key] = floating(x)
        if not found:
            return None
        vf = "returns" in found and "values" in found
        names = [
            triple(prefix) + ((VF_RETURNS_STD,) if vf and key == "returns" else ())
            for key, prefix in TOKEN_METRICS
            if key in found
        ] + ([(VF_RESIDUAL_STD,)] if vf else [])
        if mask.numel() == 0:  # nothing to summarize: an empty block on the host
            shape = (5, len(names), mask.shape[0]) if rows else (5, len(names))
            return cls(names, torch.zeros(shape, dtype=torch.float64), rows=rows)
        dtype = torch.float64 if any(x.dtype == torch.float64 for x in found.values()) else torch.float32
        keys = list(found)
        m2_from = 0
        if not m2 and not rows and not torch_compile:  # those without M2 first: M2 over the last ones
            keys = [key for key in found if not (vf and key == "returns")] + (["returns"] if vf else [])
            m2_from = len(keys) - 1 if vf else len(keys) + 1
        xs = tuple(found[key] if found[key].dtype == dtype else found[key].to(dtype) for key in keys)
        residual = (keys.index("returns"), keys.index("values")) if vf else None
        block = _summaries(xs, residual, mask, torch_compile, rows, m2_from)
        out = cls(names, block, (keys, xs, residual, mask), rows)
        if keys != list(found):
            out._columns = [keys.index(key) for key in found] + ([len(keys)] if vf else [])
        return out

    def on_host(self, block: np.ndarray) -> np.ndarray:
        """The moved block in :attr:`names` order, empty columns with ``min = inf``, ``max = -inf``."""
        block = block.reshape(5, -1)
        if self._columns is not None:
            block = block[:, self._columns]
        empty = block[0] == 0  # their extremes are padding's: a response token of the batch, or 0
        block[3, empty], block[4, empty] = math.inf, -math.inf
        return block

    def finite(self, block: np.ndarray, nan_strategy: str) -> np.ndarray:
        """A non-finite host ``block`` under ``nan_strategy``: raise, or re-summarize finite tokens."""
        has = block[0] > 0
        if self._inputs is None or np.isfinite(block[3:5, has]).all():
            return block
        keys, xs, residual, mask = self._inputs
        on = mask != 0
        finite = [torch.isfinite(x) for x in xs]
        bad = torch.stack([(on & ~f).sum() for f in finite]).tolist()
        prefixes = dict(TOKEN_METRICS)
        if nan_strategy == "error":
            for key, n in zip(keys, bad):
                if n:
                    raise MetricValueError(
                        f"metric {prefixes[key] + '/*'!r}: {int(n)} non-finite response value(s) in batch "
                        f"key {key!r} (nan_strategy='error')"
                    )
            return block
        names, blocks = [], []
        for key, x, f in zip(keys, xs, finite):
            names.append(triple(prefixes[key]))
            blocks.append(_token_block((x,), None, on & f, rows=self.rows))
        if residual is not None:
            i, j = residual
            names += [(VF_RETURNS_STD,), (VF_RESIDUAL_STD,)]
            both = on & finite[i] & finite[j]
            blocks.append(_token_block((xs[i], xs[j]), (0, 1), both, rows=self.rows)[:, [0, 2]])
        self.names, self._columns = names, None
        return self.on_host(to_host([torch.cat(blocks, 1)])[0])


def _summaries(
    xs: tuple[Any, ...],
    residual: tuple[int, int] | None,
    mask: Any,
    torch_compile: bool,
    rows: bool = False,
    m2_from: int = 0,
) -> Any:
    """The device block of :func:`_token_block`, compiled if asked (and compiling works)."""
    if torch_compile:
        block = _compiled_token_block(xs, residual, mask, rows, m2_from)
        if block is not None:
            return block
    k, dtype = len(xs) + (residual is not None), xs[0].dtype
    # small batches go through the summaries together (fewer kernels), large ones one tensor at a
    # time (a smaller working set stays in cache)
    group = k if k * mask.numel() * dtype.itemsize <= _STACK_BYTES else 1
    itype = itype_of(dtype)
    scratch = _scratch((2 + group, *mask.shape), itype, mask.device)
    return _token_block(xs, residual, mask, scratch, group, rows, m2_from)


class _TokenMask:
    """The response mask as integers of ``dtype``: ``on`` (``mask != 0``) and ``off``; ``bits * on`` zeroes
    padding whatever it holds, ``+ off * v`` sets it to ``v``. Per sequence ``count`` with ``rows``."""

    def __init__(self, mask: Any, dtype: Any, out: Any = None, rows: bool = False) -> None:
        if out is None:
            on = mask.ne(0).to(dtype)
        elif mask.is_floating_point():
            on = torch.ne(mask, 0, out=out[0])
        else:  # an integer copy compared in place: faster than a comparison into another dtype
            on = out[0].copy_(mask).ne_(0)
        self.on = on
        counts = on.sum(-1, dtype=dtype)
        # a response token of each sequence: its last one (0 without), as ``on * column`` peaks there
        # (argmax reads several times slower than this product and its max)
        columns = torch.arange(on.shape[-1], dtype=dtype, device=on.device)
        if rows:
            self.count = counts
            self.last = torch.mul(on, columns, out=None if out is None else out[1]).amax(-1)
        else:  # a response token of the batch: the last of its fullest sequence
            self.count = counts.sum(dtype=dtype)
            row = counts.argmax(-1, keepdim=True)
            self.last = row * on.shape[-1] + (on.index_select(0, row) * columns).amax(-1)
        self.off = torch.bitwise_xor(on, 1, out=None if out is None else out[1])
        self.divisor = divisor(torch, self.count)


_SCRATCH_LIMIT = 32 * 2**20
"""Bytes of scratch memory a thread keeps between calls on CPU (see :func:`_scratch`)."""

_STACK_BYTES = 4 * 2**20
"""Token tensors of at most this many bytes in all are summarized together, larger ones one at a time."""

_kept = threading.local()


def _scratch(shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
    """An uninitialised tensor, on CPU in this thread's kept memory: must not outlive the caller's use."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes > _SCRATCH_LIMIT:
        return torch.empty(shape, dtype=dtype, device=device)
    kept = getattr(_kept, "memory", None)
    if kept is None or kept.numel() < nbytes:
        with torch.inference_mode(False):  # a normal tensor: later calls may run outside inference mode
            kept = _kept.memory = torch.empty(nbytes, dtype=torch.uint8)
    return kept[:nbytes].view(dtype).view(shape)


def _summarize_tokens(
    buf: Any, mask: _TokenMask, dtype: Any, rows: bool = False, m2_from: int = 0
) -> tuple[Any, Any, Any, Any]:
    """Sum, m2 (float64), min, max (``dtype``) of ``K`` tensors as integer bits in ``buf``, 0 on padding:
    ``(K,)`` each (``rows``: ``(K, B)``); ``buf`` is overwritten, M2 before ``m2_from`` is NaN.
    """
    k = buf.shape[0]
    vals = buf.view(dtype)
    if rows:
        sums = vals.sum(-1).to(torch.float64)
        means = (sums / mask.divisor).to(dtype)
        buf.addcmul_(mask.off, buf.gather(-1, mask.last.view(1, -1, 1).expand(k, -1, 1)))
        mins, maxs = extremes(torch, vals)
        vals.sub_(means.view(k, -1, 1))
        buf.mul_(mask.on)  # padding := 0
        return sums, square_(torch, vals).sum(-1).to(torch.float64), mins, maxs
    sums = total(torch, vals, levels=2)  # the batch's, as float64: the sums of the rows' sums
    means = (sums / mask.divisor).to(dtype)
    flat = vals.view(k, -1)  # what needs no rows
    buf.addcmul_(mask.off, flat.view(buf.dtype).index_select(1, mask.last).view(k, 1, 1))
    mins, maxs = extremes(torch, flat)  # one pass for both when K == 1
    if m2_from >= k:
        return sums, torch.full_like(sums, math.nan), mins, maxs
    if m2_from > 0:
        buf, vals, flat, means = buf[m2_from:], vals[m2_from:], flat[m2_from:], means[m2_from:]
    flat.sub_(means.view(-1, 1))
    buf.mul_(mask.on)  # padding := 0
    m2 = total(torch, square_(torch, vals), levels=2)
    return sums, m2 if m2_from == 0 else torch.cat([sums[:m2_from] * math.nan, m2]), mins, maxs


def itype_of(dtype: Any) -> Any:
    """The integer type as wide as float ``dtype`` (that holds its bits)."""
    return torch.int64 if dtype == torch.float64 else torch.int32


def _token_block(
    xs: tuple[Any, ...],
    residual: tuple[int, int] | None,
    mask: Any,
    scratch: Any = None,
    group: int = 1,
    rows: bool = False,
    m2_from: int = 0,
) -> Any:
    """``(5, K)`` float64 summaries of ``xs`` (and ``xs[i] - xs[j]`` for ``residual=(i, j)``) over the
    response tokens; ``scratch``: ``(2 + group, *mask.shape)`` integers, or None for fresh tensors.
    """
    dtype = xs[0].dtype
    itype = itype_of(dtype)
    k = len(xs) + (residual is not None)
    slots = None if scratch is None else scratch.unbind(0)  # one op for all the views
    token_mask = _TokenMask(mask, itype, out=slots, rows=rows)
    parts = []
    for start in range(0, k, group):
        bufs = []
        for i in range(start, min(start + group, k)):
            out = None if slots is None else slots[2 + i - start]
            if i < len(xs):
                x = xs[i]
            else:  # the residual, into its slot
                x = torch.sub(xs[residual[0]], xs[residual[1]], out=None if out is None else out.view(dtype))
            # x on the response, 0 (all bits) elsewhere
            bufs.append(torch.mul(x.view(itype), token_mask.on, out=out))
        stacked = scratch[2 : 2 + len(bufs)] if scratch is not None else torch.stack(bufs)
        parts.append(_summarize_tokens(stacked, token_mask, dtype, rows, m2_from - start))
    sums, m2s, mins, maxs = parts[0] if len(parts) == 1 else (torch.cat(column) for column in zip(*parts))
    count = token_mask.count.to(torch.float64).expand_as(sums)
    return torch.stack([count, sums, m2s, mins.to(torch.float64), maxs.to(torch.float64)])


_compiled: dict[str, Any] = {}  # "fn": _token_block under torch.compile; "failed": compiling failed
_compile_lock = threading.Lock()


def _compiled_token_block(
    xs: tuple[Any, ...], residual: tuple[int, int] | None, mask: Any, rows: bool, m2_from: int = 0
) -> Any:
    """:func:`_token_block` compiled (one call at a time), or None once compiling failed (one warning)."""
    with _compile_lock:
        if _compiled.get("failed"):
            return None
        try:
            if "fn" not in _compiled:
                _compiled["fn"] = torch.compile(_token_block, dynamic=True)
            return _compiled["fn"](xs, residual, mask, rows=rows, m2_from=m2_from)
        except Exception as exc:  # no C++ compiler, a device torch.compile does not support, ...
            _compiled["failed"] = True
            warnings.warn(
                f"torch_compile=True: compiling the token summaries failed ({type(exc).__name__}: {exc}); "
                "they are computed eagerly from now on",
                RuntimeWarning,
                stacklevel=2,
            )
            return None


__all__ = ["TOKEN_METRICS", "TokenSummaries", "triple"]
