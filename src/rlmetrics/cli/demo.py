"""``rlmetrics demo``: a simulated multi-rank GRPO run, aggregated every step.

Each rank (a thread, for the in-process backend) draws a batch with its own size, computes
sequence-level rewards, response lengths and token-level advantages, and submits them as data
(not pre-averaged means); rank 0 reads every step without a barrier and prints the exact global
values.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

import rlmetrics

SHOWN = ("critic/score/mean", "critic/advantages/mean", "response/length/mean", "response/length/max",
         "response/clip_ratio/mean", "perf/total_num_tokens", "perf/delta_time/gen")  # fmt: skip


def simulate_batch(rank: int, step: int, steps: int, max_len: int = 512) -> dict[str, object]:
    """One rank's metrics for one step: batch sizes differ across ranks, rewards improve over steps."""
    rng = np.random.default_rng([rank, step])
    batch = int(rng.integers(4, 16))
    p_correct = 0.2 + 0.6 * step / max(steps - 1, 1)
    score = (rng.random(batch) < p_correct).astype(float)
    length = np.minimum(rng.lognormal(5.0, 0.6, batch).astype(int) + 1, max_len)
    mask = np.arange(max_len)[None, :] < length[:, None]
    adv = (score - score.mean())[:, None] * np.ones((1, max_len)) + rng.normal(0, 0.1, (batch, max_len))
    stat_len = rlmetrics.Stat.of(length)
    return {
        "critic/score/mean": score,
        "critic/score/max": score,
        "critic/advantages/mean": rlmetrics.Stat.of(adv, mask=mask),
        "response/length/mean": stat_len,
        "response/length/max": stat_len,
        "response/clip_ratio/mean": (length >= max_len).astype(float),
        "perf/total_num_tokens": float(length.sum()),
        "timing_s/gen": float(rng.uniform(0.5, 1.5)),
    }


def run_local(steps: int, workers: int, out=print) -> list[rlmetrics.StepResult]:
    name = f"demo-{time.monotonic_ns()}"
    results: list[rlmetrics.StepResult] = []

    def rank(r: int) -> None:
        client = rlmetrics.connect("local", world_size=workers, name=name, label=f"rank{r}")
        for step in range(steps):
            time.sleep(0.002 * r)  # ranks run at different speeds; nobody waits at a barrier
            client.submit_metric(simulate_batch(r, step, steps))
            client.wait_submit()
            if r == 0:
                res = client.result(step, timeout=30)
                results.append(res)
                out(f"step {step:3d}  " + "  ".join(f"{k}={res[k]:.4g}" for k in SHOWN if k in res))
        client.stop()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rlmetrics.backends.local.drop_worker(name)
    return results


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="simulate a multi-rank GRPO run and print the aggregated metrics per step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=10, help="training steps to simulate (default 10)")
    p.add_argument("--workers", type=int, default=4, help="simulated ranks (default 4)")
    p.add_argument("--backend", choices=["local"], default="local", help="where the aggregator runs")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    run_local(args.steps, args.workers)
    return 0
