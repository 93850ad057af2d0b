"""The seed's ``compute_local_*`` methods, on every client (a mixin over
:class:`~rlmetrics.client.ClientCore`): compute built-in metrics on this rank's batch and submit them
as mergeable Stats (docs/metrics.md); metric modules and torch are imported on first use.

>>> from rlmetrics.backends import MetricClient, local
>>> client = MetricClient(local.LocalMetricWorker(), world_size=1)
>>> client.process_local_validation_metrics(["gsm8k", "gsm8k"], ["q1", "q1"], {"acc": [1.0, 0.0]})
>>> client.wait_submit()
>>> client.wait_final_res()["val-core/gsm8k/acc/mean@2"]
0.5
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlmetrics.client import world_size_arg
from rlmetrics.core.values import MetricValueError
from rlmetrics.packing import pack

if TYPE_CHECKING:
    from rlmetrics.metrics.validation import SampleRecord


class ComputeLocal:
    """The ``compute_local_*`` and ``process_local_validation_metrics`` methods of a client."""

    def _compute_strategy(self) -> str:
        """The nan_strategy compute functions run with (``"error"`` is left to :meth:`submit_metric`)."""
        return "drop" if self.nan_strategy == "drop" else "propagate"

    def compute_local_data_metric(
        self,
        data: Any,
        world_size: int | None = None,
        step: int | None = None,
        *,
        torch_compile: bool = False,
        group_by: Any = None,
        difficulty: bool | str = False,
    ) -> None:
        """Submit the data metrics of this rank's batch (a mapping, a TensorDict or a ``DataProto``)
        and every :func:`~rlmetrics.metrics.custom.register_metric` function's. ``torch_compile``,
        ``group_by``: :func:`~rlmetrics.metrics.data.compute_data_stats`; ``difficulty`` (``True``:
        prompt ids in ``uid``; or the key): GRPO's difficulty groups (docs/groups.md). Refused values
        raise :class:`~rlmetrics.core.stat.MetricValueError` after the others were queued."""
        from rlmetrics.metrics.batch import as_batch
        from rlmetrics.metrics.custom import debug_enabled, debug_report, run_custom_metrics
        from rlmetrics.metrics.data import data_stats_and_prompts

        batch = as_batch(data, "compute_local_data_metric")
        errors: dict[str, str] = {}
        stats, prompts = data_stats_and_prompts(
            batch,
            torch_compile=torch_compile,
            nan_strategy=self._compute_strategy(),
            group_by=group_by,
            difficulty=difficulty,
            errors=errors,
        )
        metrics: dict[str, Any] = dict(stats)
        metrics.update(run_custom_metrics(data))
        if debug_enabled():
            debug_report(batch, metrics)
        kept = ""
        try:
            self.submit_metric(metrics, world_size, step)
        except MetricValueError as exc:  # it says what of the call was queued; so are the prompts, below
            errors["metrics"] = str(exc)
        else:
            kept = f" ({len(metrics)} metric(s) of this call were submitted; only what is named here is not)"
        if prompts is not None:
            from rlmetrics.metrics.difficulty import PROMPT_STATS, PromptStats

            self._submit_state(PROMPT_STATS, PromptStats([(self.client_id, prompts)]), world_size, step)
        if errors:
            raise MetricValueError("; ".join(errors.values()) + kept)

    def compute_local_timing_metrics(
        self,
        data: Any,
        timing_raw: Mapping[str, float],
        world_size: int | None = None,
        step: int | None = None,
        *,
        stragglers: bool = False,
    ) -> None:
        """Submit ``timing_s/{stage}`` and ``timing_per_token_ms/{stage}`` (``stragglers=True``: and
        :meth:`compute_local_straggler_metrics`). A time that is no number raises MetricValueError
        naming it, after the call's names were submitted."""
        from rlmetrics.metrics.timing import compute_timing_stats

        errors: dict[str, str] = {}
        stats = compute_timing_stats(data, timing_raw, nan_strategy=self._compute_strategy(), errors=errors)
        if stragglers:
            self.compute_local_straggler_metrics(timing_raw, world_size, step)
        self._submit_refusing(stats, world_size, step, errors)

    def _submit_refusing(
        self, metrics: Mapping[str, Any], world_size: int | None, step: int | None, errors: dict[str, str]
    ) -> None:
        """Submit ``metrics``, then raise one MetricValueError for ``errors`` and refused names."""
        try:
            self.submit_metric(metrics, world_size, step)
        except MetricValueError as exc:  # it says what of the call was submitted
            raise MetricValueError("; ".join([*errors.values(), str(exc)])) from None
        if errors:
            raise MetricValueError(
                "; ".join(errors.values()) + f" (the call's {len(metrics)} names were submitted, those "
                "named here with no value of this rank: the step does not wait for them)"
            )

    def compute_local_straggler_metrics(
        self,
        timing_raw: Mapping[str, float],
        world_size: int | None = None,
        step: int | None = None,
        *,
        name: str | None = None,
    ) -> None:
        """Send this rank's finite seconds per stage under ``name`` (default ``rank<N>``, else its
        ``client_id``), once per step, for ``perf/straggler/<stage>/*`` (docs/stragglers.md)."""
        import math

        from rlmetrics.metrics.stragglers import STAGE_TIMES, StageTimes
        from rlmetrics.metrics.timing import stage_seconds

        times = {k: float(v) for k, v in stage_seconds(timing_raw).items() if math.isfinite(v)}
        if name is None:
            name = self.client_id if self.rank is None else f"rank{self.rank}"
        self._submit_state(STAGE_TIMES, StageTimes([(str(name), times)]), world_size, step)

    def compute_local_throughout_metrics(
        self,
        data: Any,
        timing_raw: Mapping[str, float],
        n_gpu: int,
        world_size: int | None = None,
        step: int | None = None,
    ) -> None:
        """Submit ``perf/total_num_tokens``, ``perf/time_per_step``, ``perf/throughput``; ``n_gpu``:
        this rank's GPUs (siiRL passes ``pp * tp``). A bad ``n_gpu`` or step time raises
        MetricValueError naming it, after the call's names were submitted."""
        from rlmetrics.metrics.timing import compute_throughput_stats

        errors: dict[str, str] = {}
        strategy = self._compute_strategy()
        stats = compute_throughput_stats(data, timing_raw, n_gpu, nan_strategy=strategy, errors=errors)
        self._submit_refusing(stats, world_size, step, errors)

    compute_local_throughput_metrics = compute_local_throughout_metrics

    def compute_local_mfu_metrics(
        self,
        data: Any,
        timing_raw: Mapping[str, float],
        n_gpu: int,
        world_size: int | None = None,
        step: int | None = None,
        *,
        peak_flops: float | str,
        flops_per_token: float | None = None,
        model: Any = None,
        **options: Any,
    ) -> None:
        """Submit ``perf/mfu/{stage}`` (default ``actor``; docs/mfu.md) of this rank's batch or token
        count ``data`` on ``n_gpu`` GPUs of ``peak_flops`` (FLOP/s or ``"H100"``), with
        ``flops_per_token`` or ``model`` (a :class:`~rlmetrics.metrics.mfu.ModelFlops`); ``options``:
        :func:`~rlmetrics.metrics.mfu.compute_mfu_stats`'s ``stage``, ``timer``, ``seq_len``, ``training``."""
        from rlmetrics.metrics.mfu import compute_mfu_stats

        stats = compute_mfu_stats(
            data, timing_raw, n_gpu, peak_flops=peak_flops, flops_per_token=flops_per_token, model=model,
            nan_strategy=self._compute_strategy(), **options,
        )  # fmt: skip
        self.submit_metric(stats, world_size, step)

    def compute_local_memory_metrics(
        self,
        stage: str | None = None,
        world_size: int | None = None,
        step: int | None = None,
        *,
        reset_peak: bool = False,
        device: Any = None,
    ) -> None:
        """Submit this rank's GPU memory, ``perf/max_memory_{allocated,reserved}_gb`` and with ``stage``
        ``perf/memory/<stage>/*`` (max over ranks; docs/mfu.md). Nothing without a CUDA device."""
        from rlmetrics.metrics.memory import compute_memory_metrics

        metrics = compute_memory_metrics(stage, device=device, reset_peak=reset_peak)
        if metrics:
            self.submit_metric(metrics, world_size, step)

    def process_local_validation_metrics(
        self,
        data_sources: list[str],
        sample_inputs: list[str],
        infos_dict: Mapping[str, list[Any]],
        sample_turns: Any = (),
        world_size: int | None = None,
        step: int | None = None,
        *,
        exact: bool = False,
        **record_options: Any,
    ) -> None:
        """Send this rank's validation samples: ``val-core/...``, ``val-aux/...`` come from all ranks'
        samples in rank order (docs/reductions.md, "Validation order"); ``nan_strategy="drop"`` drops
        samples with a non-finite value; ``exact=True`` adds ``pass@k`` and
        exact best/worst/maj@k; ``record_options`` (``style``, ``seed``, ``expected_counts``, ``tie``,
        ``missing``) go to :func:`~rlmetrics.metrics.validation.encode_samples`."""
        from rlmetrics.metrics.validation import encode_samples

        record = encode_samples(
            data_sources, sample_inputs, infos_dict, sample_turns, exact=exact,
            nan_strategy=self.nan_strategy, **record_options,
        )  # fmt: skip
        self._submit_samples(record, world_size, step)

    def _submit_samples(self, record: SampleRecord, world_size: int | None, step: int | None) -> None:
        """Queue a validation record, placed among all ranks' by :meth:`_rank_key`."""
        from rlmetrics.metrics.validation.samples import VALIDATION_SAMPLES, Samples

        with self._lock:
            seq = self._seq  # the next seq: the one _submit_state takes
            state = Samples([(self._rank_key(record, seq), record)])
            self._submit_state(VALIDATION_SAMPLES, state, world_size, step, float(record.n_samples))

    def _submit_state(
        self, name: str, state: Any, world_size: int | None, step: int | None, value: float | None = None
    ) -> None:
        """Queue ``state`` on the column ``name`` (its value: ``value``, else the state's records)."""
        ws = self.world_size if world_size is None else world_size_arg(world_size)
        if ws is None:
            raise ValueError(f"{name}: needs world_size (or a client created with world_size=...)")
        packed = pack({name: float(len(state.records)) if value is None else value})
        packed.states[0] = state
        if step is None:
            self._catch_up()
        with self._lock:
            self.submit_packed(packed, ws, self.step if step is None else int(step), self._next_seq())

    def _rank_key(self, record: SampleRecord, seq: int) -> tuple[int, int, int, str]:
        """Where a record goes in the merged order: ``(0, rank, seq, digest)`` for a client with a
        rank, ``(1, 0, 0, digest)`` without; ``digest`` is the record's content hash."""
        from rlmetrics.metrics.validation import record_digest

        rank = self.rank
        if rank is None:
            match = re.match(r"rank(\d+)(?:@|$)", self.client_id)
            rank = int(match.group(1)) if match else None
        digest = record_digest(record)
        return (1, 0, 0, digest) if rank is None else (0, rank, seq, digest)


__all__ = ["ComputeLocal"]
