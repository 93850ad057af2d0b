"""A verl-style PPO loop on rlmetrics: data-parallel rank actors, one merged result per step.

The driver of a verl trainer holds the whole batch; here it only dispatches it. Each step:

1. the driver samples responses from a tiny policy (a bigram model over a 16-token vocabulary) into
   a ``DataProto``-shaped batch (``.batch`` a TensorDict, ``.non_tensor_batch``, ``.meta_info``) and
   cuts it into one shard per data-parallel rank (unequal shards, as verl's dispatch may give);
2. every rank (a Ray actor) computes verl's metrics of its shard with the functions of
   ``rlmetrics.integrations.verl`` (the same calls a verl driver makes on the full batch) and runs
   a real PPO update of the policy on its shard, micro-batch by micro-batch, submitting
   ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/entropy`` with their token
   counts and ``actor/grad_norm``; then it closes the step;
3. the driver averages the ranks' updated weights (no gradient all-reduce in this sketch), reads
   the merged step with ``result(global_steps, timeout, finalize=True)`` (no barrier), logs it to
   the sinks (JSONL, console), and checks that the merged batch, timing and throughput metrics
   equal the same functions on the full batch.

The step is verl's ``global_steps`` (from 1), passed by the driver to the ranks, which pass it to
every ``submit_metric`` / ``wait_submit``; the driver reads and logs that step (docs/steps.md).

A validation round runs on the last step: each rank sends its samples, the aggregator computes
verl's ``val-core/...`` keys once over all of them.

Run: ``python examples/verl_style.py [--steps 3] [--ranks 2] [--out runs/verl_style]`` (needs the
``ray`` and ``torch`` extras; verl itself is not needed). With the defaults it took 17 s and 25 s
on a 2-core machine shared with other jobs, nearly all of it fixed costs: 3 s importing torch and
Ray, 5-7 s starting Ray, 2-6 s starting the rank actors (each imports torch), 2-5 s in the first
step before a rank runs (unpickling its first TensorDict shard), 3 s stopping Ray and exiting; a
step's own work (metrics, PPO update, submission) takes 0.05-0.2 s on a rank.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from types import SimpleNamespace

import numpy as np
import ray
import torch
from tensordict import TensorDict

from rlmetrics.integrations import verl
from rlmetrics.sinks import make_sinks, run_files

VOCAB, EOS, GOOD = 16, 0, 3  # a response is rewarded when it contains token GOOD
PROMPT_LEN, RESPONSE_LEN, GROUP = 4, 6, 4  # GRPO: GROUP responses per prompt
CLIP, LR, MINI_BATCH, MICRO_BATCH = 0.2, 2.0, 6, 3
TIMING = {
    "gen": 0.8,
    "old_log_prob": 0.2,
    "update_actor": 1.1,
    "step": 2.5,
}  # seconds, as verl's timer reports


class Policy(torch.nn.Module):
    """Next-token logits from the previous token."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = torch.nn.Embedding(VOCAB, VOCAB)

    def log_probs(self, prompts: torch.Tensor, responses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities of ``responses`` and the entropy of each step's distribution."""
        previous = torch.cat([prompts[:, -1:], responses[:, :-1]], dim=1)
        logp = torch.log_softmax(self.logits(previous), dim=-1)
        chosen = logp.gather(-1, responses[..., None])[..., 0]
        return chosen, -(logp.exp() * logp).sum(-1)


def rollout(policy: Policy, n_prompts: int, generator: torch.Generator) -> SimpleNamespace:
    """A DataProto-shaped GRPO batch: ``n_prompts * GROUP`` sequences."""
    prompts = torch.randint(1, VOCAB, (n_prompts, PROMPT_LEN), generator=generator).repeat_interleave(
        GROUP, 0
    )
    b = len(prompts)
    responses = torch.zeros(b, RESPONSE_LEN, dtype=torch.long)
    alive = torch.ones(b, dtype=torch.bool)
    token = prompts[:, -1]
    with torch.no_grad():
        for t in range(RESPONSE_LEN):
            probs = torch.softmax(policy.logits(token), -1)
            token = torch.multinomial(probs, 1, generator=generator)[:, 0]
            responses[:, t] = torch.where(alive, token, EOS)
            alive &= token != EOS
        mask = (torch.cumsum(responses == EOS, 1) == 0).long()  # tokens before the first EOS
        old_log_probs, _ = policy.log_probs(prompts, responses)
    length = mask.sum(-1)
    score = ((responses == GOOD) & (mask == 1)).any(-1).float()
    scores = torch.zeros(b, RESPONSE_LEN)
    scores[torch.arange(b), (length - 1).clamp(min=0)] = score * (length > 0)
    grouped = score.view(-1, GROUP)
    advantage = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
    tensors = {
        "prompts": prompts, "responses": responses,
        "attention_mask": torch.cat([torch.ones_like(prompts), mask], 1), "response_mask": mask,
        "token_level_scores": scores, "token_level_rewards": scores,
        "advantages": advantage[:, None] * mask, "returns": advantage[:, None] * mask,
        "old_log_probs": old_log_probs,
    }  # fmt: skip
    non_tensors = {"uid": np.repeat(np.arange(n_prompts), GROUP).astype(str), "__num_turns__": np.full(b, 2)}
    meta = {"global_token_num": tensors["attention_mask"].sum(-1).tolist()}
    return SimpleNamespace(
        batch=TensorDict(tensors, batch_size=[b]), non_tensor_batch=non_tensors, meta_info=meta
    )


def chunk(batch: SimpleNamespace, cuts: list[int]) -> list[SimpleNamespace]:
    """Shards of rows ``cuts[i]:cuts[i+1]``; each keeps the batch's meta_info (as ``DataProto.chunk``)."""
    return [
        SimpleNamespace(
            batch=batch.batch[lo:hi],
            non_tensor_batch={k: v[lo:hi] for k, v in batch.non_tensor_batch.items()},
            meta_info=batch.meta_info,
        )
        for lo, hi in zip(cuts[:-1], cuts[1:])
    ]


@ray.remote(num_cpus=0)
class DataParallelRank:
    """One data-parallel rank: its metrics client and a copy of the policy to update."""

    def __init__(self, rank: int, world_size: int, name: str) -> None:
        self.client = verl.connect("ray", world_size=world_size, name=name, label=f"rank{rank}")
        self.policy = Policy()

    def step(
        self,
        global_steps: int,
        shard: SimpleNamespace,
        weights: dict,
        n_gpus: int,
        validation: tuple | None = None,
    ) -> dict:
        """This rank's part of trainer step ``global_steps``; returns its updated weights."""
        self.client.submit_metric({
            **verl.compute_data_metrics(shard, use_critic=False),
            **verl.compute_timing_metrics(shard, TIMING),
            **verl.compute_throughout_metrics(shard, TIMING, n_gpus),
        }, step=global_steps)  # fmt: skip
        self.policy.load_state_dict(weights)
        self.ppo_update(shard.batch, global_steps)
        if validation is not None:
            sources, uids, infos, turns = validation
            verl.submit_validation_metrics(
                self.client, sources, uids, infos, sample_turns=turns, step=global_steps
            )
        self.client.wait_submit(step=global_steps)
        return self.policy.state_dict()

    def ppo_update(self, td: TensorDict, step: int) -> None:
        """One PPO epoch over the shard in mini-batches (one optimizer step each) of micro-batches
        (the clipped loss, token-mean over the mini-batch); each micro-batch's metrics are submitted
        with its response tokens, each mini-batch's gradient norm as one value."""
        optimizer = torch.optim.SGD(self.policy.parameters(), lr=LR)
        for start in range(0, len(td), MINI_BATCH):
            mini = td[start : start + MINI_BATCH]
            total = mini["response_mask"].sum().clamp(min=1)
            optimizer.zero_grad()
            for lo in range(0, len(mini), MICRO_BATCH):
                mb = mini[lo : lo + MICRO_BATCH]
                mask = mb["response_mask"].float()
                tokens = int(mask.sum())
                if tokens == 0:
                    continue
                log_probs, entropy = self.policy.log_probs(mb["prompts"], mb["responses"])
                ratio = torch.exp(log_probs - mb["old_log_probs"])
                advantages = mb["advantages"]
                losses = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - CLIP, 1 + CLIP))
                pg_loss = (losses * mask).sum() / tokens
                (pg_loss * tokens / total).backward()  # the mini-batch's token mean
                with torch.no_grad():
                    clipped = ((ratio - 1).abs() > CLIP).float()
                    kl = ((mb["old_log_probs"] - log_probs) * mask).sum() / tokens
                    self.client.submit_metric({
                        "actor/pg_loss": (pg_loss.item(), tokens),
                        "actor/pg_clipfrac": ((clipped * mask).sum().item() / tokens, tokens),
                        "actor/ppo_kl": (kl.item(), tokens),
                        "actor/entropy": ((entropy * mask).sum().item() / tokens, tokens),
                    }, step=step)  # fmt: skip
            grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
            optimizer.step()
            self.client.submit_metric({"actor/grad_norm": grad_norm.item()}, step=step)


def validation_samples(policy: Policy, generator: torch.Generator) -> tuple[list, list, dict, np.ndarray]:
    """8 prompts x 4 samples: acc (the response contains GOOD), reward, pred (its last token)."""
    batch = rollout(policy, 8, generator)
    td = batch.batch
    length = td["response_mask"].sum(-1)
    last = td["responses"][torch.arange(len(td)), (length - 1).clamp(min=0)]
    acc = td["token_level_scores"].sum(-1).tolist()
    preds = [str(t) if n > 0 else None for t, n in zip(last.tolist(), length.tolist())]  # None: verl drops it
    sources = ["bigram-easy" if int(u) % 2 else "bigram-hard" for u in batch.non_tensor_batch["uid"]]
    infos = {"acc": acc, "reward": [a - 0.1 for a in acc], "pred": preds}
    return sources, batch.non_tensor_batch["uid"].tolist(), infos, batch.non_tensor_batch["__num_turns__"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=6, help="prompts per step (GROUP responses each)")
    parser.add_argument("--out", default=None, help="sink directory (default: a temporary one)")
    parser.add_argument("--overwrite", action="store_true", help="replace the run that --out holds")
    args = parser.parse_args(argv)
    if args.out and not args.overwrite and run_files(args.out):
        parser.error(f"{args.out} holds a run: pass --overwrite to replace it, or another --out")
    out = args.out or tempfile.mkdtemp(prefix="verl_style-")
    generator = torch.Generator().manual_seed(0)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        driver = verl.connect("ray", name="verl-style")  # creates the aggregator; reads results only
        ranks = [DataParallelRank.remote(r, args.ranks, "verl-style") for r in range(args.ranks)]
        policy = Policy()
        worst = 0.0
        with make_sinks(["jsonl", "console"], out, overwrite=args.overwrite) as sinks:
            for global_steps in range(1, args.steps + 1):  # verl's step: from 1 (N after a resume)
                batch = rollout(policy, args.prompts, generator)
                n = len(batch.batch)
                spread = np.linspace(0, n, args.ranks + 1)[1:-1] + global_steps % 3
                cuts = [0, *sorted(int(c) for c in spread), n]
                validation = [None] * args.ranks
                if global_steps == args.steps:  # a validation round: every rank gets a part of the samples
                    sources, uids, infos, turns = validation_samples(policy, generator)
                    validation = [
                        ([sources[i] for i in idx], [uids[i] for i in idx],
                         {k: [v[i] for i in idx] for k, v in infos.items()}, turns[idx])
                        for idx in np.array_split(np.arange(len(uids)), args.ranks)
                    ]  # fmt: skip
                states = ray.get([
                    rank.step.remote(global_steps, shard, policy.state_dict(), args.ranks, part)
                    for rank, shard, part in zip(ranks, chunk(batch, cuts), validation)
                ])  # fmt: skip
                policy.load_state_dict({k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]})
                result = driver.result(global_steps, timeout=60, finalize=True)
                sinks.log(result, global_steps)
                full = {  # the verl driver's own calls, on the whole batch
                    **verl.compute_data_metrics(batch, use_critic=False),
                    **verl.compute_timing_metrics(batch, TIMING),
                    **verl.compute_throughout_metrics(batch, TIMING, args.ranks),
                }
                worst = max([worst] + [_difference(result[k], v) for k, v in full.items() if k in result])
        print(f"merged step vs the functions on the full batch: largest relative difference {worst:.1e}")
        print(f"sinks: {out}/metrics.jsonl")
        return result
    finally:
        ray.shutdown()


def _difference(a: float, b: float) -> float:
    if math.isnan(a) and math.isnan(b):
        return 0.0
    return abs(a - b) / max(abs(b), 1e-12)


if __name__ == "__main__":
    main()
