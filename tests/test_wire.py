"""The wire codec is lossless bit for bit, whatever the values, and refuses malformed data."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rlmetrics.messages import SubmissionError
from rlmetrics.wire import _float_bytes, _floats

doubles = hnp.arrays(np.float64, st.integers(0, 700), elements=st.floats(width=64))
float32s = hnp.arrays(np.float32, st.integers(0, 700), elements=st.floats(width=32)).map(
    lambda a: a.astype(np.float64)
)


@given(st.one_of(doubles, float32s), st.integers(0, 3))
def test_round_trip_is_bit_exact(values, doubles_in):
    values = values.copy()
    values[: doubles_in * 7] = np.random.default_rng(len(values)).random(min(len(values), doubles_in * 7))
    back = _floats(_float_bytes(values), max(len(values), 1))
    assert back.tobytes() == values.tobytes()  # NaN payloads, -0.0 and inf included


@pytest.mark.parametrize(
    "values, codec, k",
    [(np.arange(1000) / 16, 1, 8), (np.random.default_rng(0).random(1000), 1, 2), (np.ones(10) / 3, 0, None)],
)
def test_the_codec_follows_the_values(values, codec, k):
    data = _float_bytes(values)
    assert data[0] == codec and (k is None or data[1] == k)
    assert sum(len(x) for x in data if isinstance(x, bytes)) < 8 * len(values) or codec == 0


@pytest.mark.parametrize("mutate", ["bomb", "size", "codec", "k"])
def test_malformed_compressed_stats_are_refused(mutate):
    import zlib

    _, k, packed, rest = _float_bytes(np.arange(1000) / 16.0)
    data = {
        "bomb": (1, k, zlib.compress(bytes(8 * 10**6)), rest),  # decompresses past the bound
        "size": (1, 2, packed, rest[:-3]),
        "codec": (7, k, packed, rest),
        "k": (1, 3, packed, rest),
    }[mutate]
    with pytest.raises(SubmissionError):
        _floats(data, 1000)
