"""``process_validation_metrics``: rlmetrics against siiRL 0.2.0 on random validation sets (1e-12).

Same bootstrap indices (``np.random.seed(seed)`` reseeded per call in siiRL, a private
``RandomState`` with the same draws here), so every key agrees to float rounding.
"""

import numpy as np
import pytest

pytest.importorskip("siirl.utils.metrics.metric_utils")

from siirl.utils.metrics.metric_utils import (  # noqa: E402
    process_validation_metrics as siirl_validation_metrics,
)

from rlmetrics.metrics.validation import process_validation_metrics  # noqa: E402
from tests.peers.parity import assert_close  # noqa: E402

pytestmark = pytest.mark.torch

REL = 1e-12


def random_validation(seed: int, *, reward: bool = True):
    """Data sources (one named ``minerva_math``), prompts with 1 to 9 samples each, interleaved;
    ``acc`` 0/1, a float ``reward``, a string ``pred`` with few classes (ties in majority votes) and
    a string variable that both skip; turns as a list of arrays, as siiRL's rollout gives them."""
    rng = np.random.default_rng(seed)
    sources, prompts = [], []
    for s, source in enumerate(["gsm8k", "minerva_math", "aime"][: 2 + seed % 2]):
        for q in range(int(rng.integers(2, 5))):
            n = 8 if q == 0 else int(rng.choice([1, 2, 3, 4, 5, 8, 9]))
            sources += [source] * n
            prompts += [f"{source}-q{q}-{s}"] * n
    order = rng.permutation(len(sources))
    sources = [sources[i] for i in order]
    prompts = [prompts[i] for i in order]
    size = len(sources)
    infos = {
        "acc": rng.integers(0, 2, size).astype(float).tolist(),
        "pred": [str(v) for v in rng.integers(0, 3, size)],
        "text": [f"answer {i}" for i in range(size)],
    }
    if reward:
        infos["reward"] = rng.normal(size=size).tolist()
    turns = [rng.integers(1, 5, k) for k in (size // 2, size - size // 2)]
    return sources, prompts, infos, turns


@pytest.mark.parametrize("seed", range(3))
def test_every_key_matches_siirl(seed):
    """Every key (``val-core``/``val-aux`` mean/std/best/worst/maj@k, ``val/test_score/*``,
    ``val-aux/num_turns/*``) equals siiRL's to 1e-12 on random validation sets."""
    sources, prompts, infos, turns = random_validation(seed)
    theirs = siirl_validation_metrics(sources, prompts, infos, turns)
    ours = process_validation_metrics(sources, prompts, infos, turns)
    assert any(k.startswith("val-core/minerva_math/acc/maj@") for k in theirs)
    assert_close(ours, theirs, REL)


def test_other_seed_and_reward_as_core_variable_match_siirl():
    """Without ``acc`` the core variable is ``reward`` in both; a non-default seed draws the same
    bootstrap indices in both."""
    sources, prompts, infos, turns = random_validation(9)
    del infos["acc"]
    theirs = siirl_validation_metrics(sources, prompts, infos, turns, seed=7)
    ours = process_validation_metrics(sources, prompts, infos, turns, seed=7)
    assert any(k.startswith("val-core/gsm8k/reward/") for k in theirs)
    assert_close(ours, theirs, REL)


def test_without_reward_siirl_raises_keyerror_we_report():
    """Intended difference: without a ``reward`` variable siiRL raises ``KeyError: 'reward'`` (its
    ``val/test_score`` step), after computing everything else; we return the metrics without
    ``val/test_score/*``, equal to siiRL's other keys."""
    sources, prompts, infos, turns = random_validation(2, reward=False)
    with pytest.raises(KeyError, match="reward"):
        siirl_validation_metrics(sources, prompts, infos, turns)
    ours = process_validation_metrics(sources, prompts, infos, turns)
    assert ours and not any(k.startswith("val/test_score/") for k in ours)
    with_reward = dict(infos, reward=[0.0] * len(sources))  # siiRL's value of every other key
    theirs = siirl_validation_metrics(sources, prompts, with_reward, turns)
    theirs = {k: v for k, v in theirs.items() if "/reward/" not in k and not k.startswith("val/test_score/")}
    assert_close(ours, theirs, REL)
