"""The metric reference: every built-in metric name, what it means and how ranks are merged.

:func:`markdown_table` is docs/metrics.md, "Reference" (a test keeps them equal); print it with
``python -m rlmetrics.metrics.catalog``.

>>> expand("critic/score/{mean,max}")
['critic/score/mean', 'critic/score/max']
>>> merge_of("response/length/{mean,max,min}")
'mean / max / min'
>>> covers("timing_s/<stage>", "timing_s/update_actor")
True
"""

from __future__ import annotations

import re

from rlmetrics.core.reduce import resolve

SAMPLES = "all ranks' samples"
RANKS = "each rank's own seconds"
_SEQ, _TOK = "sequence-weighted", "token-weighted"

CATALOG: tuple[tuple[str, str], ...] = (
    # compute_data_metric (rlmetrics.metrics.data)
    ("critic/score/{mean,max,min}", f"sequence score: sum of token_level_scores per response ({_SEQ})"),
    ("critic/rewards/{mean,max,min}", f"sequence reward: sum of token_level_rewards per response ({_SEQ})"),
    ("critic/advantages/{mean,max,min}", f"advantages over response tokens ({_TOK})"),
    ("critic/returns/{mean,max,min}", f"returns over response tokens ({_TOK})"),
    ("critic/values/{mean,max,min}", f"value estimates over response tokens ({_TOK})"),
    ("critic/vf_explained_var", "1 - Var(returns - values) / Var(returns), exact over all ranks' tokens"),
    ("response/length/{mean,max,min}", "response length in tokens"),
    ("response/clip_ratio/mean", "share of responses that reach the maximum response length"),
    ("response/aborted_ratio", "share of responses without tokens"),
    ("response/correct_length/{mean,max,min}", "length of responses whose sequence reward is > 0.5"),
    ("response/wrong_length/{mean,max,min}", "length of responses whose sequence reward is <= 0.5"),
    ("prompt/length/{mean,max,min}", "prompt length in tokens"),
    ("prompt/clip_ratio/mean", "share of prompts that fill the prompt width"),
    ("num_turns/{mean,max,min}", "turns per sample (__num_turns__, multi-turn rollouts)"),
    ("tool_call_counts/{mean,max,min}", "tool calls per sample (tool_call_counts)"),
    ("perf/process_cpu_mem_used_gb", "resident memory of the rank's process, GB"),
    # compute_timing_metrics / compute_throughput_metrics (rlmetrics.metrics.timing)
    ("perf/delta_time/<stage>", "seconds spent in a stage (submitted as timing_s/<stage>, renamed)"),
    ("timing_per_token_ms/<stage>", "milliseconds per token of a stage (gen: response tokens)"),
    ("perf/total_num_tokens", "tokens in the step's batches"),
    ("perf/time_per_step", "seconds per training step"),
    ("perf/throughput", "tokens per second per GPU"),
    # compute_local_mfu_metrics (rlmetrics.metrics.mfu)
    ("perf/mfu/{actor,critic,actor_infer,ref}", "model FLOPs / (stage seconds * GPUs * dense peak FLOP/s)"),
    # compute_local_memory_metrics (rlmetrics.metrics.memory; CUDA only)
    ("perf/max_memory_{allocated,reserved}_gb", "peak GPU memory held by tensors / reserved, GiB"),
    ("perf/memory/<stage>/{allocated_gb,reserved_gb,peak_gb}", "GPU memory after a stage, GiB"),
    # compute_local_straggler_metrics (rlmetrics.metrics.stragglers)
    ("perf/straggler/<stage>/{min,p50,max}", "a stage's seconds of the fastest, median, slowest rank"),
    ("perf/straggler/<stage>/max_over_p50", "the slowest rank's seconds over the median rank's"),
    ("perf/straggler/<stage>/slowest", "the 3 slowest ranks by name, slowest first (StepResult.lists)"),
    # process_validation_metrics (rlmetrics.metrics.validation)
    ("val-core/<source>/<var>/mean@<n>", "mean of the core variable (acc, else reward) over all n samples"),
    ("val-core/<source>/<var>/{best,worst}@<n>/{mean,std}", "bootstrap best / worst of n samples"),
    ("val-core/<source>/<var>/maj@<n>/{mean,std}", "bootstrap majority vote of n samples (needs pred)"),
    ("val-aux/<source>/<var>/{mean,std}@<k>", "mean and std over the first k samples of a prompt"),
    ("val-aux/<source>/<var>/{best,worst}@<k>/{mean,std}", "bootstrap best / worst of k samples"),
    ("val-aux/<source>/<var>/maj@<k>/{mean,std}", "bootstrap majority vote of k samples"),
    ("val-aux/<source>/<var>/pass@<k>", "unbiased pass@k of 0/1 variables (exact=True)"),
    (
        "val-aux/<source>/<var>:<missing>/failed",
        "samples whose score was None or NaN, made 0 (count_as_zero) or left out (drop), over all ranks",
    ),
    (
        "val-aux/<source>/<var>/pass^<k>",
        "unbiased pass^k (all k samples correct), C(c, k) / C(n, k), of 0/1 variables (exact=True)",
    ),
    (
        "val-aux/<source>/<var>/{best,worst,maj}@<k>/{exact_mean,exact_std}",
        "exact expectation / std of the bootstrap distribution (exact=True)",
    ),
    (
        "val-aux/<source>/<var>/{best,worst,maj}@<k>/unbiased",
        "best / worst / majority-voted value over all k-subsets: unbiased, no bootstrap (exact=True)",
    ),
    (
        "val-aux/<source>/<var>/pass@<k>/{ci_low,ci_high}",
        "95 % confidence interval across prompts (exact=True)",
    ),
    (
        "val-aux/<source>/<var>/{best,worst,maj}@<k>/{exact_mean,unbiased}/{ci_low,ci_high}",
        "95 % confidence interval across prompts (exact=True)",
    ),
    (
        "val-aux/<source>/<var>/pass^<k>/{ci_low,ci_high}",
        "95 % confidence interval across prompts (exact=True)",
    ),
    (
        "val-core/<source>/<var>/maj_strict@<n>/{mean,std}",
        'bootstrap majority vote of n samples, a tie no majority (reports 0; tie="none", instead of maj@n)',
    ),
    ("val-aux/<source>/<var>/maj_strict@<k>/{mean,std}", 'maj@k/... with tie="none": a tie is no majority'),
    (
        "val-aux/<source>/<var>/maj_strict@<k>/{exact_mean,exact_std,unbiased}",
        'maj@k/... with tie="none": a tie is no majority (exact=True)',
    ),
    (
        "val-aux/<source>/<var>/maj_strict@<k>/{exact_mean,unbiased}/{ci_low,ci_high}",
        '95 % confidence interval across prompts (exact=True, tie="none")',
    ),
    (
        "val-{core,aux}/<source>/<var>:{count_as_zero,drop,error}/<metric>",
        "every val-core / val-aux key above, of samples whose None or NaN scores were made 0, left out, or "
        "refused (missing=...)",
    ),
    ("val-aux/num_turns/{min,max,mean}", "turns per validation sample"),
    ("val/test_score/<source>", "mean reward of a data source"),
    ("val/test_score:{count_as_zero,drop,error}/<source>", "mean reward of a data source (missing=...)"),
)
"""(pattern, meaning) of every built-in metric, in the order of ``docs/metrics.md``."""

_ALTERNATIVES = re.compile(r"\{([^}]*)\}")
_EXAMPLES = {"stage": "gen", "source": "gsm8k", "var": "acc", "n": "8", "k": "4"}


def expand(pattern: str) -> list[str]:
    """Every name of ``{a,b}`` alternatives (``<x>`` placeholders kept)."""
    match = _ALTERNATIVES.search(pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [name for alt in match.group(1).split(",") for name in expand(head + alt + tail)]


def covers(pattern: str, name: str) -> bool:
    """Whether ``name`` is a name of ``pattern`` (``<x>``: a segment; ``<n>``, ``<k>``: numbers)."""
    for alt in expand(pattern):
        parts = re.split(r"(<[a-z]+>)", alt)
        regex = "".join(
            (r"\d+" if p in ("<n>", "<k>") else r"[^/]+") if p.startswith("<") else re.escape(p)
            for p in parts
        )
        if re.fullmatch(regex, name):
            return True
    return False


def merge_of(pattern: str) -> str:
    """How a metric of ``pattern`` merges over ranks: its reductions, in the names' order."""
    if pattern.startswith(("val-core/", "val-aux/", "val-{", "val/")):
        return SAMPLES
    if pattern.startswith("perf/straggler/"):
        return RANKS
    if pattern == "critic/vf_explained_var" or pattern.startswith("perf/mfu/"):
        return "derived"
    names = [re.sub(r"<([a-z]+)>", lambda m: _EXAMPLES[m.group(1)], n) for n in expand(pattern)]
    found: list[str] = []
    for name in names:
        reduction = resolve(name).name
        found += [reduction] if not found or found[-1] != reduction else []
    return " / ".join(found)


def markdown_table(rows: tuple[tuple[str, str], ...] = CATALOG) -> str:
    """The metric reference as a markdown table, of the built-ins or of your ``(pattern, meaning)`` rows."""
    lines = ["| name | meaning | merged over ranks |", "|---|---|---|"]
    lines += [f"| `{p}` | {meaning} | {merge_of(p)} |" for p, meaning in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
