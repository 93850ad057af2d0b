"""Batches as verl 0.9.1's trainer builds them, and the comparison of verl's numbers with ours
(verl is imported only by :func:`data_proto`)."""

import math

import numpy as np
import torch


def verl_batch(
    seed: int, b: int = 24, p: int = 10, r: int = 12, *, multi_turn: bool = False, aborted: int = 2
):
    """Tensors and non-tensor arrays of a PPO batch: left-padded prompts, right-padded responses, some
    at full width (clip ratios), ``aborted`` empty responses; with ``multi_turn``, tool output spans
    inside responses (attention 1, ``response_mask`` 0), ``__num_turns__`` and ``tool_call_counts``.
    Returns ``(tensors, non_tensors)``."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, p + 1, (b,), generator=g)
    prompt_len[: b // 4] = p
    resp_len = torch.randint(1, r + 1, (b,), generator=g)
    resp_len[: b // 5] = r
    resp_len[b // 5 : b // 5 + aborted] = 0
    cols_p, cols_r = torch.arange(p), torch.arange(r)
    prompt_mask = (cols_p[None, :] >= (p - prompt_len)[:, None]).long()
    attention_r = (cols_r[None, :] < resp_len[:, None]).long()
    response_mask = attention_r.clone()
    non_tensors = {}
    if multi_turn:  # a tool span in every other response: attended, not trained on
        for i in range(0, b, 2):
            n = int(resp_len[i])
            if n >= 4:
                start = int(torch.randint(1, n - 2, (1,), generator=g))
                response_mask[i, start : start + 2] = 0
        non_tensors["__num_turns__"] = np.asarray(torch.randint(1, 6, (b,), generator=g).tolist())
        non_tensors["tool_call_counts"] = np.asarray(torch.randint(0, 4, (b,), generator=g).tolist())
    fm = attention_r.float()
    scores = torch.randn(b, r, generator=g) * fm
    values = torch.randn(b, r, generator=g)
    tensors = {
        "prompts": torch.randint(0, 1000, (b, p), generator=g),
        "responses": torch.randint(0, 1000, (b, r), generator=g),
        "attention_mask": torch.cat([prompt_mask, attention_r], dim=1),
        "response_mask": response_mask,
        "token_level_scores": scores,
        "token_level_rewards": scores - 0.1 * torch.rand(b, r, generator=g) * fm,
        "advantages": torch.randn(b, r, generator=g),
        "returns": values + 0.5 * torch.randn(b, r, generator=g),
        "values": values,
        "old_log_probs": -torch.rand(b, r, generator=g) * 3,
        "sum_pi_squared": torch.rand(b, r, generator=g),
    }
    return tensors, non_tensors


def data_proto(tensors, non_tensors, **meta):
    """A verl ``DataProto`` of the batch, ``meta_info["global_token_num"]`` as verl's trainer sets it."""
    from verl import DataProto

    meta.setdefault("global_token_num", tensors["attention_mask"].sum(-1).tolist())
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)


def assert_same(ours, theirs, rel, keys=None):
    """``ours[k]`` equals verl's ``theirs[k]`` (relative and absolute ``rel``; NaN where verl has NaN)
    for every ``k`` in ``keys``; without ``keys``, for every key, and both have the same keys."""
    if keys is None:
        assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))
        keys = theirs
    bad = {}
    for k in keys:
        a, b = float(ours[k]), float(theirs[k])
        if math.isnan(b) or math.isnan(a):
            if not (math.isnan(a) and math.isnan(b)):
                bad[k] = (a, b)
        elif not math.isclose(a, b, rel_tol=rel, abs_tol=rel):
            bad[k] = (a, b)
    assert not bad, bad
