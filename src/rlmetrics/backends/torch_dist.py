"""torch.distributed backend: the client API over collectives, for runs without a central actor.

Over 600 lines on purpose: the client and its transport over collectives are one protocol (every
rank calls the same collectives in the same order); the forms of the exchange live in
torch_exchange.py, whether the ranks are alive in torch_alive.py. docs/torch-distributed.md.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import numpy as np

from rlmetrics.backends.torch_alive import (
    BEAT,
    GONE_AFTER,
    Beats,
    RankGoneError,
    are_gone,
    heartbeat,
    survivors,
)
from rlmetrics.backends.torch_exchange import (
    EXCHANGES,
    GATHER_LIMIT,
    Layout,
    StepsApart,
    exchange_form,
    exchange_state,
    merge_sketches,
)
from rlmetrics.client import ClientCore, SyncTransport, identity
from rlmetrics.compute_local import ComputeLocal
from rlmetrics.core.sketch import Sketch
from rlmetrics.core.stat import empty_arrays, merge_arrays
from rlmetrics.core.states import State, decode_state, encode_state
from rlmetrics.engine.aggregator import Aggregator
from rlmetrics.engine.server import merge_items
from rlmetrics.extras import require
from rlmetrics.messages import (
    PartialStepWarning,
    Reply,
    StepMeta,
    StepResult,
    StepWarning,
    Submission,
    TorchFacts,
)
from rlmetrics.packing import Packed, Schema

torch = require("torch", "torch")
dist = require("torch.distributed", "torch")

logger = logging.getLogger(__name__)

__all__ = [
    "EXCHANGES", "GATHER_LIMIT", "GONE_AFTER", "Layout", "RankGoneError", "TorchDistTransport",
    "TorchMetricClient", "exchange_form",
]  # fmt: skip


class TorchDistTransport(SyncTransport):
    """The transport of :class:`TorchMetricClient`: Aggregators merge this rank's submissions and the
    collected step around :meth:`close_step`. ``exchange``: one of :data:`EXCHANGES`; ``bytes_last_step``,
    ``bytes_received_last_step``, ``collectives_last_step`` and ``relayouts`` count what ran."""

    def __init__(
        self,
        group: Any = None,
        *,
        result_on: int | None = None,
        renames: Mapping[str, str] | None = None,
        keep_results: int = 64,
        device: Any = None,
        memory: int = 64,
        exchange: str = "auto",
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
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        self.exchange = exchange
        self.next_step = 0  # the step the next close_step collects, equal on every rank
        self._collecting = 0  # the step of the collectives running
        self._held: dict[int, list[tuple[Packed, int]]] = {}  # a rank ahead: its parts, until its step's turn
        self._global = [
            r if group is None else dist.get_global_rank(group, r) for r in range(self.world_size)
        ]
        self._store = heartbeat()
        self._sliced = self._store is not None and dist.get_backend(group) == "gloo"
        self._beats: Beats | None = None  # the heartbeats as this step's collectives saw them
        self._regroups = 0  # new groups of survivors formed
        self._partial: dict[int, list[str]] = {}  # step: the ranks gone while it was collected
        self.relayouts = 0
        self.bytes_last_step = self.bytes_received_last_step = self.collectives_last_step = 0
        self._local = Aggregator(renames={})
        self._engine = Aggregator(renames=renames, keep_results=keep_results)
        self._layout = Layout.of({})
        self._positions: dict[bytes, np.ndarray | None] = {}  # schema id -> layout positions
        self._last_seen = np.empty(0)  # per layout name: last step with an observation on some rank
        self._last: StepResult | None = None
        self._cond = threading.Condition()

    # ------------------------------------------------------------------------- Transport protocol
    def send(self, who: str, items: list[Submission], close: list, resync: bool = False) -> Reply:
        """Merge this rank's submissions locally; ``close`` is ignored (steps close in the collective)."""
        client_id = identity(who)[0]
        with self._cond:
            late = [it for it in items if it[0] < self.next_step]
            errors = merge_items(self._local, client_id, [it for it in items if it[0] >= self.next_step], [])
            for step, seq, _, _ in late:
                errors[f"{client_id}/{step}/{seq}"] = (
                    f"step {step}: already collected by wait_submit() (now at step {self.next_step})"
                )
            return Reply(errors, "torch", *self._engine.finalized_state())

    def result(
        self, step: int, timeout: float | None = None, finalize: bool = False, who: str | None = None
    ) -> StepResult:
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
                    return StepResult({}, step, StepMeta.of(complete=False))
                self._cond.wait(left)
            return self._engine.finalize(step)

    def final(self, timeout: float | None = None, who: str | None = None) -> StepResult:
        """The newest collected step's result (no collective: any subset of ranks may call it)."""
        with self._cond:
            if self._last is None:
                return StepResult({}, -1)
            return self._last

    def register(self, who: str) -> None:
        """Nothing to do: every rank of the group takes part in every step."""

    def depart(self, who: str) -> None:
        """Nothing to do: a rank leaves with its process group."""

    # ---------------------------------------------------------------------------- the collective
    def close_step(self, step: int) -> StepResult:
        """Collect ``step`` from every rank of the group (a collective), realigning or regrouping first."""
        with self._cond:
            self.bytes_last_step = self.bytes_received_last_step = self.collectives_last_step = 0
            at = step
            while True:
                try:
                    res = self._exchange_step(at)
                except StepsApart:
                    at = self._realign(at)
                    continue
                except RankGoneError as exc:
                    self._regroup(exc)  # then the step again, on the survivors
                    continue
                if at == step:
                    return res
                at = step

    def _exchange_step(self, step: int) -> StepResult:
        parts = self._held.pop(step, None)
        if parts is None:
            parts = [(packed, ws) for packed, ws, _keys in self._local.take(step)]
        try:
            return self._exchange_parts(step, parts)
        except (StepsApart, RankGoneError):
            self._held[step] = parts  # exchanged again in the step's turn, or on the survivors
            raise

    def _exchange_parts(self, step: int, parts: list[tuple[Packed, int]]) -> StepResult:
        relayout = False
        self._collecting, self._beats = step, None
        while True:
            lay = self._layout
            covered = all(self._position(p.schema) is not None for p, _ in parts)
            if covered:
                local, sketches, others = self._local_columns(parts, lay)
            else:  # exchanged only to agree on a re-layout
                local, sketches, others = empty_arrays(len(lay.names)), {}, {}
            form = exchange_form(self.exchange, self.world_size, lay)
            merged = exchange_state(
                self._collect, step, lay, local, sketches, others, covered,
                form=form, world_size=self.world_size, rank=self.rank,
            )  # fmt: skip
            if merged is not None:
                break
            if relayout:
                raise RuntimeError("ranks built different layouts after a re-layout")
            self._relayout(
                step, {n: r for p, _ in parts for n, r in zip(p.schema.names, p.schema.reductions)}
            )
            relayout = True
        total, n_others, sizes, infos = merged
        if n_others:  # some rank holds states other than sketches (validation samples)
            others = self._gather_states(others)
        global_sketches = {}
        if len(lay.quantiles):
            global_sketches = merge_sketches(
                self._collect, lay, sketches, sizes, infos,
                world_size=self.world_size, rank=self.rank,
            )  # fmt: skip
        self._last_seen[total[0] > 0] = step
        facts = TorchFacts(self.world_size, relayout, form, self.result_on)
        res = self._finish(step, lay, total, {**global_sketches, **others}, facts)
        self._last = res
        self.next_step = step + 1
        self._cond.notify_all()
        return res

    def _realign(self, step: int) -> int:
        """The step to exchange after ranks were at different steps: the lowest if one apart, else raise."""
        (rows,) = self._collect((np.array([step, self.next_step], dtype=np.float64), None))
        steps = rows[:, 0].astype(np.int64)
        low, high = int(steps.min()), int(steps.max())
        at: dict[int, list[str]] = {}
        for r, s in enumerate(steps.tolist()):
            at.setdefault(s, []).append(f"rank{self._global[r]}")
        where = "; ".join(
            f"{', '.join(names[:8])}{' ...' * (len(names) > 8)} at step {s}"
            for s, names in sorted(at.items())
        )
        ahead = ", ".join(at[high][:8])
        if high - low > 1 or rows[:, 1].max() > low:
            raise RuntimeError(
                f"rlmetrics: ranks are at different steps ({where}) and cannot be realigned exactly: "
                "every rank of the group must call wait_submit(step=...) once per step, with the "
                "trainer's step, also after a caught error"
            )
        warnings.warn(
            f"rlmetrics: ranks at different steps ({where}): {ahead} did not call "
            f"wait_submit() for step {low}. Realigned: step {low} holds what every rank submitted for it, "
            f"step {high} is collected at the next wait_submit(). Call wait_submit(step=...) once per "
            "step on every rank, also after a caught error",
            StepWarning,
            stacklevel=4,
        )
        return low

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """Around a collective: a failure caused by a gone rank raises :class:`RankGoneError` naming it."""
        try:
            yield
        except RankGoneError:
            raise
        except RuntimeError as exc:
            if self._store is None:
                raise
            beats = self._beats or Beats(self._store, self._global)
            gone = beats.settled()
            if not gone:
                raise
            said = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip())  # gloo's source file:line
            raise self._gone_error(gone, (said.split(". ")[0] or type(exc).__name__)[:120]) from exc

    def _wait(self, work: Any) -> None:
        """Wait for a collective; on gloo in slices of :data:`BEAT` s, so a gone rank raises here, not at
        the group's timeout (:class:`RankGoneError`)."""
        if not self._sliced:
            work.wait()
            return
        while True:
            try:
                work.wait(timeout=timedelta(seconds=BEAT))
                return
            except RuntimeError as exc:
                if "Operation timed out" not in str(exc):  # the slice's own timeout
                    raise
            self._beats = self._beats or Beats(self._store, self._global)
            gone = self._beats.gone()
            if gone:
                raise self._gone_error(gone, "")

    def _gone_error(self, gone: list[int], said: str) -> RankGoneError:
        said = f"; torch: {said}" if said else ""
        who = f"{are_gone(gone)} (heartbeat stopped{said})"
        if dist.get_rank() in gone:  # no counter could be read
            who = f"the group's store is gone with its host (rank{self._global[0]} under torchrun{said})"
        return RankGoneError(
            f"rlmetrics: step {self._collecting} cannot be collected: {who}, and the other ranks "
            "could not form a group without it. The steps before "
            "it are collected (client.result). Restart the run from your checkpoint (torchrun "
            "--max-restarts restarts every rank)",
            gone,
        )

    def _regroup(self, exc: RankGoneError) -> None:
        """Survivors of ``exc`` form a new group and collect the step partial; else raise ``exc``."""
        try:
            agreed = survivors(self._store, self._regroups, self._global, exc.gone)
            if dist.get_rank() not in agreed:
                raise exc
            group = dist.new_group(agreed, use_local_synchronization=True)
        except RankGoneError:
            raise
        except Exception as failed:
            raise exc from failed
        gone = [g for g in self._global if g not in agreed]
        if self.result_on is not None:
            on = self._global[self.result_on]
            self.result_on = agreed.index(on) if on in agreed else None
        self.group, self._global, self.world_size = group, agreed, len(agreed)
        self.rank, self._regroups = dist.get_rank(group), self._regroups + 1
        self._partial[self._collecting] = [f"rank{g}" for g in gone]
        warnings.warn(
            f"rlmetrics: step {self._collecting}: {are_gone(gone)} (heartbeat stopped). Step "
            f"{self._collecting} is collected without it (meta.missing_ranks) and the {len(agreed)} "
            "other ranks go on in a new group; the run's own collectives on the old group fail",
            PartialStepWarning,
            stacklevel=4,
        )

    def _collect(self, *jobs: tuple[np.ndarray, Any]) -> list[np.ndarray]:
        """Collectives on float64 vectors, issued and awaited together; a job is ``(vector, op)``: a
        ``ReduceOp`` all-reduces, None all-gathers (a ``(W, n)`` array back)."""
        outs, works = [], []
        for vec, op in jobs:
            t = torch.from_numpy(vec)
            if self.device.type != "cpu":
                t = t.to(self.device)
            if op is None:
                out = torch.empty((self.world_size, vec.size), dtype=torch.float64, device=self.device)
                works.append(dist.all_gather(list(out.unbind(0)), t, group=self.group, async_op=True))
            else:
                out = t
                works.append(dist.all_reduce(t, op=op, group=self.group, async_op=True))
            outs.append(out)
            self.collectives_last_step += 1
            self.bytes_last_step += vec.nbytes
            self.bytes_received_last_step += out.numel() * 8
        with self._failing():
            for w in works:
                self._wait(w)
        return [o.cpu().numpy() if o.device.type != "cpu" else o.numpy() for o in outs]

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
        with self._failing():
            dist.all_gather_object(gathered, (sorted(keys.items()), recent), group=self.group)
        self.collectives_last_step += 1
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
    ) -> tuple[np.ndarray, dict[int, Sketch], dict[int, State]]:
        """This rank's merged ``(5, L)`` stat array, sketches and other states, by layout position."""
        local = empty_arrays(len(lay.names))
        filled = np.zeros(len(lay.names), dtype=bool)
        states: dict[int, State] = {}
        for packed, _ in parts:
            pos = self._position(packed.schema)
            # names in several schemas of the step merge; the first contribution of a name is copied
            local[:, pos] = merge_arrays(local[:, pos], packed.stats) if filled[pos].any() else packed.stats
            filled[pos] = True
            for i, state in packed.states.items():
                p = int(pos[i])
                states[p] = state if p not in states else states[p].merge(state)
        sketches = {p: s for p, s in states.items() if isinstance(s, Sketch)}
        return local, sketches, {p: s for p, s in states.items() if p not in sketches}

    def _gather_states(self, states: dict[int, State]) -> dict[int, State]:
        """Every rank's non-sketch states (one ``all_gather_object``), merged by layout position."""
        gathered: list[Any] = [None] * self.world_size
        with self._failing():
            dist.all_gather_object(
                gathered, {p: encode_state(s) for p, s in states.items()}, group=self.group
            )
        self.collectives_last_step += 1
        out: dict[int, State] = {}
        for part in gathered:
            for p, encoded in part.items():
                state = decode_state(*encoded)
                out[p] = state if p not in out else out[p].merge(state)
        return out

    def _finish(
        self, step: int, lay: Layout, total: np.ndarray, states: dict[int, State], facts: TorchFacts
    ) -> StepResult:
        """The step's result by the Aggregator's finalization (empty off ``result_on``), with ``facts``."""
        if lay.names and (self.result_on is None or self.result_on == self.rank):
            self._engine.submit("group", step, 0, 1, Packed(lay.schema, total, states), register=False)
        self._engine.close("group", step)
        gone = self._partial.pop(step, None)
        partial = {"complete": False, "missing_ranks": gone} if gone else {}
        return self._engine.finalize(step, contributors=self._global, torch=facts, **partial)


class TorchMetricClient(ComputeLocal, ClientCore):
    """The client API on a ``torch.distributed`` process group (``rlmetrics.connect("torch")``).

    ``group``: None for the default group; ``result_on``: None (every rank gets the result) or a group
    rank (the others get an empty result with ``meta.result_on``); ``device``: where the collective
    vectors live (default ``cuda`` for NCCL, else ``cpu``); ``label`` defaults to ``rank{r}``, ``rank``
    to the group rank. ``wait_submit()`` is the only collective (every rank, once per step).
    """

    transport: TorchDistTransport

    def __init__(
        self,
        group: Any = None,
        *,
        world_size: int | None = None,
        nan_strategy: str = "propagate",
        label: str | None = None,
        naming: Any = None,
        rank: int | None = None,
        **transport_options: Any,
    ) -> None:
        """``transport_options`` go to :class:`TorchDistTransport` (``result_on``, ``device``, ...)."""
        transport = TorchDistTransport(group, **transport_options)
        super().__init__(
            transport,
            world_size=transport.world_size if world_size is None else world_size,
            nan_strategy=nan_strategy,
            label=label or f"rank{transport.rank}",
            naming=naming,
            rank=transport.rank if rank is None else rank,
        )
        self._counted: set[int] = set()  # seqs of queued submissions made without step=: at the counter

    def submit_metric(
        self,
        metrics: Mapping[str, Any],
        world_size: int | None = None,
        step: int | None = None,
        **options: Any,
    ) -> None:
        """As :meth:`~rlmetrics.client.ClientCore.submit_metric`; without ``step`` it is dropped (with a
        warning) if the next ``wait_submit(step=...)`` names another step than the counter's."""
        start = len(self._buffer)
        try:
            super().submit_metric(metrics, world_size, step, **options)
        finally:
            if step is None:
                self._counted.update(item[1] for item in self._buffer[start:])

    def wait_submit(self, step: int | None = None, block: bool | None = None) -> None:
        """Collective: merge this step (or ``step``) over every rank of the group, then advance; it
        always blocks (``block`` is accepted for the client API's sake)."""
        with self._lock:
            if step is not None and step != self.step:
                self._drop_counted(step)
                self.step = step
            self._counted.clear()
            if self.step < self.transport.next_step:  # a step collected already: no collective
                again, self.step = self.step, self.transport.next_step
                warnings.warn(
                    f"rlmetrics: rank{self.transport.rank}: wait_submit() for step {again} again: it is "
                    f"collected already (next: {self.step}); ignored, no collective ran. Call wait_submit() "
                    "once per step",
                    StepWarning,
                    stacklevel=2,
                )
                self._flush([])  # data queued for it since is refused: raises
                return
            try:
                self._flush([])  # a refused submission raises only after the collective: no rank hangs
            finally:
                self.transport.close_step(self.step)
                self.step += 1

    def _drop_counted(self, step: int) -> None:
        """Drop what was queued without ``step=`` when ``wait_submit`` names another ``step``."""
        counted = [item for item in self._buffer if item[1] in self._counted]
        if not counted:
            return
        self._buffer = [item for item in self._buffer if item[1] not in self._counted]
        names = sorted({n for item in counted for n in item[3].schema.names})
        warnings.warn(
            f"rlmetrics: rank{self.transport.rank}: wait_submit(step={step}) after {len(names)} metric(s) "
            f"submitted without step= (at this rank's counter, step {self.step}: {', '.join(names[:5])}"
            f"{' ...' * (len(names) > 5)}); dropped, as the step they were meant for is unknown. Pass the "
            "trainer's step to submit_metric(..., step=step) too",
            StepWarning,
            stacklevel=3,
        )
