"""A batch's tensors as the torch metric functions read them: keys as tensors, the response and prompt masks.

Rules: docs/metrics.md, "What the data metrics summarize" (masks) and docs/reductions.md, "Inputs".

>>> import torch
>>> t = BatchTensors({"responses": torch.zeros(2, 3), "attention_mask": torch.ones(2, 5, dtype=torch.long)})
>>> t.response_width, t.prompt_width, tuple(t.response_mask.shape), t.get("values")
(3, 2, (2, 3), None)
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from rlmetrics.core.values import is_dataless
from rlmetrics.extras import require
from rlmetrics.metrics.batch import as_batch, key_error

torch = require("torch", "torch")

Batch = Any  # a mapping, a TensorDict or a DataProto-shaped object: rlmetrics.metrics.batch


class BatchTensors:
    """The batch's tensors (None if missing) and masks; a bad recognised key raises ``MetricValueError``."""

    def __init__(self, batch: Batch, what: str = "compute_data_metric") -> None:
        self.batch = as_batch(batch, what)
        self.size: int | None = None  # sequences in the batch
        self._size_key = ""
        responses = self.get("responses")
        attention = self.get("attention_mask")
        response_mask = self.get("response_mask")
        for key, x in (
            ("responses", responses),
            ("attention_mask", attention),
            ("response_mask", response_mask),
        ):
            if x is not None:
                if x.dim() != 2:
                    raise key_error(key, f"must be 2-D (sequences, tokens), got shape {tuple(x.shape)}")
                self.check_size(key, x)
        if responses is not None and response_mask is not None and responses.shape != response_mask.shape:
            raise key_error(
                "response_mask", f"shape {tuple(response_mask.shape)}, responses' is {tuple(responses.shape)}"
            )
        width = last_dim(responses) if responses is not None else last_dim(response_mask)
        self.response_width = width
        self.attention = attention
        self.prompt_width: int | None = None
        self.prompt_mask = None
        if attention is not None and width is not None:
            total = attention.shape[-1]
            if width > total:
                raise key_error("attention_mask", f"{total} columns, fewer than the {width} response columns")
            self.prompt_width = total - width
            self.prompt_mask = attention[:, : self.prompt_width]
            if response_mask is None:
                response_mask = attention[:, self.prompt_width :]
        self.response_mask = response_mask

    def check_size(self, key: str, x: Any) -> None:
        """Raise unless ``x`` has one row per sequence of the batch (the first key checked sets it)."""
        n = int(x.shape[0])
        if self.size is None:
            self.size, self._size_key = n, key
        elif n != self.size:
            raise key_error(key, f"{n} rows, {self._size_key!r} has {self.size} sequences")

    def get(self, key: str) -> Any:
        """``batch[key]`` as a tensor (numpy arrays and lists converted on the host), else None."""
        value = self.batch.get(key)
        if value is None:
            return None
        if not isinstance(value, torch.Tensor):
            try:
                arr = np.asarray(value)
            except ValueError as exc:  # ragged
                raise key_error(key, f"not an array of numbers ({exc})") from None
            if arr.dtype.kind == "O" and all(isinstance(v, numbers.Real) for v in arr.flat):
                arr = arr.astype(np.float64)  # verl's non_tensor_batch: object arrays of numbers
            if arr.dtype.kind not in "biuf":
                raise key_error(key, f"must be numbers, got {arr.dtype} data")
            value = torch.as_tensor(arr)
        if value.is_complex() or is_dataless(value) or value.layout != torch.strided:
            raise key_error(
                key, f"must be a dense real tensor, got {value.dtype} {value.layout} on {value.device}"
            )
        return value.detach()


def last_dim(t: Any) -> int | None:
    return int(t.shape[-1]) if t is not None and t.dim() >= 1 else None


def floating(t: Any) -> Any:
    """Floating point for arithmetic: float32 and float64 kept, others to float32."""
    return t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)


__all__ = ["Batch", "BatchTensors", "floating", "last_dim"]
