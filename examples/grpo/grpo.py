"""GRPO on a toy task, in plain torch: the model, the task, rollout, advantages and the policy loss.

The task: a prompt names an operation (``copy`` or ``reverse``) and gives 2-5 digits; the answer is
the digits copied or reversed, then an end-of-sequence token. The reward is verifiable with partial
credit: the share of answer positions right, over the longer of answer and response (a response
that runs on, or stops early, loses credit); ``exact`` is 1 for an exact answer ended by EOS.

The policy is a tiny causal transformer (random init, about 230 thousand parameters) that reads
digits, the operation and ``=``, and writes digits and EOS. Prompts are left-padded, responses
right-padded after their EOS (the layout of verl's and siiRL's batches), positions count real tokens.

>>> import torch
>>> prompts, prompt_mask = encode_prompts([("reverse", (3, 9, 1))])
>>> prompts.tolist(), prompt_mask.tolist()
([[12, 12, 14, 3, 9, 1, 11]], [[0, 0, 1, 1, 1, 1, 1]])
>>> responses = torch.tensor([[1, 9, 3, EOS, PAD, PAD, PAD], [1, 9, 3, 5, EOS, PAD, PAD]])
>>> score([("reverse", (3, 9, 1))] * 2, responses)
(tensor([1.0000, 0.7500], dtype=torch.float64), tensor([1., 0.], dtype=torch.float64), ['193', '1935'])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlmetrics.extras import require

torch = require("torch", "torch")
nn = torch.nn
F = torch.nn.functional

TASKS = ("copy", "reverse")
"""The operations, also the data sources of the validation metrics."""
EOS, SEP, PAD = 10, 11, 12
"""End of the answer (after the digits 0-9), ``=`` (ends the prompt), padding."""
TASK_TOKENS = {"copy": 13, "reverse": 14}
VOCAB = 15
"""Input tokens: digits, EOS, ``=``, padding, the operations."""
N_OUT = EOS + 1
"""Output tokens: the policy writes digits and EOS only."""
MIN_DIGITS, MAX_DIGITS = 2, 5
PROMPT_LEN = MAX_DIGITS + 2  # operation, digits, "="
RESPONSE_LEN = MAX_DIGITS + 2  # room to run on past the answer

Prompt = tuple[str, tuple[int, ...]]


@dataclass
class GRPOConfig:
    """The run's seed, batch shape (``prompts`` per rank and step, ``group_size`` responses per
    prompt), learning rate (those four are the demo's options), model size and the other
    hyper-parameters of the update."""

    seed: int
    prompts: int
    group_size: int
    lr: float
    d_model: int = 96
    layers: int = 2
    heads: int = 4
    clip: float = 0.2
    kl_coef: float = 0.01
    entropy_coef: float = 0.01
    max_grad_norm: float = 1.0
    minibatches: int = 2


# --------------------------------------------------------------------------------------------- task
def target(prompt: Prompt) -> tuple[int, ...]:
    """The right answer to ``prompt`` (without EOS)."""
    task, digits = prompt
    return digits if task == "copy" else digits[::-1]


def render(prompt: Prompt) -> str:
    """``reverse:391``: a prompt as text (the validation ``sample_inputs``)."""
    return f"{prompt[0]}:{''.join(map(str, prompt[1]))}"


def sample_prompts(
    rng: np.random.Generator, n: int, tasks: Sequence[str] = TASKS, exclude: frozenset = frozenset()
) -> list[Prompt]:
    """``n`` random prompts (one of ``tasks``, then 2-5 digits), none of them in ``exclude``."""
    out: list[Prompt] = []
    while len(out) < n:
        task = tasks[int(rng.integers(len(tasks)))]
        digits = tuple(int(d) for d in rng.integers(0, 10, int(rng.integers(MIN_DIGITS, MAX_DIGITS + 1))))
        if (task, digits) not in exclude:
            out.append((task, digits))
    return out


def encode_prompts(prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of ``prompts``, left-padded to :data:`PROMPT_LEN`."""
    ids = torch.full((len(prompts), PROMPT_LEN), PAD, dtype=torch.long)
    for i, (task, digits) in enumerate(prompts):
        row = [TASK_TOKENS[task], *digits, SEP]
        ids[i, PROMPT_LEN - len(row) :] = torch.tensor(row)
    return ids, (ids != PAD).long()


def score(prompts: Sequence[Prompt], responses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Per response: the reward (share of right positions over the longer of answer and response;
    a response without EOS is as long as the limit), ``exact`` (the answer, ended by EOS), and the
    answer as text (the ``pred`` that majority votes compare)."""
    rewards, exact, preds = [], [], []
    for prompt, row in zip(prompts, responses.tolist()):
        ended = EOS in row
        answer = row[: row.index(EOS)] if ended else row
        want = target(prompt)
        right = sum(a == b for a, b in zip(answer, want))
        rewards.append(right / max(len(answer), len(want)))
        exact.append(float(ended and tuple(answer) == want))
        preds.append("".join(map(str, answer)) + ("" if ended else "..."))
    return torch.tensor(rewards, dtype=torch.float64), torch.tensor(exact, dtype=torch.float64), preds


# -------------------------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    """A small decoder-only transformer with learned positions; logits over :data:`N_OUT` tokens.

    >>> model = TinyCausalLM(GRPOConfig(seed=0, prompts=8, group_size=8, lr=3e-3))
    >>> sum(p.numel() for p in model.parameters())
    227723
    """

    def __init__(self, cfg: GRPOConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, cfg.d_model)
        self.pos = nn.Embedding(PROMPT_LEN + RESPONSE_LEN, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, N_OUT)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.tok(ids) + self.pos((mask.cumsum(-1) - 1).clamp(min=0))
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        # a query attends to the real tokens before it, and to itself (so a padding row is not empty)
        allowed = (causal & mask.bool()[:, None, :]) | torch.eye(t, dtype=torch.bool)
        for block in self.blocks:
            x = block(x, allowed[:, None])
        return self.head(self.norm(x))


@torch.no_grad()
def generate(
    model: TinyCausalLM, prompts: torch.Tensor, prompt_mask: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one response per row (temperature 1); returns ``responses`` (PAD after EOS) and
    ``response_mask`` (1 up to and including EOS)."""
    ids, mask = prompts, prompt_mask
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out = torch.full((len(prompts), RESPONSE_LEN), PAD, dtype=torch.long)
    for t in range(RESPONSE_LEN):
        logits = model(ids, mask)[:, -1].float()
        # diverged weights: sample uniformly; the log-probs of the update then carry the NaN
        logits = torch.where(logits.isfinite().all(-1, keepdim=True), logits, 0.0)
        token = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)
        token = torch.where(done, PAD, token)
        out[:, t] = token
        ids = torch.cat([ids, token[:, None]], 1)
        mask = torch.cat([mask, (~done)[:, None].long()], 1)
        done |= token == EOS
        if done.all():
            break
    return out, (out != PAD).long()


def log_probs(
    model: TinyCausalLM,
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per response token: the log-probability of the token and the entropy of the policy there."""
    logits = model(torch.cat([prompts, responses], 1), torch.cat([prompt_mask, response_mask], 1))
    logp_all = logits[:, prompts.shape[1] - 1 : -1].float().log_softmax(-1)
    tokens = torch.where(response_mask.bool(), responses, 0)
    logp = logp_all.gather(-1, tokens[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


# ---------------------------------------------------------------------------------------- algorithm
def group_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each score minus its group's mean, over the group's (unbiased) std plus ``eps``.

    >>> [round(a, 4) for a in group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 2).tolist()]
    [0.7071, -0.7071, 0.0, 0.0]
    """
    groups = scores.view(-1, group_size)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + eps)).view(-1)


def policy_terms(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip: float,
) -> dict[str, torch.Tensor]:
    """Per token: the clipped surrogate loss (``pg_loss``), whether clipping bound it
    (``pg_clipfrac``), ``old - new`` log-prob (``ppo_kl``) and the k3 estimate of KL(policy || ref)
    (``kl_loss``, clamped to [-10, 10] as verl's ``low_var_kl``).

    >>> zero, one = torch.tensor([0.0]), torch.tensor([1.0])
    >>> t = policy_terms(logp=zero, old_logp=-one, ref_logp=zero, advantages=one, clip=0.2)
    >>> round(float(t["pg_loss"]), 4), float(t["pg_clipfrac"]), float(t["ppo_kl"]), float(t["kl_loss"])
    (-1.2, 1.0, -1.0, 0.0)
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)
    log_ref_ratio = ref_logp - logp
    return {
        "pg_loss": torch.maximum(unclipped, clipped),
        "pg_clipfrac": (clipped > unclipped).to(logp.dtype),
        "ppo_kl": old_logp - logp,
        "kl_loss": (torch.exp(log_ref_ratio) - log_ref_ratio - 1.0).clamp(-10.0, 10.0),
    }


class Adam:
    """Adam (Kingma and Ba 2015) over ``params``, written out: the first use of ``torch.optim``
    imports ``torch._dynamo``, seconds of start-up on every rank of a CPU demo.

    >>> w = torch.nn.Parameter(torch.tensor([1.0]))
    >>> opt = Adam([w], lr=0.1)
    >>> opt.step(torch.tensor([0.5])); round(w.item(), 4)
    0.9
    """

    def __init__(
        self, params: Sequence[torch.Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.99)
    ) -> None:
        self.params, self.lr, self.betas, self.eps, self.t = list(params), lr, betas, 1e-8, 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self, grad: torch.Tensor) -> None:
        """One update with ``grad``, the gradients of all ``params`` flattened into one vector."""
        b1, b2 = self.betas
        self.t += 1
        grads = grad.split([p.numel() for p in self.params])
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            g = g.view_as(p)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            p.addcdiv_(m, (v / (1 - b2**self.t)).sqrt_().add_(self.eps), value=-self.lr / (1 - b1**self.t))
