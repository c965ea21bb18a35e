"""Block scaling on the GPU against the CPU reference, bit for bit; the block-scaled GEMM on cuBLASLt against
the emulation and torch._scaled_mm. Skipped, with the reason, where there is no GPU."""

import ml_dtypes
import numpy as np
import pytest

import fp8core
from conftest import requires_gpu
from fp8core.blocks import (dequantize_blockwise, dequantize_mxfp8, quantize_blockwise, quantize_mxfp8,
                            quantize_mxfp8_both)
from fp8core.formats import ENCODINGS
from test_blocks import SCHEMES, _amax_cases, block_gemm_tolerance, block_operands, dequantized_operand

pytestmark = requires_gpu
torch = pytest.importorskip("torch")

DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]
SHAPES = [(1, 1), (3, 31), (33, 65), (64, 128), (130, 257), (2, 3, 40), (0, 32), (1000, 1024)]


def to_cuda(x: np.ndarray):
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(x.copy()).cuda()


def host(t) -> np.ndarray:
    """Bits of a torch tensor as unsigned integers of its width."""
    t = t.detach().cpu()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.view(width).numpy().view({1: np.uint8, 2: np.uint16, 4: np.uint32}[t.element_size()])


def cpu_bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def inputs(rng, shape, dtype):
    x = (rng.standard_normal(shape) * 2.0 ** rng.uniform(-20, 20, shape)).astype(np.float32)
    flat = x.reshape(-1)
    if flat.size > 40:
        flat[[3, 17, 29]] = [np.nan, np.inf, -0.0]
        flat[5:9] = [2.0 ** -130, -2.0 ** -140, 1e-38, 3e38]
    return x.astype(dtype)


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("fmt", [f.value for f in ENCODINGS])
def test_e8m0_rounding_cases_bits(fmt, mode):
    amaxes = _amax_cases(fmt)
    x = np.zeros((len(amaxes), 64), np.float32)
    x[:, 5] = amaxes
    x[:, 40] = amaxes
    x[:, 41] = -np.float32(amaxes) / 3
    want = quantize_mxfp8_both(x, fmt, scale_mode=mode)
    got = quantize_mxfp8_both(to_cuda(x), fmt, scale_mode=mode)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(host(g.data), cpu_bits(w.data))
        np.testing.assert_array_equal(host(g.scale), cpu_bits(w.scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_mxfp8_bits_match_the_cpu(rng, dtype, shape, mode):
    x = inputs(rng, shape, dtype)
    xg = to_cuda(x)
    for columnwise in (False, True):
        want = quantize_mxfp8(x, "e4m3", scale_mode=mode, columnwise=columnwise)
        got = quantize_mxfp8(xg, "e4m3", scale_mode=mode, columnwise=columnwise)
        assert got.data.is_cuda and got.scale.dtype == torch.float8_e8m0fnu
        np.testing.assert_array_equal(host(got.data), cpu_bits(want.data))
        np.testing.assert_array_equal(host(got.scale), cpu_bits(want.scale))
        for out in ("float32", "bfloat16", "float16"):
            np.testing.assert_array_equal(host(dequantize_mxfp8(got, out)), cpu_bits(dequantize_mxfp8(want, out)))
    both = quantize_mxfp8_both(xg, "e5m2", scale_mode=mode)
    for g, w in zip(both, quantize_mxfp8_both(x, "e5m2", scale_mode=mode)):
        np.testing.assert_array_equal(host(g.data), cpu_bits(w.data))
        np.testing.assert_array_equal(host(g.scale), cpu_bits(w.scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", ["1x128", "128x128"])
@pytest.mark.parametrize("power_of_2", [True, False])
def test_blockwise_bits_match_the_cpu(rng, dtype, shape, block, power_of_2):
    x = inputs(rng, shape, dtype)
    for fmt in (f.value for f in ENCODINGS):
        want = quantize_blockwise(x, fmt, block=block, power_of_2=power_of_2, epsilon=1e-30)
        got = quantize_blockwise(to_cuda(x), fmt, block=block, power_of_2=power_of_2, epsilon=1e-30)
        np.testing.assert_array_equal(host(got.data), cpu_bits(want.data))
        np.testing.assert_array_equal(host(got.scale_inv), cpu_bits(want.scale_inv))
        for out in ("float32", "bfloat16", "float16"):
            np.testing.assert_array_equal(host(dequantize_blockwise(got, out)),
                                          cpu_bits(dequantize_blockwise(want, out)))


@pytest.mark.parametrize("shape", [(64, 96), (37, 70), (300, 257)])
def test_transpose_blocks_bits_match_the_cpu(rng, shape):
    from fp8core.blocks import transpose_blocks

    x = inputs(rng, shape, np.float32)
    for columnwise in (False, True):
        want = transpose_blocks(quantize_mxfp8(x, columnwise=columnwise))
        got = transpose_blocks(quantize_mxfp8(to_cuda(x), columnwise=columnwise))
        np.testing.assert_array_equal(host(got.data), cpu_bits(want.data))
        np.testing.assert_array_equal(host(got.scale), cpu_bits(want.scale))
    want = transpose_blocks(quantize_blockwise(x, block="128x128"))
    got = transpose_blocks(quantize_blockwise(to_cuda(x), block="128x128"))
    np.testing.assert_array_equal(host(got.data), cpu_bits(want.data))
    np.testing.assert_array_equal(host(got.scale_inv), cpu_bits(want.scale_inv))


def test_misaligned_views_take_the_scalar_path(rng):
    x = inputs(rng, (64, 257), np.float32)
    xg = to_cuda(x)[:, 1:]  # rows start 4 bytes past 16: not contiguous -> refused; a flat offset view is
    with pytest.raises(ValueError, match="x: expected a contiguous"):
        quantize_mxfp8(xg)
    flat = to_cuda(x.reshape(-1))[1:1 + 64 * 256].view(64, 256)
    want = quantize_mxfp8(x.reshape(-1)[1:1 + 64 * 256].reshape(64, 256))
    got = quantize_mxfp8(flat)
    np.testing.assert_array_equal(host(got.data), cpu_bits(want.data))


def test_cupy_arrays_get_uint8_storage(rng):
    cupy = pytest.importorskip("cupy")
    x = inputs(rng, (40, 96), np.float32)
    got = quantize_mxfp8(cupy.asarray(x))
    assert got.data.dtype == np.uint8 and got.scale.dtype == np.uint8
    np.testing.assert_array_equal(cupy.asnumpy(got.scale), cpu_bits(quantize_mxfp8(x).scale))
    y = dequantize_mxfp8(got, fmt="e4m3")
    np.testing.assert_array_equal(cupy.asnumpy(y).view(np.uint32), cpu_bits(dequantize_mxfp8(quantize_mxfp8(x))))


# ---- scale layouts for cuBLASLt ---------------------------------------------------------------------------

def swizzled_offset(r: int, c: int, kgroups: int) -> int:
    """cuBLAS's "1D block scaling factors layout": 128 x 4 tiles of 512 bytes, row-major over tiles."""
    tiles_c = -(-kgroups // 4)
    return ((r // 128) * tiles_c + c // 4) * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4


@pytest.mark.parametrize("rows,kgroups", [(1, 1), (128, 4), (130, 6), (256, 32)])
def test_mx_scale_swizzle_matches_cublas_layout(rng, rows, kgroups):
    from fp8core.backends import cpu_blocks, cuda_blocks
    from fp8core._tensor import wrap

    s = rng.integers(0, 255, (rows, kgroups), dtype=np.uint8)
    t = wrap(torch.from_numpy(s).cuda())
    got = cuda_blocks.gemm_scale(t, "1x32").get()
    want = np.zeros(cuda_blocks.mx_swizzled_size(rows, kgroups), np.uint8)
    for r in range(rows):
        for c in range(kgroups):
            want[swizzled_offset(r, c, kgroups)] = s[r, c]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, cpu_blocks.gemm_scale(wrap(s), "1x32"))


@pytest.mark.parametrize("kind,shape", [("1x128", (130, 9)), ("128x128", (3, 9)), ("128x128", (2, 4))])
def test_fp32_gemm_scale_layouts_match_the_cpu(rng, kind, shape):
    from fp8core.backends import cpu_blocks, cuda_blocks
    from fp8core._tensor import wrap

    s = rng.standard_normal(shape).astype(np.float32)
    got = cuda_blocks.gemm_scale(wrap(torch.from_numpy(s).cuda()), kind).get()
    np.testing.assert_array_equal(got.view(np.uint32), cpu_blocks.gemm_scale(wrap(s), kind).view(np.uint32))


# ---- the block-scaled GEMM --------------------------------------------------------------------------------

def _cc() -> int:
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def _cuda_pair(t):
    """A CPU MXTensor / BlockScaledTensor as torch CUDA tensors (fp8 and E8M0 travel as bytes)."""
    def move(a):
        a = np.asarray(a)
        if a.dtype.itemsize == 1 and a.dtype != np.uint8:
            return torch.from_numpy(a.view(np.uint8).copy()).cuda().view(getattr(torch, a.dtype.name))
        return to_cuda(a)

    return type(t)(*(move(v) for v in t))


def _supported(scheme: str) -> bool:
    return _cc() >= 100 if scheme == "mx" else _cc() == 90  # cuBLASLt: 1x128/128x128 on Hopper only


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("k", [128, 1024, 4096])
def test_block_gemm_against_the_emulation(rng, scheme, k):
    a, b = block_operands(rng, 256, 512, k, scheme)
    if not _supported(scheme):
        with pytest.raises(ValueError, match="needs a GPU of compute capability"):
            fp8core.gemm(_cuda_pair(a), _cuda_pair(b), out_dtype="bfloat16")
        return
    d = fp8core.gemm(_cuda_pair(a), _cuda_pair(b), out_dtype="bfloat16")
    emulated = np.asarray(fp8core.gemm(a, b, out_dtype="float32"), np.float64)
    ref = dequantized_operand(a) @ dequantized_operand(b).T
    atol, rtol = block_gemm_tolerance(a, b, "bfloat16", tensor_core=True)
    got = d.float().cpu().numpy().astype(np.float64)
    assert (np.abs(got - ref) <= atol + rtol * np.abs(ref)).all()
    assert (np.abs(got - emulated) <= 2 * (atol + rtol * np.abs(ref))).all()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_block_gemm_with_partial_row_tiles(rng, scheme):
    """M = 136, N = 144, two K blocks: 128x128 scales with a partial second row tile, 1x128 scales [KB, M] with M
    not a multiple of 16 -- where a layout cuBLASLt reads differently would show. (M = 130 was refused by cuBLASLt
    on an H200: fp8core asks multiples of 8, test_blocks.py's refusal test.)"""
    if not _supported(scheme):
        pytest.skip(f"{scheme}: needs a newer GPU")
    a, b = block_operands(rng, 136, 144, 256, scheme)
    d = fp8core.gemm(_cuda_pair(a), _cuda_pair(b), out_dtype="float32")
    ref = dequantized_operand(a) @ dequantized_operand(b).T
    atol, rtol = block_gemm_tolerance(a, b, "float32", tensor_core=True)
    got = d.cpu().numpy().astype(np.float64)
    assert (np.abs(got - ref) <= atol + rtol * np.abs(ref)).all()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_block_gemm_against_torch_scaled_mm_with_the_same_scales(rng, scheme):
    if not _supported(scheme):
        pytest.skip(f"{scheme} GEMM needs compute capability {'10.0' if scheme == 'mx' else '9.0'}")
    m, n, k = 256, 384, 1024
    a, b = block_operands(rng, m, n, k, scheme)
    ga, gb = _cuda_pair(a), _cuda_pair(b)
    d = fp8core.gemm(ga, gb, out_dtype="bfloat16")
    if scheme == "mx":
        from fp8core.backends import cuda_blocks
        from fp8core._tensor import wrap

        def swz(s):
            return torch.from_dlpack(cuda_blocks.gemm_scale(wrap(s), "1x32")).view(torch.float8_e8m0fnu)

        ref = torch._scaled_mm(ga.data, gb.data.t(), scale_a=swz(ga.scale), scale_b=swz(gb.scale),
                               out_dtype=torch.bfloat16)
    else:
        a_block, b_block = scheme.split(",")
        sa = ga.scale_inv if a_block == "128x128" else ga.scale_inv.t().contiguous().t()
        sb = gb.scale_inv.t() if b_block == "128x128" else gb.scale_inv.t().contiguous()
        ref = torch._scaled_mm(ga.data, gb.data.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    atol, rtol = block_gemm_tolerance(a, b, "bfloat16", tensor_core=True)
    diff = np.abs(d.float().cpu().numpy().astype(np.float64) - ref.float().cpu().numpy().astype(np.float64))
    assert (diff <= 2 * atol + 2 * rtol * np.abs(ref.float().cpu().numpy())).all()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_block_gemm_with_bias(rng, scheme):
    """The BIAS epilogue with block scale modes (Transformer Engine allows BIAS with 1x128/128x128 blocks;
    torch fixed MXFP8 + bias in PR #152665): D = a b^T + bias[N] against the float64 reference."""
    if not _supported(scheme):
        pytest.skip(f"{scheme}: needs a newer GPU")
    a, b = block_operands(rng, 128, 256, 512, scheme)
    bias = (rng.standard_normal(256) * 8).astype(ml_dtypes.bfloat16)
    d = fp8core.gemm(_cuda_pair(a), _cuda_pair(b), out_dtype="float32", bias=to_cuda(bias))
    ref = dequantized_operand(a) @ dequantized_operand(b).T + bias.astype(np.float64)[None, :]
    atol, rtol = block_gemm_tolerance(a, b, "float32", tensor_core=True)
    got = d.cpu().numpy().astype(np.float64)
    assert (np.abs(got - ref) <= atol + rtol * np.abs(ref)).all()


@pytest.mark.parametrize("scheme", ["1x128,1x128", "128x128,1x128"])
def test_block_gemm_refuses_fast_accumulation_like_the_cpu(rng, scheme):
    a, b = block_operands(rng, 64, 128, 256, scheme)
    with pytest.raises(ValueError, match="use_fast_accum: a 1x128/128x128 block GEMM"):
        fp8core.gemm(_cuda_pair(a), _cuda_pair(b), out_dtype="bfloat16", use_fast_accum=True)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("m", [8, 24, 136])
def test_block_gemm_small_m(rng, scheme, m):
    """M is cuBLASLt's n (our a is its B). On an H200 cuBLASLt found no algorithm for M = 1 and 130, so fp8core
    refuses M % 8 != 0 on both backends (test_blocks.py); every multiple of 8 must run and be right."""
    if not _supported(scheme):
        pytest.skip(f"{scheme}: needs a newer GPU")
    a, b = block_operands(rng, m, 144, 384, scheme)
    d = fp8core.gemm(_cuda_pair(a), _cuda_pair(b), out_dtype="float32")
    ref = dequantized_operand(a) @ dequantized_operand(b).T
    atol, rtol = block_gemm_tolerance(a, b, "float32", tensor_core=True)
    got = d.cpu().numpy().astype(np.float64)
    assert (np.abs(got - ref) <= atol + rtol * np.abs(ref)).all()


# ---- rowwise (axiswise) scaling --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("axis", [-1, 0])
def test_rowwise_bits_match_the_cpu(rng, dtype, shape, axis):
    x = inputs(rng, shape, dtype)
    for fmt in (f.value for f in ENCODINGS):
        for power_of_2 in (True, False):
            want = fp8core.quantize_rowwise(x, fmt, axis=axis, power_of_2=power_of_2, epsilon=1e-30)
            got = fp8core.quantize_rowwise(to_cuda(x), fmt, axis=axis, power_of_2=power_of_2, epsilon=1e-30)
            np.testing.assert_array_equal(host(got.data), cpu_bits(want.data))
            np.testing.assert_array_equal(host(got.scale_inv), cpu_bits(want.scale_inv))
            np.testing.assert_array_equal(host(fp8core.dequantize_rowwise(got, "bfloat16")),
                                          cpu_bits(fp8core.dequantize_rowwise(want, "bfloat16")))


@pytest.mark.parametrize("k", [64, 1024, 4096])
def test_rowwise_gemm_on_cublaslt_against_float64_and_torch_scaled_mm(rng, k):
    """cuBLASLt's outer-vector scale mode (sm_90, cuBLAS 12.9+; refused by name elsewhere) against float64 and
    against torch._scaled_mm's rowwise GEMM fed the same codes and scales."""
    m, n = 200, 384
    x = (rng.standard_normal((m, k)) * 2.0 ** rng.uniform(-6, 6, (m, 1))).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 2.0 ** rng.uniform(-6, 6, (n, 1))).astype(np.float32)
    a, b = fp8core.quantize_rowwise(x), fp8core.quantize_rowwise(w)
    ga, gb = fp8core.quantize_rowwise(to_cuda(x)), fp8core.quantize_rowwise(to_cuda(w))
    if _cc() != 90:
        with pytest.raises(ValueError, match="rowwise-scaled GEMM .* compute capability 9.0"):
            fp8core.gemm(ga, gb, out_dtype="bfloat16")
        return
    d = fp8core.gemm(ga, gb, out_dtype="bfloat16").float().cpu().numpy().astype(np.float64)
    ref = dequantized_operand(a) @ dequantized_operand(b).T
    atol, rtol = block_gemm_tolerance(a, b, "bfloat16", tensor_core=True)
    assert (np.abs(d - ref) <= atol + rtol * np.abs(ref)).all()
    mm = torch._scaled_mm(ga.data, gb.data.t(), scale_a=ga.scale_inv, scale_b=gb.scale_inv.t(),
                          out_dtype=torch.bfloat16).float().cpu().numpy()
    assert (np.abs(d - mm) <= 2 * atol + 2 * rtol * np.abs(ref)).all()
