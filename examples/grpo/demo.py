"""The GRPO demo: a multi-worker GRPO run on CPU, its metrics aggregated every step.

By default W ranks (Ray actors) train a tiny causal transformer with GRPO on a toy task
(examples/grpo/grpo.py, trainer.py): each rolls out --group-size responses to --prompts prompts,
scores them, computes group-normalised advantages and updates its replica (gradients summed over the
ranks with torch.distributed gloo), then submits the data, timing, throughput and update metrics of
its batch through its own rlmetrics client; every --val-every steps it also answers held-out prompts
(--val-samples samples each; best/worst/maj@k and pass@k). --simulate draws made-up batches instead
(fast; threads with --backend local). The driver reads each step as soon as every rank closed it
(no barrier), logs it to the sinks (JSONL and TensorBoard by default) with a progress bar, and at the
end prints a summary table and writes PNG plots (reward, response length, advantages, update,
timing, validation, and the heat maps over steps of the response-length and score histograms of all
ranks' data, histograms.png) into --out.

Run it from the repository's root (make demo runs it with its defaults):

    python -m examples.grpo --steps 20 --workers 2 --out runs/w2   # a shorter run on 2 ranks
    python -m examples.grpo --seed 1 --lr 0.1      # another run; a learning rate that collapses the policy
    python -m examples.grpo --simulate --backend local --sinks jsonl,console
"""
# Over 400 lines on purpose: the driver of one run end to end (ranks, steps, validation, sinks,
# plots, the summary it prints), read top to bottom as the example the README points to; this is a
# comment, not the docstring, because the docstring is the command's --help.

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from rlmetrics.backends import connect
from rlmetrics.messages import ProvisionalWarning
from rlmetrics.sinks.keys import KEYS

PROG = "python -m examples.grpo"
DEFAULT_OUT = "runs/demo"
SOURCES = ("gsm8k", "math500")
PROMPTS_PER_RANK = 8
GROUP_SIZE = 4  # responses per prompt: GRPO's group
MAX_PROMPT, MAX_RESPONSE = 256, 512
PROGRESS = ("critic/score/mean", "response/length/mean")
PLOTS = {  # file name -> metric globs ({k}: --val-samples); a plot without a matching metric is not written
    "reward": ("critic/score/mean", "critic/rewards/mean", "response/correct_length/mean"),
    "tasks": ("group/task/*/critic/score/mean", "group/task/*/response/length/mean"),  # per task
    "response_length": ("response/length/*", "response/clip_ratio/mean"),
    "advantages": ("critic/advantages/*",),
    "actor": ("actor/*",),
    "timing": ("perf/delta_time/*", "perf/throughput"),
    "validation": ("val-core/*/mean@*", "val-core/*/maj@*/mean", "val-aux/*/pass@{k}"),
}
HISTOGRAMS = ("response/length/hist", "critic/score/hist")  # drawn into histograms.png
HEALTH = {  # options of the default health rules for this run; why: docs/demo.md, "Alerts"
    # the reference is the random init, nearly uniform over the 11 output tokens: the KL to it is
    # about ln 11 - entropy and grows as the policy learns; a jump (10x its recent mean) still alerts
    "kl_blowup": {"ceiling": None},
    # one right answer per prompt: the entropy must fall from about ln 11 towards 0 within the run
    # (seeds 0-4: falls of up to 12% of its mean per step; --lr 0.1 collapses it at 52%)
    "entropy_collapse": {"max_fall": 0.2},
}
SUMMARY = (
    "critic/*/mean",
    "actor/*",
    "response/length/*",
    "response/clip_ratio/mean",
    "num_turns/mean",
    "perf/throughput",
    "perf/delta_time/step",
    "val-core/*",
)


def progress(step: int, steps: int) -> float:
    """Training progress in [0, 1]: the probability of a correct answer grows with it."""
    return step / max(steps - 1, 1)


def simulate_batch(rank: int, step: int, steps: int) -> Any:
    """One rank's GRPO batch for one step as a TensorDict (token-level tensors, right-padded)."""
    import torch
    from tensordict import TensorDict

    rng = np.random.default_rng([rank, step, 1])
    b = PROMPTS_PER_RANK * GROUP_SIZE
    prompt_len = np.repeat(
        np.minimum(rng.lognormal(4.2, 0.5, PROMPTS_PER_RANK).astype(int) + 8, MAX_PROMPT), GROUP_SIZE
    )
    p_correct = 0.15 + 0.6 * progress(step, steps)
    correct = rng.random(b) < p_correct
    # correct answers get shorter as training goes on; some responses run into the length limit
    mean_len = np.where(correct, 5.6 - 0.4 * progress(step, steps), 5.9)
    response_len = np.clip(rng.lognormal(mean_len, 0.45).astype(int), 1, MAX_RESPONSE)
    cols = np.arange(MAX_RESPONSE)
    resp_mask = cols[None, :] < response_len[:, None]
    last = resp_mask & (cols[None, :] == response_len[:, None] - 1)
    scores = np.where(last, correct[:, None].astype(float), 0.0)
    kl = np.where(resp_mask, rng.normal(0.0, 0.002, (b, MAX_RESPONSE)), 0.0)
    group_scores = correct.reshape(PROMPTS_PER_RANK, GROUP_SIZE).astype(float)
    adv = (group_scores - group_scores.mean(1, keepdims=True)) / (group_scores.std(1, keepdims=True) + 1e-6)
    advantages = np.where(resp_mask, adv.reshape(b, 1), 0.0)
    prompt_mask = np.arange(MAX_PROMPT)[None, :] >= MAX_PROMPT - prompt_len[:, None]
    f32 = torch.float32
    return TensorDict(
        {
            "responses": torch.zeros(b, MAX_RESPONSE, dtype=torch.long),
            "attention_mask": torch.from_numpy(np.concatenate([prompt_mask, resp_mask], 1).astype(np.int64)),
            "response_mask": torch.from_numpy(resp_mask.astype(np.int64)),
            "token_level_scores": torch.tensor(scores, dtype=f32),
            "token_level_rewards": torch.tensor(scores - kl, dtype=f32),
            "advantages": torch.tensor(advantages, dtype=f32),
            "returns": torch.tensor(advantages, dtype=f32),
            "__num_turns__": torch.from_numpy(rng.integers(1, 4, b)),
        },
        batch_size=[b],
    )


def simulate_validation(rank: int, workers: int, step: int, steps: int, prompts: int, samples: int) -> dict:
    """This rank's share of a validation round: ``prompts`` prompts per data source, ``samples``
    samples each, dealt to ranks sample by sample (a prompt's samples sit on several ranks)."""
    rng = np.random.default_rng([step, 2])  # the same round on every rank: each keeps its share
    n = len(SOURCES) * prompts * samples
    source = np.repeat(np.arange(len(SOURCES)), prompts * samples)
    prompt = np.repeat(np.arange(len(SOURCES) * prompts), samples)
    difficulty = rng.random(len(SOURCES) * prompts)[prompt]
    correct = rng.random(n) < (0.1 + 0.7 * progress(step, steps)) * (1.2 - difficulty)
    wrong_answer = rng.integers(0, 3, n)
    mine = np.arange(n) % workers == rank
    return {
        "data_sources": [SOURCES[s] for s in source[mine]],
        "sample_inputs": [f"prompt {p}" for p in prompt[mine]],
        "infos_dict": {
            "reward": correct[mine].astype(float).tolist(),
            "acc": correct[mine].astype(float).tolist(),
            "pred": ["right" if c else f"wrong{w}" for c, w in zip(correct[mine], wrong_answer[mine])],
        },
    }


class DemoRank:
    """One simulated training rank: its own client; ``run`` does every step without a barrier."""

    def __init__(self, rank: int, workers: int, backend: str, name: str) -> None:
        import tensordict  # noqa: F401  (imported here, not inside the first step's timings)

        self.rank, self.workers = rank, workers
        self.client = connect(backend, world_size=workers, name=name, label=f"rank{rank}")

    def run(self, steps: int, val_every: int, val_prompts: int, val_samples: int, pace: float) -> int:
        rng = np.random.default_rng(self.rank)
        for step in range(steps):
            t0 = time.perf_counter()
            timing: dict[str, float] = {}
            for stage, scale in (("gen", 4.0), ("ref", 1.0), ("adv", 0.2), ("update_actor", 2.0)):
                t = time.perf_counter()
                time.sleep(pace * scale * rng.uniform(0.5, 1.5))  # the work of this stage
                timing[stage] = time.perf_counter() - t
            batch = simulate_batch(self.rank, step, steps)
            timing["step"] = time.perf_counter() - t0
            self.client.compute_local_data_metric(batch, self.workers, step)
            self.client.compute_local_timing_metrics(batch, timing, self.workers, step)
            self.client.compute_local_throughout_metrics(batch, timing, 1, self.workers, step)
            if val_every and (step + 1) % val_every == 0:
                val = simulate_validation(self.rank, self.workers, step, steps, val_prompts, val_samples)
                self.client.process_local_validation_metrics(
                    **val, world_size=self.workers, step=step, exact=True
                )
            self.client.wait_submit()
        self.client.stop()
        return steps


def start_ranks(args: argparse.Namespace, name: str) -> tuple[Any, Any]:
    """Start the ranks; returns (join, poll): join() waits for all of them to finish, poll() raises
    the error of a rank that already failed."""
    if args.simulate:
        run_args = (args.steps, args.val_every, args.val_prompts, args.val_samples, args.pace)
        if args.backend == "local":
            ranks = [DemoRank(r, args.workers, "local", name) for r in range(args.workers)]
            failed: list[BaseException] = []

            def run_rank(rank: DemoRank) -> None:
                try:
                    rank.run(*run_args)
                except BaseException as exc:  # the driver raises it at its next poll
                    failed.append(exc)
                    rank.client.stop()  # its steps wait for it no more

            threads = [threading.Thread(target=run_rank, args=(r,), daemon=True) for r in ranks]
            for t in threads:
                t.start()

            def raise_failed() -> None:
                if failed:
                    raise failed[0]

            return lambda: [t.join() for t in threads], raise_failed
        import ray

        actor = ray.remote(num_cpus=0)(DemoRank)
        ranks = [actor.remote(r, args.workers, "ray", name) for r in range(args.workers)]
        refs = [r.run.remote(*run_args) for r in ranks]
    else:
        import ray

        from examples.grpo.grpo import GRPOConfig
        from examples.grpo.trainer import GRPORank

        cfg = GRPOConfig(seed=args.seed, prompts=args.prompts, group_size=args.group_size, lr=args.lr)
        dump = str((Path(args.out) / "dump").resolve()) if args.dump else None
        actor = ray.remote(num_cpus=0)(GRPORank)
        ranks = [actor.remote(r, args.workers, name, cfg, dump) for r in range(args.workers)]
        address = ray.get(ranks[0].address.remote())
        ray.get([r.join.remote(address) for r in ranks])  # the gloo group: all ranks at once
        refs = [r.run.remote(args.steps, args.val_every, args.val_prompts, args.val_samples) for r in ranks]

    def poll() -> None:
        for ref in ray.wait(refs, num_returns=len(refs), timeout=0)[0]:
            ray.get(ref)

    return lambda: ray.get(refs), poll


def log_run(args: argparse.Namespace) -> tuple[float, float]:
    """Run the ranks and log every step to the sinks in ``--out``, announcing each phase; returns
    the seconds spent starting (Ray, the aggregator, the ranks) and running the steps."""
    from rlmetrics.health import Monitor, default_rules
    from rlmetrics.sinks import make_sinks

    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"demo-{time.time_ns()}"
    started_ray = False
    if args.backend == "ray":
        import ray

        if not ray.is_initialized():
            print("starting Ray...", flush=True)
            # a cluster's other nodes get this example's code from Ray (it is in no installed package)
            code = {"py_modules": [str(Path(__file__).resolve().parents[1])]} if args.address else None
            ray.init(
                address=args.address or "local",  # a new instance, whatever else runs here
                include_dashboard=False,
                logging_level="ERROR",
                log_to_driver=False,
                namespace="rlmetrics-demo",
                runtime_env=code,
            )
            started_ray = True
    sinks = [s for s in args.sinks.split(",") if s]
    health = Monitor(default_rules(**HEALTH))
    keys = args.keys if args.keys in KEYS else [g for g in args.keys.split(",") if g]
    tracking = make_sinks(
        ["jsonl", *sinks], out, run_name=name, overwrite=args.overwrite, health=health, keys=keys
    )
    ranks = f"{args.workers} ranks" + ("" if args.simulate else " (each imports torch, then all join gloo)")
    print(f"starting the aggregator and {ranks}...", flush=True)
    driver = connect(args.backend, name=name)  # a reader; creates the aggregator first
    try:
        join, poll = start_ranks(args, name)
        ready = time.perf_counter()
        print(f"{args.workers} ranks ready in {ready - started:.1f} s", flush=True)
        _log_steps(driver, tracking, args.steps, poll)
        join()
        return ready - started, time.perf_counter() - ready
    finally:
        print("closing the sinks" + (" and stopping Ray..." if started_ray else "..."), flush=True)
        tracking.close()
        if args.backend == "local":
            from rlmetrics.backends import local

            local.drop_worker(name)
        elif started_ray:
            import ray

            ray.shutdown()


def run(args: argparse.Namespace) -> Path:
    """The whole demo: the logged run, then its summary table and plots; returns the output folder."""
    from rlmetrics.cli import plot, report
    from rlmetrics.sinks import read_jsonl

    started = time.perf_counter()
    logging.captureWarnings(True)  # warnings (a NaN metric) are log records: printed above the bar
    try:
        start, steps = log_run(args)
    finally:
        logging.captureWarnings(False)
    ended = time.perf_counter()
    out = Path(args.out)
    run_log = read_jsonl(out / "metrics.jsonl")
    report.print_table(
        report.summarize(run_log, SUMMARY), title=f"{args.workers} workers, {args.steps} steps"
    )
    print("writing the plots...", flush=True)
    written = [
        plot.plot_runs(
            [("demo", run_log)],
            [g.format(k=args.val_samples) for g in globs],
            out / f"{fname}.png",
            title=fname.replace("_", " "),
        )
        for fname, globs in PLOTS.items()
    ]
    written.append(plot.plot_histograms(run_log, HISTOGRAMS, out / "histograms.png", title="histograms"))
    print(f"metrics: {out / 'metrics.jsonl'}")
    sinks = args.sinks.split(",")
    if "tensorboard" in sinks:
        print(f"tensorboard: {out / 'tensorboard'}   (tensorboard --logdir {out / 'tensorboard'})")
    if "wandb" in sinks:
        print(f"wandb: {out / 'wandb'}   (offline; wandb sync {out / 'wandb'}/offline-run-*)")
    if "mlflow" in sinks:
        server = os.environ.get("MLFLOW_TRACKING_URI")  # make_sinks sends the run there when set
        local = f"{out / 'mlflow.db'}   (mlflow ui --backend-store-uri sqlite:///{out / 'mlflow.db'})"
        print(f"mlflow: {server or local}")
    if "swanlab" in sinks:
        print(f"swanlab: {out / 'swanlab'}   (offline; swanlab sync {out / 'swanlab'}/run-*)")
    print("plots: " + "  ".join(str(p) for p in written if p is not None))
    print(
        f"time: {time.perf_counter() - started:.1f} s: start {start:.1f} s, {args.steps} steps "
        f"{steps:.1f} s, shutdown {ended - started - start - steps:.1f} s, table and plots "
        f"{time.perf_counter() - ended:.1f} s"
    )
    return out


def _log_steps(driver: Any, tracking: Any, steps: int, poll: Any) -> None:
    """Log every step with a progress bar; log records (health alerts, and warnings in :func:`run`)
    print above it."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(), tqdm(range(steps), desc="steps", unit="step") as bar:
        for step in bar:
            end = time.monotonic() + 120
            while True:  # a second at a time, so that a rank's error is raised within a second
                poll()
                left = end - time.monotonic()
                with warnings.catch_warnings():  # a provisional read here is this loop's, not news
                    warnings.simplefilter("ignore", ProvisionalWarning)
                    res = driver.result(step, timeout=min(1.0, max(left, 0.0)), finalize=left <= 1.0)
                if not res.meta.provisional:
                    break
            tracking.log(res, step)
            bar.set_postfix({k.split("/")[1]: f"{res[k]:.3g}" for k in PROGRESS if k in res})


def build_parser() -> argparse.ArgumentParser:
    from rlmetrics.cli import Parser

    p = Parser(prog=PROG, description=__doc__)
    p.add_argument("--steps", type=int, default=50, help="training steps")
    p.add_argument("--workers", type=int, default=4, help="worker ranks")
    p.add_argument(
        "--backend",
        choices=["ray", "local"],
        default="ray",
        help="ray: an embedded local Ray instance (or --address); local: threads, no Ray (--simulate)",
    )
    p.add_argument(
        "--address",
        default=None,
        help="join an existing Ray cluster, e.g. 'auto' (default: start a local instance)",
    )
    p.add_argument(
        "--sinks",
        default="jsonl,tensorboard",
        help="comma-separated: jsonl,console,tensorboard,wandb,mlflow,swanlab (offline, but mlflow "
        "to $MLFLOW_TRACKING_URI when set; JSONL is always written)",
    )
    p.add_argument(
        "--keys",
        default="all",
        help="what the trackers get: all, core (the core metrics) or comma-separated globs such as "
        "'critic/**,actor/*', which add an overview/ section of the core metrics (JSONL keeps every key)",
    )
    p.add_argument(
        "--out",
        help=f"folder for metrics.jsonl, event files, PNGs (default: {DEFAULT_OUT}, or {DEFAULT_OUT}-2, -3 "
        "... when it holds a run; an --out that holds one is refused)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run that --out holds (its metrics.jsonl, tensorboard/ ...; other files stay)",
    )
    p.add_argument("--val-every", type=int, default=10, help="validation round every N steps (0: none)")
    p.add_argument("--val-prompts", type=int, default=32, help="validation prompts per data source")
    p.add_argument("--val-samples", type=int, default=8, help="samples per validation prompt (the k)")
    p.add_argument("--seed", type=int, default=0, help="seed: the same seed, the same run")
    p.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="learning rate (0.1 collapses the policy, 1 turns it NaN)",
    )
    p.add_argument("--prompts", type=int, default=8, help="prompts per rank and step")
    p.add_argument("--group-size", type=int, default=8, help="responses per prompt, GRPO's group")
    p.add_argument(
        "--dump", action="store_true", help="each rank writes its tensors of every step to OUT/dump/"
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="made-up batches instead of training (fast; the only mode of --backend local)",
    )
    p.add_argument("--pace", type=float, default=0.02, help="with --simulate: seconds of work per stage unit")
    return p


def out_folder(out: str | None, overwrite: bool) -> Path:
    """The folder of this run: ``out`` (refused if it holds a run, unless ``overwrite``), by default
    DEFAULT_OUT, or the first of DEFAULT_OUT-2, -3 ... that holds none: a rerun never mixes runs."""
    from rlmetrics.sinks import new_run_folder, run_files

    if out is None and not overwrite:
        folder = new_run_folder(DEFAULT_OUT)
        if folder != Path(DEFAULT_OUT):
            print(f"{DEFAULT_OUT} holds a run: this one goes to {folder}", flush=True)
        return folder
    folder = Path(out or DEFAULT_OUT)
    held = run_files(folder)
    if held and not overwrite:
        raise SystemExit(
            f"{PROG}: {folder} holds a run ({', '.join(p.name for p in held)}): pass --overwrite to "
            "replace it, or another --out"
        )
    return folder


def main(argv: list[str] | None = None) -> int:
    from rlmetrics.sinks import TRACKERS

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    least = {"--steps": 1, "--workers": 1, "--prompts": 1, "--group-size": 2, "--val-prompts": 1,
             "--val-samples": 1, "--val-every": 0, "--pace": 0}  # fmt: skip
    for option, low in least.items():
        value = getattr(args, option[2:].replace("-", "_"))
        if value < low:
            raise SystemExit(f"{PROG}: {option} {value}: must be >= {low}")
    if args.backend == "local" and not args.simulate:
        raise SystemExit(f"{PROG}: the real run needs Ray (--backend local needs --simulate)")
    if args.backend == "local" and args.address:
        raise SystemExit(f"{PROG}: --address is for --backend ray (local runs threads in this process)")
    unknown = [s for s in args.sinks.split(",") if s and s not in TRACKERS]
    if unknown:
        raise SystemExit(
            f"{PROG}: --sinks {','.join(unknown)}: not a tracker; choose from {', '.join(TRACKERS)}"
        )
    globs = [g for g in args.keys.split(",") if g]
    if args.keys not in KEYS and (not globs or set(globs) & set(KEYS)):
        raise SystemExit(
            f"{PROG}: --keys {args.keys!r}: 'all', 'core' or comma-separated globs such as "
            "'critic/**,actor/grad_norm' (not both)"
        )
    args.out = out_folder(args.out, args.overwrite)
    run(args)
    return 0
