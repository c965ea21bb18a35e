"""The CPU backend's fast paths against the oracle and against each other: the fp32 -> fp8 cast by lookup, the
direct path on tensors of any size, the per-scale 16-bit tables (built for a scale seen before), and amax's
small- and large-array reductions. Every one must give the contract's bits."""

import ml_dtypes
import numpy as np
import pytest

import fp8core
from fp8core import Format, _caches
from fp8core._tensor import wrap
from fp8core.backends import cpu
from fp8core.formats import ENCODINGS
from oracle import quantize_bits

FORMATS = [(f.value, f) for f in ENCODINGS]
DTYPES = [ml_dtypes.bfloat16, np.float16]
SCALES = [1.0, 0.3, 2.0 ** -7, 448 / 1000.0, 2.0 ** 60, 2.0 ** -60, 2.0 ** 140 / 2.0 ** 20]


def _cast(f: np.ndarray, fmt: Format) -> np.ndarray:
    out = np.empty(f.size, np.uint8)
    cpu._cast_f32(f.copy(), fmt.encoding, out)
    return out


@pytest.mark.parametrize("name,fmt", FORMATS)
def test_the_cast_by_lookup_is_satfinite_rtne_for_every_top_half_and_low_half_kind(name, fmt):
    """Every fp32 top half (sign, exponent, 7 mantissa bits) with low halves 0, 1, 0x7FFF, 0x8000, 0x8001 and
    0xFFFF: ties, just above ties, the saturation boundary, inf vs NaN, subnormals."""
    top = np.arange(1 << 16, dtype=np.uint32) << 16
    bits = np.concatenate([top | low for low in (0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF)])
    f = bits.view(np.float32)
    np.testing.assert_array_equal(_cast(f, fmt), quantize_bits(f, 1.0, name))


@pytest.mark.parametrize("name,fmt", FORMATS)
def test_the_cast_by_lookup_on_random_fp32_patterns(name, fmt):
    bits = np.random.default_rng(7).integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    f = bits.view(np.float32)
    np.testing.assert_array_equal(_cast(f, fmt), quantize_bits(f, 1.0, name))


@pytest.fixture
def fresh_tables():
    _caches.reset("cpu.quantize_tables", "cpu.seen_scales")
    yield
    _caches.reset("cpu.quantize_tables", "cpu.seen_scales")


@pytest.mark.parametrize("name,fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_small_tensors_take_the_direct_path_exactly(name, fmt, dtype, fresh_tables):
    """Every 16-bit pattern, 16 at a time (the per-call path of small tensors), with amax_out: the same bits as
    the oracle and as the table path over all patterns at once."""
    x = np.arange(65536, dtype=np.uint16).view(dtype)
    for built, scale in enumerate((0.3, 2.0 ** 60), 1):
        s = np.array([scale], np.float32)
        want = quantize_bits(x.astype(np.float32), scale, name)
        table = cpu.quantize_table("bfloat16" if dtype == ml_dtypes.bfloat16 else "float16",
                                    int(s.view(np.uint32)[0]), fmt.encoding)
        np.testing.assert_array_equal(table, want)
        got = np.concatenate([fp8core.quantize(x[i:i + 16], s, fmt).view(np.uint8) for i in range(0, 65536, 16)])
        np.testing.assert_array_equal(got, want)
        assert cpu.quantize_table.cache_info().currsize == built  # the small calls built no table


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("scale", SCALES)
def test_a_scale_seen_before_takes_a_table_from_mid_sizes(dtype, scale, fresh_tables):
    """Between TABLE_MIN >> 4 and TABLE_MIN elements: the first call with a scale runs directly, the second
    builds (and later ones reuse) the table; all give the oracle's bits and the same amax."""
    n = cpu.TABLE_MIN >> 3
    rng = np.random.default_rng(3)
    x = np.concatenate([np.arange(65536, dtype=np.uint16)[rng.permutation(65536)[:n - 8]],
                        np.array([0x7FC0, 0xFF80, 0x7F80, 0x8000, 0, 1, 0x8001, 0x7C00], np.uint16)]).view(dtype)
    want = quantize_bits(x.astype(np.float32), scale, "e4m3")
    results, slots = [], []
    for _ in range(3):
        slot = np.zeros(1, np.float32)
        results.append(fp8core.quantize(x, scale, "e4m3", amax_out=slot).view(np.uint8))
        slots.append(slot.view(np.uint32)[0])
        if _ == 0:
            assert cpu.quantize_table.cache_info().currsize == 0
    assert cpu.quantize_table.cache_info().currsize == 1
    for r in results:
        np.testing.assert_array_equal(r, want)
    assert slots == [0x7FFFFFFF] * 3


def test_many_scales_in_turn_never_build_tables_for_mid_sizes(fresh_tables):
    """A scale per call (current scaling) or more scales in turn than the memory holds: the direct path."""
    x = np.ones(cpu.TABLE_MIN >> 3, ml_dtypes.bfloat16)
    for _ in range(2):
        for k in range(cpu._SEEN_MAX + 1):
            fp8core.quantize(x, 1.0 + k / 64, "e4m3")
    assert cpu.quantize_table.cache_info().currsize == 0


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32], ids=["bf16", "fp16", "fp32"])
def test_amax_small_and_large_reductions_agree(dtype, monkeypatch):
    """One masked reduction (small arrays) and two plain ones (large), each by argmax or by max: the same bits,
    NaN canonical, -0, inf, subnormals, every 16-bit pattern one at a time in pairs with its negation."""
    rng = np.random.default_rng(5)
    if dtype == np.float32:
        cases = [rng.integers(0, 1 << 32, size=64, dtype=np.uint64).astype(np.uint32).view(np.float32)
                 for _ in range(200)]
        cases += [np.array(v, np.float32) for v in ([-0.0, 0.0], [-np.inf, 1], [1e-45, -1e-44], [np.nan, 1],
                                                   [-np.nan, -np.inf], [-3.0, 2.0])]
    else:
        p = np.arange(65536, dtype=np.uint16).view(dtype)
        cases = [p[i:i + 256] for i in range(0, 65536, 256)] + [p[::-1], -p[:0x7C00], p[0x8000:0x8400]]
    for x in cases:
        x = np.ascontiguousarray(x)
        got = []
        for small_max, argmax_max in ((cpu._SMALL, cpu._ARGMAX_MAX), (0, cpu._ARGMAX_MAX), (cpu._SMALL, 0), (0, 0)):
            monkeypatch.setattr(cpu, "_SMALL", small_max)  # 0: the two plain reductions
            monkeypatch.setattr(cpu, "_ARGMAX_MAX", argmax_max)  # 0: max instead of the value at argmax
            got.append(cpu._amax_bits(x))
            monkeypatch.undo()
        with np.errstate(invalid="ignore"):
            m = np.max(np.abs(x.astype(np.float32)))
        want = 0x7FFFFFFF if np.isnan(m) else int(np.array(m, np.float32).view(np.uint32))
        assert got == [want] * 4, (x[:4], got, want)


@pytest.mark.parametrize("name,fmt", FORMATS)
def test_fp32_tensors_of_every_size_regime(name, fmt):
    """fp32 quantize below and above the chunk size and with a chunk count that is not a multiple of the pool."""
    rng = np.random.default_rng(11)
    for n in (1, 15, 16, 4095, 4096, cpu.CHUNK, cpu.CHUNK + 3, 3 * cpu.CHUNK + 1):
        bits = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
        x = bits.view(np.float32)
        slot = np.zeros(1, np.float32)
        q = fp8core.quantize(x, 2.0 ** 100, fmt, amax_out=slot)
        np.testing.assert_array_equal(q.view(np.uint8), quantize_bits(x, 2.0 ** 100, name))
        assert slot.view(np.uint32)[0] == cpu._amax_bits(x)


def test_torch_scales_of_every_kind_give_the_oracles_bits():
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(np.arange(65536, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    for v in (0.3, 2.0 ** -130, 2.0 ** 100, 0.0, float("inf"), float("nan")):
        s = torch.tensor([v], dtype=torch.float32)
        got = fp8core.quantize(x[:1000], s, "e4m3").view(torch.uint8).numpy()
        want = quantize_bits(wrap(x[:1000]).data.astype(np.float32), float(np.float32(v)), "e4m3")
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("margin,power_of_2,epsilon", [(0, False, 0.0), (3, False, 0.0), (0, True, 0.0),
                                                      (2, True, 1e-30), (-5, False, 2.0 ** -140)])
def test_the_vectorised_scale_rule_matches_the_oracle(margin, power_of_2, epsilon):
    from fp8core._oracle import scale_rule

    rng = np.random.default_rng(13)
    bits = np.concatenate([rng.integers(0, 1 << 32, size=3000, dtype=np.uint64).astype(np.uint32),
                           np.array([0, 0x80000000, 1, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F7FFFFF, 0x00800000,
                                     0x3F800000, 0x43E00000, 0x0000FFFF], np.uint32)])
    amax = bits.view(np.float32)
    s, s_inv = cpu.compute_scale(amax, 448.0, margin, power_of_2, epsilon, None)
    for i, a in enumerate(amax):
        ws, wi, _ = scale_rule(float(a), 448.0, margin, power_of_2, epsilon)
        got = (s[i:i + 1].view(np.uint32)[0], s_inv[i:i + 1].view(np.uint32)[0])
        assert got == (np.array(ws, np.float32).view(np.uint32), np.array(wi, np.float32).view(np.uint32)), \
            (hex(bits[i]), got)


SMALL_SHAPES = [(), (1,), (16,), (4, 4), (2, 3, 5), (0,), (0, 3), (64, 64)]


@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16], ids=["fp32", "bf16", "fp16"])
def test_small_calls_that_allocate_give_what_the_general_path_gives(dtype, shape):
    """NumPy callers' small quantize, dequantize and transpose let the last NumPy call allocate the result; with
    out= (or for torch callers) the general path writes into given memory. Same bits, dtype and shape; the
    result is an ordinary C-contiguous, writable array; amax_out accumulates the same way."""
    rng = np.random.default_rng(3)
    with np.errstate(all="ignore"):  # random patterns: NaN and overflow narrowed on purpose
        x = rng.integers(0, 1 << 32, size=shape, dtype=np.uint64).astype(np.uint32).view(np.float32).astype(dtype)
    for fmt in ENCODINGS:
        for start in (0.0, 1e30, -1.0, np.nan):
            slot, given_slot = np.array([start], np.float32), np.array([start], np.float32)
            q = fp8core.quantize(x, 0.75, fmt, amax_out=slot)
            given = np.empty(shape, fmt.numpy_dtype)
            assert fp8core.quantize(x, 0.75, fmt, amax_out=given_slot, out=given) is given
            _same_array(q, given)
            assert slot.view(np.uint32)[0] == given_slot.view(np.uint32)[0]
        for out_dtype in ("float32", "bfloat16", "float16"):
            y, given = fp8core.dequantize(q, 3.0, out_dtype), np.empty(shape, ml_dtypes.bfloat16 if
                                                                          out_dtype == "bfloat16" else out_dtype)
            _same_array(y, fp8core.dequantize(q, 3.0, out_dtype, out=given))
        if len(shape) == 2:
            given = np.empty(shape[::-1], q.dtype)
            _same_array(fp8core.transpose(q), fp8core.transpose(q, out=given))


def _same_array(got: np.ndarray, want: np.ndarray) -> None:
    assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape
    assert got.flags.c_contiguous and got.flags.writeable
    np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8))


def test_the_update_step_counter_decides_and_advances_as_on_the_device():
    """update(step=, interval=): the scale is taken at steps % interval == 0 only, the counter advancing on every
    call, whether or not anything ran (cuda/update.cu's rule), next to the host's own update_scale."""
    fp8_max = np.full(2, 448, np.float32)
    step = np.array([0, 0], np.int32)
    taken = []
    for call in range(7):
        history = np.array([[2.0, 0.0 if call == 4 else 8.0], [1.0, 1.0]], np.float32)
        scale, scale_inv = np.ones(2, np.float32), np.ones(2, np.float32)
        twin = [a.copy() for a in (history, scale, scale_inv)]
        cpu.update(history, scale, scale_inv, fp8_max, 0, "max", False, 0.0, False, None, step, 3)
        cpu.update(*twin, fp8_max, 0, "max", False, 0.0, call % 3 == 0, None)
        for got, want in zip((history, scale, scale_inv), twin):
            np.testing.assert_array_equal(got, want)
        taken.append(bool(scale[0] != 1))
        assert step.tolist() == [(call + 1) % 3, 0]
    assert taken == [True, False, False, True, False, False, True]


@pytest.mark.parametrize("origin", ["numpy", "cupy", "jax", "dlpack", "torch"])
def test_the_caller_follows_the_origin_the_boundary_read(origin):
    """Backends ask the tensor's caller (allocator, stream, graph safety), never the framework: torch arrays get
    torch's allocator (a CPU result is a NumPy view owned by a torch tensor of the same bytes), the rest NumPy's."""
    torch = pytest.importorskip("torch")
    from fp8core._views import Tensor

    caller = Tensor(np.zeros(4, np.float32), "float32", ("cpu", 0), origin).caller
    assert (caller.allocates, caller.graph_safe) == ((True, True) if origin == "torch" else (False, False))
    out = caller.empty((2, 3), ml_dtypes.bfloat16, ("cpu", 0))
    assert out.shape == (2, 3) and out.dtype == ml_dtypes.bfloat16 and out.flags.writeable
    base = out
    while isinstance(base, np.ndarray):
        base = base.base
    owner = getattr(base, "tensor", None)
    assert (isinstance(owner, torch.Tensor) and owner.dtype == torch.bfloat16 and owner.data_ptr() == out.ctypes.data
            if origin == "torch" else owner is None)
