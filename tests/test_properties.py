"""Property tests: random shapes, values and scales against the oracle."""

import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fp8core
from fp8core.formats import ENCODINGS
from oracle import quantize_bits

dtypes = st.sampled_from([np.float32, np.float16, ml_dtypes.bfloat16])
formats = st.sampled_from([f.value for f in ENCODINGS])
scales = st.floats(min_value=2.0 ** -40, max_value=2.0 ** 40, width=32)


@st.composite
def arrays(draw):
    dtype = draw(dtypes)
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=40))
    bits = draw(hnp.arrays(np.uint32 if dtype == np.float32 else np.uint16, shape))
    return bits.view(dtype)


@settings(max_examples=150, deadline=None)
@given(arrays(), scales, formats)
def test_quantize_matches_oracle(x, scale, fmt):
    slot = np.zeros(1, np.float32)
    q = fp8core.quantize(x, scale, fmt, amax_out=slot)
    np.testing.assert_array_equal(q.view(np.uint8), quantize_bits(x.astype(np.float32), scale, fmt))
    f = np.abs(x.astype(np.float32))
    if f.size == 0:
        assert slot[0] == 0
    elif np.isnan(f).any():
        assert slot.view(np.uint32)[0] == 0x7FFFFFFF
    else:
        assert slot[0] == f.max()


@settings(max_examples=100, deadline=None)
@given(arrays(), scales, formats)
def test_cast_transpose_is_quantize_then_transpose(x, scale, fmt):
    q, qt = fp8core.cast_transpose(x, scale, fmt)
    rows = int(np.prod(x.shape[:-1]))
    expected = quantize_bits(x.astype(np.float32), scale, fmt).reshape(rows, x.shape[-1])
    np.testing.assert_array_equal(qt.view(np.uint8), expected.T)
