"""torch.distributed backend: the client API over ``all_reduce``, for runs without a central actor.

Every rank of a process group holds a :class:`TorchMetricClient` (``rlmetrics.connect("torch")``).
``submit_metric`` summarizes at once, as with every backend; ``wait_submit()`` is the collective
point: every rank of the group calls it once per step (like the ``dist.barrier`` of the seed) and
gets the merged step back from ``result(step)`` / ``wait_final_res()``, on every rank (default) or on
``result_on`` only.

.. code-block:: python

    import torch.distributed as dist
    import rlmetrics

    dist.init_process_group("gloo")  # torchrun sets rank and world size
    client = rlmetrics.connect("torch")  # group=None: the default group
    for step in range(steps):
        client.submit_metric({"critic/score/mean": scores, "critic/score/max": scores})
        client.wait_submit()  # collective: every rank, every step
        res = client.result(step)  # the same {name: value} on every rank

**Protocol of one step** (``wait_submit``). The ranks share a *layout*: the sorted names (with their
reductions) of recent steps, identical on every rank, identified by a blake2b fingerprint.

1. ``MAX`` of 5 floats: ``[fingerprint, -fingerprint, step, -step, not covered]``. Ranks that hold
   different layouts, or a rank with a name outside the layout, make every rank do one
   ``all_gather_object`` of name lists and build the sorted union (the rare re-layout path; names
   seen in the last ``memory`` steps stay, so alternating key sets do not re-layout every time).
   Ranks at different steps raise :class:`RuntimeError` on every rank, instead of hanging.
2. ``SUM`` of ``[count, sum]`` for the ``L`` layout names (+ 2 flags, + 1 per quantile name)
   together with (async, overlapped) ``MAX`` of ``max`` for max names and ``-min`` for min names
   (+ 12 per quantile name: sketch mode, size, bucket range and parameters).
3. Only when the layout has std or quantile names: ``SUM`` of ``M2_r + n_r (mean_r - mean)^2`` for
   the std names (exact pooled M2, as :func:`~rlmetrics.stat.reduce_parts`: no sum of squares that
   cancels) and of the quantile sketches on an aligned layout.

A rank without a name sends count 0 and neutral extremes, so the name is not reported as zero; a
name no rank has in a step is left out of that step's values (listed in ``meta["empty"]``). NaN
follows ``nan_strategy``; with ``"propagate"`` a NaN reaches mean, std, min, max and quantiles (a
NaN extreme is flagged in step 2 and fixed by one extra ``MAX`` of a 0/1 mask, since ``MAX`` is
not NaN-safe in every backend). Validation sample records are gathered with one
``all_gather_object`` in the steps that have them.

Sketches: while every rank holds an exact sketch and the total fits ``exact_limit``, the raw values
are summed into disjoint per-rank slots (a gather by ``SUM``), so quantiles equal the in-process
aggregator's exact ones (``torch.quantile`` / ``torch.median``). Otherwise every rank folds its
log buckets into the window ``[hi - max_buckets + 1, hi]`` of the global top bucket and the windows
are summed: the same counts as :meth:`~rlmetrics.sketch.Sketch.merge`, so the same relative error.

``world_size`` and partial results: in a collective every rank of the group is present by
construction, so each step is complete; ``world_size`` given to ``submit_metric`` is accepted for
API compatibility and not used. A dead rank makes the collective fail or time out as torch
configures it (``init_process_group(timeout=...)``); the result of a step is never partial.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlmetrics.aggregator import Aggregator, Packed, Schema, StepResult
from rlmetrics.client import ClientCore, Submission, make_reply, receive
from rlmetrics.reduce import parse_reduction
from rlmetrics.sketch import Sketch
from rlmetrics.stat import empty_arrays, merge_arrays, spread

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover - torch is an extra
    raise ImportError("the torch backend needs torch: pip install 'rlmetrics[torch]'") from exc

logger = logging.getLogger(__name__)

__all__ = ["Layout", "TorchDistTransport", "TorchMetricClient"]

_NEUTRAL = -np.inf  # the identity of MAX
_SK_MAX = 12  # MAX floats per quantile name in step 2
_SK_HEADER = 15  # Sketch.to_array header length (documented there)


@dataclass
class Layout:
    """The agreed column order: sorted names, their reductions and what each reduction reads.

    >>> lay = Layout.of({"b/max": "max", "a/mean": "mean", "c/p95": "p95"})
    >>> lay.names, lay.maxes.tolist(), lay.quantiles.tolist()
    (('a/mean', 'b/max', 'c/p95'), [1], [2])
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

    @classmethod
    def of(cls, keys: Mapping[str, str]) -> Layout:
        names = tuple(sorted(keys))
        reductions = tuple(keys[n] for n in names)
        kinds = [parse_reduction(r) for r in reductions]

        def where(pred) -> np.ndarray:
            return np.array([i for i, r in enumerate(kinds) if pred(r)], dtype=np.int64)

        schema = Schema.of(names, reductions)
        return cls(
            names,
            reductions,
            schema,
            float(int.from_bytes(schema.id[:6], "big")),
            {n: i for i, n in enumerate(names)},
            where(lambda r: r.kind == "std"),
            where(lambda r: r.kind == "max"),
            where(lambda r: r.kind == "min"),
            where(lambda r: r.needs_sketch),
        )


def _sketch_state(sk: Sketch) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(header, bucket-mode array, exact values or None)`` of a sketch, from its documented array
    form (:meth:`~rlmetrics.sketch.Sketch.to_array`). An exact sketch is also put into buckets with
    the same parameters, in case the step's total is not exact."""
    arr = sk.to_array()
    head = arr[:_SK_HEADER]
    if head[2] != 0.0:
        return head, arr, None
    values = arr[_SK_HEADER : _SK_HEADER + int(head[10])]
    buckets = Sketch.of(values, rel_err=head[3], exact_limit=0, max_buckets=int(head[5])).to_array()
    return head, buckets, values


def _stores(barr: np.ndarray) -> tuple[tuple[int, np.ndarray], tuple[int, np.ndarray]]:
    """``((neg_offset, neg_counts), (pos_offset, pos_counts))`` of a bucket-mode sketch array."""
    n_neg, n_pos = int(barr[12]), int(barr[14])
    body = barr[_SK_HEADER:]
    return (int(barr[11]), body[:n_neg]), (int(barr[13]), body[n_neg : n_neg + n_pos])


def _fold(offset: int, counts: np.ndarray, lo: int, width: int) -> np.ndarray:
    """Counts of buckets ``offset + i`` on the window ``[lo, lo + width)``, lower ones folded into ``lo``."""
    if counts.size == 0 or width == 0:
        return np.zeros(width)
    idx = np.maximum(np.arange(offset, offset + counts.size), lo) - lo
    return np.bincount(idx, weights=counts, minlength=width)


class TorchDistTransport:
    """The transport of :class:`TorchMetricClient`: merges this rank's submissions of a step in a
    local :class:`~rlmetrics.aggregator.Aggregator`, runs the collective of
    :meth:`close_step`, and finalizes the merged step with a second Aggregator (renames, derived
    and validation metrics, NaN warnings), so the reported numbers come from the same code as with
    the other backends.

    ``bytes_last_step``: float64 bytes this rank handed to collectives in the last step;
    ``relayouts``: how many re-layouts (``all_gather_object``) happened.
    """

    def __init__(
        self,
        group: Any = None,
        *,
        result_on: int | None = None,
        renames: Mapping[str, str] | None = None,
        keep_results: int = 64,
        device: Any = None,
        memory: int = 64,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "connect('torch') needs an initialized process group: call "
                "torch.distributed.init_process_group(...) first"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the process group given to connect('torch')")
        self.world_size = dist.get_world_size(group)
        if result_on is not None and not 0 <= result_on < self.world_size:
            raise ValueError(f"result_on must be None or a rank of the group, got {result_on!r}")
        self.result_on = result_on
        if device is None:
            device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        self.device = torch.device(device)
        self.memory = memory
        self.next_step = 0  # the step the next close_step collects, equal on every rank
        self.relayouts = 0
        self.bytes_last_step = 0
        self._local = Aggregator(renames={})
        self._engine = Aggregator(renames=renames, keep_results=keep_results)
        self._layout = Layout.of({})
        self._positions: dict[bytes, np.ndarray | None] = {}  # schema id -> layout positions
        self._last_seen = np.empty(0)  # per layout name: last step with an observation on some rank
        self._last: StepResult | None = None
        self._cond = threading.Condition()

    # ------------------------------------------------------------------------- Transport protocol
    def send(self, client_id: str, items: list[Submission], close: list[int], resync: bool = False) -> dict:
        """Merge this rank's submissions locally; ``close`` is ignored (steps close in the collective)."""
        with self._cond:
            late = [it for it in items if it[0] < self.next_step]
            reply = receive(self._local, client_id, [it for it in items if it[0] >= self.next_step], [])
            errors = dict(reply["errors"])
            for step, seq, _, _ in late:
                errors[f"{client_id}/{step}/{seq}"] = (
                    f"step {step}: already collected by wait_submit() (now at step {self.next_step})"
                )
            return make_reply(self._engine, errors, "torch")

    def result(self, step: int, timeout: float | None = None) -> StepResult:
        """The result of a collected step; waits up to ``timeout`` for another thread's ``wait_submit``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while step >= self.next_step:
                if deadline is None:
                    raise RuntimeError(
                        f"step {step} is not collected yet (next: {self.next_step}); on torch.distributed "
                        "a step completes when every rank called wait_submit() for it"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    return StepResult(
                        {}, step, {"complete": False, "missing_ranks": [], "missing_metrics": {}, "empty": []}
                    )
                self._cond.wait(left)
            return self._engine.finalize(step)

    def final(self) -> StepResult:
        """The newest collected step's result (no collective: any subset of ranks may call it)."""
        with self._cond:
            if self._last is None:
                return StepResult({}, -1, {"complete": True, "missing_ranks": [], "missing_metrics": {}})
            return self._last

    def register(self, client_id: str) -> None:
        """Nothing to do: every rank of the group takes part in every step."""

    def depart(self, client_id: str) -> None:
        """Nothing to do: a rank leaves with its process group."""

    # ---------------------------------------------------------------------------- the collective
    def close_step(self, step: int) -> StepResult:
        """Collect ``step`` from every rank of the group (a collective; see the module docstring)."""
        with self._cond:
            self.bytes_last_step = 0
            parts = self._local.take(step)
            relayout = self._agree(step, parts)
            lay = self._layout
            local, sketches, records = self._local_columns(parts, lay)
            total, global_sketches, records = self._reduce(lay, local, sketches, records)
            seen = total[0] > 0
            self._last_seen[seen] = step
            res = self._finish(step, lay, total, global_sketches, records)
            res.meta.update(
                relayout=relayout, ranks=self.world_size, contributors=list(range(self.world_size))
            )
            self._last = res
            self.next_step = step + 1
            self._cond.notify_all()
            return res

    def _allreduce(self, *vectors: tuple[np.ndarray, Any]) -> list[np.ndarray]:
        """All-reduce ``(float64 vector, op)`` pairs, issued together (async) and awaited together."""
        tensors, works = [], []
        for vec, op in vectors:
            t = torch.from_numpy(vec)
            if self.device.type != "cpu":
                t = t.to(self.device)
            tensors.append(t)
            works.append(dist.all_reduce(t, op=op, group=self.group, async_op=True))
            self.bytes_last_step += vec.nbytes
        for w in works:
            w.wait()
        return [t.cpu().numpy() if t.device.type != "cpu" else t.numpy() for t in tensors]

    def _agree(self, step: int, parts: list[tuple[Packed, int]]) -> bool:
        """Step 1: check step and layout on every rank; re-layout once when needed. True if it did."""
        for attempt in range(2):
            covered = all(self._position(p.schema) is not None for p, _ in parts)
            fp = self._layout.fingerprint
            (head,) = self._allreduce(
                (np.array([fp, -fp, step, -step, 0.0 if covered else 1.0]), dist.ReduceOp.MAX)
            )
            if head[2] != -head[3]:
                raise RuntimeError(
                    f"ranks are at different steps ({-head[3]:.0f}..{head[2]:.0f}): every rank of the group "
                    "must call wait_submit() once per step"
                )
            if head[0] == -head[1] and head[4] == 0.0:
                return attempt > 0
            if attempt:
                raise RuntimeError("ranks built different layouts after a re-layout")
            self._relayout(
                step, {n: r for p, _ in parts for n, r in zip(p.schema.names, p.schema.reductions)}
            )
        raise AssertionError("unreachable")

    def _position(self, schema: Schema) -> np.ndarray | None:
        """Layout positions of a schema's names (cached per layout); None if one is not in the layout."""
        if schema.id not in self._positions:
            index = self._layout.index
            covered = all(n in index for n in schema.names)
            self._positions[schema.id] = (
                np.array([index[n] for n in schema.names], dtype=np.int64) if covered else None
            )
        return self._positions[schema.id]

    def _relayout(self, step: int, keys: dict[str, str]) -> None:
        lay = self._layout
        recent = [
            (n, lay.reductions[i])
            for i, n in enumerate(lay.names)
            if self._last_seen[i] >= step - self.memory
        ]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (sorted(keys.items()), recent), group=self.group)
        merged: dict[str, str] = {}
        for current, _ in gathered:
            for name, red in current:
                if merged.setdefault(name, red) != red:
                    logger.warning(
                        "metric %r: ranks resolve different reductions, keeping %r", name, merged[name]
                    )
        for _, kept in gathered:
            for name, red in kept:
                merged.setdefault(name, red)
        new = Layout.of(merged)
        last_seen = np.full(len(new.names), -np.inf)
        for i, n in enumerate(lay.names):
            j = new.index.get(n)
            if j is not None:
                last_seen[j] = self._last_seen[i]
        self._layout, self._last_seen, self._positions = new, last_seen, {}
        self.relayouts += 1
        logger.debug("step %d: re-layout to %d names", step, len(new.names))

    def _local_columns(
        self, parts: list[tuple[Packed, int]], lay: Layout
    ) -> tuple[np.ndarray, dict[int, Sketch], list]:
        """This rank's merged ``(5, L)`` stat array in layout order, its sketches and records."""
        local = empty_arrays(len(lay.names))
        sketches: dict[int, Sketch] = {}
        records: list = []
        for packed, _ in parts:
            pos = self._position(packed.schema)
            local[:, pos] = merge_arrays(local[:, pos], packed.stats)
            for i, sk in packed.sketches.items():
                p = int(pos[i])
                sketches[p] = sk if p not in sketches else sketches[p].merge(sk)
            records.extend(packed.records)
        return local, sketches, records

    def _reduce(
        self, lay: Layout, local: np.ndarray, sketches: dict[int, Sketch], records: list
    ) -> tuple[np.ndarray, dict[int, Sketch], list]:
        """Steps 2 and 3: the global ``(5, L)`` stat array, sketches and validation records."""
        n_names, n_q = len(lay.names), len(lay.quantiles)
        states = [sketches.get(int(p)) for p in lay.quantiles]
        states = [None if sk is None else _sketch_state(sk) for sk in states]
        lacking = [lay.names[p] for p in lay.quantiles.tolist() if p not in sketches and local[0, p] > 0]
        if lacking:
            logger.warning(
                "rank %d: quantile metric(s) %s came without a sketch: left out", self.rank, lacking
            )
        ext = np.concatenate([local[4, lay.maxes], -local[3, lay.mins]])
        nan_ext = np.isnan(ext)
        ext[nan_ext] = _NEUTRAL
        sum1 = np.concatenate(
            [local[0], local[1], [float(len(records)), float(nan_ext.any())], np.zeros(n_q)]
        )
        max1 = np.concatenate([ext, np.full(n_q * _SK_MAX, _NEUTRAL)])
        for j, st in enumerate(states):
            if st is not None:
                sum1[2 * n_names + 2 + j], max1[ext.size + j * _SK_MAX : ext.size + (j + 1) * _SK_MAX] = (
                    _sketch_info(st)
                )
        if max1.size:
            sum1, max1 = self._allreduce((sum1, dist.ReduceOp.SUM), (max1, dist.ReduceOp.MAX))
        else:
            (sum1,) = self._allreduce((sum1, dist.ReduceOp.SUM))
        total = empty_arrays(n_names)
        total[0], total[1] = sum1[:n_names], sum1[n_names : 2 * n_names]
        n_records, any_nan = sum1[2 * n_names : 2 * n_names + 2]
        if any_nan:  # rare: a NaN extreme somewhere; MAX of NaN is order-dependent in gloo
            (mask,) = self._allreduce((nan_ext.astype(np.float64), dist.ReduceOp.MAX))
            max1[: ext.size][mask > 0] = np.nan
        total[4, lay.maxes] = max1[: lay.maxes.size]
        total[3, lay.mins] = -max1[lay.maxes.size : ext.size]
        if n_records:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, records, group=self.group)
            records = [r for part in gathered for r in part]
        if lay.stds.size or n_q:
            with np.errstate(invalid="ignore", divide="ignore"):
                mean = np.divide(
                    total[1, lay.stds],
                    total[0, lay.stds],
                    out=np.zeros(lay.stds.size),
                    where=total[0, lay.stds] > 0,
                )
            m2 = local[2, lay.stds] + spread(local[0, lay.stds], local[1, lay.stds], mean)
            plans = [
                _SketchPlan.of(
                    max1[ext.size + j * _SK_MAX : ext.size + (j + 1) * _SK_MAX],
                    sum1[2 * n_names + 2 + j],
                    self.world_size,
                )
                for j in range(n_q)
            ]
            sections = [plan.section(st, self.rank) for plan, st in zip(plans, states)]
            (sum2,) = self._allreduce((np.concatenate([m2, *sections]), dist.ReduceOp.SUM))
            total[2, lay.stds] = sum2[: lay.stds.size]
            offset = lay.stds.size
            global_sketches = {}
            for plan, p in zip(plans, lay.quantiles.tolist()):
                sk = plan.sketch(sum2[offset : offset + plan.size])
                offset += plan.size
                if sk is not None:
                    global_sketches[p] = sk
            return total, global_sketches, records
        return total, {}, records

    def _finish(self, step: int, lay: Layout, total: np.ndarray, sketches: dict, records: list) -> StepResult:
        """The step's result by the Aggregator's own finalization (or an empty one off ``result_on``)."""
        if lay.names and (self.result_on is None or self.result_on == self.rank):
            self._engine.submit(
                "group", step, 0, 1, Packed(lay.schema, total, sketches, records=records), register=False
            )
        self._engine.close("group", step)
        res = self._engine.finalize(step)
        if self.result_on is not None:
            res.meta["result_on"] = self.result_on
        return res


def _sketch_info(state: tuple[np.ndarray, np.ndarray, np.ndarray | None]) -> tuple[float, np.ndarray]:
    """Step 2 data of one local sketch: its exact size (SUM) and 12 MAX floats: bucket mode flag,
    exact size, ``[hi, -lo]`` of the positive and negative stores, parameters and their negatives."""
    head, barr, values = state
    size = 0.0 if values is None else float(values.size)
    out = np.full(_SK_MAX, _NEUTRAL)
    out[0] = 1.0 if values is None else 0.0
    out[1] = size
    for k, (off, counts) in enumerate(reversed(_stores(barr))):  # positive store first
        if counts.size:
            out[2 + 2 * k], out[3 + 2 * k] = off + counts.size - 1, -off
    out[6:9] = head[3:6]
    out[9:12] = -head[3:6]
    return size, out


@dataclass
class _SketchPlan:
    """How one quantile name travels in step 3, agreed from step 2: exact slots or bucket windows."""

    exact: bool
    world: int
    params: tuple[float, int, int] | None  # (rel_err, exact_limit, max_buckets); None: no rank has one
    slot: int = 0  # exact: values per rank slot
    pos: tuple[int, int] = (0, 0)  # bucket windows (lo, width) of the positive store
    neg: tuple[int, int] = (0, 0)

    @classmethod
    def of(cls, info: np.ndarray, exact_total: float, world: int) -> _SketchPlan:
        if info[6] == _NEUTRAL:
            return cls(True, world, None)
        if not np.array_equal(info[6:9], -info[9:12]):
            raise ValueError("ranks built quantile sketches with different parameters for one metric")
        params = (float(info[6]), int(info[7]), int(info[8]))
        if info[0] == 0.0 and exact_total <= params[1]:
            return cls(True, world, params, slot=int(info[1]))

        def window(hi: float, minus_lo: float) -> tuple[int, int]:
            if hi == _NEUTRAL:
                return 0, 0
            lo = max(int(-minus_lo), int(hi) - params[2] + 1)  # Sketch.merge folds below the same bucket
            return lo, int(hi) - lo + 1

        return cls(False, world, params, pos=window(info[2], info[3]), neg=window(info[4], info[5]))

    @property
    def size(self) -> int:
        if self.params is None:
            return 0
        if self.exact:
            return 1 + self.world + self.world * self.slot
        return 4 + self.neg[1] + self.pos[1]

    def section(
        self, state: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None, rank: int
    ) -> np.ndarray:
        out = np.zeros(self.size)
        if state is None or self.params is None:
            return out
        head, barr, values = state
        out[0] = head[6]  # NaN weight
        if self.exact:
            out[1 + rank] = values.size
            start = 1 + self.world + rank * self.slot
            out[start : start + values.size] = values
            return out
        out[1:4] = barr[7:10]  # -inf, +inf, zero weights (bucket form)
        neg, pos = _stores(barr)
        out[4 : 4 + self.neg[1]] = _fold(*neg, *self.neg)
        out[4 + self.neg[1] :] = _fold(*pos, *self.pos)
        return out

    def sketch(self, section: np.ndarray) -> Sketch | None:
        """The merged sketch from the summed section."""
        if self.params is None:
            return None
        rel_err, exact_limit, max_buckets = self.params
        if self.exact:
            sizes = section[1 : 1 + self.world].astype(np.int64)
            base = 1 + self.world
            chunks = [
                section[base + r * self.slot : base + r * self.slot + sizes[r]] for r in range(self.world)
            ]
            chunks.append(np.full(int(section[0]), np.nan))
            return Sketch.of(
                np.concatenate(chunks), rel_err=rel_err, exact_limit=exact_limit, max_buckets=max_buckets
            )
        arr = Sketch(rel_err, exact_limit, max_buckets).to_array()  # the header of this parameter set
        arr[2] = 1.0  # bucket mode
        arr[6:10] = section[:4]
        arr[11:15] = [self.neg[0], self.neg[1], self.pos[0], self.pos[1]]
        return Sketch.from_array(np.concatenate([arr, section[4:]]))


class TorchMetricClient(ClientCore):
    """The client API on a ``torch.distributed`` process group (``rlmetrics.connect("torch")``).

    ``group``: the process group (None: the default group). ``result_on``: None (every rank gets
    the result) or a group rank (only that rank gets it; the others get an empty
    :class:`~rlmetrics.aggregator.StepResult` with ``meta["result_on"]``, and skip the final
    reduction work). ``renames``, ``keep_results``: as for the Aggregator; ``device``: where the
    collective vectors live (default ``cuda`` for NCCL, else ``cpu``); ``nan_strategy``, ``label``,
    ``rank``: client options (label defaults to ``rank{r}``, rank to the group rank).

    ``wait_submit()`` is collective: every rank of the group calls it once per step, in the same
    order as its other collectives. ``result(step)`` and ``wait_final_res()`` are local reads of
    collected steps. ``close_step()``, ``stop()`` and ``register()`` run no collective.
    Submissions for a step that is already collected are refused with an error.
    """

    transport: TorchDistTransport

    def __init__(
        self,
        group: Any = None,
        *,
        world_size: int | None = None,
        nan_strategy: str = "propagate",
        label: str | None = None,
        rank: int | None = None,
        **transport_options: Any,
    ) -> None:
        """``transport_options`` go to :class:`TorchDistTransport`: ``result_on``, ``renames``,
        ``keep_results``, ``device`` (above), ``memory``."""
        transport = TorchDistTransport(group, **transport_options)
        super().__init__(
            transport,
            world_size=world_size or transport.world_size,
            nan_strategy=nan_strategy,
            label=label or f"rank{transport.rank}",
            rank=transport.rank if rank is None else rank,
        )

    def wait_submit(self) -> None:
        """Collective: merge this step over every rank of the group, then advance to the next step."""
        with self._lock:
            try:
                self._flush([])  # a refused submission raises only after the collective: no rank hangs
            finally:
                self.transport.close_step(self.step)
                self.step += 1
