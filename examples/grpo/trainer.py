"""One data-parallel rank of the GRPO demo's real run, and the metrics it reports.

Every rank holds a replica of the policy (the same random init on every rank) and a frozen copy of
it (the reference of the KL term). Each step it samples its share of the step's prompts, rolls out
``group_size`` responses per prompt, scores them, computes the old and reference log-probs and the
group-normalised advantages, and updates the policy in ``minibatches`` optimizer steps. The loss of
a mini-batch is the token mean over the mini-batch of *all* ranks (each rank divides its token sum
by the global token count, then the gradients are summed over ranks with ``torch.distributed``
gloo), so the replicas take identical steps and stay in sync.

Metrics go through rlmetrics' public client, as a training rank of siiRL or verl would send them:

- ``compute_local_data_metric`` of the step's batch (``prompts``, ``responses``, ``attention_mask``,
  ``response_mask``, ``token_level_scores``, ``token_level_rewards``, ``advantages``, ``returns``),
  also per task (``group_by="task"``: ``group/task/<copy|reverse>/...``);
- ``compute_local_timing_metrics`` / ``compute_local_throughout_metrics`` of the measured phases
  ``gen`` (rollout), ``reward``, ``old_log_prob``, ``ref``, ``adv``, ``update_actor`` and ``step``;
- ``submit_metric`` of ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl``,
  ``actor/entropy``, ``actor/kl_loss`` (each mini-batch's token mean on this rank, as
  ``(values, token_counts)``, so the merged value is the token mean over all ranks and mini-batches),
  ``actor/grad_norm`` (of the summed gradient, before clipping; one per mini-batch) and ``actor/lr``;
- every ``val_every`` steps ``process_local_validation_metrics`` of its share of the held-out prompts
  (``val_samples`` samples each; ``reward``, the core variable, ``exact`` (1 for an exact answer)
  and ``pred``; ``exact=True`` adds pass@k of ``exact``);
- then ``wait_submit()`` closes the step.

With ``dump`` set, each rank also writes its raw tensors of every step to
``{dump}/step{step:04d}_rank{rank}.pt``, so the logged metrics can be recomputed independently.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from examples.grpo import grpo
from examples.grpo.grpo import torch
from rlmetrics.backends import connect

UPDATE_TERMS = ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss")
"""Per-token quantities of the update, submitted as ``actor/{name}`` weighted by token counts."""
VAL_SEED = 1  # the held-out prompts are drawn from their own stream of the run's seed


def validation_set(seed: int, per_task: int) -> list[grpo.Prompt]:
    """The held-out prompts: ``per_task`` of every task, never drawn for training."""
    rng = np.random.default_rng([seed, VAL_SEED])
    out: list[grpo.Prompt] = []
    for task in grpo.TASKS:
        for _ in range(per_task):  # one at a time: distinct prompts
            out += grpo.sample_prompts(rng, 1, tasks=(task,), exclude=frozenset(out))
    return out


def _generator(*key: int) -> torch.Generator:
    """A torch generator seeded from ``key`` (seed, rank, step, purpose): every stream is fixed."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence(list(key)).generate_state(1)[0]))


@contextmanager
def _timed(timing: dict[str, float], stage: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timing[stage] = time.perf_counter() - start


class GRPORank:
    """One rank: a policy replica, its share of each step's prompts and its own metric client.

    Start all ranks, give every one the address of rank 0 (:meth:`address`) with :meth:`join`,
    then call :meth:`run` on all of them.
    """

    def __init__(
        self, rank: int, workers: int, name: str, cfg: grpo.GRPOConfig, dump: str | None = None
    ) -> None:
        torch.set_num_threads(1)  # ranks share the machine's cores; also keeps CPU results reproducible
        self.rank, self.workers, self.cfg = rank, workers, cfg
        self.dump = Path(dump) if dump else None
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.model = grpo.TinyCausalLM(cfg)
        self.ref = copy.deepcopy(self.model).requires_grad_(False)
        self.params = list(self.model.parameters())
        self.optimizer = grpo.Adam(self.params, cfg.lr)
        self.client = connect("ray", world_size=workers, name=name, label=f"rank{rank}")

    # ------------------------------------------------------------------------- process group
    def address(self) -> str:
        """A free TCP address on this rank's node for the gloo rendezvous (asked of rank 0)."""
        import socket

        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return f"tcp://{ip}:{s.getsockname()[1]}"

    def join(self, address: str) -> None:
        """Join the ranks' gloo process group (every rank at once)."""
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=address,
            rank=self.rank,
            world_size=self.workers,
            timeout=timedelta(seconds=120),
        )

    # ---------------------------------------------------------------------------------- a run
    def run(self, steps: int, val_every: int, val_prompts: int, val_samples: int) -> int:
        """Train ``steps`` steps, reporting every step's metrics; returns the number of steps."""
        import torch.distributed as dist

        held_out = validation_set(self.cfg.seed, val_prompts) if val_every else []
        exclude = frozenset(held_out)
        try:
            for step in range(steps):
                self.step(step, exclude)
                if val_every and (step + 1) % val_every == 0:
                    self.validate(step, held_out[self.rank :: self.workers], val_samples)
                self.client.wait_submit()
        finally:
            dist.destroy_process_group()
        self.client.stop()
        return steps

    def step(self, step: int, held_out: frozenset) -> None:
        """One GRPO step on this rank's share of the prompts; submits its metrics."""
        cfg, timing = self.cfg, {}
        n, g = cfg.prompts, cfg.group_size
        everyone = grpo.sample_prompts(
            np.random.default_rng([cfg.seed, 0, step]), n * self.workers, exclude=held_out
        )
        prompts = [p for p in everyone[self.rank * n : (self.rank + 1) * n] for _ in range(g)]
        ids, prompt_mask = grpo.encode_prompts(prompts)
        t0 = time.perf_counter()
        with _timed(timing, "gen"):
            responses, response_mask = grpo.generate(
                self.model, ids, prompt_mask, _generator(cfg.seed, self.rank, step, 0)
            )
        with _timed(timing, "reward"):
            scores, _, _ = grpo.score(prompts, responses)
            lengths = response_mask.sum(-1)
            token_scores = torch.zeros(responses.shape, dtype=torch.float32)
            token_scores[torch.arange(len(prompts)), lengths - 1] = scores.float()  # on the last token
        with _timed(timing, "old_log_prob"), torch.no_grad():
            old_logp, _ = grpo.log_probs(self.model, ids, prompt_mask, responses, response_mask)
        with _timed(timing, "ref"), torch.no_grad():
            ref_logp, _ = grpo.log_probs(self.ref, ids, prompt_mask, responses, response_mask)
        with _timed(timing, "adv"):
            advantages = grpo.group_advantages(scores.float(), g)[:, None] * response_mask
        batch = {
            "prompts": ids,
            "responses": responses,
            "attention_mask": torch.cat([prompt_mask, response_mask], 1),
            "response_mask": response_mask,
            "token_level_scores": token_scores,
            "token_level_rewards": token_scores,  # the KL is a loss term, not part of the reward
            "advantages": advantages,
            "returns": advantages,  # GRPO's returns are its advantages
            "old_log_probs": old_logp,
            "ref_log_prob": ref_logp,
            "task": [task for task, _ in prompts],  # each response's task: the data metrics' groups
        }
        with _timed(timing, "update_actor"):
            update = self.update(batch)
        timing["step"] = time.perf_counter() - t0
        self.submit(step, batch, timing, update)
        if self.dump is not None:
            self.save(step, prompts=prompts, batch=batch, timing=timing, update=update)

    def update(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``minibatches`` optimizer steps on the rank's batch, gradients summed over ranks; returns
        per mini-batch the token means of :data:`UPDATE_TERMS`, the token counts, the gradient norms,
        and (for the dump) the rows and the log-probs and entropies of each mini-batch."""
        import torch.distributed as dist

        cfg = self.cfg
        groups = torch.arange(len(batch["responses"])).view(-1, cfg.group_size)
        rows = [c.reshape(-1) for c in groups.tensor_split(min(cfg.minibatches, len(groups)))]  # whole groups
        masks = [batch["response_mask"][r].double() for r in rows]
        tokens = torch.stack([m.sum() for m in masks])
        global_tokens = tokens.clone()
        dist.all_reduce(global_tokens)
        out: dict[str, Any] = {k: [] for k in (*UPDATE_TERMS, "grad_norm", "logp", "entropy_tokens")}
        for r, mask, total in zip(rows, masks, global_tokens.tolist()):
            logp, entropy = grpo.log_probs(
                self.model, batch["prompts"][r], batch["attention_mask"][r, : grpo.PROMPT_LEN],
                batch["responses"][r], batch["response_mask"][r],
            )  # fmt: skip
            terms = grpo.policy_terms(
                logp, batch["old_log_probs"][r], batch["ref_log_prob"][r], batch["advantages"][r], cfg.clip
            )
            terms["entropy"] = entropy
            per_token = terms["pg_loss"] + cfg.kl_coef * terms["kl_loss"] - cfg.entropy_coef * entropy
            grads = torch.autograd.grad((per_token * mask).sum() / total, self.params)
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)  # the gradient of the loss over all ranks' tokens
            norm = float(flat.double().norm())
            out["grad_norm"].append(norm)
            self.optimizer.step(flat * min(1.0, cfg.max_grad_norm / (norm + 1e-6)))  # clipped
            for name in UPDATE_TERMS:
                out[name].append(float((terms[name].detach().double() * mask).sum() / mask.sum()))
            out["logp"].append(logp.detach())
            out["entropy_tokens"].append(entropy.detach())
        out.update(rows=rows, tokens=tokens.tolist(), lr=self.optimizer.lr)
        return out

    def submit(
        self, step: int, batch: dict[str, Any], timing: dict[str, float], update: dict[str, Any]
    ) -> None:
        """This rank's metrics of the step, through the seed's client calls; the data metrics also
        per task (``group/task/<copy|reverse>/...``, each over that task's responses of all ranks)."""
        w = self.workers
        self.client.compute_local_data_metric(batch, w, step, group_by="task")
        self.client.compute_local_timing_metrics(batch, timing, w, step)
        self.client.compute_local_throughout_metrics(batch, timing, 1, w, step)
        metrics: dict[str, Any] = {f"actor/{k}": (update[k], update["tokens"]) for k in UPDATE_TERMS}
        metrics["actor/grad_norm"] = update["grad_norm"]
        metrics["actor/lr"] = update["lr"]
        self.client.submit_metric(metrics, w, step)

    def validate(self, step: int, prompts: list[grpo.Prompt], samples: int) -> None:
        """Sample ``samples`` responses to each of this rank's held-out prompts; submit them."""
        prompts = [p for p in prompts for _ in range(samples)]
        ids, mask = grpo.encode_prompts(prompts)
        responses, _ = grpo.generate(self.model, ids, mask, _generator(self.cfg.seed, self.rank, step, 1))
        rewards, exact, preds = grpo.score(prompts, responses)
        val = {
            "data_sources": [p[0] for p in prompts],
            "sample_inputs": [grpo.render(p) for p in prompts],
            "infos_dict": {"reward": rewards.tolist(), "exact": exact.tolist(), "pred": preds},
        }
        self.client.process_local_validation_metrics(**val, world_size=self.workers, step=step, exact=True)
        if self.dump is not None:
            self.save(step, "val", **val)

    def save(self, step: int, kind: str = "train", **data: Any) -> None:
        """Write ``data`` (and a checksum of the weights) to the dump folder."""
        self.dump.mkdir(parents=True, exist_ok=True)
        data["weights"] = float(sum(p.detach().double().sum() for p in self.params))
        torch.save(data, self.dump / f"{kind}_step{step:04d}_rank{self.rank}.pt")
