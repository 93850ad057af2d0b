"""One device-to-host copy per call: :func:`to_host` moves tensors together, :class:`HostPlan` queues them.

Why and how: docs/gpu-syncs.md, "How rlmetrics keeps to one".

>>> import torch
>>> plan = HostPlan()
>>> plan.add([torch.tensor([1.0, 2.0])], lambda a: float(a.sum()))
>>> plan.add([torch.tensor(3), torch.ones(1, 2)], lambda n, b: n.tolist() + b.tolist())
>>> plan.run()
[3.0, [3.0, 1.0, 1.0]]
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class HostPlan:
    """Device tensors of one computation and their readers, run after one copy (:meth:`run`)."""

    def __init__(self) -> None:
        self._tensors: list[Any] = []
        self._readers: list[tuple[int, Callable[..., Any]]] = []

    def add(self, tensors: Sequence[Any], read: Callable[..., Any]) -> None:
        """Queue ``tensors``; ``read(*arrays)`` gets them as flat float64 host arrays in :meth:`run`."""
        self._tensors.extend(tensors)
        self._readers.append((len(tensors), read))

    def run(self) -> list[Any]:
        """The readers' results in the order of :meth:`add`, after one copy of every queued tensor."""
        arrays = iter(to_host(self._tensors) if self._tensors else [])
        return [read(*itertools.islice(arrays, n)) for n, read in self._readers]


def to_host(tensors: Sequence[Any]) -> list[np.ndarray]:
    """``tensors`` as flat float64 host arrays, in one copy (mps tensors, without float64, one by one).
    >>> import torch
    >>> [a.tolist() for a in to_host([torch.tensor([1, 2]), torch.ones(1, 2)])]
    [[1.0, 2.0], [1.0, 1.0]]
    """
    import torch

    out: list[Any] = [None] * len(tensors)
    on_device: list[int] = []
    on_host: list[int] = []
    for i, t in enumerate(tensors):
        (on_host if t.is_cpu or t.device.type == "mps" else on_device).append(i)
    if on_device:
        first = tensors[on_device[0]].device
        moved = [t if t.device == first else t.to(first) for t in (tensors[i].detach() for i in on_device)]
        flat = [t.reshape(-1).to(torch.float64) for t in moved]
        _spread(_device_to_host(torch.cat(flat)), on_device, flat, out)
    if on_host:
        flat = [_flat(tensors[i].detach()) for i in on_host]
        host = torch.cat(flat, out=torch.empty(sum(t.numel() for t in flat), dtype=torch.float64))
        _spread(host.numpy(), on_host, flat, out)  # converted to float64 as concatenated: one op
    return out


def _flat(t: Any) -> Any:
    """A host tensor of :func:`to_host` (an mps one copied over), flat."""
    t = t if t.is_cpu else t.cpu()
    return t if t.dim() == 1 else t.reshape(-1)


def _spread(host: np.ndarray, idx: list[int], flat: list[Any], out: list[Any]) -> None:
    """``out[i]`` := the part of the concatenated ``host`` that holds ``flat[k]``, for ``i = idx[k]``."""
    start = 0
    for i, t in zip(idx, flat):
        end = start + t.numel()
        out[i] = host[start:end]
        start = end


def _device_to_host(flat: Any) -> np.ndarray:
    """The one copy of :func:`to_host`: pinned and non-blocking on CUDA, else blocking."""
    if flat.device.type == "cuda":
        import torch

        return _pinned_to_host(flat, torch.cuda.current_stream(flat.device).synchronize)
    return flat.numpy(force=True)


def _pinned_to_host(flat: Any, wait: Callable[[], None]) -> np.ndarray:
    """Copy into pinned host memory without blocking, then ``wait()`` for the stream that queued it."""
    host = flat.to("cpu", non_blocking=True)
    wait()
    return host.numpy()


__all__ = ["HostPlan", "to_host"]
