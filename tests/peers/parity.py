"""The comparison every parity test makes: our numbers against siiRL's, key by key."""

import math


def assert_close(ours: dict, theirs: dict, rel: float, keys=None) -> None:
    """``ours[k]`` equals siiRL's ``theirs[k]`` (relative and absolute tolerance ``rel``) for every
    ``k`` in ``keys``; without ``keys``, for every key, and both must have the same keys."""
    if keys is None:
        assert set(ours) == set(theirs)
        keys = theirs
    bad = {
        k: (ours[k], float(theirs[k]))
        for k in keys
        if not math.isclose(ours[k], float(theirs[k]), rel_tol=rel, abs_tol=rel)
    }
    assert not bad, bad
