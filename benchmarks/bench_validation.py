"""Speed and memory of ``rlmetrics.metrics.validation.process_validation_metrics`` vs the seed's loop.

One validation batch: P prompts x n samples over 4 data sources, each sample with ``acc`` (0/1),
``reward`` (``acc`` minus a 0.2 format penalty on some samples) and ``pred`` (an answer string; per
prompt a difficulty decides how often the correct answer comes up, wrong answers come from 1-6
candidates, so votes tie now and then). Prompts are ~300-character strings, a distinct object per
sample as a tokenizer's ``batch_decode`` returns them.

- **rlmetrics**: ``process_validation_metrics(data_sources, sample_inputs, infos_dict)`` from the raw
  lists (encoding included); median of N calls (N = 5, 3 with ``--quick``).
- **exact=True**: the same call with the opt-in extras (``pass@k``, exact best/worst/maj expectations).
- **naive**: the seed's algorithm as siiRL writes it, transcribed here: nested dicts per data source
  and prompt, and per prompt, variable and k, ``bootstrap_metric`` with 1000 iterations of
  ``np.random.choice`` + ``np.max``/``np.min`` on a list, and another 1000 with a dict-counting majority
  vote. Its cost is linear in the number of prompts (each prompt is independent), so it is timed on
  the first ``m`` prompts of the batch and scaled by P/m; ``m`` is in the table (``--naive-prompts``
  raises it, up to all prompts).

Both must agree (relative and absolute 1e-12) on every key for those ``m`` prompts; the benchmark
asserts it. Peak memory: a fresh subprocess builds a 10,000 x 64 batch and runs the function once;
reported are its peak RSS (``ru_maxrss``, inputs and interpreter included) and its RSS just before the
call.

Exact estimators: at 4096 x 16 (512 x 16 with ``--quick``) the ``exact=True`` call against the plain
one, the difference being what the exact estimators cost (``pass@k``, the exact bootstrap
expectations, the unbiased best/worst/maj@k over k-subsets and their confidence intervals; maj@k by
its dynamic program is most of it), best of 3 calls each. And the bias table: for one prompt of
``n`` samples, ``c`` of them correct (``acc``; the correct ones share one ``pred``, each wrong one has
its own), the seed's bootstrap ``best@k/mean`` and ``maj@k/mean`` (1000 draws), their exact
expectation (``exact_mean``: with replacement) and the unbiased value over k-subsets (``unbiased``),
and the bias of the bootstrap.

One large prompt: ``n`` samples of one prompt (1,024; 512 with ``--quick``), through the chunked
bootstrap rows (what runs: ``bootstrap.SHARED_MAX``) and through the vectorised path forced (its
indices and tie words kept per ``(n, k)``, the path before): seconds of a call once the first call
filled the caches (best of 2), and the peak of numpy's allocations during that first call
(``tracemalloc``); results asserted equal (1e-12).

Run: ``PYTHONPATH=src python benchmarks/bench_validation.py [--quick] [--markdown PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import report

from rlmetrics.metrics.validation import bootstrap, process_validation_metrics

CELLS = ((128, 16), (512, 16))
QUICK_CELLS = ((32, 8), (128, 16))
TARGET_CELL = (512, 16)
TARGET_RATIO = 100.0
TARGET_SECONDS = 0.3
EXACT_CELL = (4096, 16)
QUICK_EXACT_CELL = (512, 16)
EXACT_TARGET_SECONDS = 1.0
BIAS_CASES = ((4, 1, 4), (4, 2, 4), (8, 1, 8), (8, 2, 4), (8, 4, 8), (16, 2, 16), (16, 4, 8), (16, 8, 16))
LARGE_PROMPT, QUICK_LARGE_PROMPT = 1024, 512
MEMORY_CELL = (10_000, 64)
QUICK_MEMORY_CELL = (1_000, 64)
MEMORY_LIMIT = 2 << 30
N_BOOTSTRAP = 1000

Batch = tuple[list[str], list[str], dict[str, list[Any]]]


def make_batch(prompts: int, samples: int, seed: int = 0) -> Batch:
    """``prompts`` x ``samples`` validation samples (see the module docstring)."""
    rng = np.random.default_rng(seed)
    difficulty = rng.random(prompts)
    n_wrong = rng.integers(1, 7, size=prompts)
    prompt_of = np.repeat(np.arange(prompts), samples)
    correct = rng.random(prompts * samples) < difficulty[prompt_of]
    wrong = rng.integers(1, n_wrong[prompt_of] + 1)
    answer = np.where(correct, 0, wrong)
    acc = correct.astype(np.float64)
    reward = acc - 0.2 * (rng.random(prompts * samples) < 0.1)
    filler = "Solve the problem and put the final answer in \\boxed{}. " * 5
    data_sources = [f"source_{p % 4}" for p in prompt_of.tolist()]
    sample_inputs = [f"Question {p}: {filler}" for p in prompt_of.tolist()]  # one object per sample
    preds = [f"\\boxed{{{p * 7 + a}}}" for p, a in zip(prompt_of.tolist(), answer.tolist())]
    return data_sources, sample_inputs, {"acc": acc.tolist(), "reward": reward.tolist(), "pred": preds}


def first_prompts(batch: Batch, samples: int, m: int) -> Batch:
    """The samples of the first ``m`` prompts (``make_batch`` keeps a prompt's samples together)."""
    ds, inputs, infos = batch
    cut = m * samples
    return ds[:cut], inputs[:cut], {k: v[:cut] for k, v in infos.items()}


# ------------------------------------------------------------------------------------- naive baseline
def naive_bootstrap(data: list[Any], k: int, fns: list[Any], seed: int) -> list[tuple[float, float]]:
    np.random.seed(seed)
    results: list[list[Any]] = [[] for _ in fns]
    for _ in range(N_BOOTSTRAP):
        idx = np.random.choice(len(data), size=k, replace=True)
        sample = [data[i] for i in idx]
        for out, fn in zip(results, fns):
            out.append(fn(sample))
    return [(np.mean(r), np.std(r)) for r in results]


def naive_majority(votes: list[dict[str, Any]]) -> Any:
    by_pred: defaultdict[Any, list[Any]] = defaultdict(list)
    for vote in votes:
        by_pred[vote["pred"]].append(vote["val"])
    counts = {p: len(v) for p, v in by_pred.items()}
    return by_pred[max(counts, key=counts.get)][0]  # type: ignore[arg-type]


def naive_validation_metrics(
    data_sources: list[str], sample_inputs: list[str], infos: dict[str, list[Any]], seed: int = 42
) -> dict[str, float]:
    """The seed's ``process_validation_metrics`` algorithm (per prompt, per k, 1000 Python iterations)."""
    tree: Any = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i, ds in enumerate(data_sources):
        for var, vals in infos.items():
            tree[ds][sample_inputs[i]][var].append(vals[i])
    per_prompt: Any = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for ds, prompts in tree.items():
        for var2vals in prompts.values():
            for var, vals in var2vals.items():
                if isinstance(vals[0], str):
                    continue
                n = len(vals)
                metric = {f"mean@{n}": np.mean(vals)}
                if n > 1:
                    metric[f"std@{n}"] = np.std(vals)
                    ks, k = [], 2
                    while k < n:
                        ks.append(k)
                        k *= 2
                    for k in [*ks, n]:
                        (bm, bs), (wm, ws) = naive_bootstrap(vals, k, [np.max, np.min], seed)
                        metric.update({f"best@{k}/mean": bm, f"best@{k}/std": bs})
                        metric.update({f"worst@{k}/mean": wm, f"worst@{k}/std": ws})
                        if "pred" in var2vals:
                            votes = [{"val": v, "pred": p} for v, p in zip(vals, var2vals["pred"])]
                            [(mm, ms)] = naive_bootstrap(votes, k, [naive_majority], seed)
                            metric.update({f"maj@{k}/mean": mm, f"maj@{k}/std": ms})
                for name, value in metric.items():
                    per_prompt[ds][var][name].append(value)
    out = {}
    for ds, by_var in per_prompt.items():
        core = "acc" if "acc" in by_var else "reward"
        for var, metrics in by_var.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metrics)
            for name, values in metrics.items():
                is_core = var == core and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                out[f"{'val-core' if is_core else 'val-aux'}/{ds}/{var}/{name}"] = float(np.mean(values))
    rewards: defaultdict[str, list[float]] = defaultdict(list)
    for ds, r in zip(data_sources, infos["reward"]):
        rewards[ds].append(r)
    out.update({f"val/test_score/{ds}": float(np.mean(r)) for ds, r in rewards.items()})
    return out


# ---------------------------------------------------------------------------------------- measuring
@dataclass
class Row:
    prompts: int
    samples: int
    ours_s: float
    exact_s: float  # the same call with exact=True (pass@k and exact expectations added)
    naive_prompts: int
    naive_sub_s: float  # seconds of the naive loop on the first naive_prompts prompts
    checked: int

    @property
    def naive_s(self) -> float:
        return self.naive_sub_s * self.prompts / self.naive_prompts

    @property
    def ratio(self) -> float:
        return self.naive_s / self.ours_s


def _timed(fn: Any, reps: int) -> tuple[float, Any]:
    gc.collect()
    gc.disable()
    try:
        times, out = [], None
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), out
    finally:
        gc.enable()


def measure(prompts: int, samples: int, reps: int, naive_prompts: int) -> Row:
    batch = make_batch(prompts, samples, seed=prompts * 131 + samples)
    ours_s, _ = _timed(lambda: process_validation_metrics(*batch), reps)
    exact_s, _ = _timed(lambda: process_validation_metrics(*batch, exact=True), reps)
    m = min(prompts, naive_prompts)
    sub = first_prompts(batch, samples, m)
    naive_s, naive = _timed(lambda: naive_validation_metrics(*sub), 1)
    ours = process_validation_metrics(*sub)
    assert set(ours) == set(naive), sorted(set(ours) ^ set(naive))[:5]
    for name, value in naive.items():
        assert math.isclose(ours[name], value, rel_tol=1e-12, abs_tol=1e-12), (name, ours[name], value)
    return Row(prompts, samples, ours_s, exact_s, m, naive_s, len(naive))


def measure_exact(prompts: int, samples: int) -> tuple[float, float]:
    """Seconds (best of 3) of the plain and the ``exact=True`` call on one batch."""
    batch = make_batch(prompts, samples, seed=7)
    plain = min(_timed(lambda: process_validation_metrics(*batch), 1)[0] for _ in range(3))
    exact = min(_timed(lambda: process_validation_metrics(*batch, exact=True), 1)[0] for _ in range(3))
    return plain, exact


def bias_rows() -> list[list[str]]:
    """The bias table (see the module docstring), computed here."""
    rows = []
    for n, c, k in BIAS_CASES:
        preds = ["right"] * c + [f"wrong{i}" for i in range(n - c)]
        acc = [1.0] * c + [0.0] * (n - c)
        m = process_validation_metrics(["s"] * n, ["q"] * n, {"acc": acc, "pred": preds}, exact=True)
        for metric in ("best", "maj"):
            boot = m.get(f"val-core/s/acc/{metric}@{k}/mean", m.get(f"val-aux/s/acc/{metric}@{k}/mean"))
            expected = m[f"val-aux/s/acc/{metric}@{k}/exact_mean"]
            unbiased = m[f"val-aux/s/acc/{metric}@{k}/unbiased"]
            values = [f"{boot:.3f}", f"{expected:.4f}", f"{unbiased:.4f}", f"{boot - unbiased:+.3f}"]
            rows.append([n, c, f"{metric}@{k}", *values])
    return rows


def measure_large_prompt(n: int) -> list[list[str]]:
    """One prompt of ``n`` samples, chunked rows against the vectorised path forced (module docstring)."""
    import tracemalloc

    batch = make_batch(1, n, seed=5)
    out = {}
    for path, limit in (("chunked rows", bootstrap.SHARED_MAX), ("vectorised, kept", float("inf"))):
        bootstrap.SHARED_MAX, saved = limit, bootstrap.SHARED_MAX
        bootstrap._indices.cache_clear(), bootstrap._words.cache_clear()
        try:
            tracemalloc.start()
            first = process_validation_metrics(*batch)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            seconds = min(_timed(lambda: process_validation_metrics(*batch), 1)[0] for _ in range(2))
        finally:
            bootstrap.SHARED_MAX = saved
            bootstrap._indices.cache_clear(), bootstrap._words.cache_clear()
        out[path] = (seconds, peak, first)
    rows_metrics, vec_metrics = out["chunked rows"][2], out["vectorised, kept"][2]
    assert rows_metrics.keys() == vec_metrics.keys()
    for name, value in vec_metrics.items():
        assert math.isclose(rows_metrics[name], value, rel_tol=1e-12, abs_tol=1e-12), name
    base = out["vectorised, kept"][0]
    return [
        [f"1 x {n}", path, f"{s:.3f}", f"{base / s:.2f}x", f"{peak / 2**20:.0f} MiB"]
        for path, (s, peak, _) in out.items()
    ]


def memory_child(prompts: int, samples: int) -> None:
    """Runs in a fresh interpreter: build the batch, run once, print peak RSS and time as JSON."""
    batch = make_batch(prompts, samples)
    gc.collect()
    before = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    out = process_validation_metrics(*batch)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    print(json.dumps({"before": before, "peak": peak, "seconds": seconds, "keys": len(out)}))


def measure_memory(prompts: int, samples: int) -> dict[str, float]:
    paths = [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", str(prompts), str(samples)],
        capture_output=True, text=True, env=env, check=True, timeout=600,
    )  # fmt: skip
    return {"prompts": prompts, "samples": samples, **json.loads(out.stdout.strip().splitlines()[-1])}


# ---------------------------------------------------------------------------------------- reporting
def render(rows: list[Row], mem: dict[str, float]) -> str:
    columns = [
        "prompts x samples",
        "rlmetrics s",
        "naive s",
        "naive timed on",
        "ratio",
        "exact=True s",
        "peak RSS",
    ]
    cells = [
        [f"{r.prompts} x {r.samples}", f"{r.ours_s:.3f}", f"{r.naive_s:.1f}", f"{r.naive_prompts} prompts",
         f"{r.ratio:.0f}x", f"{r.exact_s:.3f}", ""]
        for r in rows
    ]  # fmt: skip
    peak = f"{mem['peak'] / 2**20:.0f} MiB ({mem['before'] / 2**20:.0f} MiB before the call)"
    cells.append([f"{mem['prompts']} x {mem['samples']}", f"{mem['seconds']:.2f}", "", "", "", "", peak])
    return report.table(columns, cells)


def targets(rows: list[Row], mem: dict[str, float]) -> list[str]:
    out = []
    cell = next((r for r in rows if (r.prompts, r.samples) == TARGET_CELL), None)
    p, n = TARGET_CELL
    if cell is None:
        out.append(f"targets at {p} x {n}: not measured in this run")
    else:
        out.append(
            f"target >= {TARGET_RATIO:.0f}x the naive loop at {p} x {n}: {cell.ratio:.0f}x "
            f"— {report.verdict(cell.ratio >= TARGET_RATIO)}"
        )
        out.append(
            f"target <= {TARGET_SECONDS} s at {p} x {n}: {cell.ours_s:.3f} s "
            f"— {report.verdict(cell.ours_s <= TARGET_SECONDS)}"
        )
    p, n = MEMORY_CELL
    if (mem["prompts"], mem["samples"]) != MEMORY_CELL:
        out.append(f"target peak memory < 2 GiB at {p} x {n}: not measured in this run")
    else:
        out.append(
            f"target peak memory < 2 GiB at {p} x {n}: {mem['peak'] / 2**30:.2f} GiB "
            f"— {report.verdict(mem['peak'] < MEMORY_LIMIT)}"
        )
    return out


def main(argv: list[str] | None = None) -> list[Row]:
    parser = report.parser(__doc__, "small cells, few naive prompts")
    parser.add_argument("--naive-prompts", type=int, help="prompts the naive loop is timed on (default 128)")
    parser.add_argument("--memory-child", nargs=2, type=int, metavar=("P", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        memory_child(*args.memory_child)
        return []

    start = time.perf_counter()
    cells, reps, naive_prompts, mem_cell = (
        (QUICK_CELLS, 3, 4, QUICK_MEMORY_CELL) if args.quick else (CELLS, 5, 128, MEMORY_CELL)
    )
    naive_prompts = args.naive_prompts or naive_prompts
    head = report.header("validation", f"numpy {np.__version__}")
    print(head, flush=True)
    rows = [measure(p, n, reps, naive_prompts) for p, n in cells]
    mem = measure_memory(*mem_cell)
    exact_cell = QUICK_EXACT_CELL if args.quick else EXACT_CELL
    plain_s, exact_s = measure_exact(*exact_cell)
    exact_table = report.table(
        ["prompts x samples", "plain s", "exact=True s", "exact estimators s"],
        [
            [
                f"{exact_cell[0]} x {exact_cell[1]}",
                f"{plain_s:.3f}",
                f"{exact_s:.3f}",
                f"{exact_s - plain_s:.3f}",
            ]
        ],
    )
    bias_table = report.table(
        [
            "n",
            "correct",
            "metric",
            "bootstrap (1000 draws)",
            "exact_mean",
            "unbiased",
            "bias of the bootstrap",
        ],
        bias_rows(),
    )
    large_table = report.table(
        ["prompts x samples", "path", "s", "speed-up vs vectorised", "peak allocations (first call)"],
        measure_large_prompt(QUICK_LARGE_PROMPT if args.quick else LARGE_PROMPT),
    )
    body = (
        f"{render(rows, mem)}\n\nexact estimators:\n\n{exact_table}\n\nbias, one prompt:\n\n{bias_table}"
        f"\n\none large prompt:\n\n{large_table}"
    )
    notes = [
        f"rlmetrics: median of {reps} calls on the raw lists; naive: one run on the first prompts, "
        "scaled linearly to all prompts",
        f"results asserted equal (1e-12) on {sum(r.checked for r in rows)} keys",
        *targets(rows, mem),
        f"target exact estimators <= {EXACT_TARGET_SECONDS:g} s at {EXACT_CELL[0]} x {EXACT_CELL[1]}: "
        + (
            f"{exact_s - plain_s:.3f} s — {report.verdict(exact_s - plain_s <= EXACT_TARGET_SECONDS)}"
            if exact_cell == EXACT_CELL
            else "not measured in this run"
        ),
        f"total runtime: {time.perf_counter() - start:.1f} s",
    ]
    report.emit(head, body, notes, args.markdown)
    return rows


if __name__ == "__main__":
    main()
