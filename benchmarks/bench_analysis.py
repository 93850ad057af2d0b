"""The seed's example metric pack, vectorised (examples/seed_metrics), against its loop references.

A batch of B sequences (prompt P, response R; Zipf-distributed token ids, so bigrams repeat; random
response lengths from 0 to R) with every input the seed's examples read: ``correct_tokens``,
``attention_mask``, ``responses``, ``response_mask``, ``prompts``, ``token_level_rewards``,
``policy_logits`` (a small vocabulary, ``V_SMALL``: the seed's entropy is already vectorised, so a large
one only adds equal time to both sides), ``loss_values``, ``grad_norm``, and model outputs
``attention_weights`` (B x 16 queries x P+R keys) and ``hidden_states`` (B x R x 32).

- **loop references** (``ref_*`` below): the seed's example functions as its docs write them, a Python
  loop per sequence with ``.item()`` per token where the seed has one; the reward distribution, which
  the seed only names, as defined in examples/seed_metrics, with a loop per sequence.
  ``float_dtype`` sets the precision of the floating-point statistics (the seed's ``.float()``,
  float32; float64 here by default, to compare tightly). The tests check the pack against these.
- **vectorised**: the ``compute_*`` functions of examples/seed_metrics (dict view, one host copy).

Every row asserts that both sides give the same numbers (relative 1e-9, NaN equal to NaN). Timed: the
fastest of ``reps`` calls after one warm-up call, of ``3 * reps`` for the fast vectorised side (as
``timeit`` advises: slower runs measure the load of the machine, which multi-threaded torch ops feel
most; ``--threads 1`` compares single-threaded code with single-threaded loops). One extra row times the
chunked policy entropy at a 150k vocabulary against the seed's one-shot formula (no target: the point
there is bounded memory).

Run: ``make bench``, or
``PYTHONPATH=src python benchmarks/bench_analysis.py [--quick] [--threads N] [--markdown PATH]``.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import report
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's root: its examples package
from examples import seed_metrics as an  # noqa: E402

FULL = {"B": 256, "R": 1024, "P": 512}
QUICK = {"B": 32, "R": 256, "P": 128}
VOCAB = 32_000
V_SMALL = 16
BIG_VOCAB = 150_000
TARGET_RATIO = 20.0
OURS_REPS = 3  # the vectorised side is cheap: more calls, to find one the machine's load did not slow
REL = 1e-9
LOOSER = {"model/prompt_attention_ratio/mean": 1e-6}
"""Sums of float32 rows, added in float64 (the seed sums everything in float32)."""


# ---------------------------------------------------------------------------------------- inputs
def make_batch(
    b: int, r: int, p: int, *, seed: int = 0, vocab: int = VOCAB, holes: float = 0.0, v_small: int = V_SMALL
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(data, model_outputs)``: a random batch with every key the examples read.

    Response lengths are uniform in ``0..r`` (right padding); ``holes`` is the probability that a
    position inside a response is masked as well (the seed's masks need not be prefixes).
    """
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = rng.integers(0, r + 1, size=b)
    prompt_lengths = rng.integers(1, p + 1, size=b) if p else np.zeros(b, dtype=np.int64)
    response_mask = np.arange(r)[None, :] < lengths[:, None]
    if holes:
        response_mask &= rng.random((b, r)) >= holes
    responses = np.minimum(rng.zipf(1.3, size=(b, r)), vocab) - 1
    responses[~response_mask] = 0  # the pad token
    prompt_mask = np.arange(p)[None, :] >= (p - prompt_lengths[:, None])  # left padding
    rewards = np.zeros((b, r), dtype=np.float32)
    if r:  # an outcome reward on the last response token, plus sparse dense ones
        last = np.maximum(lengths - 1, 0)
        rewards[np.arange(b), last] = np.where(lengths > 0, rng.choice([-1.0, 0.0, 0.5, 1.0], size=b), 0.0)
    rewards += np.where(rng.random((b, r)) < 0.05, rng.normal(size=(b, r)), 0.0).astype(np.float32)
    attention = torch.softmax(torch.randn(b, 16, p + r, generator=gen), dim=-1)
    data = {
        "responses": torch.from_numpy(responses),
        "response_mask": torch.from_numpy(response_mask.astype(np.int64)),
        "prompts": torch.from_numpy(rng.integers(0, vocab, size=(b, p))),
        "attention_mask": torch.from_numpy(
            np.concatenate([prompt_mask, response_mask], axis=1).astype(np.int64)
        ),
        "correct_tokens": torch.from_numpy(rng.random((b, p + r)) < 0.7),
        "token_level_rewards": torch.from_numpy(rewards * response_mask),
        "policy_logits": 3 * torch.randn(b, r, v_small, generator=gen),
        "loss_values": torch.randn(64, generator=gen).abs(),
        "grad_norm": torch.tensor(1.25),
    }
    outputs = {"attention_weights": attention, "hidden_states": torch.randn(b, r, 32, generator=gen)}
    return data, outputs


# ----------------------------------------------------------------------- loop references (the seed)
def ref_response_quality_score(data: Any) -> torch.Tensor:
    responses = data["responses"]
    response_mask = data["response_mask"]
    unique_tokens_per_response = []
    for i in range(responses.shape[0]):
        response_tokens = responses[i][response_mask[i].bool()]
        unique_tokens_per_response.append(len(torch.unique(response_tokens)))
    return torch.tensor(unique_tokens_per_response, device=responses.device).float()


def ref_custom_data_metrics(data: Any, float_dtype: torch.dtype = torch.float64) -> dict[str, float]:
    metrics = {}
    if "correct_tokens" in data and "attention_mask" in data:
        correct = data["correct_tokens"].to(float_dtype)
        mask = data["attention_mask"].to(float_dtype)
        metrics["custom/token_accuracy/mean"] = ((correct * mask).sum() / mask.sum()).item()
    if "responses" in data and "response_mask" in data:
        response_quality = ref_response_quality_score(data).to(float_dtype)
        metrics["custom/response_quality/mean"] = response_quality.mean().item()
        metrics["custom/response_quality/max"] = response_quality.max().item()
        metrics["custom/response_quality/min"] = response_quality.min().item()
    return metrics


def ref_custom_training_metrics(data: Any, float_dtype: torch.dtype = torch.float64) -> dict[str, float]:
    metrics = {}
    if "policy_logits" in data:
        logits = data["policy_logits"]
        probs = torch.softmax(logits, dim=-1)
        entropy = -torch.sum(probs * torch.log(probs + 1e-8), dim=-1)
        response_mask = data.get("response_mask", torch.ones_like(entropy))
        masked_entropy = entropy.to(float_dtype) * response_mask.to(float_dtype)
        metrics["training/policy_entropy/mean"] = (masked_entropy.sum() / response_mask.sum()).item()
    if "grad_norm" in data:
        metrics["training/grad_norm/mean"] = data["grad_norm"].item()
    if "loss_values" in data:
        loss_values = data["loss_values"].to(float_dtype)
        metrics["training/loss/mean"] = loss_values.mean().item()
        metrics["training/loss/std"] = loss_values.std().item()
    return metrics


def ref_sequence_coherence(data: Any, float_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    responses = data["responses"]
    attention_mask = data["attention_mask"]
    coherence_scores = []
    for i in range(responses.shape[0]):
        valid_length = int(attention_mask[i].sum().item())
        sequence = responses[i][:valid_length]
        if len(sequence) > 1:
            coherence = 1.0 / (1.0 + torch.var(sequence.to(float_dtype)).item())
        else:
            coherence = 1.0
        coherence_scores.append(coherence)
    return torch.tensor(coherence_scores, dtype=float_dtype)


def ref_token_transitions(data: Any) -> dict[str, float]:
    responses = data["responses"]
    response_mask = data.get("response_mask", torch.ones_like(responses))
    unique_transitions = set()
    total_transitions = 0
    for i in range(responses.shape[0]):
        response_tokens = responses[i][response_mask[i].bool()]
        if len(response_tokens) > 1:
            for j in range(len(response_tokens) - 1):
                unique_transitions.add((response_tokens[j].item(), response_tokens[j + 1].item()))
                total_transitions += 1
    return {
        "analysis/transition_diversity/mean": len(unique_transitions) / max(total_transitions, 1),
        "analysis/unique_transitions/total": len(unique_transitions),
        "analysis/total_transitions/total": total_transitions,
    }


def ref_reward_distribution(data: Any, float_dtype: torch.dtype = torch.float64) -> dict[str, float]:
    """Sequence reward = sum of token_level_rewards; a loop per sequence."""
    token_rewards = data["token_level_rewards"]
    response_mask = data.get("response_mask")
    sequence_rewards, nonzero_tokens, response_tokens = [], 0, 0
    for i in range(token_rewards.shape[0]):
        sequence_rewards.append(token_rewards[i].to(float_dtype).sum().item())
        keep = (
            torch.ones_like(token_rewards[i], dtype=torch.bool)
            if response_mask is None
            else response_mask[i] != 0
        )
        nonzero_tokens += int(((token_rewards[i] != 0) & keep).sum().item())
        response_tokens += int(keep.sum().item())
    r = torch.tensor(sequence_rewards, dtype=float_dtype)
    n = len(sequence_rewards)
    name = "analysis/reward_distribution/"
    return {
        name + "mean": r.mean().item(),
        name + "std": r.std().item(),
        name + "median": r.median().item(),
        name + "min": r.min().item(),
        name + "max": r.max().item(),
        name + "p25": torch.quantile(r, 0.25).item(),
        name + "p75": torch.quantile(r, 0.75).item(),
        "analysis/reward_positive_ratio/mean": sum(x > 0 for x in sequence_rewards) / n,
        "analysis/reward_negative_ratio/mean": sum(x < 0 for x in sequence_rewards) / n,
        "analysis/reward_zero_ratio/mean": sum(x == 0 for x in sequence_rewards) / n,
        "analysis/reward_nonzero_token_ratio/mean": nonzero_tokens / response_tokens
        if response_tokens
        else math.nan,
    }


def ref_advanced_metrics(data: Any, float_dtype: torch.dtype = torch.float64) -> dict[str, float]:
    metrics = {}
    if "responses" in data and "attention_mask" in data:
        coherence_scores = ref_sequence_coherence(data, float_dtype)
        metrics.update(
            {
                "analysis/coherence/mean": coherence_scores.mean().item(),
                "analysis/coherence/std": coherence_scores.std().item(),
                "analysis/coherence/median": coherence_scores.median().item(),
            }
        )
    if "responses" in data:
        metrics.update(ref_token_transitions(data))
    if "token_level_rewards" in data:
        metrics.update(ref_reward_distribution(data, float_dtype))
    return metrics


def ref_model_performance_metrics(
    data: Any, model_outputs: dict, float_dtype: torch.dtype = torch.float64
) -> dict[str, float]:
    metrics = {}
    if "attention_weights" in model_outputs:
        attention_weights = model_outputs["attention_weights"]
        attention_entropy = -torch.sum(attention_weights * torch.log(attention_weights + 1e-9), dim=-1)
        metrics["model/attention_entropy/mean"] = attention_entropy.to(float_dtype).mean().item()
        if "attention_mask" in data:
            prompt_attention = attention_weights[:, :, : -data["responses"].shape[-1]]
            metrics["model/prompt_attention_ratio/mean"] = (
                prompt_attention.to(float_dtype).sum() / attention_weights.to(float_dtype).sum()
            ).item()
    if "hidden_states" in model_outputs:
        layer_norms = torch.norm(model_outputs["hidden_states"], dim=-1).to(float_dtype)
        metrics["model/hidden_norm/mean"] = layer_norms.mean().item()
        metrics["model/hidden_norm/std"] = layer_norms.std().item()
    return metrics


def ref_length_appropriateness(length: int, target_length: int = 50) -> float:
    if length == 0:
        return 0.0
    ratio = length / target_length
    if ratio <= 1.0:
        return ratio
    return 1.0 / ratio


def ref_repetition_score(tokens: torch.Tensor) -> float:
    if len(tokens) <= 1:
        return 1.0
    bigrams = set()
    repeated_bigrams = 0
    for i in range(len(tokens) - 1):
        bigram = (tokens[i].item(), tokens[i + 1].item())
        if bigram in bigrams:
            repeated_bigrams += 1
        else:
            bigrams.add(bigram)
    return 1.0 - repeated_bigrams / (len(tokens) - 1)


def ref_conversation_quality_scores(data: Any, target_length: int = 50) -> list[float]:
    responses = data["responses"]
    response_mask = data.get("response_mask", torch.ones_like(responses))
    quality_scores = []
    for i in range(responses.shape[0]):
        response_tokens = responses[i][response_mask[i].bool()]
        response_length = len(response_tokens)
        length_score = ref_length_appropriateness(response_length, target_length)
        unique_tokens = len(torch.unique(response_tokens))
        vocab_score = min(unique_tokens / response_length, 1.0) if response_length > 0 else 0
        repetition_score = ref_repetition_score(response_tokens)
        quality_scores.append(0.3 * length_score + 0.3 * vocab_score + 0.4 * repetition_score)
    return quality_scores


def ref_conversation_quality_metrics(
    data: Any, float_dtype: torch.dtype = torch.float64, target_length: int = 50
) -> dict[str, float]:
    if "responses" not in data or "prompts" not in data:
        return {}
    quality_tensor = torch.tensor(ref_conversation_quality_scores(data, target_length), dtype=float_dtype)
    return {
        "conversation/quality/mean": quality_tensor.mean().item(),
        "conversation/quality/std": quality_tensor.std().item(),
        "conversation/quality/min": quality_tensor.min().item(),
        "conversation/quality/max": quality_tensor.max().item(),
    }


def ref_example_metrics(data: Any, model_outputs: dict | None = None) -> dict[str, float]:
    return {
        **ref_custom_data_metrics(data),
        **ref_custom_training_metrics(data),
        **ref_advanced_metrics(data),
        **(ref_model_performance_metrics(data, model_outputs) if model_outputs else {}),
        **ref_conversation_quality_metrics(data),
    }


# ---------------------------------------------------------------------------------------- measuring
def assert_same(ours: dict[str, float], ref: dict[str, float], rel: float = REL, label: str = "") -> None:
    """Same names, same numbers (relative ``rel``, NaN equal to NaN)."""
    assert set(ours) == set(ref), (label, sorted(set(ours) ^ set(ref)))
    for name, value in ref.items():
        a, b = ours[name], float(value)
        tol = max(rel, LOOSER.get(name, 0.0))
        ok = (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=tol, abs_tol=1e-300)
        assert ok, (label, name, a, b)


def _best_time(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    times, out = report.timed(fn, reps)
    return min(times), out


@dataclass
class Row:
    name: str
    ref_s: float
    ours_s: float
    target: bool = False

    @property
    def ratio(self) -> float:
        return self.ref_s / self.ours_s


def measure(b: int, r: int, p: int, reps: int) -> list[Row]:
    data, outputs = make_batch(b, r, p, seed=b * 7 + r)
    cases = [
        (an.compute_custom_data_metrics, ref_custom_data_metrics, (data,)),
        (an.compute_custom_training_metrics, ref_custom_training_metrics, (data,)),
        (an.compute_advanced_metrics, ref_advanced_metrics, (data,)),
        (an.compute_model_performance_metrics, ref_model_performance_metrics, (data, outputs)),
        (an.compute_conversation_quality_metrics, ref_conversation_quality_metrics, (data,)),
        (an.compute_example_metrics, ref_example_metrics, (data, outputs)),  # the whole pack: the target
    ]
    rows = []
    for ours_fn, ref_fn, args in cases:
        pack = ours_fn is an.compute_example_metrics
        name = f"example pack ({ours_fn.__name__})" if pack else ours_fn.__name__
        ours_s, ours = _best_time(lambda f=ours_fn, a=args: f(*a), OURS_REPS * reps)
        ref_s, ref = _best_time(lambda f=ref_fn, a=args: f(*a), reps)
        assert_same(ours, ref, label=name)
        rows.append(Row(name, ref_s, ours_s, pack))
    return rows


def measure_entropy(rows: int, seq: int, reps: int) -> Row:
    """Chunked policy entropy at a 150k vocabulary vs the seed's one-shot formula."""
    logits = 4 * torch.randn(rows, seq, BIG_VOCAB, generator=torch.Generator().manual_seed(1))

    def seed_formula() -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1)
        return -torch.sum(probs * torch.log(probs + 1e-8), dim=-1)

    ours_s, ours = _best_time(lambda: an.policy_entropy(logits), reps)
    ref_s, ref = _best_time(seed_formula, reps)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    return Row(f"policy_entropy, logits {rows}x{seq}x{BIG_VOCAB} (chunked vs one-shot)", ref_s, ours_s)


# ---------------------------------------------------------------------------------------- reporting
def render(rows: list[Row]) -> str:
    cells = [[r.name, f"{r.ref_s * 1e3:.1f}", f"{r.ours_s * 1e3:.2f}", f"{r.ratio:.1f}x"] for r in rows]
    return report.table(["function", "loop reference ms", "vectorised ms", "ratio"], cells)


def targets(rows: list[Row], shape: dict[str, int]) -> list[str]:
    pack = next(r for r in rows if r.target)
    where = f"B={shape['B']}, R={shape['R']}"
    if shape != FULL:
        return [
            f"target >= {TARGET_RATIO:.0f}x at B={FULL['B']}, R={FULL['R']}: not measured (--quick, {where})"
        ]
    met = report.verdict(pack.ratio >= TARGET_RATIO)
    return [f"target >= {TARGET_RATIO:.0f}x for the example pack at {where}: {pack.ratio:.1f}x — {met}"]


def main(argv: list[str] | None = None) -> list[Row]:
    parser = report.parser(__doc__, f"B={QUICK['B']}, R={QUICK['R']}, fewer reps")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    start = time.perf_counter()
    shape, reps, entropy_shape = (QUICK, 2, (1, 8)) if args.quick else (FULL, 5, (4, 64))
    torch_version = f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    head = report.header("example-metrics", torch_version)
    print(head, flush=True)
    rows = measure(shape["B"], shape["R"], shape["P"], reps)
    rows.append(measure_entropy(*entropy_shape, reps))
    notes = [
        f"batch B={shape['B']}, prompt P={shape['P']}, response R={shape['R']}; policy_logits vocabulary "
        f"{V_SMALL}; fastest of {reps} calls (vectorised: {OURS_REPS * reps}) after 1 warm-up",
        f"every row asserted equal to its loop reference (relative {REL:g}; 1e-6 for the float32 entropy row "
        "and the prompt attention ratio)",
        *targets(rows, shape),
        f"total runtime: {time.perf_counter() - start:.1f} s",
    ]
    report.emit(head, render(rows), notes, args.markdown)
    return rows


if __name__ == "__main__":
    main()
