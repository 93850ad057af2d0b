"""verl's batch metric functions: rlmetrics.integrations.verl against verl 0.9.1 on the same batches.

``compute_data_metrics``, ``compute_timing_metrics``, ``compute_throughout_metrics`` and
``compute_variance_proxy_metrics`` on single-turn and multi-turn batches (tool spans), with aborted
(empty) responses, as a ``DataProto``, its TensorDict and a plain dict. verl sums in float32, we in
float64: 1e-5 relative. The intended differences are asserted with both behaviours.
"""

import math

import pytest

pytest.importorskip("verl.trainer.ppo.metric_utils")
torch = pytest.importorskip("torch")

import verl.trainer.ppo.metric_utils as verl_metrics  # noqa: E402

from rlmetrics.integrations import verl as ours  # noqa: E402
from tests.peers.verl_batches import assert_same, data_proto, verl_batch  # noqa: E402

pytestmark = pytest.mark.torch

REL = 1e-5
TIMING = {
    "gen": 1.5,
    "ref": 0.25,
    "values": 0.5,
    "adv": 0.01,
    "update_critic": 1.0,
    "update_actor": 2.5,
    "step": 6.0,
}


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
@pytest.mark.parametrize("seed", range(3))
def test_data_metrics_match_verl(seed, multi_turn):
    """Every key of verl's ``compute_data_metrics``, with and without the critic; in multi-turn
    batches the lengths count tool output (attention_mask) and the token metrics do not
    (response_mask); aborted responses are out of ``critic/score`` and ``critic/rewards``."""
    batch = data_proto(*verl_batch(seed, b=16 + 7 * seed, multi_turn=multi_turn, aborted=1 + seed))
    for use_critic in (True, False):
        theirs = verl_metrics.compute_data_metrics(batch, use_critic=use_critic)
        assert_same(ours.compute_data_metrics(batch, use_critic=use_critic), theirs, REL)
    tensors = batch.batch
    if multi_turn:  # the tool spans make the two masks differ: both are read where verl reads them
        assert (tensors["response_mask"].sum() < tensors["attention_mask"][:, -12:].sum()).item()


def test_tensordict_and_plain_dict_match_verl():
    """A TensorDict (``DataProto.batch``) and a plain dict give verl's numbers too; the TensorDict has
    no ``__num_turns__`` (a non-tensor entry), the dict has them as numpy arrays."""
    tensors, non_tensors = verl_batch(5, multi_turn=True)
    batch = data_proto(tensors, non_tensors)
    theirs = verl_metrics.compute_data_metrics(batch)
    assert_same(ours.compute_data_metrics({**tensors, **non_tensors}), theirs, REL)
    from_td = ours.compute_data_metrics(batch.batch)
    counts = {k for k in theirs if k.startswith(("num_turns/", "tool_call_counts/"))}
    assert counts and set(from_td) == set(theirs) - counts
    assert_same(from_td, theirs, REL, set(from_td))


def test_given_prompt_and_response_lengths_are_used_as_verl():
    """With ``prompt_length`` and ``response_length`` in the batch, verl reads the lengths from them
    (not from attention_mask); so do we."""
    tensors, non_tensors = verl_batch(2)
    tensors["prompt_length"] = tensors["attention_mask"][:, :10].sum(-1).float()
    tensors["response_length"] = tensors["response_mask"].sum(-1).float() + (torch.arange(24) % 3 == 0)
    batch = data_proto(tensors, non_tensors)
    assert_same(ours.compute_data_metrics(batch), verl_metrics.compute_data_metrics(batch), REL)


def test_all_responses_aborted_gives_nan_as_verl():
    """Every response empty: verl reports NaN for the scores, rewards, token metrics and
    non-aborted lengths (and the same key set); so do we."""
    tensors, non_tensors = verl_batch(3, b=6, aborted=6)
    tensors["attention_mask"][:, 10:] = 0
    tensors["response_mask"][:] = 0
    batch = data_proto(tensors, non_tensors)
    theirs = verl_metrics.compute_data_metrics(batch)
    assert math.isnan(theirs["critic/score/mean"]) and theirs["response/aborted_ratio"] == 1.0
    assert_same(ours.compute_data_metrics(batch), theirs, REL)


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_timing_and_throughput_match_verl(multi_turn):
    """``timing_s/*`` of every stage, ``timing_per_token_ms/*`` per response token (gen) or per token
    (the others), and the throughput from ``meta_info["global_token_num"]``."""
    batch = data_proto(*verl_batch(4, multi_turn=multi_turn))
    timing = dict(TIMING, reshard=0.125)
    assert_same(
        ours.compute_timing_metrics(batch, timing), verl_metrics.compute_timing_metrics(batch, timing), 1e-12
    )
    assert_same(
        ours.compute_throughout_metrics(batch, timing, 8),
        verl_metrics.compute_throughout_metrics(batch, timing, 8),
        1e-12,
    )


def test_timing_without_tokens_is_zero_as_verl():
    """A stage timed over a batch without tokens: verl reports 0.0 ms per token; so do we."""
    tensors, non_tensors = verl_batch(6, b=4, aborted=4)
    tensors["attention_mask"][:] = 0
    batch = data_proto(tensors, non_tensors)
    theirs = verl_metrics.compute_timing_metrics(batch, TIMING)
    assert theirs["timing_per_token_ms/gen"] == 0.0
    assert_same(ours.compute_timing_metrics(batch, TIMING), theirs, 1e-12)


@pytest.mark.parametrize("importance", [False, True], ids=["on-policy", "rollout-is"])
@pytest.mark.parametrize("gradient_norm", [None, 0.4, 30.0])
def test_variance_proxy_matches_verl(gradient_norm, importance):
    """All five ``variance_proxy/*`` keys, on-policy and with rollout importance weights, without a
    gradient norm (proxy1 and proxy3 are 0.0) and with one (proxy3 clipped at 0 for a large norm)."""
    tensors, non_tensors = verl_batch(8, multi_turn=True)
    if importance:
        tensors["rollout_is_weights"] = torch.rand(24, 12, generator=torch.Generator().manual_seed(1)) + 0.5
    batch = data_proto(tensors, non_tensors)
    theirs = verl_metrics.compute_variance_proxy_metrics(batch, gradient_norm)
    assert_same(ours.compute_variance_proxy_metrics(batch, gradient_norm), theirs, REL)
    without = data_proto({k: v for k, v in tensors.items() if k != "sum_pi_squared"}, non_tensors)
    assert (
        ours.compute_variance_proxy_metrics(without)
        == verl_metrics.compute_variance_proxy_metrics(without)
        == {}
    )


def test_missing_key_verl_raises_we_skip_its_metrics():
    """Intended difference: without ``values`` (and ``use_critic=True``) verl raises ``KeyError``; we
    leave out ``critic/values/*`` and ``critic/vf_explained_var`` and report the rest, equal to
    verl's ``use_critic=False`` numbers."""
    tensors, non_tensors = verl_batch(9)
    del tensors["values"]
    batch = data_proto(tensors, non_tensors)
    with pytest.raises(KeyError):
        verl_metrics.compute_data_metrics(batch, use_critic=True)
    assert_same(
        ours.compute_data_metrics(batch), verl_metrics.compute_data_metrics(batch, use_critic=False), REL
    )


def test_shard_throughput_counts_the_shards_tokens():
    """Intended difference: ``DataProto.chunk`` gives every shard the whole batch's
    ``meta_info["global_token_num"]``, so verl's throughput of a shard is the whole batch's; we count
    the shard's own tokens (attention_mask) when the list is not the shard's, so that ranks' tokens
    add up to the batch's."""
    batch = data_proto(*verl_batch(10))
    shard = batch.chunk(4)[1]
    assert len(shard.meta_info["global_token_num"]) == 24 != len(shard)
    theirs = verl_metrics.compute_throughout_metrics(shard, TIMING, 4)
    mine = ours.compute_throughout_metrics(shard, TIMING, 4)
    assert theirs["perf/total_num_tokens"] == sum(batch.meta_info["global_token_num"])
    assert mine["perf/total_num_tokens"] == shard.batch["attention_mask"].sum().item()
    assert mine["perf/time_per_step"] == theirs["perf/time_per_step"]
