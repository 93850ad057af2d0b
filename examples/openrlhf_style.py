"""An OpenRLHF-style PPO loop on rlmetrics: Ray rank actors with torch.distributed inside.

OpenRLHF (0.11) runs each data-parallel rank of the actor and of the critic as a Ray actor that
joins a torch.distributed group; the driver hands out the experiences, calls ``fit`` on every rank
and logs the status dict one of them returns. Here, per step:

1. the driver samples 16 responses from a tiny policy (a bigram model over a 16-token vocabulary)
   for two kinds of prompt, short-answer and long-answer ones, scores them with a tiny critic (one
   value per previous token) and gives the first 8 to rank 0, the other 8 to rank 1: equal samples,
   very unequal response tokens;
2. every rank (a Ray actor in a gloo group) trains the actor and the critic on its shard, micro-batch
   by micro-batch (one optimizer step each, gradients all-reduced over the group), and reduces the
   status as OpenRLHF does: the actor's keys weighted by the micro-batch's response tokens or
   samples before a mean ``all_reduce``, the critic's keys a plain mean ``all_reduce`` (both losses
   are the rank's share of the loss scaled by the global token count, as OpenRLHF's
   ``aggregate_loss`` returns it), then the epoch's mean over micro-batches. It also submits, per
   micro-batch, each key's local mean with its weight to rlmetrics:
   ``client.submit_metric({name: (value, tokens)})``;
3. the driver reads the merged step with ``client.result(step, timeout, finalize=True)``, logs it to
   the JSONL sink, and prints both next to numpy on the concatenated per-token data of both ranks.

Run: ``python examples/openrlhf_style.py [--steps 3] [--out DIR] [--overwrite]`` (needs the ``ray``
and ``torch`` extras; OpenRLHF itself is not needed). The JSONL sink and one ``batch-<step>.npz``
per step (the per-token data of both ranks, for checking) go to ``--out`` (default: a temporary
folder). With the defaults it took 11-21 s in five runs on a 2-core machine shared with other jobs,
mostly importing torch and Ray (3 s), starting Ray and the two rank actors (each imports torch); a
step takes about 0.1 s. In two runs while that machine was heavily loaded (load average up to 22)
it took 30 s and 44 s (``ray.init`` alone 29 s).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np
import ray
import torch
import torch.distributed as dist

import rlmetrics
from rlmetrics.sinks import make_sinks, run_files

VOCAB, EOS, GOOD = 16, 0, 3  # a response is rewarded when it contains GOOD
PROMPT_LEN, MAX_RESPONSE = 3, 10
SAMPLES, MICRO_BATCH, RANKS = 16, 2, 2  # per step; every rank gets SAMPLES // RANKS
CLIP, LR = 0.2, 2.0
TOKEN_KEYS = ("policy_loss", "ppo_kl", "ppo_clip_ratio")  # OpenRLHF: weights[k] == "token"
SAMPLE_KEYS = ("response_length",)  # weights[k] == "sample"
CRITIC_KEYS = ("critic_loss", "values")  # the critic's status: a plain mean all_reduce
NAME = "openrlhf-style"


def make_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same initial policy and critic on every process. After a token < 8 the policy likely picks
    a token < 8 or stops (short answers), after a token >= 8 a token >= 8, and rarely stops (long ones)."""
    torch.manual_seed(0)
    policy = torch.nn.Embedding(VOCAB, VOCAB)  # next-token logits from the previous token
    critic = torch.nn.Embedding(VOCAB, 1)  # a value from the previous token
    with torch.no_grad():
        low = torch.arange(VOCAB) < 8
        policy.weight.mul_(0.5).add_(3.0 * (low[:, None] == low[None, :]))
        policy.weight[:, EOS] = torch.where(low, 4.5, -3.0)
        critic.weight.zero_()
    return policy, critic


def token_log_probs(policy: torch.nn.Module, previous: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(policy(previous), -1).gather(-1, responses[..., None])[..., 0]


def rollout(policy: torch.nn.Module, critic: torch.nn.Module, generator: torch.Generator) -> dict:
    """SAMPLES experiences: the first half short-answer prompts, the second half long-answer ones."""
    low = torch.randint(1, 8, (SAMPLES // 2, PROMPT_LEN), generator=generator)
    prompts = torch.cat([low, low + 8])
    responses = torch.zeros(SAMPLES, MAX_RESPONSE, dtype=torch.long)
    alive = torch.ones(SAMPLES, dtype=torch.bool)
    token = prompts[:, -1]
    with torch.no_grad():
        for t in range(MAX_RESPONSE):
            token = torch.multinomial(torch.softmax(policy(token), -1), 1, generator=generator)[:, 0]
            responses[:, t] = torch.where(alive, token, EOS)
            alive &= token != EOS
        previous = torch.cat([prompts[:, -1:], responses[:, :-1]], 1)
        stop = (responses == EOS).long()
        mask = (torch.cumsum(stop, 1) - stop == 0).float()  # the tokens up to the first EOS
        reward = ((responses == GOOD).float() * mask).amax(1)
        old_values = critic(previous)[..., 0]
        returns = reward[:, None] * mask
        old_log_probs = token_log_probs(policy, previous, responses)
    return {
        "previous": previous,
        "responses": responses,
        "action_mask": mask,
        "old_log_probs": old_log_probs,
        "old_values": old_values,
        "returns": returns,
        "advantages": (returns - old_values) * mask,
    }


@ray.remote(num_cpus=0)
class TrainingRank:
    """One data-parallel rank of the actor and the critic (OpenRLHF puts them in separate Ray actor
    groups; one actor holding both keeps the sketch small)."""

    def __init__(self, rank: int, world_size: int, address: str) -> None:
        self.rank, self.world_size, self.address = rank, world_size, address

    def setup(self) -> None:
        dist.init_process_group("gloo", init_method=self.address, rank=self.rank, world_size=self.world_size)
        self.policy, self.critic = make_models()
        self.policy_optim = torch.optim.SGD(self.policy.parameters(), lr=LR)
        self.critic_optim = torch.optim.SGD(self.critic.parameters(), lr=LR)
        label = f"rank{self.rank}"
        self.client = rlmetrics.connect("ray", world_size=self.world_size, name=NAME, label=label)

    def all_reduce_mean(self, values: dict) -> dict:
        """OpenRLHF's ``strategy.all_reduce(data)`` (op "mean"): every value / world size, then SUM."""
        keys = sorted(values)
        vector = torch.tensor([values[k] for k in keys], dtype=torch.float64) / self.world_size
        dist.all_reduce(vector)
        return dict(zip(keys, vector.tolist()))

    def step(self, module: torch.nn.Module, optim: torch.optim.Optimizer, loss: torch.Tensor) -> None:
        optim.zero_grad()
        loss.backward()
        for p in module.parameters():  # DeepSpeed's data-parallel gradient mean
            dist.all_reduce(p.grad)
            p.grad /= self.world_size
        optim.step()

    def fit(self, shard: dict) -> dict:
        """One PPO epoch over the shard; returns OpenRLHF's status, the per-token data and the weights
        (the same on every rank: the gradients are all-reduced)."""
        actor_status, critic_status = [], []
        raw = {k: [] for k in ("loss", "ppo_kl", "clipped", "values", "value_loss", "response_length")}
        for lo in range(0, len(shard["responses"]), MICRO_BATCH):
            mb = {k: v[lo : lo + MICRO_BATCH] for k, v in shard.items()}
            mask = mb["action_mask"]
            m64 = mask.double()  # the metrics in float64, the training in float32
            n_tokens, n_samples = float(mask.sum()), float(len(mask))
            tokens = torch.tensor(n_tokens)
            dist.all_reduce(tokens)  # the global normalizer of one optimizer step (gas = 1)
            global_tokens = float(tokens)

            # actor: the clipped PPO loss
            log_probs = token_log_probs(self.policy, mb["previous"], mb["responses"])
            ratio = torch.exp(log_probs - mb["old_log_probs"])
            adv = mb["advantages"]
            per_token = -torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
            scaled_loss = (per_token * mask).sum() / global_tokens * self.world_size  # aggregate_loss
            self.step(self.policy, self.policy_optim, scaled_loss)
            clipped = (ratio.clamp(1 - CLIP, 1 + CLIP) * adv < ratio * adv).float()
            log_ratio = (mb["old_log_probs"] - log_probs).detach().double()
            per_token, clipped = per_token.detach().double(), clipped.double()
            local = {  # the rank's own means over its micro-batch
                "policy_loss": float((per_token * m64).sum()) / n_tokens,
                "ppo_kl": float((log_ratio * m64).sum()) / n_tokens,
                "ppo_clip_ratio": float((clipped * m64).sum()) / n_tokens,
                "response_length": float(m64.sum(1).mean()),
            }
            # critic: squared error to the returns, its status as OpenRLHF's critic builds it
            values = self.critic(mb["previous"])[..., 0]
            per_token_vloss = 0.5 * (values - mb["returns"]) ** 2
            critic_loss = (per_token_vloss * mask).sum() / global_tokens * self.world_size
            self.step(self.critic, self.critic_optim, critic_loss)
            values, per_token_vloss = values.detach().double(), per_token_vloss.detach().double()
            local["critic_loss"] = float((per_token_vloss * m64).sum()) / n_tokens
            local["values"] = float((values * m64).sum()) / n_tokens

            # OpenRLHF's reduction (PPOTrainer-side actor: weighted; critic: plain mean)
            reported = {**local, "policy_loss": float(scaled_loss)}  # the status holds the scaled loss
            weighted = {k: reported[k] * n_tokens for k in TOKEN_KEYS}
            weighted |= {k: reported[k] * n_samples for k in SAMPLE_KEYS}
            reduced = self.all_reduce_mean({**weighted, "_tokens": n_tokens, "_samples": n_samples})
            merged = {k: reduced[k] / reduced["_tokens"] for k in TOKEN_KEYS}
            merged |= {k: reduced[k] / reduced["_samples"] for k in SAMPLE_KEYS}
            actor_status.append({**merged, "_tokens": reduced["_tokens"], "_samples": reduced["_samples"]})
            critic = {"critic_loss": float(critic_loss), "values": local["values"]}  # the scaled loss again
            critic_status.append(self.all_reduce_mean(critic))

            # rlmetrics: each key's local value with its weight, per micro-batch
            self.client.submit_metric({
                **{k: (local[k], n_tokens) for k in TOKEN_KEYS + CRITIC_KEYS},
                "response_length": mask.sum(1),  # one observation per sample
            })  # fmt: skip

            on = mask.bool()
            raw["loss"].append(per_token[on].numpy())
            raw["ppo_kl"].append(log_ratio[on].numpy())
            raw["clipped"].append(clipped[on].numpy())
            raw["values"].append(values[on].numpy())
            raw["value_loss"].append(per_token_vloss[on].numpy())
            raw["response_length"].append(m64.sum(1).numpy())
        self.client.wait_submit()

        # the epoch's status: the actor's token- (or sample-) weighted over micro-batches, the critic's a mean
        status = {}
        for keys, weight in ((TOKEN_KEYS, "_tokens"), (SAMPLE_KEYS, "_samples")):
            total = sum(s[weight] for s in actor_status)
            status |= {k: sum(s[k] * s[weight] for s in actor_status) / total for k in keys}
        status |= {k: float(np.mean([s[k] for s in critic_status])) for k in CRITIC_KEYS}
        weights = {"policy": self.policy.state_dict(), "critic": self.critic.state_dict()}
        return {"status": status, "raw": {k: np.concatenate(v) for k, v in raw.items()}, "weights": weights}


def exact(raw: dict) -> dict:
    """numpy on the concatenated data of all ranks: every token (or sample) counts once."""
    return {
        "policy_loss": np.mean(raw["loss"]),
        "ppo_kl": np.mean(raw["ppo_kl"]),
        "ppo_clip_ratio": np.mean(raw["clipped"]),
        "response_length": np.mean(raw["response_length"]),
        "critic_loss": np.mean(raw["value_loss"]),
        "values": np.mean(raw["values"]),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="sink folder (default: a temporary one)")
    parser.add_argument("--overwrite", action="store_true", help="replace the run that --out holds")
    args = parser.parse_args(argv)
    if args.out and not args.overwrite and run_files(args.out):
        parser.error(f"{args.out} holds a run: pass --overwrite to replace it, or another --out")
    out = Path(args.out or tempfile.mkdtemp(prefix="openrlhf_style-"))
    generator = torch.Generator().manual_seed(0)
    store = tempfile.mkdtemp(prefix="openrlhf_style-store-")  # the ranks meet in a file: no port to race for
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        reader = rlmetrics.connect("ray", name=NAME)  # before the ranks: it owns the aggregator
        ranks = [TrainingRank.remote(r, RANKS, f"file://{store}/store") for r in range(RANKS)]
        ray.get([rank.setup.remote() for rank in ranks])
        policy, critic = make_models()
        worst, differs = 0.0, 0.0
        per = SAMPLES // RANKS
        with make_sinks(["jsonl"], out, overwrite=args.overwrite, health=False) as sinks:
            for step in range(args.steps):
                batch = rollout(policy, critic, generator)
                shards = [{k: v[r * per : (r + 1) * per] for k, v in batch.items()} for r in range(RANKS)]
                outs = ray.get([rank.fit.remote(shard) for rank, shard in zip(ranks, shards)])
                policy.load_state_dict(outs[0]["weights"]["policy"])  # for the next rollout
                critic.load_state_dict(outs[0]["weights"]["critic"])
                result = reader.result(step, timeout=60, finalize=True)
                sinks.log(result, step)
                raw = {k: np.concatenate([o["raw"][k] for o in outs]) for k in outs[0]["raw"]}
                np.savez(out / f"batch-{step}.npz", **raw)
                truth, status = exact(raw), outs[0]["status"]  # OpenRLHF's driver logs one rank's status
                tokens = [int(len(o["raw"]["loss"])) for o in outs]
                print(f"step {step}: response tokens per rank {tokens}")
                print(f"  {'key':<16}{'openrlhf-style':>16}{'rlmetrics':>16}{'numpy':>16}")
                for k in truth:
                    print(f"  {k:<16}{status[k]:>16.6f}{result[k]:>16.6f}{truth[k]:>16.6f}")
                worst = max([worst] + [abs(result[k] - truth[k]) for k in truth])
                differs = max([differs] + [abs(status[k] - truth[k]) for k in ("policy_loss", "values")])
        print(f"largest difference rlmetrics vs numpy: {worst:.1e}")
        print(f"largest difference openrlhf-style vs numpy (policy_loss, values): {differs:.1e}")
        print(f"sinks: {out}/metrics.jsonl")
        return dict(result)
    finally:
        ray.shutdown()
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
