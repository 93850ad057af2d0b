"""``compute_data_metric``: rlmetrics against siiRL 0.2.0 on random TensorDict batches.

Every siiRL key is compared (float32 in siiRL against float64 accumulation here: 1e-5 relative),
except ``perf/process_cpu_mem_used_gb`` (the process RSS at call time). The intended differences of
:mod:`rlmetrics.metrics.data` are asserted with both behaviours.
"""

import pytest

pytest.importorskip("siirl.utils.metrics.metric_utils")
torch = pytest.importorskip("torch")
TensorDict = pytest.importorskip("tensordict").TensorDict

from siirl.utils.metrics.metric_utils import compute_data_metric as siirl_data_metric  # noqa: E402

from rlmetrics.metrics.data import compute_data_metric  # noqa: E402
from tests.peers.parity import assert_close  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

REL = 1e-5
VOLATILE = {"perf/process_cpu_mem_used_gb"}
OURS_ONLY = {"response/aborted_ratio"}  # verl's share of empty responses; siiRL 0.2.0 has no such key


def random_batch(seed: int, b: int = 32, p: int = 12, r: int = 16, *, num_turns: bool = False) -> TensorDict:
    """A PPO batch as siiRL's trainer builds it: left-padded prompts, right-padded responses; some
    prompts and responses at full width (clip ratios), a few empty responses, rewards on both
    sides of the correctness threshold."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, p + 1, (b,), generator=g)
    prompt_len[: b // 4] = p
    resp_len = torch.randint(0, r + 1, (b,), generator=g)
    resp_len[: b // 5] = r
    resp_len[b // 5] = 0
    cols_p, cols_r = torch.arange(p), torch.arange(r)
    prompt_mask = (cols_p[None, :] >= (p - prompt_len)[:, None]).long()
    response_mask = (cols_r[None, :] < resp_len[:, None]).long()
    fm = response_mask.float()
    scores = torch.randn(b, r, generator=g) * fm
    rewards = scores - 0.1 * torch.rand(b, r, generator=g) * fm
    values = torch.randn(b, r, generator=g) * fm
    returns = (values + 0.5 * torch.randn(b, r, generator=g)) * fm
    data = {
        "responses": torch.randint(0, 1000, (b, r), generator=g),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "response_mask": response_mask,
        "token_level_scores": scores,
        "token_level_rewards": rewards,
        "advantages": torch.randn(b, r, generator=g) * fm,
        "returns": returns,
        "values": values,
    }
    if num_turns:
        data["__num_turns__"] = torch.randint(1, 6, (b,), generator=g).float()
    return TensorDict(data, batch_size=[b])


@pytest.mark.parametrize("seed", range(6))
def test_every_key_matches_siirl(seed):
    """Every key siiRL reports has our value (1e-5 relative), on random batches with values,
    multi-turn counts, clipped and empty responses; ours adds only ``response/aborted_ratio``."""
    batch = random_batch(seed, b=8 + 9 * seed, num_turns=seed % 2 == 0)
    theirs = siirl_data_metric(batch)
    ours = compute_data_metric(batch)
    assert set(ours) - set(theirs) == OURS_ONLY
    assert set(theirs) - set(ours) == set()
    assert_close(ours, theirs, REL, set(theirs) - VOLATILE)
    compiled = compute_data_metric(batch, torch_compile=True)  # the same keys and numbers compiled
    assert set(compiled) == set(ours)
    assert_close(compiled, theirs, REL, set(theirs) - VOLATILE)
    lengths = batch["response_mask"].sum(-1)
    assert ours["response/aborted_ratio"] == pytest.approx((lengths == 0).float().mean().item())


def test_without_values_and_turns_matches_siirl():
    """Without ``values`` both leave out ``critic/values/*`` and ``critic/vf_explained_var``; the
    other keys still match."""
    batch = random_batch(7)
    del batch["values"]
    theirs, ours = siirl_data_metric(batch), compute_data_metric(batch)
    assert not any(k.startswith("critic/values") or k == "critic/vf_explained_var" for k in theirs)
    assert set(ours) == set(theirs) | OURS_ONLY
    assert_close(ours, theirs, REL, set(theirs) - VOLATILE)


def test_vf_explained_var_unbiased_variances_as_siirl():
    """``critic/vf_explained_var`` is ``1 - Var(returns - values) / (Var(returns) + 1e-5)`` with
    unbiased variances in both, over the response tokens of one batch (across ranks siiRL averages
    the ranks' values, we compute the global one: see test_worker_parity)."""
    batch = random_batch(11, b=3, r=4)
    mask = batch["response_mask"].bool()
    ret, res = batch["returns"][mask], (batch["returns"] - batch["values"])[mask]  # residual in float32
    expected = 1.0 - torch.var(res.double()).item() / (torch.var(ret.double()).item() + 1e-5)
    theirs, ours = siirl_data_metric(batch), compute_data_metric(batch)
    assert theirs["critic/vf_explained_var"] == pytest.approx(expected, rel=REL)
    assert ours["critic/vf_explained_var"] == pytest.approx(expected, rel=1e-7)  # float32 sums on device


@pytest.mark.parametrize("side", ["correct", "wrong"])
def test_empty_correct_or_wrong_siirl_reports_zero_we_omit(side):
    """Intended difference: with no correct (or no wrong) response in the batch siiRL reports
    ``response/{side}_length/*`` as 0, a number no response has; we leave the names out (as the
    aggregator leaves out names without data)."""
    batch = random_batch(3)
    rewards = torch.zeros_like(batch["token_level_rewards"])
    rewards[:, 0] = 1.0 if side == "wrong" else -1.0  # every response correct / every response wrong
    batch["token_level_rewards"] = rewards
    theirs, ours = siirl_data_metric(batch), compute_data_metric(batch)
    names = [f"response/{side}_length/{s}" for s in ("mean", "max", "min")]
    assert all(theirs[n] == 0 for n in names)
    assert not any(n in ours for n in names)
    other = "wrong" if side == "correct" else "correct"
    assert_close(ours, theirs, REL, [f"response/{other}_length/{s}" for s in ("mean", "max", "min")])


def test_integer_num_turns_siirl_raises_we_report():
    """Intended difference: ``__num_turns__`` of an integer dtype (as rollouts count turns) makes
    siiRL raise (``torch.mean`` of an integer tensor); we report ``num_turns/*`` as for floats."""
    batch = random_batch(5, num_turns=True)
    turns = batch["__num_turns__"]
    batch["__num_turns__"] = turns.long()
    with pytest.raises(RuntimeError):
        siirl_data_metric(batch)
    ours = compute_data_metric(batch)
    batch["__num_turns__"] = turns
    theirs = siirl_data_metric(batch)
    assert_close(ours, theirs, REL, ["num_turns/mean", "num_turns/max", "num_turns/min"])
    assert ours["num_turns/mean"] == pytest.approx(turns.double().mean().item(), rel=1e-12)
