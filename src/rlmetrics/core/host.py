"""One device-to-host copy per call: :func:`to_host` moves tensors together, :class:`HostPlan` collects
the device tensors of one computation with what to make of them on the host.

A compute function queues every tensor it needs on the host and reads nothing earlier (no
``.item()``, no data-dependent shape), so on an accelerator the device is synchronized once.

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
    """Device tensors of one computation and their readers; :meth:`run` moves all the tensors to the
    host in one copy and returns what each reader makes of its arrays, in the order of :meth:`add`."""

    def __init__(self) -> None:
        self._tensors: list[Any] = []
        self._readers: list[tuple[int, Callable[..., Any]]] = []

    def add(self, tensors: Sequence[Any], read: Callable[..., Any]) -> None:
        """Queue ``tensors``; ``read(*arrays)`` gets them as flat float64 host arrays in :meth:`run`."""
        self._tensors.extend(tensors)
        self._readers.append((len(tensors), read))

    def run(self) -> list[Any]:
        """The readers' results, after one device-to-host copy of every queued tensor."""
        arrays = iter(to_host(self._tensors) if self._tensors else [])
        return [read(*itertools.islice(arrays, n)) for n, read in self._readers]


def to_host(tensors: Sequence[Any]) -> list[np.ndarray]:
    """``tensors`` as flat float64 host arrays, with one device-to-host copy for all of them.

    Accelerator tensors are concatenated on the first one's device (others join it by a
    device-to-device copy) and come over at once: on CUDA into pinned memory without blocking, then
    waiting for the current stream only. Host tensors are concatenated where they are, converted to
    float64 as they are (one op): moving them to the device first would be a blocking copy, a sync
    of its own. mps has no float64: its tensors come over one by one.

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
    """Copy into pinned host memory without blocking (torch pins the destination of a non-blocking
    copy from CUDA: the DMA engine writes it directly, no staging copy), then ``wait()`` for the
    stream that queued the copy after the kernels making ``flat``: one sync, and only for them."""
    host = flat.to("cpu", non_blocking=True)
    wait()
    return host.numpy()


__all__ = ["HostPlan", "to_host"]
