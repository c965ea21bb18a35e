"""FP4 on the CPU reference (NUMERICS.md "FP4: E2M1 elements, NVFP4 and MXFP4"): bit for bit against the
independent reference of tests/fp4_reference.py and against ml_dtypes' E2M1 cast, on the families the contract
names (midpoint ties, zero/NaN/inf/subnormal blocks, scale boundaries, odd shapes, bf16/fp16/fp32), Philox's
known answers, stochastic rounding's reproducibility and unbiasedness, the Hadamard transform, round trips."""

import itertools

import ml_dtypes
import numpy as np
import pytest

import fp8core
import fp4_reference as ref
from fp8core import backends
from fp8core.backends import cpu_fp4
from fp8core.fp4 import (MXFP4Tensor, NVFP4Tensor, dequantize_mxfp4, dequantize_nvfp4, gemm_scale, quantize_mxfp4,
                         quantize_mxfp4_both, quantize_nvfp4, quantize_nvfp4_both)
from fp8core.formats import E2M1

F32 = np.float32
DTYPES = (np.float32, ml_dtypes.bfloat16, np.float16)
VALUES = (0, 0.5, 1, 1.5, 2, 3, 4, 6)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _codes(t) -> np.ndarray:
    return ref.unpack(np.asarray(t.data))


def _specials(rng, shape, dtype) -> np.ndarray:
    """Gaussian values over several binades, with +-0, +-inf-free specials: subnormals of the dtype, midpoints."""
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-6, 6, shape)
    flat = x.reshape(-1)
    tiny = {np.float32: 1e-40, ml_dtypes.bfloat16: 1e-39, np.float16: 3e-6}[dtype]
    flat[:8] = [0.0, -0.0, tiny, -tiny, 0.25, -2.5, 5.0, 448.0][:flat.size]
    return x.astype(dtype)


# ---- E2M1 ---------------------------------------------------------------------------------------------------

def _ml_dtypes_e2m1(y: np.ndarray) -> np.ndarray:
    """ml_dtypes' RTNE cast, clipped first (it does not saturate), NaN set to the contract's 0x7."""
    with np.errstate(invalid="ignore"):
        codes = np.clip(y, F32(-6), F32(6)).astype(ml_dtypes.float4_e2m1fn).view(np.uint8).copy()
    codes[np.isnan(y)] = 0x7
    return codes


def test_e2m1_cast_matches_ml_dtypes_on_every_bf16_pattern_and_around_every_grid_point(rng):
    every_bf16 = np.left_shift(np.arange(1 << 16, dtype=np.uint32), 16).view(F32)
    grid = np.array([v for v in VALUES] + [(a + b) / 2 for a, b in zip(VALUES, VALUES[1:])], F32)
    around = (grid.view(np.uint32)[:, None] + np.arange(-300, 301, dtype=np.int64)[None, :]).astype(np.uint32)
    around = np.concatenate([around, around | np.uint32(0x80000000)]).reshape(-1).view(F32)
    random = rng.integers(0, 1 << 32, 400_000, dtype=np.uint64).astype(np.uint32).view(F32)
    for y in (every_bf16, around, random):
        np.testing.assert_array_equal(cpu_fp4.e2m1_codes(y), _ml_dtypes_e2m1(y))


@pytest.mark.parametrize("mid, down, up", [(0.25, 0, 1), (0.75, 1, 2), (1.25, 2, 3), (1.75, 3, 4), (2.5, 4, 5),
                                           (3.5, 5, 6), (5.0, 6, 7)])
def test_e2m1_ties_at_every_midpoint_go_to_the_even_code(mid, down, up):
    even = down if down % 2 == 0 else up
    below, above = np.nextafter(F32(mid), F32(0)), np.nextafter(F32(mid), F32(10))
    y = np.array([mid, below, above, -mid, -below, -above], F32)
    assert list(cpu_fp4.e2m1_codes(y)) == [even, down, up, 8 | even, 8 | down, 8 | up]


def test_e2m1_saturates_keeps_signed_zero_and_sends_nan_to_plus_six():
    y = np.array([6, 7, 1e30, np.inf, -np.inf, -7, 0.0, -0.0, -1e-45, 1e-45, 0.2500001, np.nan, -np.nan], F32)
    assert list(cpu_fp4.e2m1_codes(y)) == [7, 7, 7, 7, 15, 15, 0, 8, 8, 0, 1, 7, 7]


def test_packing_puts_element_2j_in_the_low_nibble():
    x = np.array([[0.5, 6, -1, 0, 4, -6] + [0] * 10], F32)  # codes 1, 7, 0xA, 0, 6, 0xF
    t = quantize_nvfp4(x, global_amax=2688.0)  # S_enc 1; block amax 6 -> s_b 1.0 (0x38): elements as they are
    assert np.asarray(t.scale).view(np.uint8)[0, 0] == 0x38
    assert list(np.asarray(t.data)[0, :3]) == [0x71, 0x0A, 0xF6]
    np.testing.assert_array_equal(cpu_fp4._pack_rows(_codes(t)), np.asarray(t.data))
    np.testing.assert_array_equal(E2M1.pack(_codes(t)), np.asarray(t.data))


# ---- Philox and stochastic rounding ----------------------------------------------------------------------

# Random123's kat_vectors (philox4x32 10): counter, key, result
PHILOX_KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
              ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
              ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
               (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in cpu_fp4.philox4x32_10(counter, key)) == expected
    assert ref.philox(counter, key) == expected


def test_block_zero_bytes_with_seed_and_offset_zero_are_the_contracts():
    got = cpu_fp4.block_bytes(np.array([0], np.uint64), 0, 0)[0]
    assert bytes(got).hex() == "d5e827668dc569e14cac57bcd8db009b"


def test_block_bytes_match_the_reference_for_64_bit_seeds_offsets_and_block_numbers():
    g = np.array([0, 1, 2**32 - 1, 2**32, 2**40 + 7, 2**64 - 1], np.uint64)
    for seed, offset in [(1, 2), (2**64 - 1, 2**33 + 5), (0xDEADBEEF12345678, 0)]:
        got = cpu_fp4.block_bytes(g, seed, offset)
        for i, gi in enumerate(g):
            assert list(got[i]) == ref.sr_bytes(int(gi), seed, offset)


def test_stochastic_rounding_of_every_byte_matches_the_rule(rng):
    y = np.concatenate([np.array([0.3, -0.3, 0.0, -0.0, 1e-45, 0.25, 1.9, 2.0, 2.9, 5.99, 6, 7, np.inf, -np.inf,
                                  np.nan], F32), rng.uniform(-7, 7, 40).astype(F32)])
    for r in range(256):
        got = cpu_fp4.e2m1_stochastic(y, np.full(y.shape, r, np.uint8))
        assert list(got) == [ref.sr(v, r) for v in y], r
    # the contract's example: 0.3 has f8 = 153 and goes up to 0.5 exactly for r >= 103
    up = [int(cpu_fp4.e2m1_stochastic(np.array([0.3], F32), np.array([r], np.uint8))[0]) for r in range(256)]
    assert up == [0] * 103 + [1] * 153


def test_stochastic_rounding_is_unbiased_up_to_its_8_bit_truncation():
    # 2^16 blocks of 16 copies of y under S_enc = 1 and s_b = 1 (global_amax 2688, a 6 in each block's last place):
    # y is quantized as it is. The mean of the dequantized values is lo + step * f8 / 256 plus sampling noise of
    # standard deviation step * sqrt(p (1 - p) / n); the bound below is 8 of those (fixed seed: cannot flake).
    n_blocks = 1 << 16
    for y, (lo, step) in [(0.3, (0.0, 0.5)), (1.1, (1.0, 0.5)), (2.7, (2.0, 1.0)), (-4.6, (-4.0, -2.0))]:
        x = np.full((n_blocks, 16), y, F32)
        x[:, 15] = 6
        t = quantize_nvfp4(x, rounding="stochastic", seed=12345, offset=6, global_amax=2688.0)
        assert np.all(np.asarray(t.scale).view(np.uint8) == 0x38)
        got = dequantize_nvfp4(t)[:, :15].astype(np.float64)
        f8 = np.floor(256 * (abs(F32(y)) - abs(lo)) / abs(step))
        p = f8 / 256
        expected = lo + step * p
        sigma = abs(step) * np.sqrt(p * (1 - p) / got.size)
        assert abs(got.mean() - expected) <= 8 * sigma, (y, got.mean(), expected)
        assert abs(expected - F32(y)) < abs(step) / 256  # the truncation: less than one 256th of a step


def test_stochastic_rounding_is_reproducible_and_keyed_by_seed_and_offset(rng):
    x = rng.standard_normal((48, 64)).astype(F32)
    a = quantize_nvfp4(x, rounding="stochastic", seed=5, offset=9)
    b = quantize_nvfp4(x, rounding="stochastic", seed=5, offset=9)
    np.testing.assert_array_equal(a.data, b.data)
    for other in ({"seed": 6, "offset": 9}, {"seed": 5, "offset": 10}):
        c = quantize_nvfp4(x, rounding="stochastic", **other)
        assert not np.array_equal(a.data, c.data)
        np.testing.assert_array_equal(a.scale.view(np.uint8), c.scale.view(np.uint8))  # scales round to nearest


def _state(seed: int, offset: int, form: str):
    """(seed, offset) in memory, as each front-end holds it."""
    words = [seed & 0xFFFFFFFF, seed >> 32, offset & 0xFFFFFFFF, offset >> 32]
    if form == "uint32":  # fp8core.jax's
        return np.array(words, np.uint32)
    if form == "torch":  # fp8core.torch's fp4_rng: int64, the unsigned numbers' bits
        torch = pytest.importorskip("torch")
        return torch.from_numpy(np.array([seed, offset], np.uint64).view(np.int64))
    if form == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return jnp.asarray(np.array(words, np.uint32))
    return np.array([seed, offset], form)


@pytest.mark.parametrize("form", ["uint64", "uint32", "torch", "jax"])
@pytest.mark.parametrize("seed, offset, stream", [(5, 9, 0), (2 ** 64 - 1, 2 ** 32 - 1, 1), (3, 2 ** 64 - 2, 3)])
def test_a_state_in_memory_gives_the_bytes_of_its_numbers_by_value(rng, form, seed, offset, stream):
    """rng_state (the form each front-end keeps) holds the seed and offset; ``offset`` is added to the state's, the
    carry reaching its high word and the sum wrapping past 2^64: the bytes of the same numbers by value, for the
    rowwise, columnwise (Hadamard) and 16x16 operands and for quantize_nvfp4_both. The state is only read."""
    x = rng.standard_normal((32, 64)).astype(ml_dtypes.bfloat16)
    state = _state(seed, offset, form)
    raw = (lambda: state.numpy().tobytes()) if form == "torch" else (lambda: np.asarray(state).tobytes())
    before = raw()
    key = dict(seed=seed, offset=(offset + stream) % 2 ** 64)
    for kw in ({}, dict(columnwise=True, hadamard=True), dict(weight_2d=True)):
        got = quantize_nvfp4(x, rounding="stochastic", rng_state=state, offset=stream, **kw)
        want = quantize_nvfp4(x, rounding="stochastic", **key, **kw)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"{form} {kw}")
    for g, w in zip(quantize_nvfp4_both(x, hadamard=True, rounding="stochastic", rng_state=state, offset=stream),
                    quantize_nvfp4_both(x, hadamard=True, rounding="stochastic", **key)):
        for gp, wp in zip(g, w):
            np.testing.assert_array_equal(_bits(gp), _bits(wp), err_msg=f"{form} both")
    assert raw() == before
    nearest = quantize_nvfp4(x, rng_state=state)  # rounding to nearest takes no random bytes
    np.testing.assert_array_equal(nearest.data, quantize_nvfp4(x).data)


def test_the_cpu_backend_reads_a_state_as_the_kernel_does():
    """Four little-endian u32 words (seed lo, seed hi, offset lo, offset hi), whichever dtype holds them; the offset
    added mod 2^64."""
    seed, offset = 0x0123456789ABCDEF, 0xFFFFFFFF_FFFFFFFE
    for state in (np.array([seed, offset], np.uint64), np.array([seed, offset], np.uint64).view(np.int64),
                  np.array([0x89ABCDEF, 0x01234567, 0xFFFFFFFE, 0xFFFFFFFF], np.uint32)):
        assert cpu_fp4.state_seed_offset(state, 0) == (seed, offset)
        assert cpu_fp4.state_seed_offset(state, 3) == (seed, 1)


@pytest.mark.parametrize("columnwise, hadamard, weight_2d", [(False, True, False), (True, True, False),
                                                             (True, False, False), (True, False, True)])
def test_stochastic_rounding_does_not_depend_on_how_the_work_is_split(rng, monkeypatch, columnwise, hadamard,
                                                                       weight_2d):
    x = rng.standard_normal((256, 512)).astype(ml_dtypes.bfloat16)
    kw = dict(columnwise=columnwise, hadamard=hadamard, weight_2d=weight_2d)
    runs = []
    # one tile; several on the pool; 16-row groups; 16 x 64 tiles (columnwise and the rowwise transform's
    # position-major blocks are split by columns too)
    for span in (1 << 20, 1 << 16, 512 * 16, 1):
        monkeypatch.setattr(cpu_fp4, "SPAN", span)
        t = quantize_nvfp4(x, rounding="stochastic", seed=3, offset=4, **kw)
        runs.append((np.asarray(t.data).copy(), _bits(t.scale).copy()))
    for data, scale in runs[1:]:
        np.testing.assert_array_equal(data, runs[0][0])
        np.testing.assert_array_equal(scale, runs[0][1])
    # and they are the contract's bytes: the operand's first 32 rows (x's first rows, or first columns, keep their
    # block numbers) against the reference, under the whole tensor's global amax
    g = float(quantize_nvfp4(x, **kw).global_amax[0])
    part = np.ascontiguousarray(x[:, :32] if columnwise else x[:32])
    codes, scales, _ = ref.nvfp4(part, stochastic=True, seed=3, offset=4, global_amax=g, **kw)
    np.testing.assert_array_equal(ref.unpack(runs[0][0])[:32], codes)
    np.testing.assert_array_equal(runs[0][1][:scales.shape[0]], scales)


def test_mxfp4_does_not_depend_on_how_the_work_is_split(rng, monkeypatch):
    x = _specials(rng, (128, 256), np.float16)
    runs = []
    for span in (1 << 20, 1):
        monkeypatch.setattr(cpu_fp4, "SPAN", span)
        runs.append([_bits(a).copy() for a in (*quantize_mxfp4(x, columnwise=True), *quantize_mxfp4(x))])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("span", [1, 1 << 16], ids=["16x64-tiles", "one-tile"])
def test_columnwise_operand_is_the_rowwise_one_of_the_transpose(rng, monkeypatch, span):
    """The columnwise operand's codes are packed 16 a column into 8-byte words, then the words transposed: over
    several words a column and several tiles, from x one element into its buffer (misaligned), its bytes are the
    rowwise bytes of x^T (the same operand, packed along its rows), for every NVFP4 option and MXFP4."""
    monkeypatch.setattr(cpu_fp4, "SPAN", span)
    x = np.empty(96 * 128 + 1, ml_dtypes.bfloat16)[1:].reshape(96, 128)
    x[...] = _specials(rng, (96, 128), ml_dtypes.bfloat16)
    nan = x.copy()
    nan[17:33, 5] = np.nan  # two NaN blocks in operand row 5, one in each of two 16-row words
    for x in (x, nan):
        xt = np.ascontiguousarray(x.T)
        pairs = [(quantize_nvfp4(x, columnwise=True, **kw), quantize_nvfp4(xt, **kw))
                 for kw in (dict(), dict(hadamard=True), dict(weight_2d=True),
                            dict(rounding="stochastic", seed=5, offset=9))]
        pairs.append((quantize_mxfp4(x, columnwise=True), quantize_mxfp4(xt)))
        for col, row in pairs:
            assert col.data.shape == (128, 48)
            for a, b in zip(col, row):
                np.testing.assert_array_equal(_bits(a), _bits(b))


# ---- NVFP4 against the reference --------------------------------------------------------------------------

OPTIONS = [dict(weight_2d=w, hadamard=h, stochastic=s, columnwise=c)
           for w, h, s, c in itertools.product((False, True), repeat=4) if not (w and h)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(k for k, v in o.items() if v) or "plain")
def test_nvfp4_matches_the_reference(rng, dtype, opts):
    for shape in [(32, 48), (19, 16)] if not opts["columnwise"] else [(32, 48), (48, 16)]:
        x = _specials(rng, shape, dtype)
        t = quantize_nvfp4(x, weight_2d=opts["weight_2d"], hadamard=opts["hadamard"],
                           rounding="stochastic" if opts["stochastic"] else "nearest", seed=77, offset=2**40 + 1,
                           columnwise=opts["columnwise"])
        codes, scales, g = ref.nvfp4(x, seed=77, offset=2**40 + 1, **opts)
        np.testing.assert_array_equal(_codes(t), codes)
        np.testing.assert_array_equal(_bits(t.scale), scales)
        np.testing.assert_array_equal(_bits(t.global_amax), _bits(g))
        assert t.data.dtype == np.uint8 and t.scale.dtype == ml_dtypes.float8_e4m3fn and t.global_amax.dtype == F32


def test_nvfp4_special_blocks():
    x = np.zeros((6, 32), F32)
    x[1, :16] = np.linspace(-3, 3, 16)
    x[2, 3] = np.inf
    x[2, 4] = 1.0
    x[3, :16] = 1e-30  # d_b far below 2^-10: scale 0, multiplier FLT_MAX
    x[4, :16] = 2e-40  # fp32 subnormals
    finite = x.copy()
    finite[2, 3] = 0
    # an inf element: G = inf -> S_enc = 1; its block's scale saturates to 0x7E and it becomes +6
    t = quantize_nvfp4(x)
    assert np.isinf(t.global_amax[0])
    s = _bits(t.scale)
    assert s[2, 0] == 0x7E and _codes(t)[2, 3] == 0x7
    assert s[0, 0] == 0 and not _codes(t)[0].any()  # an all-zero block: scale 0, codes 0
    assert s[3, 0] == 0 and np.all(_codes(t)[3, :16] == 0x7)  # amax 1e-30 with S_enc 1: scale 0, codes +6 ...
    assert not dequantize_nvfp4(t)[3].any()  # ... that dequantize to 0
    # a NaN element: G NaN (returned), S_enc 1 for the rest; its block 0x7F and all 0x7, dequantized NaN
    y = finite.copy()
    y[5, 20] = np.nan
    t = quantize_nvfp4(y)
    assert _bits(t.global_amax)[0] == 0x7FFFFFFF
    assert _bits(t.scale)[5, 1] == 0x7F and np.all(_codes(t)[5, 16:] == 0x7)
    d = dequantize_nvfp4(t)
    assert np.all(_bits(d[5, 16:]) == 0x7FFFFFFF) and not np.isnan(d[:5]).any()
    np.testing.assert_array_equal(_bits(t.scale)[:5], _bits(quantize_nvfp4(finite, global_amax=np.nan).scale)[:5])
    np.testing.assert_array_equal(_bits(quantize_nvfp4(finite, global_amax=np.nan).scale)[:5],
                                  _bits(quantize_nvfp4(finite, global_amax=0.0).scale)[:5])  # S_enc = 1 both


def test_nvfp4_global_scale_boundaries():
    for g, s_enc, s_dec in [(0.0, 1.0, 1.0), (np.inf, 1.0, 1.0), (np.nan, 1.0, 1.0), (2688.0, 1.0, 1.0),
                            (1e-40, ref.FLT_MAX, 2.0 ** -128), (6.0, 448.0, F32(1) / F32(448))]:
        got = cpu_fp4.global_scales(np.array([g], F32))
        assert _bits(np.array(got, F32)).tolist() == _bits(np.array([s_enc, s_dec], F32)).tolist(), g
    # a subnormal G: S_dec = 2^-128 is used, not flushed; the block scales and codes are the reference's
    x = np.full((1, 16), 1e-39, F32)
    t = quantize_nvfp4(x)
    codes, scales, _ = ref.nvfp4(x)
    np.testing.assert_array_equal(_codes(t), codes)
    np.testing.assert_array_equal(_bits(t.scale), scales)
    # S_enc = FLT_MAX gives d_b = 0.0567, s_b = 0x17 (0.0586), and e_b = 1 / (s_b * 2^-128) overflows to FLT_MAX:
    # 1e-39 * FLT_MAX = 0.34 -> 0.5, decoded through S_dec = 2^-128, a subnormal that is not flushed to 0
    assert _bits(t.scale)[0, 0] == 0x17 and _codes(t)[0, 0] == 1
    assert dequantize_nvfp4(t)[0, 0] == F32(F32(0.5) * ref.e4m3_value(0x17)) * F32(2.0 ** -128) != 0


def test_nvfp4_e4m3_block_scale_saturation_subnormals_and_zero():
    # global_amax fixes S_enc = 1 (2688): d_b = amax_b / 6 (rounded by fp32(1/6))
    amaxes = [6 * 448.0, 6 * 1000.0, 6 * 2.0 ** -9, 6 * 3 * 2.0 ** -9, 6 * 2.0 ** -10, 6 * 2.0 ** -11, 6 * 2.0 ** -6]
    x = np.zeros((len(amaxes), 16), F32)
    x[:, 0] = amaxes
    x[:, 1] = 1.5 * 2.0 ** -9
    t = quantize_nvfp4(x, global_amax=2688.0)
    # 448 and above saturate (0x7E); 2^-9 and 3 * 2^-9 are E4M3 subnormals; 2^-10 is a tie between 0 and 2^-9
    # (to even: 0); 2^-11 rounds to 0; 2^-6 is the smallest normal, 0x08
    assert _bits(t.scale)[:, 0].tolist() == [0x7E, 0x7E, 0x01, 0x03, 0x00, 0x00, 0x08]
    codes, scales, _ = ref.nvfp4(x, global_amax=2688.0)
    np.testing.assert_array_equal(_codes(t), codes)
    np.testing.assert_array_equal(_bits(t.scale), scales)
    assert _codes(t)[4, 0] == 0x7  # scale 0 with amax > 0: multiplied by FLT_MAX


def test_global_amax_given_is_used_and_returned(rng):
    x = rng.standard_normal((16, 64)).astype(F32)
    own = quantize_nvfp4(x)
    given = quantize_nvfp4(x, global_amax=float(own.global_amax[0]))
    np.testing.assert_array_equal(given.data, own.data)
    larger = quantize_nvfp4(x, global_amax=1e3)
    assert larger.global_amax[0] == F32(1e3)
    codes, scales, _ = ref.nvfp4(x, global_amax=1e3)
    np.testing.assert_array_equal(_codes(larger), codes)
    np.testing.assert_array_equal(_bits(larger.scale), scales)
    for amax in (np.array([1e3], F32), np.float32(1e3)):
        np.testing.assert_array_equal(quantize_nvfp4(x, global_amax=amax).data, larger.data)


def test_weight_2d_columnwise_is_the_rowwise_transposed(rng):
    x = _specials(rng, (48, 80), ml_dtypes.bfloat16)
    row = quantize_nvfp4(x, weight_2d=True)
    col = quantize_nvfp4(x, weight_2d=True, columnwise=True)
    np.testing.assert_array_equal(_codes(col), _codes(row).T)
    np.testing.assert_array_equal(_bits(col.scale), _bits(row.scale).T)
    assert row.scale.shape == (3, 5) and col.scale.shape == (5, 3)


def test_weight_2d_partial_last_tile_and_odd_rows(rng):
    for m in (1, 5, 17, 33):
        x = _specials(rng, (m, 32), F32)
        t = quantize_nvfp4(x, weight_2d=True)
        assert t.scale.shape == (-(-m // 16), 2) and t.data.shape == (m, 16)
        codes, scales, _ = ref.nvfp4(x, weight_2d=True)
        np.testing.assert_array_equal(_codes(t), codes)
        np.testing.assert_array_equal(_bits(t.scale), scales)


def test_leading_dimensions_fold_into_rows(rng):
    x = rng.standard_normal((2, 3, 32)).astype(F32)
    t = quantize_nvfp4(x)
    flat = quantize_nvfp4(x.reshape(6, 32))
    assert t.data.shape == (6, 16)
    np.testing.assert_array_equal(t.data, flat.data)


def test_empty_tensors():
    t = quantize_nvfp4(np.zeros((0, 32), F32))
    assert t.data.shape == (0, 16) and t.scale.shape == (0, 2) and t.global_amax[0] == 0
    t = quantize_nvfp4(np.zeros((0, 32), F32), columnwise=True, weight_2d=True)
    assert t.data.shape == (32, 0) and t.scale.shape == (2, 0)
    t = quantize_nvfp4(np.zeros((3, 0), F32))
    assert t.data.shape == (3, 0) and t.scale.shape == (3, 0)
    assert dequantize_nvfp4(t).shape == (3, 0)
    m = quantize_mxfp4(np.zeros((0, 64), ml_dtypes.bfloat16))
    assert m.data.shape == (0, 32) and m.scale.shape == (0, 2)


def test_both_equals_the_two_calls(rng):
    x = _specials(rng, (32, 64), ml_dtypes.bfloat16)
    for kw in (dict(), dict(hadamard=True, rounding="stochastic", seed=4, offset=1), dict(weight_2d=True)):
        row, col = quantize_nvfp4_both(x, **kw)
        one_row = quantize_nvfp4(x, **{**kw, "hadamard": False})
        one_col = quantize_nvfp4(x, columnwise=True, **kw)
        for a, b in ((row, one_row), (col, one_col)):
            for p, q in zip(a, b):
                np.testing.assert_array_equal(_bits(p), _bits(q))
    row, col = quantize_mxfp4_both(x, rounding="floor")
    for a, b in ((row, quantize_mxfp4(x, rounding="floor")), (col, quantize_mxfp4(x, rounding="floor",
                                                                                  columnwise=True))):
        for p, q in zip(a, b):
            np.testing.assert_array_equal(_bits(p), _bits(q))


# ---- the Hadamard transform -------------------------------------------------------------------------------

def _h16() -> np.ndarray:
    i = np.arange(16)
    return np.array([[(-1) ** bin(a & b).count("1") for b in i] for a in i], np.float64)


def test_hadamard_is_s_h16_over_4_where_the_sums_are_exact_and_inverts(rng):
    x = rng.integers(-4, 4, (8, 64)).astype(ml_dtypes.bfloat16)  # small integers: every sum exact, bf16 too
    got = cpu_fp4.hadamard16(x, False).astype(np.float64)
    s = np.diag(ref.SIGNS).astype(np.float64)
    expected = (x.astype(np.float64).reshape(-1, 16) @ s @ _h16() / 4).reshape(x.shape)
    np.testing.assert_array_equal(got, expected)
    back = (got.reshape(-1, 16) @ _h16() @ s / 4).reshape(x.shape)  # H16 H16 = 16 I: orthogonal up to 1/4
    np.testing.assert_array_equal(back, x.astype(np.float64))


def test_hadamard_follows_the_butterfly_order_where_sums_round(rng):
    # magnitudes spread over 2^40: the fp32 sums round, so the order shows in the bits
    x = (rng.standard_normal((64, 32)) * 2.0 ** rng.integers(-20, 20, (64, 32))).astype(F32)
    got = cpu_fp4.hadamard16(x, False)
    expected = np.stack([np.concatenate([ref.hadamard_block(row[b:b + 16]) for b in (0, 16)]) for row in x])
    np.testing.assert_array_equal(_bits(got), _bits(expected))
    matmul = (x.reshape(-1, 16) @ (np.diag(ref.SIGNS) @ _h16()).astype(F32) * F32(0.25)).reshape(x.shape)
    assert not np.array_equal(_bits(got), _bits(matmul))  # another order gives other bits: the test can fail
    cols = cpu_fp4.hadamard16(np.ascontiguousarray(x.T), True)  # down the columns of x^T: the same blocks
    np.testing.assert_array_equal(_bits(cols), _bits(np.ascontiguousarray(got.T)))


@pytest.mark.parametrize("dtype", (ml_dtypes.bfloat16, np.float16))
def test_hadamard_rounds_to_the_input_dtype(rng, dtype):
    x = rng.standard_normal((4, 16)).astype(dtype)
    got = cpu_fp4.hadamard16(x, False)
    assert got.dtype == dtype
    expected = np.stack([ref.hadamard_block(row) for row in x])
    np.testing.assert_array_equal(_bits(got), _bits(expected))


def test_hadamard_overflow_gives_inf_and_nan_by_the_rules():
    x = np.zeros((2, 16), F32)
    x[0, :2] = 3e38  # stage h = 1: 3e38 + 3e38 = inf, 3e38 - 3e38 = 0; then inf +- 0 and 0 +- 0
    x[1, :4] = [3e38, 3e38, 3e38, -3e38]  # (S_3 = -1) stage 1 gives inf, 0, inf, 0; stage 2: inf - inf = NaN
    t = quantize_nvfp4(x[:1], hadamard=True)
    assert np.isinf(t.global_amax[0]) and _bits(t.scale)[0, 0] == 0x7E
    assert _codes(t)[0].tolist() == [7, 0] * 8  # inf (scaled: inf) -> 6, zeros stay 0
    t = quantize_nvfp4(x, hadamard=True)
    assert np.isnan(t.global_amax[0]) and _bits(t.scale)[1, 0] == 0x7F and np.all(_codes(t)[1] == 0x7)


# ---- MXFP4 ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("columnwise", [False, True])
def test_mxfp4_matches_the_reference(rng, dtype, rule, columnwise):
    x = _specials(rng, (64, 96), dtype)
    x[5, 40] = np.nan
    x[7, 3] = -np.inf
    t = quantize_mxfp4(x, rounding=rule, columnwise=columnwise)
    codes, scales = ref.mxfp4(x, rule, columnwise)
    np.testing.assert_array_equal(_codes(t), codes)
    np.testing.assert_array_equal(_bits(t.scale), scales)
    assert t.scale.dtype == ml_dtypes.float8_e8m0fnu and t.data.shape == codes.shape[:1] + (codes.shape[1] // 2,)


def test_mxfp4_scale_boundaries():
    k = np.arange(-130, 126)
    powers = (6.0 * 2.0 ** k).astype(F32)  # 6 * 2^k, subnormal below 2^-126
    amax = np.concatenate([powers, np.nextafter(powers, F32(np.inf)),
                           np.array([0.0, 1e-45, 2.0 ** -127, 3e38, np.inf, np.nan], F32)])
    x = np.zeros((amax.size, 32), F32)
    x[:, 0] = amax
    for rule in ("rceil", "floor"):
        e = _bits(quantize_mxfp4(x, rounding=rule).scale)[:, 0]
        assert e.tolist() == [ref.e8m0(a, rule) for a in amax]
    rceil = _bits(quantize_mxfp4(x).scale)[:, 0]
    i = np.flatnonzero(k == 0)[0]
    assert rceil[i] == 127 and rceil[k.size + i] == 128  # 6 * 2^0: exactly 2^0; just above: one binade up
    assert rceil[-6:].tolist() == [0, 0, 0, 253, 254, 0xFF]  # 3e38 / 6 < 2^126: 253; only inf saturates
    floor = _bits(quantize_mxfp4(x, rounding="floor").scale)[:, 0]
    assert floor[i] == 127 and floor[-6:].tolist() == [0, 0, 0, 252, 254, 0xFF]
    nan_block = quantize_mxfp4(x[-1:])
    assert np.all(_codes(nan_block) == 0x7) and np.all(_bits(dequantize_mxfp4(nan_block)) == 0x7FFFFFFF)


# ---- round trips and dequantize --------------------------------------------------------------------------

def test_round_trips_of_values_on_the_grid(rng):
    codes = rng.integers(0, 16, (32, 64)).astype(np.uint8)
    codes[:, 0] = 7  # each block's amax is 6 times its scale
    codes[:, 32] = 15
    q = E2M1.values[codes]
    # MXFP4: q * 2^k comes back exactly (rceil gives e = 127 + k for amax 6 * 2^k)
    kx = rng.integers(-100, 100, (32, 2))
    x = (q.reshape(32, 2, 32) * 2.0 ** kx[:, :, None]).reshape(32, 64).astype(F32)
    t = quantize_mxfp4(x)
    np.testing.assert_array_equal(_codes(t), codes)
    np.testing.assert_array_equal(dequantize_mxfp4(t), x)
    # NVFP4 with S_enc = 1: power-of-two block scales s_b (E4M3 normals and subnormals) come back exactly
    kb = rng.integers(-9, 8, (32, 4))
    x = (q.reshape(32, 4, 16) * 2.0 ** kb[:, :, None]).reshape(32, 64).astype(F32)
    x[:, 16] = 6 * 2.0 ** kb[:, 1]
    x[:, 48] = -6 * 2.0 ** kb[:, 3]
    t = quantize_nvfp4(x, global_amax=2688.0)
    for dtype in DTYPES:
        np.testing.assert_array_equal(dequantize_nvfp4(t, dtype), x.astype(dtype))


def test_dequantize_nvfp4_order_and_rounding(rng):
    x = _specials(rng, (32, 64), F32)
    t = quantize_nvfp4(x)
    s_enc, s_dec = ref.global_scales(t.global_amax[0])
    codes = _codes(t)
    scales = np.repeat(_bits(t.scale).view(ml_dtypes.float8_e4m3fn).astype(F32), 16, axis=1)
    expected = (E2M1.values[codes].astype(F32) * scales) * s_dec  # the first product exact, then one rounding
    np.testing.assert_array_equal(_bits(dequantize_nvfp4(t)), _bits(expected))
    for dt in (ml_dtypes.bfloat16, np.float16):
        np.testing.assert_array_equal(_bits(dequantize_nvfp4(t, dt)), _bits(expected.astype(dt)))
    tiles = quantize_nvfp4(x, weight_2d=True)
    expected = (E2M1.values[_codes(tiles)].astype(F32) *
                np.repeat(np.repeat(_bits(tiles.scale).view(ml_dtypes.float8_e4m3fn).astype(F32), 16, 0), 16, 1)
                ) * ref.global_scales(tiles.global_amax[0])[1]
    np.testing.assert_array_equal(_bits(dequantize_nvfp4(tiles)), _bits(expected))


@pytest.mark.parametrize("g", [0.0, np.inf, np.nan])
def test_dequantize_nvfp4_decodes_with_s_dec_1_where_it_encoded_with_s_enc_1(g):
    x = np.zeros((1, 16), F32)
    x[0, :3] = [1.0, -3.0, 6.0]
    t = quantize_nvfp4(x, global_amax=g)
    one = quantize_nvfp4(x, global_amax=2688.0)  # S_enc = 1 too
    np.testing.assert_array_equal(np.asarray(t.data), one.data)
    np.testing.assert_array_equal(dequantize_nvfp4(t), dequantize_nvfp4(one))
    assert dequantize_nvfp4(t)[0, :3].tolist() == [1.0, -3.0, 6.0]


def test_dequantize_nan_scales_give_canonical_nans():
    t = NVFP4Tensor(np.full((1, 8), 0x21, np.uint8), np.array([[0xFF]], np.uint8).view(ml_dtypes.float8_e4m3fn),
                    np.array([1.0], F32))
    for dt, nan in (("float32", 0x7FFFFFFF), ("bfloat16", 0x7FFF), ("float16", 0x7FFF)):
        assert np.all(_bits(dequantize_nvfp4(t, dt)) == nan)
    m = MXFP4Tensor(np.full((1, 16), 0x9A, np.uint8), np.array([[0xFF]], np.uint8).view(ml_dtypes.float8_e8m0fnu))
    assert np.all(_bits(dequantize_mxfp4(m, "bfloat16")) == 0x7FFF)


# ---- the GEMM scale layout ------------------------------------------------------------------------------

def test_gemm_scale_is_cublaslt_128x4_layout(rng):
    x = rng.standard_normal((200, 16 * 9)).astype(F32)
    for t, rows in ((quantize_nvfp4(x), 200), (quantize_nvfp4(x, weight_2d=True), 200),
                    (quantize_mxfp4(np.ascontiguousarray(x[:, :128])), 200)):
        s = _bits(t.scale)
        full = s if s.shape[0] == rows else np.repeat(s, 16, axis=0)[:rows]
        cols = full.shape[1]
        out = np.asarray(gemm_scale(t))
        assert out.shape == (-(-rows // 128) * 128 * -(-cols // 4) * 4,) and out.dtype == np.uint8
        expected = np.zeros_like(out)
        for r in range(rows):
            for c in range(cols):
                expected[((r // 128) * -(-cols // 4) + c // 4) * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4] \
                    = full[r, c]
        np.testing.assert_array_equal(out, expected)


# ---- arrays in, arrays out ------------------------------------------------------------------------------

def test_torch_in_torch_out(rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((32, 64)).astype(F32)
    t = quantize_nvfp4(torch.from_numpy(x).bfloat16())
    assert isinstance(t.data, torch.Tensor) and t.data.dtype == torch.uint8
    assert t.scale.dtype == torch.float8_e4m3fn and t.global_amax.dtype == torch.float32
    expected = quantize_nvfp4(x.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(t.data.numpy(), expected.data)
    y = dequantize_nvfp4(t, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (32, 64)
    m = quantize_mxfp4(torch.from_numpy(x))
    assert m.scale.dtype == torch.float8_e8m0fnu
    assert dequantize_mxfp4(m).dtype == torch.float32


def test_jax_in_jax_out(rng):
    jnp = pytest.importorskip("jax.numpy")
    x = rng.standard_normal((32, 64)).astype(F32)
    t = quantize_nvfp4(jnp.asarray(x), columnwise=True)
    assert t.scale.dtype == jnp.float8_e4m3fn and t.data.shape == (64, 16)
    np.testing.assert_array_equal(np.asarray(t.data), quantize_nvfp4(x, columnwise=True).data)
    assert dequantize_nvfp4(t, jnp.bfloat16).dtype == jnp.bfloat16


# ---- bad input ------------------------------------------------------------------------------------------

def test_cuda_input_takes_the_cuda_backend():
    """Every FP4 function, the GEMM included (cuda_fp4.gemm refuses a GPU without FP4 GEMMs by its compute
    capability: tests/test_cublaslt_plan.py), goes to cuda_fp4 for a CUDA input."""
    from fp8core.backends import cuda_fp4

    for name in ("quantize_nvfp4", "dequantize_mxfp4", "gemm_scale", "gemm"):
        assert backends.fp4_for_device(("cuda", 1), name) is cuda_fp4
    assert backends.fp4_for_device(("cpu", 0), "quantize_nvfp4") is cpu_fp4


@pytest.mark.parametrize("call, error, match", [
    (lambda x: quantize_nvfp4(np.ones((32, 40), F32)), ValueError, r"^x: quantize_nvfp4 takes blocks of 16 .* K = 40"),
    (lambda x: quantize_nvfp4(x[:20], columnwise=True), ValueError, r"^x: quantize_nvfp4 \(columnwise\) .* M = 20"),
    (lambda x: quantize_nvfp4(x, weight_2d=True, hadamard=True), ValueError, r"^hadamard: weight_2d=True"),
    (lambda x: quantize_nvfp4(x, rounding="up"), ValueError, r"^rounding: expected 'nearest' or 'stochastic'"),
    (lambda x: quantize_nvfp4(x, seed=-1), ValueError, r"^seed: expected an unsigned 64-bit integer"),
    (lambda x: quantize_nvfp4(x, seed=2**64), ValueError, r"^seed: expected an unsigned 64-bit integer"),
    (lambda x: quantize_nvfp4(x, offset=1.0), ValueError, r"^offset: expected an unsigned 64-bit integer"),
    (lambda x: quantize_nvfp4(x, offset=True), ValueError, r"^offset: expected an unsigned 64-bit integer"),
    (lambda x: quantize_nvfp4(x, rng_state=np.zeros(3, np.int64)), ValueError,
     r"^rng_state: expected int64 \[2\] \(seed, offset\) or uint64 \[2\] \(seed, offset\) or uint32 \[4\] "
     r"\(seed lo, seed hi, offset lo, offset hi\), got int64 \[3\]"),
    (lambda x: quantize_nvfp4(x, rng_state=np.zeros(2, np.int32)), ValueError, r"^rng_state: expected .* got int32 \[2\]"),
    (lambda x: quantize_nvfp4(x, rng_state=np.zeros(2, F32)), ValueError, r"^rng_state: expected .* got float32 \[2\]"),
    (lambda x: quantize_nvfp4(x, rng_state=np.zeros(4, np.int64)[::2]), ValueError, r"^rng_state: expected a contiguous"),
    (lambda x: quantize_nvfp4(x, rng_state=np.zeros(2, np.int64), seed=5), ValueError,
     r"^seed: rng_state holds the seed; leave seed at 0 with it \(got 5\)"),
    (lambda x: quantize_nvfp4(x, rng_state=[1, 2]), TypeError, r"^rng_state: "),
    (lambda x: quantize_nvfp4_both(x, rng_state=np.zeros(4, np.uint64)), ValueError, r"^rng_state: expected"),
    (lambda x: quantize_nvfp4(x, global_amax=-1.0), ValueError, r"^global_amax: expected an amax >= 0"),
    (lambda x: quantize_nvfp4(x, global_amax=-0.0), ValueError, r"^global_amax: expected an amax >= 0"),
    (lambda x: quantize_nvfp4(x, global_amax=np.ones(2, F32)), ValueError, r"^global_amax: expected 1 element"),
    (lambda x: quantize_nvfp4(x, global_amax=np.ones(1)), TypeError, r"^global_amax: expected float32"),
    (lambda x: quantize_nvfp4(x, weight_2d=1), TypeError, r"^weight_2d: expected a bool"),
    (lambda x: quantize_nvfp4(x, columnwise="yes"), TypeError, r"^columnwise: expected a bool"),
    (lambda x: quantize_nvfp4(x.astype(np.float64)), TypeError, r"^x: expected float32, bfloat16 or float16"),
    (lambda x: quantize_nvfp4(x.T), ValueError, r"^x: expected a contiguous"),
    (lambda x: quantize_nvfp4(np.float32(1)), ValueError, r"^x: expected at least 1 dimension"),
    (lambda x: quantize_nvfp4_both(x[:24]), ValueError, r"^x: quantize_nvfp4_both \(columnwise\) .* M = 24"),
    (lambda x: quantize_nvfp4_both(x, hadamard=True, global_amax=1.0), ValueError, r"^global_amax: with hadamard"),
    (lambda x: quantize_mxfp4(np.ones((32, 48), F32)), ValueError, r"^x: quantize_mxfp4 takes blocks of 32 .* K = 48"),
    (lambda x: quantize_mxfp4(x, rounding="nearest"), ValueError, r"^rounding: expected 'rceil'"),
])
def test_bad_quantize_arguments_are_refused_by_name(call, error, match):
    x = np.ones((32, 64), F32)
    with pytest.raises(error, match=match):
        call(x)


def test_bad_dequantize_arguments_are_refused_by_name():
    t = quantize_nvfp4(np.ones((32, 64), F32))
    m = quantize_mxfp4(np.ones((32, 64), F32))
    cases = [
        (lambda: dequantize_nvfp4(t[:2]), TypeError, r"^t: expected an NVFP4Tensor \(data, scale, global_amax\)"),
        (lambda: dequantize_nvfp4(m), TypeError, r"^t: expected an NVFP4Tensor"),
        (lambda: dequantize_nvfp4(t._replace(data=t.data.view(np.int8))), TypeError, r"^t.data: expected uint8"),
        (lambda: dequantize_nvfp4(t._replace(scale=t.scale[:, :2].copy())), ValueError,
         r"^t.scale: expected shape \(32, 4\) \(1x16 blocks\) for data viewed as \(32, 64\), got \(32, 2\)"),
        (lambda: dequantize_nvfp4(tuple(t._replace(scale=t.scale[:, :2].copy()))), ValueError,  # no layout named
         r"^t.scale: expected shape \(32, 4\) \(1x16 blocks\) or \(2, 4\) \(16x16 tiles\) .* got \(32, 2\)"),
        (lambda: dequantize_nvfp4(t._replace(scale=t.scale.astype(F32))), TypeError,
         r"^t.scale: expected float8_e4m3fn"),
        (lambda: dequantize_nvfp4(t._replace(data=t.data[:, :4].copy())), ValueError, r"^t.data: 4 bytes a row"),
        (lambda: dequantize_nvfp4(t._replace(global_amax=np.ones(2, F32))), ValueError, r"^t.global_amax: expected 1"),
        (lambda: dequantize_nvfp4(t, "float64"), ValueError, r"^out_dtype: expected float32, bfloat16 or float16"),
        (lambda: dequantize_mxfp4(m._replace(scale=m.scale[:, :1].copy())), ValueError,
         r"^t.scale: expected shape \(32, 2\)"),
        (lambda: dequantize_mxfp4(m._replace(scale=m.scale.view(np.uint8).view(ml_dtypes.float8_e4m3fn))), TypeError,
         r"^t.scale: expected float8_e8m0fnu"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


# ---- the floating-point environment and the memos ----------------------------------------------------------

def _fp4_run(x: np.ndarray) -> list[np.ndarray]:
    """Every FP4 path on x (blocks with subnormal amaxes, scales and multipliers among them), as bits."""
    out = []
    for kw in (dict(), dict(weight_2d=True), dict(hadamard=True), dict(columnwise=True, hadamard=True),
               dict(rounding="stochastic", seed=1), dict(global_amax=1e-39)):
        t = quantize_nvfp4(x, **kw)
        out += [_bits(a).copy() for a in t] + [_bits(dequantize_nvfp4(t, "float32")).copy()]
    for rule in ("rceil", "floor"):
        m = quantize_mxfp4(x, rounding=rule)
        out += [_bits(a).copy() for a in m] + [_bits(dequantize_mxfp4(m, "bfloat16")).copy()]
    out.append(_bits(fp8core.gemm(quantize_nvfp4(x), quantize_nvfp4(x[:16]), out_dtype="float32")).copy())
    return out


def test_fp4_gives_the_same_bits_under_flush_to_zero(rng):
    torch = pytest.importorskip("torch")
    x = (rng.standard_normal((64, 64)) * 2.0 ** rng.integers(-149, -120, (64, 64))).astype(F32)
    x[::4] *= F32(2.0 ** 100)  # normal rows beside subnormal ones: G normal, tiny blocks' scales subnormal or 0
    want = _fp4_run(x)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        assert np.float32(1e-39) * np.float32(1) == 0, "torch.set_flush_denormal(True) did not flush"
        got = _fp4_run(x)
    finally:
        torch.set_flush_denormal(False)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"result {i}")


def test_fp4_memos_are_registered_and_a_reset_gives_the_same_bits(rng):
    from fp8core import _caches

    names = {"cpu_fp4.e2m1_table", "cpu_fp4.e2m1_f32", "cpu_fp4.e4m3_f32", "cpu_fp4.e2m1_f64"}
    assert names <= set(_caches.names())
    x = rng.standard_normal((32, 64)).astype(ml_dtypes.bfloat16)
    want = _fp4_run(x)
    _caches.reset(*names)
    assert cpu_fp4.e2m1_table.cache_info().currsize == 0
    got = _fp4_run(x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
