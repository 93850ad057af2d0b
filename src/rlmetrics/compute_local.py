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

from rlmetrics.client import _step_arg, world_size_arg
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
        """Submit the data metrics of this rank's batch (docs/metrics.md) and the registered custom ones.

        Args:
            data: a mapping, a TensorDict or a verl ``DataProto`` (docs/reductions.md, "Inputs").
            world_size: the contributions expected per name and step (None: the client's).
            step: the step (None: the client's current one).
            torch_compile: summarize with ``torch.compile`` (docs/reductions.md, "`torch_compile=True`").
            group_by: a batch key, a named function of the batch, a list of them or ``{tag: key or
                function}``: each group's metrics too (docs/groups.md, "Data metrics by a tag").
            difficulty: GRPO's difficulty groups: ``True`` (prompt ids in ``uid``) or the prompt ids' key.

        Raises:
            TypeError: ``data`` of none of those kinds.
            ValueError: no ``world_size`` here or on the client; a bad ``world_size`` or ``step``.
            MetricValueError: naming each refused value or group tag, once the others were queued.

        Example:
        >>> import torch, rlmetrics
        >>> client = rlmetrics.MetricClient(rlmetrics.LocalMetricWorker(), world_size=1)
        >>> batch = {"responses": torch.zeros(2, 3), "data_source": ["gsm8k", "math"]}
        >>> batch["attention_mask"] = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])  # responses: 2, 3
        >>> batch["token_level_rewards"] = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
        >>> client.compute_local_data_metric(batch, group_by="data_source")
        >>> client.wait_submit()
        >>> res = client.result(0)
        >>> res["response/length/mean"], res["group/data_source/math/critic/rewards/mean"]
        (2.5, 1.0)
        """
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
        """Submit ``timing_s/{stage}`` and ``timing_per_token_ms/{stage}`` (docs/metrics.md).

        Args:
            data: this rank's batch, for its token counts (docs/reductions.md, "Inputs").
            timing_raw: seconds by stage (``{"gen": 0.5, "step": 2.0}``).
            world_size: the contributions expected per name and step (None: the client's).
            step: the step (None: the client's current one).
            stragglers: also :meth:`compute_local_straggler_metrics` (docs/stragglers.md).

        Raises:
            ValueError: no ``world_size`` here or on the client; a bad ``world_size`` or ``step``.
            MetricValueError: a time that is no number, naming it, once the call's names were submitted.

        Example:
        >>> import torch, rlmetrics
        >>> client = rlmetrics.MetricClient(rlmetrics.LocalMetricWorker(), world_size=1)
        >>> batch = {"responses": torch.zeros(1, 2), "attention_mask": torch.tensor([[1, 1, 1, 0]])}
        >>> client.compute_local_timing_metrics(batch, {"gen": 0.5, "step": 2.0})
        >>> client.wait_submit()
        >>> dict(client.result(0))  # timing_s/ is renamed perf/delta_time/, as in the seed
        {'perf/delta_time/gen': 0.5, 'perf/delta_time/step': 2.0, 'timing_per_token_ms/gen': 500.0}
        """
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
        """Send this rank's seconds per stage for ``perf/straggler/<stage>/*`` (docs/stragglers.md).

        Args:
            timing_raw: seconds by stage; non-finite ones are left out.
            world_size: the contributions expected per name and step (None: the client's).
            step: the step (None: the client's current one).
            name: the rank's name in the report (None: ``rank<N>`` with a rank, else its ``client_id``).

        Raises:
            ValueError: no ``world_size`` here or on the client; a bad ``world_size`` or ``step``.

        Example:
        >>> import torch, rlmetrics  # the call imports torch (rlmetrics.metrics.timing)
        >>> client = rlmetrics.MetricClient(rlmetrics.LocalMetricWorker(), world_size=1, rank=3)
        >>> client.compute_local_straggler_metrics({"gen": 12.0, "update_actor": 5.0})
        >>> client.wait_submit()
        >>> res = client.result(0)
        >>> res["perf/straggler/gen/max"], res.lists["perf/straggler/gen/slowest"]
        (12.0, ['rank3'])
        """
        import math

        from rlmetrics.metrics.stragglers import STAGE_TIMES, StageTimes
        from rlmetrics.metrics.timing import stage_seconds

        world_size, step = self._where("compute_local_straggler_metrics", world_size, step)
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
        """Submit ``perf/total_num_tokens``, ``perf/time_per_step`` and ``perf/throughput`` (docs/metrics.md).

        Args:
            data: this rank's batch: tokens from ``global_token_num``, else ``attention_mask``.
            timing_raw: seconds by stage; ``"step"`` is the step's time.
            n_gpu: the GPUs this rank's batch ran on (siiRL passes ``pp * tp``).
            world_size: the contributions expected per name and step (None: the client's).
            step: the step (None: the client's current one).

        Raises:
            ValueError: no ``world_size`` here or on the client; a bad ``world_size`` or ``step``.
            MetricValueError: a bad ``n_gpu``, step time or ``global_token_num``, naming it (a bad
                ``n_gpu`` or step time once the call's names were submitted).

        Example:
        >>> import torch, rlmetrics
        >>> client = rlmetrics.MetricClient(rlmetrics.LocalMetricWorker(), world_size=1)
        >>> batch = {"attention_mask": torch.ones(4, 100)}  # 400 tokens
        >>> client.compute_local_throughput_metrics(batch, {"step": 2.0}, n_gpu=4)
        >>> client.wait_submit()
        >>> dict(client.result(0))  # tokens / (seconds * GPUs)
        {'perf/total_num_tokens': 400.0, 'perf/time_per_step': 2.0, 'perf/throughput': 50.0}
        """
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
        """Submit ``perf/mfu/{stage}`` of this rank's batch (docs/mfu.md, "The formula").

        Args:
            data: this rank's batch, or its number of tokens.
            timing_raw: seconds by stage (the stage's verl timer, else ``"step"``).
            n_gpu: the GPUs this rank's batch ran on.
            world_size: the contributions expected per name and step (None: the client's).
            step: the step (None: the client's current one).
            peak_flops: one GPU's peak FLOP/s, or a device name (``"H100"``).
            flops_per_token: the FLOPs of one token; or ``model``: a
                :class:`~rlmetrics.metrics.mfu.ModelFlops` or a model config. Give one of the two.
            options: :func:`~rlmetrics.metrics.mfu.compute_mfu_stats`'s ``stage`` (default
                ``"actor"``), ``timer``, ``seq_len``, ``training``.

        Raises:
            ValueError: a bad stage, timer, peak or FLOPs option, or not exactly one of
                ``flops_per_token`` and ``model``; no ``world_size``; a bad ``world_size`` or ``step``.
            MetricValueError: a refused value, naming it.

        Example:
        >>> import torch, rlmetrics
        >>> client = rlmetrics.MetricClient(rlmetrics.LocalMetricWorker(), world_size=1)
        >>> batch = {"attention_mask": torch.ones(4, 250)}  # 1000 tokens
        >>> client.compute_local_mfu_metrics(batch, {"step": 2.0}, 4, flops_per_token=1e9, peak_flops=1e12)
        >>> client.wait_submit()
        >>> dict(client.result(0))  # 1000 * 1e9 / (2.0 * 4 * 1e12)
        {'perf/mfu/actor': 0.125}
        """
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
        """Submit this rank's GPU memory in GiB (docs/mfu.md, "GPU memory per stage"); nothing without CUDA.

        Args:
            stage: also ``perf/memory/<stage>/*`` (None: only ``perf/max_memory_{allocated,reserved}_gb``).
            world_size: the contributions expected per name and step (None: the client's).
            step: the step (None: the client's current one).
            reset_peak: reset the CUDA peak after reading it, so the next stage's peak is its own.
            device: the CUDA device (None: the current one).

        Raises:
            ValueError: with CUDA, no ``world_size`` here or on the client; a bad ``world_size`` or ``step``.

        Example:
        >>> import torch, rlmetrics
        >>> client = rlmetrics.MetricClient(rlmetrics.LocalMetricWorker(), world_size=1)
        >>> client.submit_metric({"actor/loss": 1.0})
        >>> client.compute_local_memory_metrics("update_actor", reset_peak=True)
        >>> client.wait_submit()
        >>> len(client.result(0)) == (6 if torch.cuda.is_available() else 1)  # the loss, and 5 with CUDA
        True
        """
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
        """Send this rank's validation samples: the aggregator computes ``val-core/...``, ``val-aux/...``.

        The samples of all ranks are merged in rank order (docs/reductions.md, "Validation order").

        Args:
            data_sources: each sample's data source.
            sample_inputs: each sample's prompt.
            infos_dict: variable name → one value per sample (``{"acc": [...]}``).
            sample_turns: each sample's number of turns (empty: none).
            world_size: the contributions expected per name and step (None: the client's).
            step: the step (None: the client's current one).
            exact: also ``pass@k`` and the exact best/worst/maj@k (docs/validation.md).
            record_options: :func:`~rlmetrics.metrics.validation.encode_samples`'s ``style``, ``seed``,
                ``expected_counts``, ``tie``, ``missing``.

        Raises:
            ValueError: lengths that differ, a bad option; no ``world_size`` here or on the client; a
                bad ``world_size`` or ``step``.
            MetricValueError: a non-finite value under ``nan_strategy="error"``, naming its variable.

        Example:
        >>> import rlmetrics
        >>> client = rlmetrics.MetricClient(rlmetrics.LocalMetricWorker(), world_size=1)
        >>> client.process_local_validation_metrics(["gsm8k", "gsm8k"], ["q1", "q1"], {"acc": [1.0, 0.0]})
        >>> client.wait_submit()
        >>> res = client.result(0)
        >>> res["val-core/gsm8k/acc/mean@2"], res["val-aux/gsm8k/acc/std@2"]
        (0.5, 0.5)
        """
        from rlmetrics.metrics.validation import encode_samples

        world_size, step = self._where("process_local_validation_metrics", world_size, step)
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

    def _where(self, call: str, world_size: Any, step: Any) -> tuple[int, int | None]:
        """``(world_size, step)`` of a call, checked before its work, or ValueError naming ``call``."""
        ws = self.world_size if world_size is None else world_size_arg(world_size)
        if ws is None:
            raise ValueError(f"{call} needs world_size (or a client created with world_size=...)")
        return ws, None if step is None else _step_arg(step)

    def _submit_state(
        self, name: str, state: Any, world_size: int | None, step: int | None, value: float | None = None
    ) -> None:
        """Queue ``state`` on the column ``name`` (its value: ``value``, else the state's records);
        ``step`` checked by the public call (:meth:`_where`, or ``submit_metric`` before it)."""
        ws = self.world_size if world_size is None else world_size_arg(world_size)
        if ws is None:
            raise ValueError(f"{name}: needs world_size (or a client created with world_size=...)")
        packed = pack({name: float(len(state.records)) if value is None else value})
        packed.states[0] = state
        if step is None:
            self._catch_up()
        with self._lock:
            self.submit_packed(packed, ws, self.step if step is None else step, self._next_seq())

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
