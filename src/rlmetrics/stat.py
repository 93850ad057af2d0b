"""Mergeable summary statistics.

A :class:`Stat` holds what is needed to merge summaries of data that lives on many ranks and still get
the statistics of the concatenated data: weighted count, sum, M2 (sum of squared deviations from the
mean), min and max, and optionally a quantile :class:`~rlmetrics.sketch.Sketch`. Merging uses the
parallel variance formula (Chan et al.), so no sum of squares ever cancels.

The same merge math works on whole vectors of statistics: the wire and the aggregator keep one
``(5, M)`` float64 array per contribution (rows :data:`FIELDS`), merged with :func:`merge_arrays`
and :func:`reduce_parts`. :class:`Stat` is the one-metric view of that layout.

>>> a, b = Stat.of([1.0, 2.0]), Stat.of([3.0, 4.0, 5.0])
>>> m = a.merge(b)
>>> (m.count, m.mean, m.min, m.max)
(5.0, 3.0, 1.0, 5.0)
>>> round(m.var, 12)
2.0
"""

from __future__ import annotations

import itertools
import math
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rlmetrics.sketch import Sketch

FIELDS = ("count", "sum", "m2", "min", "max")
"""Rows of a stat array, in order."""

NAN_STRATEGIES = ("propagate", "drop", "error")


class MetricValueError(ValueError):
    """A metric value that cannot be summarized; the message names the metric and the problem."""


def _is_torch(value: Any) -> bool:
    torch = sys.modules.get("torch")  # not imported: no tensor exists
    return torch is not None and isinstance(value, torch.Tensor)


def empty_arrays(m: int) -> np.ndarray:
    """The identity of :func:`merge_arrays`: ``m`` empty summaries.

    >>> empty_arrays(2)[:, 0].tolist()
    [0.0, 0.0, 0.0, inf, -inf]
    """
    out = np.zeros((5, m))
    out[3] = np.inf
    out[4] = -np.inf
    return out


def merge_arrays(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Merge two stat arrays of shape ``(5, ...)`` column by column (a new array).

    >>> merge_arrays(Stat.of([1.0]).to_array(), Stat.of([3.0]).to_array()).tolist()
    [2.0, 4.0, 2.0, 1.0, 3.0]
    """
    na, nb = a[0], b[0]
    n = na + nb
    with np.errstate(invalid="ignore", divide="ignore"):
        delta = np.where(nb > 0, b[1] / np.where(nb > 0, nb, 1), 0.0) - np.where(
            na > 0, a[1] / np.where(na > 0, na, 1), 0.0
        )
        extra = np.where((na > 0) & (nb > 0), delta * delta * (na * nb / np.where(n > 0, n, 1)), 0.0)
        return np.stack([n, a[1] + b[1], a[2] + b[2] + extra, np.minimum(a[3], b[3]), np.maximum(a[4], b[4])])


def reduce_parts(parts: np.ndarray) -> np.ndarray:
    """Merge ``k`` stat arrays stacked field-major, shape ``(5, k, M)``, into one ``(5, M)`` array.

    Exact for any number of parts: M2 = sum of the parts' M2 plus each part's squared distance
    from the overall mean, weighted by its count.

    >>> parts = np.stack([Stat.of(p).to_array()[:, None] for p in ([1.0, 2.0], [3.0], [4.0, 5.0])], axis=1)
    >>> reduce_parts(parts)[:, 0].tolist()
    [5.0, 15.0, 10.0, 1.0, 5.0]
    """
    counts, sums = parts[0], parts[1]
    n = counts.sum(axis=0)
    s = sums.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.divide(s, n, out=np.zeros_like(s), where=n > 0)
    m2 = parts[2].sum(axis=0) + spread(counts, sums, mean).sum(axis=0)
    return np.stack([n, s, m2, parts[3].min(axis=0), parts[4].max(axis=0)])


def spread(counts: np.ndarray, sums: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """What parts add to the merged M2 beyond their own M2: ``count * (part mean - mean) ** 2``.

    ``mean`` is the overall mean; parts without observations add nothing. Summed over the parts,
    plus the parts' own M2, this is the exact merged M2 (:func:`reduce_parts`; the torch backend
    sums it across ranks once the overall mean is known).

    >>> spread(np.array([2.0, 1.0, 0.0]), np.array([2.0, 4.0, 0.0]), np.array(2.0)).tolist()
    [2.0, 4.0, 0.0]
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        dev = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
        dev -= mean
        np.square(dev, out=dev)
        dev *= counts  # parts without observations add nothing
    return dev


def stats_of_rows(rows: np.ndarray) -> np.ndarray:
    """The ``(5, M)`` stat array of ``k`` single observations per column, ``rows`` of shape ``(k, M)``.

    >>> stats_of_rows(np.array([[1.0], [3.0]]))[:, 0].tolist()
    [2.0, 4.0, 2.0, 1.0, 3.0]
    """
    s = rows.sum(axis=0)
    dev = rows - s / len(rows)
    np.square(dev, out=dev)
    return np.stack([np.full_like(s, len(rows)), s, dev.sum(axis=0), rows.min(axis=0), rows.max(axis=0)])


def _summarize(xp: Any, x: Any, w: Any, nan_strategy: str) -> Any:
    """count, sum, m2, min, max, the number of non-finite values and of negative or non-finite weights.

    For numpy or torch inputs.

    Works on the device of ``x`` without data-dependent shapes; the caller moves the six numbers
    to the host in one transfer.
    """
    finite = xp.isfinite(x)
    keep = w > 0
    bad = (keep & ~finite).sum()
    if nan_strategy == "drop":
        keep = keep & finite
        w = xp.where(keep, w, 0.0)
    xs = xp.where(keep, x, 0.0)
    n = w.sum()
    s = (w * xs).sum()
    mean = s / xp.where(n > 0, n, 1.0)
    m2 = (w * xp.where(keep, xs - mean, 0.0) ** 2).sum()  # not 0 * (0 - mean)**2: nan if that overflows
    mn = xp.where(keep, x, math.inf).min()
    mx = xp.where(keep, x, -math.inf).max()
    bad_w = (~(xp.isfinite(w) & (w >= 0))).sum()
    return xp.stack([n, s, m2, mn, mx, bad * 1.0, bad_w * 1.0])


class Stat:
    """Mergeable summary of weighted observations.

    ``Stat.of`` accepts Python numbers, (nested) lists, numpy arrays and torch tensors on any
    device; ``mask`` (non-zero = keep) and ``weight`` broadcast against the values. A scalar is one
    observation of weight 1.

    >>> s = Stat.of([1.0, 2.0, 3.0, 10.0], mask=[1, 1, 1, 0])
    >>> (s.count, s.sum, s.mean, s.max)
    (3.0, 6.0, 2.0, 3.0)
    >>> Stat.of([1.0, 3.0], weight=[3.0, 1.0]).mean
    1.5
    """

    __slots__ = ("count", "sum", "m2", "min", "max", "sketch")

    def __init__(
        self,
        count: float = 0.0,
        sum: float = 0.0,
        m2: float = 0.0,
        min: float = math.inf,
        max: float = -math.inf,
        sketch: Sketch | None = None,
    ) -> None:
        self.count = float(count)
        self.sum = float(sum)
        self.m2 = float(m2)
        self.min = float(min)
        self.max = float(max)
        self.sketch = sketch

    # ------------------------------------------------------------------ construction
    @classmethod
    def of(
        cls,
        values: Any,
        mask: Any = None,
        weight: Any = None,
        *,
        sketch: bool = False,
        nan_strategy: str = "propagate",
        name: str = "value",
    ) -> Stat:
        """Summarize ``values``; ``sketch=True`` also keeps a quantile sketch.

        ``nan_strategy``: ``"propagate"`` keeps NaN/inf (they reach the statistics), ``"drop"``
        ignores them, ``"error"`` raises :class:`MetricValueError`. ``name`` only labels errors.

        >>> Stat.of(2.5).to_array().tolist()
        [1.0, 2.5, 0.0, 2.5, 2.5]
        >>> Stat.of([1.0, float("nan")], nan_strategy="drop").mean
        1.0
        """
        if nan_strategy not in NAN_STRATEGIES:
            raise ValueError(f"nan_strategy must be one of {NAN_STRATEGIES}, got {nan_strategy!r}")
        if isinstance(values, np.ma.MaskedArray):  # masked entries are not observations
            keep = ~np.ma.getmaskarray(values)
            values = np.ma.getdata(values)
            mask = keep if mask is None else _and_mask(keep, mask, name)
        if mask is None and weight is None and not sketch:
            v = scalar_value(values, name)
            if v is not None:
                return cls._of_scalar(v, nan_strategy, name)
        if isinstance(values, (list, tuple)) and any(map(_is_torch, values)):
            values = _stack_tensors(values, name)
        if _is_torch(values):
            return cls._of_torch(values, mask, weight, sketch, nan_strategy, name)
        x = _as_float_array(values, name, "values")
        w = _weights(np, x.shape, mask, weight, name)
        return cls._finish(np, x.reshape(-1), w, sketch, nan_strategy, name)

    @classmethod
    def _of_scalar(cls, v: float, nan_strategy: str, name: str) -> Stat:
        if not math.isfinite(v):
            if nan_strategy == "error":
                raise MetricValueError(f"metric {name!r}: non-finite value {v} (nan_strategy='error')")
            if nan_strategy == "drop":
                return cls()
        return cls(1.0, v, 0.0 if math.isfinite(v) else math.nan, v, v)

    @classmethod
    def of_tensors(
        cls, metrics: Mapping[Any, Any], needs_sketch: Callable[[str], bool], nan_strategy: str = "propagate"
    ) -> dict[str, Stat | MetricValueError]:
        """The Stats of the torch tensors among ``metrics`` values (also as ``(tensor, weight)``),
        with one device-to-host copy for all of them; a value that cannot be summarized maps to its
        error. ``needs_sketch(name)``: whether that name keeps a quantile sketch. Other values are
        left out.

        >>> import torch
        >>> metrics = {"a": torch.ones(3), "b": (torch.arange(2.0), 2.0), "c": 1.0}
        >>> out = Stat.of_tensors(metrics, needs_sketch=lambda name: False)
        >>> sorted(out), out["a"].count, out["b"].count
        (['a', 'b'], 3.0, 4.0)
        """
        items = []
        for name, value in metrics.items():
            values, weight = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
            if isinstance(name, str) and name and _is_torch(values):
                items.append((name, values, None, weight, needs_sketch(name)))
        if not items:  # (torch may not even be installed)
            return {}
        return dict(zip((it[0] for it in items), _tensor_stats(items, nan_strategy)))

    @classmethod
    def _of_torch(
        cls, values: Any, mask: Any, weight: Any, sketch: bool, nan_strategy: str, name: str
    ) -> Stat:
        (out,) = _tensor_stats([(name, values, mask, weight, sketch)], nan_strategy)
        if isinstance(out, MetricValueError):
            raise out
        return out

    @classmethod
    def _finish(cls, xp: Any, x: Any, w: Any, sketch: bool, nan_strategy: str, name: str) -> Stat:
        if x.shape[0] == 0:
            return cls(sketch=Sketch() if sketch else None)
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite values follow nan_strategy
            stat = cls._from_summary(_summarize(xp, x, w, nan_strategy), nan_strategy, name)
        if sketch:
            keep = w > 0
            if nan_strategy == "drop":
                keep &= np.isfinite(x)
            stat.sketch = Sketch.of(x[keep], w[keep])
        return stat

    @classmethod
    def _from_summary(cls, summary: np.ndarray, nan_strategy: str, name: str) -> Stat:
        if summary[6] > 0:
            raise MetricValueError(f"metric {name!r}: {int(summary[6])} negative or non-finite weight(s)")
        if nan_strategy == "error" and summary[5] > 0:
            raise MetricValueError(
                f"metric {name!r}: {int(summary[5])} non-finite value(s) (nan_strategy='error')"
            )
        return cls(*summary[:5].tolist())

    # ------------------------------------------------------------------ statistics
    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count > 0 else math.nan

    @property
    def var(self) -> float:
        """Population variance (``ddof=0``, as numpy)."""
        return max(self.m2, 0.0) / self.count if self.count > 0 else math.nan

    @property
    def std(self) -> float:
        """Population standard deviation (``ddof=0``)."""
        return math.sqrt(self.var) if self.count > 0 else math.nan

    @property
    def finite(self) -> bool:
        """Whether the summarized values are all finite (an empty Stat is): a NaN or an infinity
        among them makes the min or the max non-finite (a sum may overflow from finite values).

        >>> Stat.of([1.0, 2.0]).finite, Stat.of([1.0, float("nan")]).finite, Stat().finite
        (True, False, True)
        >>> Stat.of([-1e308, 1e308]).finite  # its sum of squares overflows, its values are finite
        True
        """
        return self.count == 0 or (math.isfinite(self.min) and math.isfinite(self.max))

    def merge(self, other: Stat) -> Stat:
        """A new Stat summarizing both; associative and commutative.

        The sketch is kept only when both sides carry one.
        """
        out = Stat(*merge_arrays(self.to_array(), other.to_array()).tolist())
        if self.sketch is not None and other.sketch is not None:
            out.sketch = self.sketch.merge(other.sketch)
        return out

    # ------------------------------------------------------------------ wire
    def to_array(self) -> np.ndarray:
        """``[count, sum, m2, min, max]`` as float64 (the sketch travels separately)."""
        return np.array([self.count, self.sum, self.m2, self.min, self.max])

    @classmethod
    def from_array(cls, arr: np.ndarray, sketch: Sketch | None = None) -> Stat:
        """Inverse of :meth:`to_array`.

        >>> Stat.from_array(Stat.of([1.0, 2.0]).to_array()).mean
        1.5
        """
        return cls(*np.asarray(arr, dtype=np.float64).tolist(), sketch=sketch)

    def __repr__(self) -> str:
        return (
            f"Stat(count={self.count:g}, mean={self.mean:g}, std={self.std:g}, "
            f"min={self.min:g}, max={self.max:g}{', sketch' if self.sketch is not None else ''})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stat) and np.array_equal(self.to_array(), other.to_array(), equal_nan=True)

    __hash__ = None  # type: ignore[assignment]


def _tensor_stats(items: Sequence[tuple], nan_strategy: str) -> list[Stat | MetricValueError]:
    """Stats of ``(name, values, mask, weight, sketch)`` items of torch values: summarized on their
    device (values and weights themselves for a sketch), then moved to the host in one copy."""
    import torch

    moved: list[Any] = []  # per item: a device tensor to move, a ready Stat or an error
    for name, values, mask, weight, sketch in items:
        try:
            check_tensor(values, name, "values")
            x = values.detach()
            if x.device.type == "mps":  # no float64 there
                x = x.cpu()
            x = x.to(torch.float64).reshape(-1)
            w = _weights(torch, tuple(values.shape) or (1,), mask, weight, name, device=x.device)
        except MetricValueError as exc:
            moved.append(exc)
            continue
        if x.shape[0] == 0:
            moved.append(Stat(sketch=Sketch() if sketch else None))
        elif sketch:  # the sketch needs the values themselves: move values and weights together
            moved.append(torch.stack([x, w.expand_as(x)]).reshape(-1))
        else:
            moved.append(_summarize(torch, x, w, nan_strategy))
    arrays = iter(to_host([m for m in moved if _is_torch(m)]))
    out: list[Stat | MetricValueError] = []
    for (name, _, _, _, sketch), m in zip(items, moved):
        if not _is_torch(m):
            out.append(m)
            continue
        host = next(arrays)
        try:
            if sketch:
                both = host.reshape(2, -1)
                out.append(Stat._finish(np, both[0], both[1], True, nan_strategy, name))
            else:
                out.append(Stat._from_summary(host, nan_strategy, name))
        except MetricValueError as exc:
            out.append(exc)
    return out


def to_host(tensors: Sequence[Any]) -> list[np.ndarray]:
    """``tensors`` as flat float64 host arrays, with one device-to-host copy for all of them.

    Accelerator tensors are concatenated on the first one's device (others join it by a
    device-to-device copy) and come over at once: on CUDA into pinned memory without blocking, then
    waiting for the current stream only. Host tensors are concatenated where they are: moving them
    to the device first would be a blocking copy, a sync of its own. mps has no float64: its
    tensors come over one by one.

    >>> import torch
    >>> [a.tolist() for a in to_host([torch.tensor([1, 2]), torch.ones(1, 2)])]
    [[1.0, 2.0], [1.0, 1.0]]
    """
    import torch

    out: list[Any] = [None] * len(tensors)
    on_device = [i for i, t in enumerate(tensors) if t.device.type not in ("cpu", "mps")]
    on_host = [i for i, t in enumerate(tensors) if t.device.type in ("cpu", "mps")]
    for idx, fetch in ((on_device, _device_to_host), (on_host, lambda flat: flat.numpy())):
        if not idx:
            continue
        first = tensors[idx[0]].device if fetch is _device_to_host else torch.device("cpu")
        moved = [t if t.device == first else t.to(first) for t in (tensors[i].detach() for i in idx)]
        flat = [t.reshape(-1).to(torch.float64) for t in moved]
        host = fetch(torch.cat(flat))
        for i, t, end in zip(idx, flat, itertools.accumulate(t.numel() for t in flat)):
            out[i] = host[end - t.numel() : end]
    return out


def _device_to_host(flat: Any) -> np.ndarray:
    """The one copy of :func:`to_host`: pinned and non-blocking on CUDA, else blocking."""
    if flat.device.type == "cuda":
        import torch

        return _pinned_to_host(flat, torch.cuda.current_stream(flat.device).synchronize)
    return flat.numpy(force=True)


def _pinned_to_host(flat: Any, wait: Callable[[], None]) -> np.ndarray:
    """Copy into pinned host memory without blocking (torch pins the destination of a non-blocking
    copy from CUDA: the DMA engine writes it directly, no staging copy), then ``wait()`` for the
    stream that queued the copy after the kernels making ``flat``: one sync, and only for them."""
    host = flat.to("cpu", non_blocking=True)
    wait()
    return host.numpy()


def scalar_value(value: Any, name: str = "value") -> float | None:
    """``value`` as a float when it is one number, whatever its type: a Python or numpy real scalar, a
    0-d real array or a 0-d tensor (detached; one host read); None for anything else (data).

    Refused with :class:`MetricValueError` naming the metric: an int beyond float64, and tensors
    that hold no real numbers (see :func:`check_tensor`).

    >>> import numpy as np
    >>> scalar_value(2), scalar_value(np.float32(0.5)), scalar_value(np.array(3.0)), scalar_value([1.0])
    (2.0, 0.5, 3.0, None)
    """
    if isinstance(value, float):
        return value
    if isinstance(value, np.ndarray):
        if value.ndim != 0 or value.dtype.kind not in "biuf" or isinstance(value, np.ma.MaskedArray):
            return None
    elif _is_torch(value):
        if value.dim() != 0:
            return None
        check_tensor(value, name, "values")
        value = value.detach()
    elif not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        raise MetricValueError(
            f"metric {name!r}: {type(value).__name__} value outside the float64 range"
        ) from None


def is_dataless(tensor: Any) -> bool:
    """A meta tensor: shape and dtype, no data. (A tensor subclass that handles its operations
    itself, as a test's emulated accelerator does, reports the meta device and still has data.)"""
    import torch

    return tensor.device.type == "meta" and type(tensor).__torch_dispatch__ == torch.Tensor.__torch_dispatch__


def check_tensor(tensor: Any, name: str, what: str) -> None:
    """Refuse tensors without real numbers to read: complex (a float64 conversion would drop the
    imaginary part, as numpy input is refused too), meta (no data) and sparse or other non-strided
    layouts (their zeros are not stored: densify, or pass ``.values()``, as meant)."""
    problem = None
    if tensor.is_complex():
        problem = f"are not numbers (got {tensor.dtype} data)"
    elif is_dataless(tensor):
        problem = "are a meta tensor (it has no data)"
    elif str(tensor.layout) != "torch.strided":
        problem = f"are a {tensor.layout} tensor; pass .to_dense() or .values()"
    if problem is not None:
        raise MetricValueError(f"metric {name!r}: {what} {problem}")


def _stack_tensors(values: list | tuple, name: str) -> Any:
    """A list of tensors (and numbers) as one detached float64 tensor on the first tensor's device."""
    import torch

    device = next(v.device for v in values if _is_torch(v))
    parts = []
    for v in values:
        if _is_torch(v):
            check_tensor(v, name, "values")
            v = v.detach()
        else:
            v = torch.as_tensor(_as_float_array(v, name, "values"))
        parts.append(v.to(device=device, dtype=torch.float64))
    try:
        return torch.stack(parts)
    except RuntimeError as exc:
        raise MetricValueError(f"metric {name!r}: a list of tensors that do not stack ({exc})") from None


def _and_mask(keep: np.ndarray, mask: Any, name: str) -> np.ndarray:
    """A masked array's own mask combined with the ``mask`` argument."""
    try:
        return keep & (_as_float_array(mask, name, "mask") != 0)
    except ValueError as exc:
        if isinstance(exc, MetricValueError):
            raise
        raise MetricValueError(f"metric {name!r}: mask does not broadcast to the values: {exc}") from None


def _as_float_array(values: Any, name: str, what: str) -> np.ndarray:
    if isinstance(values, (str, bytes)) or values is None:
        raise MetricValueError(f"metric {name!r}: {what} must be numbers, got {type(values).__name__}")
    try:
        arr = np.asarray(values)
        if arr.dtype.kind not in "biuf" and not (
            arr.dtype.kind == "O" and all(isinstance(v, numbers.Real) for v in arr.flat)
        ):  # float64 conversion would turn None into nan, "1.5" into 1.5 and drop imaginary parts
            raise TypeError(f"got {arr.dtype} data")
        arr = arr.astype(np.float64, copy=False)
    except (TypeError, ValueError, OverflowError) as exc:
        raise MetricValueError(f"metric {name!r}: {what} are not numbers ({exc})") from None
    return arr


def _weights(xp: Any, shape: tuple, mask: Any, weight: Any, name: str, device: Any = None) -> Any:
    """Per-element weights (flattened) from ``mask`` and ``weight``, broadcast to ``shape``."""

    def to_xp(v: Any, what: str) -> Any:
        if xp is np:
            return _as_float_array(v, name, what)
        if _is_torch(v):
            check_tensor(v, name, what)
            return v.detach().to(device=device, dtype=xp.float64)
        # non-blocking: a blocking copy to an accelerator waits for it (a sync); from pageable memory
        # the data are staged at once, so the host array may go
        return xp.as_tensor(_as_float_array(v, name, what)).to(device, non_blocking=True)

    w = xp.ones(shape, dtype=xp.float64) if xp is np else xp.ones(shape, dtype=xp.float64, device=device)
    try:
        if weight is not None:
            w = w * to_xp(weight, "weight")
        if mask is not None:  # after the weight: a masked element drops out even if its weight is inf or nan
            w = xp.where(to_xp(mask, "mask") != 0, w, 0.0)
    except (RuntimeError, ValueError) as exc:
        if isinstance(exc, MetricValueError):
            raise
        raise MetricValueError(
            f"metric {name!r}: mask/weight do not broadcast to shape {shape}: {exc}"
        ) from None
    if tuple(w.shape) != tuple(shape):
        raise MetricValueError(f"metric {name!r}: mask/weight of shape {tuple(w.shape)} vs values {shape}")
    return w.reshape(-1)
