"""The response tokens of each row with the masked ones removed, and what the example metrics count on them:
distinct tokens, bigrams (transitions), distinct bigrams per row and over the batch, from one sort of
packed keys, with fixed shapes (nothing read on the host before the call's one copy).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch

from .evaluate import Call, as_tensor

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_NARROW_INTS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32)


def rows_of(call: Call, responses: Any, mask: Any) -> Rows:
    """The :class:`Rows` of ``(responses, mask)``, made once per call for all the metrics that read them."""
    key = (id(responses), id(mask))
    if key not in call.shared:
        call.shared[key] = Rows(responses, mask)
    return call.shared[key]


class Rows:
    """Response tokens of each row with the masked ones removed (order kept), padded at the end.

    The padding repeats the row's first token and the padding of the bigram keys the row's first
    key, so counting distinct values needs no mask. Shared by the metrics of one call that read the
    same ``(responses, mask)``.
    """

    def __init__(self, responses: torch.Tensor, mask: torch.Tensor | None) -> None:
        tokens = as_tensor(responses)
        self._narrow = tokens.dtype in _NARROW_INTS
        tokens = tokens.long()
        b, r = tokens.shape
        if mask is None:
            keep = torch.ones_like(tokens, dtype=torch.bool)
        else:
            keep = (as_tensor(mask) != 0).broadcast_to((b, r))
        self.lengths = keep.sum(1)
        kept_before = keep.cumsum(1)
        self._pos = torch.arange(r, device=tokens.device)
        # a kept token goes to (kept ones before it); a masked one behind all kept ones, in order
        dest = torch.where(keep, kept_before - 1, self.lengths[:, None] + self._pos - kept_before)
        compact = torch.empty_like(tokens).scatter_(1, dest, tokens)
        self.valid = self._pos < self.lengths[:, None]
        self.tokens = torch.where(self.valid, compact, compact[:, :1])

    @cached_property
    def distinct_tokens(self) -> torch.Tensor:
        return _count_distinct(self.tokens, self.lengths > 0)

    @cached_property
    def _pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Bigram keys (padding: the row's first key) and the number of bigrams of each row."""
        a, b = self.tokens[:, :-1], self.tokens[:, 1:]
        keys = (a << 32) | (b & 0xFFFFFFFF)  # injective for 32-bit ids
        count = (self.lengths - 1).clamp(min=0)
        return torch.where(self._pos[:-1] < count[:, None], keys, keys[:, :1]), count

    @cached_property
    def _distinct_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Distinct bigrams of each row and of the whole batch, from one stable sort of all keys."""
        keys, count = self._pairs
        b, k = keys.shape
        if keys.numel() == 0:
            return torch.zeros(b, dtype=torch.long, device=keys.device), keys.new_zeros(())
        has = count > 0
        # rows without bigrams hold a key of a row with bigrams; within a key, the stable sort keeps
        # the rows in order, so the first entry of each (row, key) follows another row or key
        donor = has.to(torch.int32).argmax().reshape(1)
        fill = keys[:, 0].index_select(0, donor)
        sorted_keys, order = torch.where(has[:, None], keys, fill).reshape(-1).sort(stable=True)
        row = order // k
        first = torch.ones(1, dtype=torch.bool, device=keys.device)
        new_key = torch.cat([first, sorted_keys[1:] != sorted_keys[:-1]])
        new_in_row = new_key | torch.cat([first, row[1:] != row[:-1]])
        per_row = torch.zeros(b, dtype=torch.long, device=keys.device).index_add_(0, row, new_in_row.long())
        return torch.where(has, per_row, 0), torch.where(has.any(), new_key.sum(), 0)

    @property
    def distinct_pairs(self) -> torch.Tensor:
        return self._distinct_pairs[0]

    @property
    def distinct_pairs_overall(self) -> torch.Tensor:
        return self._distinct_pairs[1]

    @cached_property
    def id_overflow(self) -> torch.Tensor:
        """True when a kept token id does not fit in 32 bits (the bigram keys would collide)."""
        if self._narrow or self.tokens.numel() == 0:
            return torch.zeros((), dtype=torch.bool, device=self.tokens.device)
        lo, hi = torch.aminmax(torch.where(self.valid, self.tokens, 0))
        return (lo < _INT32_MIN) | (hi > _INT32_MAX)


def _count_distinct(keys: torch.Tensor, nonempty: torch.Tensor) -> torch.Tensor:
    """Distinct values of each row of ``keys`` (0 where not ``nonempty``): one sort, fixed shapes."""
    b, k = keys.shape
    if k == 0 or b == 0:
        return torch.zeros(b, dtype=torch.long, device=keys.device)
    s = keys.sort(1).values
    return torch.where(nonempty, (s[:, 1:] != s[:, :-1]).sum(1) + 1, 0)


__all__ = ["Rows", "rows_of"]
