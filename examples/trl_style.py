"""A TRL-style GRPO loop on rlmetrics: two torch.distributed (gloo) processes, as accelerate runs them.

TRL's ``GRPOTrainer`` appends one number per micro-batch to ``self._metrics[mode][key]`` (most of
them already reduced across processes with ``accelerator.gather(...).mean()`` or a sum-and-count
``accelerator.reduce``), and its ``log()`` reports the plain mean of each list. Here every process,
per step (one optimizer step, logged at once as with ``logging_steps=1``):

1. generates 8 completions (2 prompts x 4) from a tiny policy (a bigram model over a 16-token
   vocabulary); rank 0's prompts call for short answers, rank 1's for long ones, so the processes
   hold very different numbers of completion tokens;
2. scores them with a reward function that also logs a scalar of its own through TRL's
   ``log_metric`` callback (``good_token_rate``, the fraction of completion tokens that are the
   rewarded token), and computes group-relative advantages;
3. runs the GRPO loss (``loss_type="bnpo"``: a token mean) over 2 micro-batches of 4 completions
   with gradient accumulation, then all-reduces the gradients and steps;
4. keeps TRL's numbers as TRL computes them (its reference loop below: ``_metrics`` lists, gather
   and mean per micro-batch, mean per key at ``log()``), and submits the same quantities to
   rlmetrics, each with its tokens: ``client.submit_metric({name: (value, tokens)})``;
5. calls ``client.wait_submit()`` (the collective of the step); rank 0 reads
   ``client.result(step)``, logs it to the JSONL sink and prints TRL's number, rlmetrics' and numpy's
   on the concatenated per-token data of both processes.

Run: ``python examples/trl_style.py [--steps 3] [--out DIR] [--overwrite]`` (needs the ``torch``
extra; TRL, accelerate and transformers are not needed). The JSONL sink and one ``batch-<step>.npz``
per step (the per-token data of both processes, for checking) go to ``--out`` (default: a temporary
folder). Rank 0 runs in this process, rank 1 in a spawned one. With the defaults it took 7-9 s in
three runs on a 2-core machine shared with other jobs (load average 4-5), mostly importing torch in
both processes; a step takes about 0.1 s.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rlmetrics
from rlmetrics.sinks import make_sinks, run_files

VOCAB, EOS, GOOD = 16, 0, 3  # a completion is rewarded when it contains GOOD
PROMPT_LEN, MAX_COMPLETION = 3, 10
PROMPTS, GROUP, MICRO_BATCH = 2, 4, 4  # per process and step: 8 completions, 2 micro-batches
LR, WORLD = 2.0, 2
KEYS = ("policy_loss", "entropy", "good_token_rate", "completions/mean_length")


def make_policy() -> torch.nn.Module:
    """Next-token logits from the previous token, the same on every process. After a token < 8 the
    policy likely picks a token < 8 or stops (short answers), after a token >= 8 a token >= 8, and
    rarely stops (long answers)."""
    torch.manual_seed(0)
    policy = torch.nn.Embedding(VOCAB, VOCAB)
    with torch.no_grad():
        low = torch.arange(VOCAB) < 8
        policy.weight.mul_(0.5).add_(3.0 * (low[:, None] == low[None, :]))
        policy.weight[:, EOS] = torch.where(low, 4.5, -3.0)
    return policy


def generate(policy: torch.nn.Module, rank: int, generator: torch.Generator) -> dict:
    """PROMPTS * GROUP completions; rank 0's prompts end in a token < 8, rank 1's in one >= 8."""
    prompts = torch.randint(1, 8, (PROMPTS, PROMPT_LEN), generator=generator) + 8 * rank
    prompts = prompts.repeat_interleave(GROUP, 0)
    n = len(prompts)
    completions = torch.zeros(n, MAX_COMPLETION, dtype=torch.long)
    alive = torch.ones(n, dtype=torch.bool)
    token = prompts[:, -1]
    with torch.no_grad():
        for t in range(MAX_COMPLETION):
            token = torch.multinomial(torch.softmax(policy(token), -1), 1, generator=generator)[:, 0]
            completions[:, t] = torch.where(alive, token, EOS)
            alive &= token != EOS
    stop = (completions == EOS).long()
    mask = (torch.cumsum(stop, 1) - stop == 0).double()  # the tokens up to the first EOS
    previous = torch.cat([prompts[:, -1:], completions[:, :-1]], 1)
    return {"previous": previous, "completions": completions, "mask": mask}


def contains_good(completions: torch.Tensor, mask: torch.Tensor, log_metric) -> torch.Tensor:
    """A reward function in TRL's style: a reward per completion, plus a scalar through ``log_metric``."""
    good = (completions == GOOD).double() * mask
    log_metric("good_token_rate", float(good.sum() / mask.sum()))
    return good.amax(1)


def gather_mean(value: float) -> float:
    """``accelerator.gather(torch.tensor(value)).mean()``: each process's value, equal weight."""
    parts = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, torch.tensor([value], dtype=torch.float64))
    return float(torch.cat(parts).mean())


class TrlMetrics:
    """TRL's bookkeeping, rewritten: ``_metrics`` lists, ``log_metric``'s pending values (a mean per
    process, gathered and averaged at the flush) and ``log()``'s plain mean of each list."""

    def __init__(self) -> None:
        self.metrics, self.pending = defaultdict(list), defaultdict(list)

    def log_metric(self, name: str, value: float) -> None:
        self.pending[name].append(value)

    def flush_pending(self) -> None:
        for name in sorted(self.pending):
            values = self.pending[name]
            self.metrics[name].append(gather_mean(sum(values) / len(values)))
        self.pending.clear()

    def log(self) -> dict:
        logged = {k: sum(v) / len(v) for k, v in self.metrics.items()}
        self.metrics.clear()
        return logged


def submitting(client, tokens: float):
    """A ``log_metric`` for the reward function that submits ``(value, tokens)`` to rlmetrics."""
    return lambda name, value: client.submit_metric({name: (value, tokens)})


def worker(rank: int, address: str, steps: int, out: str, overwrite: bool) -> None:
    # a rank that dies makes the other one's collectives fail within a minute
    dist.init_process_group(
        "gloo", init_method=address, rank=rank, world_size=WORLD, timeout=timedelta(minutes=1)
    )
    policy = make_policy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=LR)
    client = rlmetrics.connect("torch")  # every process gets the merged step; rank 0 logs it
    generator = torch.Generator().manual_seed(1 + rank)
    sinks = make_sinks(["jsonl"], out, overwrite=overwrite, health=False) if rank == 0 else None
    worst, differs = 0.0, 0.0
    for step in range(steps):
        trl = TrlMetrics()  # TRL's self._metrics["train"], self._pending_metrics
        raw = defaultdict(list)  # this process's per-token data, for numpy
        batch = generate(policy, rank, generator)
        mask = batch["mask"]

        rewards = contains_good(batch["completions"], mask, trl.log_metric)
        trl.flush_pending()
        # with rlmetrics the reward function's log_metric submits (value, tokens) instead
        contains_good(batch["completions"], mask, submitting(client, float(mask.sum())))
        raw["good"].append((batch["completions"] == GOOD)[mask.bool()].double().numpy())

        lengths = mask.sum(1)
        parts = [torch.zeros_like(lengths) for _ in range(WORLD)]
        dist.all_gather(parts, lengths)  # TRL gathers the lengths: already the batch's mean
        trl.metrics["completions/mean_length"].append(float(torch.cat(parts).mean()))
        client.submit_metric({"completions/mean_length": lengths})
        raw["length"].append(lengths.numpy())

        grouped = rewards.view(-1, GROUP)
        std = grouped.std(1, keepdim=True)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (std + 1e-4)).view(-1)

        optimizer.zero_grad()
        accumulation = len(mask) // MICRO_BATCH
        for lo in range(0, len(mask), MICRO_BATCH):
            mb = slice(lo, lo + MICRO_BATCH)
            m = mask[mb]
            logp = torch.log_softmax(policy(batch["previous"][mb]), -1).double()
            token_logp = logp.gather(-1, batch["completions"][mb, :, None])[..., 0]
            ratio = torch.exp(token_logp - token_logp.detach())  # one iteration per generation: 1
            per_token = -ratio * advantages[mb, None]
            loss = (per_token * m).sum() / m.sum()  # bnpo: the micro-batch's token mean
            (loss / accumulation).backward()
            entropy = -(logp.exp() * logp).sum(-1).detach()
            n_tokens = float(m.sum())

            # TRL: policy_loss is each process's value, gathered and averaged
            trl.metrics["policy_loss"].append(gather_mean(float(loss.detach())))
            # TRL: entropy via a sum-and-count reduce over processes (exact for the micro-batch)
            totals = torch.stack([(entropy * m).sum(), m.sum()])
            dist.all_reduce(totals)
            trl.metrics["entropy"].append(float(totals[0] / totals[1]))

            client.submit_metric({
                "policy_loss": (float(loss.detach()), n_tokens),
                "entropy": (float((entropy * m).sum()) / n_tokens, n_tokens),
            })  # fmt: skip
            raw["loss"].append(per_token.detach()[m.bool()].numpy())
            raw["entropy"].append(entropy[m.bool()].numpy())
        for p in policy.parameters():  # the data-parallel gradient mean
            dist.all_reduce(p.grad)
            p.grad /= WORLD
        optimizer.step()
        logged = trl.log()  # what TRL's log() reports for the step

        client.wait_submit()  # the collective: every process, once per step
        result = client.result(step)
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, {k: np.concatenate(v) for k, v in raw.items()})
        if rank == 0:
            sinks.log(result, step)
            data = {k: np.concatenate([d[k] for d in everyone]) for k in everyone[0]}
            np.savez(Path(out) / f"batch-{step}.npz", **data)
            truth = {
                "policy_loss": np.mean(data["loss"]),
                "entropy": np.mean(data["entropy"]),
                "good_token_rate": np.mean(data["good"]),
                "completions/mean_length": np.mean(data["length"]),
            }
            tokens = [len(d["loss"]) for d in everyone]
            print(f"step {step}: completion tokens per process {tokens}")
            print(f"  {'key':<24}{'trl-style':>12}{'rlmetrics':>12}{'numpy':>12}")
            for k in KEYS:
                print(f"  {k:<24}{logged[k]:>12.6f}{result[k]:>12.6f}{truth[k]:>12.6f}")
            worst = max([worst] + [abs(result[k] - truth[k]) for k in KEYS])
            differs = max([differs] + [abs(logged[k] - truth[k]) for k in KEYS])
    if rank == 0:
        sinks.close()
        print(f"largest difference rlmetrics vs numpy: {worst:.1e}")
        print(f"largest difference trl-style vs numpy: {differs:.1e}")
        print(f"sinks: {out}/metrics.jsonl")
    dist.barrier()  # no rank tears its group down while another still talks to it (gloo aborts then)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="sink folder (default: a temporary one)")
    parser.add_argument("--overwrite", action="store_true", help="replace the run that --out holds")
    args = parser.parse_args(argv)
    if args.out and not args.overwrite and run_files(args.out):
        parser.error(f"{args.out} holds a run: pass --overwrite to replace it, or another --out")
    out = args.out or tempfile.mkdtemp(prefix="trl_style-")
    Path(out).mkdir(parents=True, exist_ok=True)
    store = tempfile.mkdtemp(prefix="trl_style-store-")  # the ranks meet in a file: no port to race for
    work = (f"file://{store}/store", args.steps, out, args.overwrite)
    others = [mp.get_context("spawn").Process(target=worker, args=(r, *work)) for r in range(1, WORLD)]
    for p in others:
        p.start()
    try:
        worker(0, *work)  # rank 0 in this process: one torch import fewer than spawning it too
    finally:
        for p in others:
            p.join()
        shutil.rmtree(store, ignore_errors=True)
    if any(p.exitcode for p in others):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in others]}")


if __name__ == "__main__":
    main()
