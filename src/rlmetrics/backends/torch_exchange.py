"""What the ranks of a ``torch.distributed`` step exchange, and how they read it back: the agreed
:class:`Layout`, the state exchange (step 1) and the sketch merge (step 2), over the transport's
``collect``. docs/torch-distributed.md, "The protocol of one step".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlmetrics.core.reduce import parse_reduction
from rlmetrics.core.sketch import BucketWindow, Sketch
from rlmetrics.core.stat import empty_arrays, reduce_parts
from rlmetrics.extras import require
from rlmetrics.packing import Schema

dist = require("torch.distributed", "torch")

logger = logging.getLogger("rlmetrics.backends.torch_dist")

Collect = Callable[..., list[np.ndarray]]
"""``collect(*jobs)``: the jobs' collectives, issued together and awaited together (the transport's)."""

_NEUTRAL = -np.inf  # the identity of MAX
_HEAD = 5  # MAX header: [fingerprint, -fingerprint, step, -step, not covered]
_SK_INFO = 12  # MAX floats per quantile name: bucket mode, exact size, bucket spans, parameters

EXCHANGES = ("auto", "gather", "reduce")
"""The forms of a step's state exchange (module docstring); ``"auto"`` picks by :data:`GATHER_LIMIT`."""

GATHER_LIMIT = 1 << 16
"""``"auto"`` gathers while a rank receives at most this many float64 (512 KiB); beyond, it all-reduces."""


@dataclass
class Layout:
    """The agreed column order: sorted names, their reductions and what each reduction reads.

    >>> lay = Layout.of({"b/max": "max", "a/mean": "mean", "c/p95": "p95"})
    >>> lay.names, lay.maxes.tolist(), lay.quantiles.tolist()
    (('a/mean', 'b/max', 'c/p95'), [1], [2])
    >>> lay.gathered.size  # fields the gather form sends: count, sum of a; count, max of b; all of c
    9
    >>> lay.fingerprint == Layout.of({"a/mean": "mean", "c/p95": "p95", "b/max": "max"}).fingerprint
    True
    """

    names: tuple[str, ...]
    reductions: tuple[str, ...]
    schema: Schema
    fingerprint: float  # 48 bits of the schema's blake2b id: exact in float64
    index: dict[str, int] = field(repr=False)
    stds: np.ndarray = field(repr=False)
    maxes: np.ndarray = field(repr=False)
    mins: np.ndarray = field(repr=False)
    quantiles: np.ndarray = field(repr=False)
    gathered: np.ndarray = field(repr=False)  # flat indices into (5, L): the fields the gather form sends

    @classmethod
    def of(cls, keys: Mapping[str, str]) -> Layout:
        names = tuple(sorted(keys))
        reductions = tuple(keys[n] for n in names)
        kinds = [parse_reduction(r) for r in reductions]

        def where(pred) -> np.ndarray:
            return np.array([i for i, r in enumerate(kinds) if pred(r)], dtype=np.int64)

        def whole(r) -> bool:  # M2 merges with every rank's count and sum; a histogram reads all fields
            return 2 in r.fields and not r.quantile

        def extreme(field: int):  # a min or max field read, reduced with MIN or MAX (a sketch has its own)
            return lambda r: field in r.fields and not whole(r) and not r.needs_sketch

        schema = Schema.of(names, reductions)
        return cls(
            names,
            reductions,
            schema,
            float(int.from_bytes(schema.id[:6], "big")),
            {n: i for i, n in enumerate(names)},
            where(whole),  # by the fields each kind reads (Reduction.fields), not by kind names
            where(extreme(4)),
            where(extreme(3)),
            where(lambda r: r.needs_sketch),
            _read_fields(kinds),
        )


def _read_fields(kinds: list[Any]) -> np.ndarray:
    """Flat indices into a ``(5, L)`` stat array of the fields the reductions ``kinds`` read."""
    reads = np.zeros((5, len(kinds)), dtype=bool)
    for i, r in enumerate(kinds):
        reads[r.fields, i] = True
    return np.flatnonzero(reads)


def exchange_form(exchange: str, world_size: int, layout: Layout) -> str:
    """The form (``"gather"`` or ``"reduce"``) of ``exchange`` in :data:`EXCHANGES` (``"auto"``: by size).

    >>> lay = Layout.of({f"m{i}/mean": "mean" for i in range(1000)})
    >>> exchange_form("auto", 8, lay), exchange_form("auto", 64, lay), exchange_form("reduce", 8, lay)
    ('gather', 'reduce', 'reduce')
    """
    if exchange != "auto":
        return exchange
    row = _HEAD + 1 + len(layout.quantiles) * (1 + _SK_INFO) + layout.gathered.size
    return "gather" if world_size * row <= GATHER_LIMIT else "reduce"


def _sketch_info(sk: Sketch | None) -> tuple[float, np.ndarray]:
    """Step 1 data of a local sketch: its exact size and 12 MAX floats (their MAX: do all ranks agree)."""
    out = np.full(_SK_INFO, _NEUTRAL)
    if sk is None:
        return 0.0, out
    size = float(sk.values.size) if sk.is_exact else 0.0
    out[0], out[1] = (0.0 if sk.is_exact else 1.0), size
    neg, pos = sk.bucket_span()
    for k, span in enumerate((pos, neg)):
        if span is not None:
            out[2 + 2 * k], out[3 + 2 * k] = span[1], -span[0]
    params = [sk.rel_err, sk.exact_limit, sk.max_buckets]
    out[6:9] = params
    out[9:12] = np.negative(params)
    return size, out


def exchange_state(
    collect: Collect,
    step: int,
    lay: Layout,
    local: np.ndarray,
    sketches: dict[int, Sketch],
    others: Mapping[int, Any],
    covered: bool,
    *,
    form: str,
    world_size: int,
    rank: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Step 1: ``(merged (5, L) stat array, how many other states the ranks hold, every rank's exact
    sketch sizes (W, Q), MAX of the sketch infos)``, or None when the ranks must re-layout first."""
    fp, n_names = lay.fingerprint, len(lay.names)
    head = np.array([fp, -fp, step, -step, 0.0 if covered else 1.0])
    lacking = [lay.names[p] for p in lay.quantiles.tolist() if p not in sketches and local[0, p] > 0]
    if lacking:
        logger.warning("rank %d: quantile metric(s) %s came without a sketch: left out", rank, lacking)
    info = [_sketch_info(sketches.get(p)) for p in lay.quantiles.tolist()]
    sizes = np.array([size for size, _ in info])
    sums = np.concatenate([[float(len(others))], sizes])
    infos = np.concatenate([np.empty(0), *(i for _, i in info)])
    if form == "gather":
        (rows,) = collect((np.concatenate([head, sums, infos, local.ravel()[lay.gathered]]), None))
        if not _agreed(rows[:, :_HEAD].max(axis=0)):
            return None
        cut = np.cumsum([_HEAD, sums.size, infos.size])
        parts = np.repeat(empty_arrays(n_names)[None], world_size, axis=0)  # fields not sent: empty
        parts.reshape(world_size, -1)[:, lay.gathered] = rows[:, cut[2] :]
        parts = parts.transpose(1, 0, 2)
        return (
            reduce_parts(parts),
            float(rows[:, cut[0]].sum()),
            rows[:, cut[0] + 1 : cut[1]],
            rows[:, cut[1] : cut[2]].max(axis=0),
        )
    ext = np.concatenate([local[4, lay.maxes], -local[3, lay.mins]])
    nan_ext = np.isnan(ext)
    ext[nan_ext] = _NEUTRAL
    slots = np.zeros((world_size, sizes.size))
    slots[rank] = sizes
    jobs = [
        (
            np.concatenate([local[0], local[1], sums[:1], slots.ravel(), [float(nan_ext.any())]]),
            dist.ReduceOp.SUM,
        ),
        (np.concatenate([head, infos, ext]), dist.ReduceOp.MAX),
    ]
    if lay.stds.size:
        jobs.append((local[:, lay.stds].ravel(), None))
    out = collect(*jobs)
    total_sums, maxes = out[0], out[1]
    if not _agreed(maxes[:_HEAD]):
        return None
    total = empty_arrays(n_names)
    total[0], total[1] = total_sums[:n_names], total_sums[n_names : 2 * n_names]
    ext = maxes[_HEAD + infos.size :]
    if total_sums[-1]:  # rare: a NaN extreme somewhere; MAX of NaN is order-dependent in gloo
        (mask,) = collect((nan_ext.astype(np.float64), dist.ReduceOp.MAX))
        ext[mask > 0] = np.nan
    total[4, lay.maxes] = ext[: lay.maxes.size]
    total[3, lay.mins] = -ext[lay.maxes.size :]
    if lay.stds.size:
        stds = out[2].reshape(world_size, 5, lay.stds.size).transpose(1, 0, 2)
        total[:, lay.stds] = reduce_parts(stds)
    all_sizes = total_sums[2 * n_names + 1 : -1].reshape(world_size, sizes.size)
    return total, float(total_sums[2 * n_names]), all_sizes, maxes[_HEAD : _HEAD + infos.size]


class StepsApart(Exception):
    """The ranks of one exchange are at different steps (the transport realigns or raises)."""


def _agreed(head: np.ndarray) -> bool:
    """Whether every rank is at this step with this layout, from the MAX of the headers."""
    if head[2] != -head[3]:
        raise StepsApart
    return bool(head[0] == -head[1] and head[4] == 0.0)


def merge_sketches(
    collect: Collect,
    lay: Layout,
    sketches: dict[int, Sketch],
    exact_sizes: np.ndarray,
    infos: np.ndarray,
    *,
    world_size: int,
    rank: int,
) -> dict[int, Sketch]:
    """Step 2: the global sketch of every quantile name some rank has, by one ``SUM``."""
    plans = [
        _SketchPlan.of(infos[j * _SK_INFO : (j + 1) * _SK_INFO], exact_sizes[:, j])
        for j in range(len(lay.quantiles))
    ]
    quantiles = lay.quantiles.tolist()
    sections = [plan.section(sketches.get(p), rank) for plan, p in zip(plans, quantiles)]
    (summed,) = collect((np.concatenate([np.empty(0), *sections]), dist.ReduceOp.SUM))
    out, offset = {}, 0
    for plan, p in zip(plans, quantiles):
        sk = plan.sketch(summed[offset : offset + plan.size])
        offset += plan.size
        if sk is not None:
            out[p] = sk
    return out


@dataclass
class _SketchPlan:
    """How one quantile name travels in step 2: every rank's values at its offset, or a bucket window."""

    params: dict[str, Any] | None  # Sketch parameters; None: no rank has a sketch
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))  # exact: rank r's values
    window: BucketWindow | None = None  # buckets: the window every rank folds onto

    @classmethod
    def of(cls, info: np.ndarray, sizes: np.ndarray) -> _SketchPlan:
        """The plan from the MAX of the ranks' infos and their exact sizes (exact while all fit)."""
        if info[6] == _NEUTRAL:
            return cls(None)
        if info[6] != -info[9] or info[8] != -info[11]:
            raise ValueError("ranks built quantile sketches with different parameters for one metric")
        params = {"rel_err": float(info[6]), "exact_limit": int(-info[10]), "max_buckets": int(info[8])}
        if info[0] == 0.0 and sizes.sum() <= params["exact_limit"]:
            return cls(params, offsets=np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]))

        def span(hi: float, minus_lo: float) -> tuple[int, int] | None:
            return None if hi == _NEUTRAL else (int(-minus_lo), int(hi))

        window = BucketWindow.covering(span(info[4], info[5]), span(info[2], info[3]), params["max_buckets"])
        return cls(params, window=window)

    @property
    def size(self) -> int:
        if self.params is None:
            return 0
        return 1 + int(self.offsets[-1]) if self.window is None else self.window.size

    def section(self, sk: Sketch | None, rank: int) -> np.ndarray:
        """This rank's part of the ``SUM``: its NaN weight, then its values at its offset; or its fold."""
        if sk is None or self.params is None:
            return np.zeros(self.size)
        if self.window is not None:
            return sk.fold(self.window)
        out = np.zeros(self.size)
        out[0] = sk.nan_count
        out[1 + self.offsets[rank] : 1 + self.offsets[rank + 1]] = sk.values
        return out

    def sketch(self, section: np.ndarray) -> Sketch | None:
        """The merged sketch from the summed section."""
        if self.params is None:
            return None
        if self.window is not None:
            return Sketch.from_folded(section, self.window, **self.params)
        return Sketch.of(np.concatenate([section[1:], np.full(int(section[0]), np.nan)]), **self.params)


__all__ = [
    "EXCHANGES",
    "GATHER_LIMIT",
    "Collect",
    "Layout",
    "StepsApart",
    "exchange_form",
    "exchange_state",
    "merge_sketches",
]
