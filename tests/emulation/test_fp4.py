"""FP4 on the emulated device against the CPU reference, by bits: NVFP4 (rowwise, columnwise, 16x16 tiles, the
Hadamard transform, nearest and stochastic rounding, the global amax taken on the device or given), MXFP4 (rceil,
floor, both layouts), their dequantization to every output dtype, and the scale layout the GEMM reads; on sm_80,
sm_90 and sm_100, with the grids the backend computes (and two launch shapes for stochastic rounding, its seed and
offset by value and read by the kernel from device memory)."""

import numpy as np
import pytest

import device
import fp8core
from arrays import DTYPES, bits, data, upload
from fp8core import _kernels, formats
from fp8core._tensor import wrap
from fp8core.backends import cpu_fp4, cuda_fp4

FP4_DEVICES = [pytest.param(i, id=f"sm_{device.DEVICES[i].cc}") for i in (0, 1, 2)]
# (M, K): odd and partial-tile M rowwise, M % 16 == 0 where columnwise operands are taken too, the empty tensor,
# and one with more blocks than the emulated devices run at once (the grid-stride loop)
ROWWISE_SHAPES = [(1, 32), (17, 64), (33, 96)]
BOTH_SHAPES = [(16, 32), (48, 64), (0, 32)]
LARGE = (128, 512)
# E2M1's midpoints (ties go to the even code) and their negatives, under a block amax of 6: with G = 2688 the
# block's scale is 1.0 and its multiplier 1, so the elements reach the cast exactly
TIES = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -0.0] * 2,
                np.float32)


@pytest.fixture(params=FP4_DEVICES)
def fp4_dev(request):
    """sm_80, sm_90 and sm_100 in turn, current for the test."""
    with device._DeviceObj(request.param):
        yield request.param


def _special_blocks(x: np.ndarray) -> np.ndarray:
    """Whole 32-element row segments of NaN, inf, zeros, fp32 subnormals, E2M1 ties, and values whose NVFP4 scales
    fall among E4M3's subnormals or round to 0 (2^-10 times the tensor's largest)."""
    x = x.copy()
    if x.shape[1] >= 32:
        rows = [np.full(32, np.nan), np.full(32, np.inf), np.zeros(32), np.full(32, 1e-41), TIES,
                TIES * np.float32(2.0 ** -12), TIES * np.float32(2.0 ** -20)]
        for i, row in enumerate(rows[:x.shape[0]]):
            x[i, :32] = np.asarray(row, np.float32).astype(x.dtype)
    return x


def _same(got, ref, label):
    for g, r, part in zip(got, ref, ("data", "scale", "global_amax")):
        np.testing.assert_array_equal(bits(g), bits(r), err_msg=f"{label} ({part})")


def _dequantized_same(got, ref, dequantize, label):
    for out in ("float32", "bfloat16", "float16"):
        np.testing.assert_array_equal(bits(dequantize(got, out)), bits(dequantize(ref, out)), err_msg=f"{label} {out}")


NVFP4_OPTIONS = [
    {},
    {"weight_2d": True},
    {"hadamard": True},
    {"rounding": "stochastic", "seed": 7, "offset": 2 ** 40 + 3},
    {"hadamard": True, "rounding": "stochastic", "seed": 2 ** 63 + 5},
    {"global_amax": 2688.0},
]


def _nvfp4_case(x, columnwise, opts, offset, label):
    got = fp8core.quantize_nvfp4(upload(x, offset), columnwise=columnwise, **opts)
    ref = fp8core.quantize_nvfp4(x, columnwise=columnwise, **opts)
    _same(got, ref, label)
    _dequantized_same(got, ref, fp8core.dequantize_nvfp4, label)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROWWISE_SHAPES + BOTH_SHAPES, ids=str)
def test_nvfp4(fp4_dev, dtype, shape, rng):
    # with special blocks (a NaN anywhere: G NaN, S_enc 1) and without (a finite G: the global scale at work)
    for special, x in ((True, _special_blocks(data(rng, shape, dtype))), (False, data(rng, shape, dtype, False))):
        for opts in NVFP4_OPTIONS:
            for columnwise in (False, True) if shape in BOTH_SHAPES else (False,):
                # +1 element into the allocation: never 16-byte aligned (the rowwise element-wise loads); the
                # columnwise loads are element-wise anyway
                for offset in (0,) if columnwise else (0, 1):
                    _nvfp4_case(x, columnwise, opts, offset, f"specials={special} {opts} columnwise={columnwise} "
                                                             f"+{offset}")


def test_nvfp4_ties_and_scale_boundaries(fp4_dev):
    """Every E2M1 midpoint under a block scale of exactly 1 (G = 2688), and the same block under E4M3's scale
    boundaries: d_b at 448 and beyond (saturated 0x7E), among the subnormals, and rounding to 0."""
    rows = [TIES * np.float32(s) for s in (1, 448 / 6 * 2, 2.0 ** 30, 2.0 ** -8, 2.0 ** -9, 2.0 ** -11, 2.0 ** -40)]
    x = np.stack([np.asarray(r, np.float32) for r in rows])
    for dtype in DTYPES:
        with np.errstate(over="ignore"):  # fp16 saturates to inf: an inf block
            xt = x.astype(dtype)
        for opts in ({"global_amax": 2688.0}, {}, {"global_amax": 0.0}, {"global_amax": np.inf},
                     {"global_amax": np.nan}, {"global_amax": 1e-38}):
            _nvfp4_case(xt, False, opts, 0, f"{dtype} {opts}")
        tie = fp8core.quantize_nvfp4(upload(x[:1].astype(dtype)), global_amax=2688.0)
        assert bits(tie.scale)[0, 0] == 0x38  # 1.0: the elements are cast unscaled


def test_nvfp4_large_takes_the_grid_stride_loop(fp4_dev, rng):
    x = data(rng, LARGE, np.float32)
    before = len(device.state.launches)
    for columnwise in (False, True):
        _nvfp4_case(x, columnwise, {"rounding": "stochastic", "seed": 1}, 0, f"columnwise={columnwise}")
    launch = [r for r in device.state.launches[before:] if r.name.startswith("fp8core::nvfp4_quantize")][-1]
    items = LARGE[0] * LARGE[1] // 16
    assert launch.grid[0] * launch.block[0] < items  # each thread quantized more than one block


def test_stochastic_rounding_is_the_same_for_two_launch_shapes(fp4_dev, rng, monkeypatch):
    """Philox keyed by (seed, block, offset): one CTA striding over every block, or the backend's grid, gives the
    same bytes (and the CPU's)."""
    x = data(rng, (64, 128), np.float32, specials=False)
    opts = {"rounding": "stochastic", "seed": 12345, "offset": 99}
    ref = fp8core.quantize_nvfp4(x, **opts)
    results, grids = [], []
    for rule in (None, lambda max_blocks, work: 1):
        if rule is not None:
            monkeypatch.setattr(_kernels.NVFP4_QUANTIZE, "rule", rule)
        before = len(device.state.launches)
        results.append(fp8core.quantize_nvfp4(upload(x), **opts))
        grids.append([r.grid for r in device.state.launches[before:]])
    assert grids[0] != grids[1] and grids[1] == [(1, 1), (1, 1)]  # the amax pass and the quantize
    for got in results:
        _same(got, ref, "stochastic")
    other = fp8core.quantize_nvfp4(upload(x), **{**opts, "offset": 100})
    assert not np.array_equal(bits(other.data), bits(ref.data))  # the offset does choose the bytes


def _rng_state(seed: int, offset: int, form: str) -> np.ndarray:
    """(seed, offset) as fp8core.torch's int64 [2] or fp8core.jax's uint32 [4] (lo, hi words)."""
    if form == "int64":
        return np.array([seed, offset], np.uint64).view(np.int64)
    return np.array([seed & 0xFFFFFFFF, seed >> 32, offset & 0xFFFFFFFF, offset >> 32], np.uint32)


# (seed, the state's offset, the offset added to it): plain; the add carrying into the high word; wrapping past 2^64
STATES = [(12345, 99, 0), (2 ** 63 + 5, 2 ** 32 - 1, 1), (7, 2 ** 64 - 1, 2)]
SR_OPTIONS = [{}, {"columnwise": True, "hadamard": True}, {"weight_2d": True}]


@pytest.mark.parametrize("form, misaligned", [("int64", 0), ("uint32", 0), ("uint32", 1)],
                         ids=["int64", "uint32", "uint32+4B"])
def test_stochastic_rounding_reads_its_state_from_device_memory_as_by_value(fp4_dev, rng, monkeypatch, form,
                                                                            misaligned):
    """rng_state on the device: the kernel reads (seed, offset) from it (never the host) and gives the bytes of the
    same numbers passed by value, and the CPU's, for the backend's grid and one CTA striding over every block; the
    added offset carries into the state's high word and wraps past 2^64; a uint32 state 4 bytes past an 8-byte
    boundary reads the same. The state is left as it was."""
    x = data(rng, (48, 64), np.float32, specials=False)
    launches = []
    kernel = _kernels.NVFP4_QUANTIZE
    launch, default_rule = _kernels.Kernel.launch, kernel.rule

    def recording(self, device_id, targs, work, stream, /, **kw):
        if self is kernel and not kw["amax_out"]:
            launches.append((kw["rng_state"], kw["seed"], kw["offset"]))
        return launch(self, device_id, targs, work, stream, **kw)

    monkeypatch.setattr(_kernels.Kernel, "launch", recording)
    for seed, offset, stream in STATES:
        host_state = _rng_state(seed, offset, form)
        state = upload(host_state, misaligned)
        key = {"seed": seed, "offset": (offset + stream) % 2 ** 64}
        for rule in (default_rule, lambda max_blocks, work: 1):
            monkeypatch.setattr(kernel, "rule", rule)
            for opts in SR_OPTIONS:
                label = f"{form}+{misaligned} {(seed, offset, stream)} {opts} one_cta={rule is not default_rule}"
                ref = fp8core.quantize_nvfp4(x, rounding="stochastic", **key, **opts)
                del launches[:]
                by_value = fp8core.quantize_nvfp4(upload(x), rounding="stochastic", **key, **opts)
                by_pointer = fp8core.quantize_nvfp4(upload(x), rounding="stochastic", rng_state=state, offset=stream,
                                                    **opts)
                _same(by_value, ref, label + " by value")
                _same(by_pointer, ref, label + " by pointer")
                assert launches == [(0, seed, (offset + stream) % 2 ** 64), (state.data.ptr, 0, stream)], label
        np.testing.assert_array_equal(bits(state), bits(host_state))


def test_a_host_state_beside_a_device_x_goes_by_value_and_a_state_elsewhere_is_refused(fp4_dev, rng, monkeypatch):
    """A state in host memory is read there (no device involved) and passed by value: the bytes of the same
    numbers; one on another device is refused by name, before any launch."""
    x = data(rng, (32, 64), np.float32, specials=False)
    state = _rng_state(2 ** 40 + 3, 5, "uint32")
    got = fp8core.quantize_nvfp4(upload(x), rounding="stochastic", rng_state=state, offset=1)
    _same(got, fp8core.quantize_nvfp4(x, rounding="stochastic", seed=2 ** 40 + 3, offset=6), "host state")
    with device._DeviceObj((fp4_dev + 1) % 3):
        elsewhere = upload(state)
    with pytest.raises(ValueError, match=rf"^rng_state: is on cuda:{(fp4_dev + 1) % 3} but x is on cuda:{fp4_dev}; "
                                         r"put it on x's device \(read there\) or in host memory \(read by value\)"):
        fp8core.quantize_nvfp4(upload(x), rounding="stochastic", rng_state=elsewhere)
    with pytest.raises(ValueError, match=rf"^rng_state: is on cuda:{fp4_dev} but x is on cpu"):
        fp8core.quantize_nvfp4(x, rounding="stochastic", rng_state=upload(state))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 32), (33, 64), (32, 96), (64, 32), (0, 32)], ids=str)
def test_mxfp4(fp4_dev, dtype, shape, rng):
    x = _special_blocks(data(rng, shape, dtype))
    for mode in ("rceil", "floor"):
        for columnwise in (False, True) if shape[0] % 32 == 0 else (False,):
            for offset in (0, 1):
                label = f"{mode} columnwise={columnwise} +{offset}"
                got = fp8core.quantize_mxfp4(upload(x, offset), rounding=mode, columnwise=columnwise)
                ref = fp8core.quantize_mxfp4(x, rounding=mode, columnwise=columnwise)
                _same(got, ref, label)
                _dequantized_same(got, ref, fp8core.dequantize_mxfp4, label)
        if shape[0] % 32 == 0:
            for g, r in zip(fp8core.quantize_mxfp4_both(upload(x), rounding=mode),
                            fp8core.quantize_mxfp4_both(x, rounding=mode)):
                _same(g, r, f"{mode} both")


def test_nvfp4_both(fp4_dev, rng):
    x = _special_blocks(data(rng, (32, 64), np.float32))
    for opts in ({}, {"hadamard": True}, {"weight_2d": True, "rounding": "stochastic"}):
        for g, r in zip(fp8core.quantize_nvfp4_both(upload(x), **opts), fp8core.quantize_nvfp4_both(x, **opts)):
            _same(g, r, f"both {opts}")


def test_dequantize_every_code_and_scale(fp4_dev, rng):
    """Every E2M1 code under every E4M3 scale byte (NaN scales included) and every E8M0 byte, with global amaxes
    0, NaN and one giving a subnormal S_dec."""
    codes = np.tile(np.arange(256, dtype=np.uint8), 8).reshape(256, 8)  # every byte (every pair of codes), a block a row
    nv_scale = np.arange(256, dtype=np.uint8).reshape(256, 1).view(formats.E4M3.numpy_dtype)
    for g in (1.0, 0.0, np.nan, 1e-38, 3e38):
        t = fp8core.NVFP4Tensor(codes, nv_scale, np.array([g], np.float32))
        td = fp8core.NVFP4Tensor(upload(codes), upload(nv_scale.view(np.uint8)), upload(np.array([g], np.float32)))
        _dequantized_same(td, t, fp8core.dequantize_nvfp4, f"nvfp4 G={g}")
    mx_codes = np.tile(np.arange(256, dtype=np.uint8), 16).reshape(256, 16)  # one 32-element block a row
    mx_scale = np.arange(256, dtype=np.uint8).reshape(256, 1).view(formats.E8M0.numpy_dtype)
    t = fp8core.MXFP4Tensor(mx_codes, mx_scale)
    td = fp8core.MXFP4Tensor(upload(mx_codes), upload(mx_scale.view(np.uint8)))
    _dequantized_same(td, t, fp8core.dequantize_mxfp4, "mxfp4")


@pytest.mark.parametrize("rows, kgroups, tiles", [(1, 1, False), (130, 7, False), (257, 2, True), (32, 5, True)])
def test_gemm_scale(fp4_dev, rng, rows, kgroups, tiles):
    s = rng.integers(0, 255, (-(-rows // 16) if tiles else rows, kgroups)).astype(np.uint8)
    got = cuda_fp4.gemm_scale(wrap(upload(s)), rows)
    np.testing.assert_array_equal(bits(got), bits(cpu_fp4.gemm_scale(wrap(s), rows)))


# global amaxes at the edges of the global scale rule: 0, +-inf, NaN, a subnormal (S_enc FLT_MAX, S_dec 2^-128),
# the largest amax whose S_enc is finite, 2688 (S_enc 1), FLT_MAX, and ordinary ones
ALPHA_AMAXES = np.array([0.0, np.inf, np.nan, 1e-40, 2688 / 3.4028235e38, 7.9e-36, 2688.0, 1.0, 3.4028235e38, 0.3,
                         448.0, 6.0, 1e-20, 123456.78], np.float32)


def test_nvfp4_gemm_alpha(fp4_dev):
    """The NVFP4 GEMM's alpha (and beta 0) as cuBLASLt reads it from the device: S_dec_a *rn S_dec_b for every pair
    of edge amaxes, the bits of the CPU reference."""
    for ga in ALPHA_AMAXES:
        for gb in ALPHA_AMAXES:
            a, b = np.array([ga], np.float32), np.array([gb], np.float32)
            got = cuda_fp4.gemm_alpha(wrap(upload(a)), wrap(upload(b)))
            ref = cpu_fp4.gemm_alpha(wrap(a), wrap(b))
            np.testing.assert_array_equal(bits(got), bits(ref), err_msg=f"amaxes {ga!r}, {gb!r}")
    assert bits(ref)[1] == 0  # beta


def test_every_quantize_path_packs_its_codes_into_an_aligned_allocation_of_its_own(fp4_dev, rng, monkeypatch):
    """The FP4 quantizers store codes by 8- and 16-byte words only (cuda/fp4_quantize.cu has no byte stores, its
    DATA_ALIGNMENT): every public path that launches them takes no caller memory for the codes (no out=) and gives the
    kernel a data pointer 16-byte aligned, the result's own allocation, whatever x's alignment; an allocator that gave
    a less aligned address is refused by name before any launch."""
    import inspect

    for f in (fp8core.quantize_nvfp4, fp8core.quantize_nvfp4_both, fp8core.quantize_mxfp4, fp8core.quantize_mxfp4_both):
        assert not {"out", "data"} & set(inspect.signature(f).parameters), f.__name__
    x = _special_blocks(data(rng, (32, 64), np.float32))
    kernels = (_kernels.NVFP4_QUANTIZE, _kernels.MXFP4_QUANTIZE)
    launched = []
    launch = _kernels.Kernel.launch

    def recording(self, device_id, targs, work, stream, /, **kw):
        if self in kernels:
            launched.append(kw["data"])
        return launch(self, device_id, targs, work, stream, **kw)

    monkeypatch.setattr(_kernels.Kernel, "launch", recording)
    paths = [lambda u, o=o, cw=cw: [fp8core.quantize_nvfp4(u, columnwise=cw, **o)]
             for o in NVFP4_OPTIONS for cw in (False, True)]
    paths += [lambda u, o=o: list(fp8core.quantize_nvfp4_both(u, **o)) for o in NVFP4_OPTIONS[:-1]]
    paths += [lambda u, m=m, cw=cw: [fp8core.quantize_mxfp4(u, rounding=m, columnwise=cw)]
              for m in ("rceil", "floor") for cw in (False, True)]
    paths += [lambda u, m=m: list(fp8core.quantize_mxfp4_both(u, rounding=m)) for m in ("rceil", "floor")]
    for i, path in enumerate(paths):
        for offset in (0, 1, 3):
            del launched[:]
            results = path(upload(x, offset))
            own = {t.data.data.ptr for t in results}
            assert launched and all(p % 16 == 0 and p in own for p in launched), (i, offset, launched, own)

    real = cuda_fp4.empty

    def shifted(shape, dtype, like):  # an allocator 8 bytes off a 16-byte boundary for the packed codes
        if np.dtype(dtype) != np.uint8 or len(shape) != 2:
            return real(shape, dtype, like)
        flat = real((int(np.prod(shape)) + 24,), dtype, like)
        start = (8 - flat.data.ptr % 16) % 16
        return flat[start:start + int(np.prod(shape))].reshape(shape)

    monkeypatch.setattr(cuda_fp4, "empty", shifted)
    for quantize in (fp8core.quantize_nvfp4, fp8core.quantize_mxfp4):
        before = len(device.state.launches)
        with pytest.raises(RuntimeError, match=r"^data: cupy's allocator gave an address 8 bytes past a 16-byte "
                                               r"boundary; the FP4 quantizers store their codes by"):
            quantize(upload(x))
        assert len(device.state.launches) == before
