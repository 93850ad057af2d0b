"""GPU memory of a rank, from torch's CUDA caching allocator; nothing on a machine without CUDA.

Names in GiB, merged over ranks by max. Rules: docs/mfu.md, "GPU memory per stage".

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
    """The memory metrics (GiB) from byte counts; the ``perf/memory/<stage>/*`` names with ``stage``."""
    out = {MEMORY_NAMES[0]: peak / GIB, MEMORY_NAMES[1]: peak_reserved / GIB}
    if stage is not None:
        head = f"perf/memory/{stage}/"
        out |= {head + "allocated_gb": allocated / GIB, head + "reserved_gb": reserved / GIB}
        out[head + "peak_gb"] = peak / GIB
    return out


def compute_memory_metrics(
    stage: str | None = None, *, device: Any = None, reset_peak: bool = False
) -> dict[str, float]:
    """This process's GPU memory (default: current CUDA device), then ``reset_peak``; ``{}`` without CUDA.

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
