"""Count device→host synchronisations without a GPU, on an accelerator emulated on the CPU.

On a GPU the host queues kernels and goes on; it **waits for the device** (a *sync*, counted here) when

1. it reads a value: ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)`` / ``if t:``
   (``aten::_local_scalar_dense``, also behind ``is_nonzero`` and ``allclose``), ``torch.equal``;
2. it copies between host and device memory with a **blocking** copy, in either direction:
   ``.cpu()``, ``.to("cpu")``, ``.tolist()``, ``.numpy(force=True)``, ``host.copy_(dev)``, and also
   ``t.to(dev)`` of a host tensor or ``torch.tensor(data, device=dev)``: torch makes a blocking copy
   an async copy followed by a stream synchronize (``torch.cuda.set_sync_debug_mode`` flags both
   directions). A **non-blocking** copy to the host does not wait when its destination is pinned
   (``.to("cpu", non_blocking=True)`` of a CUDA tensor pins it): the host waits when it
   synchronizes the stream, :meth:`SyncCounter.synchronize`, counted there; until then the
   destination holds garbage (NaN here), so code that reads it too early gives wrong numbers. Into
   pageable memory a non-blocking copy to the host is synchronous: counted at once. A non-blocking
   copy *to* the device does not wait for the device (pageable memory is staged at once);
3. it runs an op whose output **shape depends on the data**, since the host must learn the size to
   allocate the output: ``nonzero`` (``argwhere``, ``torch.where(cond)``), ``masked_select``,
   ``x[bool_mask]`` and ``x[bool_mask] = v`` (``index`` / ``index_put_`` with a boolean index),
   ``unique`` and ``unique_consecutive``, ``repeat_interleave`` without ``output_size``,
   ``bincount``, ``histc``, ``masked_scatter``.

Everything else queues work and goes on: kernels, views, device-to-device copies, factories on the
device, Python scalars as kernel arguments, metadata (shape, dtype, device).

Why emulate: on the CPU nothing waits, and ``.numpy()`` or ``.tolist()`` of a CPU tensor reaches no
dispatcher at all, so counting ops on CPU tensors would miss the very transfers that matter. Here
:func:`on_device` wraps CPU tensors into :class:`DeviceTensor`: a tensor subclass that reports device
``meta`` (the one non-CPU device type whose Python bindings work in a CPU-only build of torch; code
under test takes its accelerator branches, ``device.type != "cpu"``) and keeps its data on the CPU.
Inside a :class:`SyncCounter` (a ``TorchDispatchMode``) every op on device tensors runs on that data
and its tensor results stay on the device; factories given the device make device tensors; the three
kinds of syncs above are counted, each with a line in :attr:`SyncCounter.events`. As on a GPU,
``.numpy()`` of a device tensor raises, and so does an op that mixes device tensors with host tensors
of one or more dimensions (a 0-dim host tensor is a scalar argument, which CUDA accepts). Not
emulated: autograd, ``torch.compile``, several devices, streams other than one current stream.

>>> import torch
>>> x = on_device(torch.tensor([1.0, -2.0, 3.0]))
>>> with SyncCounter() as counter:
...     total = x.abs().sum()  # a kernel: queued
...     _ = total.item()  # the host reads it: waits
...     _ = x[x > 0]  # a data-dependent shape
>>> counter.syncs, counter.events
(2, ['read a value: aten._local_scalar_dense.default', 'data-dependent shape: aten.index.Tensor'])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["DEVICE", "DeviceTensor", "SyncCounter", "on_device"]

DEVICE = torch.device("meta")
"""The emulated accelerator."""

aten = torch.ops.aten

_DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default,
    aten.bincount.default,
    aten.histc.default,
    aten.masked_scatter.default,
    aten.masked_scatter_.default,
}
_BOOL_INDEXED = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
_READS = {aten._local_scalar_dense.default, aten.equal.default}


class DeviceTensor(torch.Tensor):
    """A tensor on the emulated device (:data:`DEVICE`); ``elem`` holds its data, on the CPU."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> DeviceTensor:
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=DEVICE,
            requires_grad=False,
        )
        out.elem = elem
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # outside a counter: nothing counted
        return _run(None, func, args, kwargs or {})

    def numpy(self, *, force: bool = False) -> Any:
        if not force:
            raise TypeError(
                f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                "to host memory first."
            )
        return self.cpu().numpy()

    def tolist(self) -> Any:
        return self.cpu().tolist()

    def __repr__(self) -> str:  # no data: printing would be a host read
        return f"DeviceTensor(shape={tuple(self.shape)}, dtype={self.dtype})"


def on_device(tree: Any) -> Any:
    """Tensors of a (nested) dict / list / tuple as :class:`DeviceTensor`; no copy, nothing counted."""
    return tree_map(lambda t: DeviceTensor(t.detach()) if type(t) is torch.Tensor else t, tree)


class SyncCounter(TorchDispatchMode):
    """Counts device→host synchronisations of the code run inside it (see the module docstring).

    ``syncs``: how many; ``events``: what each was (``"<kind>: <op>"``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0
        self.events: list[str] = []
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host destination, data)
        self._pinned: set[int] = set()  # data pointers of the storages of pinned host tensors

    def count(self, kind: str, func: Any) -> None:
        self.syncs += 1
        self.events.append(f"{kind}: {func}")

    def synchronize(self) -> None:
        """The current stream's ``synchronize()``: a sync; completes the pending non-blocking copies."""
        self.count("stream synchronize", "synchronize")
        for dst, data in self._pending:
            dst.copy_(data)
        self._pending.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(self, func, args, kwargs or {})

    def _pin(self, t: torch.Tensor) -> None:
        self._pinned.add(t.untyped_storage().data_ptr())

    def _is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._pinned

    def _later(self, dst: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        """``dst`` receives ``data`` at the next :meth:`synchronize`; garbage until then."""
        dst.fill_(float("nan") if dst.is_floating_point() else -1)
        self._pending.append((dst, data.clone()))
        return dst


def _on_emulated(device: Any) -> bool:
    return device is not None and torch.device(device).type == DEVICE.type


def _run(counter: SyncCounter | None, func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` on the CPU data of device tensors; count what waits for the device."""
    count: Callable[[str], None] = (
        (lambda kind: counter.count(kind, func)) if counter else (lambda kind: None)
    )
    flat = tree_flatten((args, kwargs))[0]
    devs = [a for a in flat if isinstance(a, DeviceTensor)]
    if func is aten._to_copy.default:
        return _to_copy(counter, count, args[0], kwargs)
    if func is aten.copy_.default:
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        return _copy(counter, count, args[0], args[1], bool(non_blocking))
    if any(type(a) is torch.Tensor and a.device == DEVICE for a in flat):
        raise NotImplementedError(
            "a tensor made on the emulated device without a copy (torch.tensor / as_tensor(data, "
            "device=...)) holds no data here; on a GPU it is a blocking copy to the device, a sync"
        )
    factory = _on_emulated(kwargs.get("device"))
    if not devs and not factory:
        return func(*args, **kwargs)  # a host op
    hosts = [a for a in flat if type(a) is torch.Tensor and a.dim() > 0]
    if devs and hosts:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, {DEVICE} and "
            f"cpu! ({func})"
        )
    if func in _READS:
        count("read a value")
    elif func in _DATA_DEPENDENT or (
        func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
    ):
        count("data-dependent shape")
    elif func in _BOOL_INDEXED and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in tree_flatten(args[1])[0]
    ):
        count("data-dependent shape")
    if factory:
        kwargs = {**kwargs, "device": torch.device("cpu")}
    out = func(*_unwrap(args), **_unwrap(kwargs))
    return _wrap(out, devs)


def _to_copy(counter: SyncCounter | None, count: Callable[[str], None], src: Any, kwargs: dict) -> Any:
    target = kwargs.get("device")
    non_blocking = bool(kwargs.get("non_blocking", False))
    here = {**kwargs, "device": torch.device("cpu")} if target is not None else kwargs
    data = aten._to_copy.default(src.elem if isinstance(src, DeviceTensor) else src, **here)
    if isinstance(src, DeviceTensor) and target is not None and not _on_emulated(target):
        if not non_blocking:  # to the host
            count("blocking copy to the host")
            return data
        if counter is None:
            return data
        counter._pin(data)  # torch pins the destination of a non-blocking copy from an accelerator
        return counter._later(data, data.clone())
    if not isinstance(src, DeviceTensor) and _on_emulated(target):
        if not non_blocking:  # to the device
            count("blocking copy to the device")
        return DeviceTensor(data)
    if isinstance(src, DeviceTensor):
        return DeviceTensor(data)
    return data


def _copy(
    counter: SyncCounter | None, count: Callable[[str], None], dst: Any, src: Any, non_blocking: bool
) -> Any:
    to_host, to_device = not isinstance(dst, DeviceTensor), not isinstance(src, DeviceTensor)
    if to_host and isinstance(src, DeviceTensor):
        if non_blocking and counter is not None and counter._is_pinned(dst):
            return counter._later(dst, src.elem.to(dst.dtype))
        count("copy to the host")  # blocking, or into pageable memory: synchronous
    elif to_device and isinstance(dst, DeviceTensor) and not non_blocking:
        count("blocking copy to the device")
    aten.copy_.default(_unwrap(dst), _unwrap(src), non_blocking)
    return dst


def _unwrap(tree: Any) -> Any:
    return tree_map(lambda a: a.elem if isinstance(a, DeviceTensor) else a, tree)


def _wrap(out: Any, inputs: list[DeviceTensor]) -> Any:
    """Results on the device; an input's own data (in-place ops, ``out=``) comes back as that input."""
    mine = {id(d.elem): d for d in inputs}

    def wrap(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        same = mine.get(id(t))
        if same is not None:
            if same.shape != t.shape:
                raise NotImplementedError("resizing a device tensor in place is not emulated")
            return same
        return DeviceTensor(t)

    return tree_map(wrap, out)
