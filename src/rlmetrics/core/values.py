"""What counts as a metric value (numbers, lists, arrays, tensors; masks, weights) and how it becomes float64.

The rules: docs/reductions.md, "The value policy".

>>> scalar_value(2), scalar_value(np.float32(0.5)), scalar_value([1.0])
(2.0, 0.5, None)
>>> as_float_array(["1.5"], "loss", "values")
Traceback (most recent call last):
...
rlmetrics.core.values.MetricValueError: metric 'loss': values are not numbers (got <U3 data)
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any

import numpy as np


class MetricValueError(ValueError):
    """A metric value that cannot be summarized; the message names the metric and the problem."""


def is_torch(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (torch is never imported here)."""
    torch = sys.modules.get("torch")  # not imported: no tensor exists
    return torch is not None and isinstance(value, torch.Tensor)


def scalar_value(value: Any, name: str = "value") -> float | None:
    """``value`` as a float when it is one number, else None; :class:`MetricValueError` if unreadable.
    >>> scalar_value(2), scalar_value(np.float32(0.5)), scalar_value(np.array(3.0)), scalar_value([1.0])
    (2.0, 0.5, 3.0, None)
    """
    if isinstance(value, float):
        return value
    if isinstance(value, np.ndarray):
        if value.ndim != 0 or value.dtype.kind not in "biuf" or isinstance(value, np.ma.MaskedArray):
            return None
    elif is_torch(value):
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
    """A meta tensor without data (not a subclass that dispatches its own operations: an emulated device)."""
    import torch

    return tensor.is_meta and type(tensor).__torch_dispatch__ == torch.Tensor.__torch_dispatch__


def check_tensor(tensor: Any, name: str, what: str) -> None:
    """Refuse (:class:`MetricValueError`) complex, meta and non-strided (sparse) tensors."""
    problem = None
    if tensor.is_complex():
        problem = f"are not numbers (got {tensor.dtype} data)"
    elif is_dataless(tensor):
        problem = "are a meta tensor (it has no data)"
    elif str(tensor.layout) != "torch.strided":
        problem = f"are a {tensor.layout} tensor; pass .to_dense() or .values()"
    if problem is not None:
        raise MetricValueError(f"metric {name!r}: {what} {problem}")


def stack_tensors(values: list | tuple, name: str) -> Any:
    """A list of tensors (and numbers) as one detached float64 tensor on the first tensor's device."""
    import torch

    device = next(v.device for v in values if is_torch(v))
    parts = []
    for v in values:
        if is_torch(v):
            check_tensor(v, name, "values")
            v = v.detach()
        else:
            v = torch.as_tensor(as_float_array(v, name, "values"))
        parts.append(v.to(device=device, dtype=torch.float64))
    try:
        return torch.stack(parts)
    except RuntimeError as exc:
        raise MetricValueError(f"metric {name!r}: a list of tensors that do not stack ({exc})") from None


def and_mask(keep: np.ndarray, mask: Any, name: str) -> np.ndarray:
    """A masked array's own mask combined with the ``mask`` argument."""
    try:
        return keep & (as_float_array(mask, name, "mask") != 0)
    except ValueError as exc:
        if isinstance(exc, MetricValueError):
            raise
        raise MetricValueError(f"metric {name!r}: mask does not broadcast to the values: {exc}") from None


def as_float_array(values: Any, name: str, what: str) -> np.ndarray:
    """``values`` as a float64 numpy array; anything but real numbers is refused (``what``: the argument)."""
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


def weights(xp: Any, shape: tuple, mask: Any, weight: Any, name: str, device: Any = None) -> Any:
    """Flat per-element weights of ``mask`` and ``weight`` broadcast to ``shape``; None if both are None."""
    if mask is None and weight is None:
        return None

    def to_xp(v: Any, what: str) -> Any:
        if xp is np:
            return as_float_array(v, name, what)
        if is_torch(v):
            check_tensor(v, name, what)
            return v.detach().to(device=device, dtype=xp.float64)
        # non-blocking: a blocking copy to an accelerator is a sync; pageable data are staged at once
        return xp.as_tensor(as_float_array(v, name, what)).to(device, non_blocking=True)

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


def check_weights(w: np.ndarray, name: str) -> None:
    """Refuse weights that are negative or not finite."""
    if not (w.min(initial=0.0) >= 0.0 and w.max(initial=0.0) < math.inf):  # (NaN fails both)
        raise bad_weights_error(name, np.count_nonzero(~((w >= 0.0) & (w < math.inf))))


def bad_weights_error(name: str, count: float) -> MetricValueError:
    """The error for ``count`` weights that are negative or not finite."""
    return MetricValueError(f"metric {name!r}: {int(count)} negative or non-finite weight(s)")


__all__ = [
    "MetricValueError", "and_mask", "as_float_array", "bad_weights_error", "check_tensor", "check_weights",
    "is_dataless", "is_torch", "scalar_value", "stack_tensors", "weights",
]  # fmt: skip
