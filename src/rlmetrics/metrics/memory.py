"""GPU memory of a rank, from torch's CUDA caching allocator; nothing on a machine without CUDA.

- ``perf/max_memory_allocated_gb`` and ``perf/max_memory_reserved_gb`` (verl's names): the peak
  memory held by tensors and reserved by the allocator since the last reset of the peak
  (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``);
- with ``stage``: ``perf/memory/<stage>/{allocated_gb,reserved_gb,peak_gb}``, the memory held by
  tensors and reserved now and the peak held by tensors (``torch.cuda.memory_allocated``,
  ``memory_reserved``, ``max_memory_allocated``). ``reset_peak=True`` then resets the peak, so the
  next stage's peak is its own.

GB are GiB (``2**30`` bytes), as verl's. **Merged over ranks: the max** (the worst rank is the one
that runs out of memory): built-in rules of :mod:`rlmetrics.core.reduce`, known to every aggregator.

>>> memory_metrics(2 * 2**30, 3 * 2**30, 2.5 * 2**30, 3 * 2**30, stage="gen")
{'perf/max_memory_allocated_gb': 2.5, 'perf/max_memory_reserved_gb': 3.0, \
'perf/memory/gen/allocated_gb': 2.0, 'perf/memory/gen/reserved_gb': 3.0, 'perf/memory/gen/peak_gb': 2.5}
"""

from __future__ import annotations

from typing import Any

GIB = float(2**30)
MEMORY_NAMES = ("perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb")
"""verl's names of the peak memory."""


def memory_metrics(
    allocated: float, reserved: float, peak: float, peak_reserved: float, stage: str | None = None
) -> dict[str, float]:
    """The names of the module docstring from byte counts."""
    out = {MEMORY_NAMES[0]: peak / GIB, MEMORY_NAMES[1]: peak_reserved / GIB}
    if stage is not None:
        head = f"perf/memory/{stage}/"
        out |= {head + "allocated_gb": allocated / GIB, head + "reserved_gb": reserved / GIB}
        out[head + "peak_gb"] = peak / GIB
    return out


def compute_memory_metrics(
    stage: str | None = None, *, device: Any = None, reset_peak: bool = False
) -> dict[str, float]:
    """This process's GPU memory (``device``: torch's current CUDA device by default); ``{}`` when
    torch or a CUDA device is absent.

    >>> import torch
    >>> compute_memory_metrics("gen") if not torch.cuda.is_available() else {}
    {}
    """
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    cuda = torch.cuda
    out = memory_metrics(
        cuda.memory_allocated(device), cuda.memory_reserved(device),
        cuda.max_memory_allocated(device), cuda.max_memory_reserved(device), stage,
    )  # fmt: skip
    if reset_peak:
        cuda.reset_peak_memory_stats(device)
    return out


__all__ = ["GIB", "MEMORY_NAMES", "compute_memory_metrics", "memory_metrics"]
