"""Layout (one value for every block-scaling spelling) and ScaledTensor (data, scale, encoding, layout): parsing with
named errors, round trips (pickle, unpacking, the MXTensor / BlockScaledTensor / NVFP4Tensor / MXFP4Tensor
spellings), and the GEMM, the dequantizers and transpose_blocks going by the layout, on the CPU reference."""

import copy
import pickle
import re

import ml_dtypes
import numpy as np
import pytest

import fp8core
from fp8core import BlockScaledTensor, Layout, MXFP4Tensor, MXTensor, NVFP4Tensor, ScaledTensor, args
from fp8core.blocks import (dequantize_blocks, dequantize_blockwise, dequantize_mxfp8, quantize_blockwise,
                            quantize_mxfp8, quantize_mxfp8_both, transpose_blocks)
from fp8core.formats import E2M1, E4M3, E8M0
from fp8core.fp4 import (dequantize_mxfp4, dequantize_nvfp4, quantize_mxfp4, quantize_mxfp4_both, quantize_nvfp4,
                         quantize_nvfp4_both)


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.fixture
def x(rng):
    v = (rng.standard_normal((64, 256)) * 2.0 ** rng.uniform(-8, 8, (64, 1))).astype(np.float32)
    v[3, 7], v[5, 9], v[6, 1] = np.nan, np.inf, -0.0
    return v


# ---- parsing ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spelling,want", [
    ("1x128", Layout.BLOCK_1X128), ((1, 128), Layout.BLOCK_1X128), ([1, 128], Layout.BLOCK_1X128),
    (Layout.BLOCK_1X128, Layout.BLOCK_1X128), ("128x128", Layout.BLOCK_128X128),
    ((128, 128), Layout.BLOCK_128X128), (Layout.BLOCK_128X128, Layout.BLOCK_128X128),
])
def test_every_block_spelling_is_one_layout(spelling, want):
    assert args.block(spelling) is want
    assert quantize_blockwise(np.ones((2, 256), np.float32), block=spelling).layout is want


@pytest.mark.parametrize("spelling", ["1x64", "1X128", "128 x 128", (1, 64), (128,), 128, 1, None, b"1x128",
                                      "1x32", Layout.MX_ROWWISE, np.array([1, 128]), {"1x128"}])
def test_bad_block_spellings_name_the_argument(spelling):
    with pytest.raises(ValueError, match=r"^block: expected '1x128' or '128x128', got "):
        args.block(spelling)
    with pytest.raises(ValueError, match=r"^block: expected '1x128' or '128x128'"):
        quantize_blockwise(np.ones((2, 256), np.float32), block=spelling)


def test_layout_names_blocks_and_lookups():
    for layout in Layout:
        assert Layout(layout.value) is layout and Layout.parse(layout.value) is layout == layout.value
        assert pickle.loads(pickle.dumps(layout)) is layout and f"{layout}" == layout.value
        if layout.block is not None:
            assert Layout.parse(layout.block) is layout
    with pytest.raises(ValueError, match=r"^layout: expected 'tensor' or '1x32' or '32x1' .* got '2x2'"):
        Layout.parse("2x2")
    with pytest.raises(ValueError, match=r"^layout: expected .* got 'bogus'"):
        ScaledTensor(np.zeros(4), np.ones(1), "bogus")


def test_recipes_block_dims_are_layouts():
    assert fp8core.Float8BlockScaling().layouts == (Layout.BLOCK_1X128, Layout.BLOCK_128X128, Layout.BLOCK_1X128)
    r = fp8core.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1, grad_block_scaling_dim=2)
    assert r.layouts == (Layout.BLOCK_128X128, Layout.BLOCK_1X128, Layout.BLOCK_128X128)


def test_layout_fields():
    L = Layout
    assert [a.value for a in L] == ["tensor", "1x32", "32x1", "1x128", "128x128", "1x16", "16x16", "rowwise",
                                    "columnwise"]
    assert (L.MX_ROWWISE.block, L.MX_COLUMNWISE.block, L.BLOCK_1X128.block, L.BLOCK_128X128.block) == \
        ((1, 32), (32, 1), (1, 128), (128, 128))
    assert L.TENSORWISE.block is None and L.TENSORWISE.scale_shape(5, 7) == (1,)
    assert L.MX_ROWWISE.scale is E8M0 and L.MX_COLUMNWISE.scale is E8M0 and not L.MX_ROWWISE.inverse
    assert L.BLOCK_1X128.scale is None and L.BLOCK_128X128.inverse and L.TENSORWISE.inverse
    assert L.NVFP4_1X16.scale is E4M3 and L.NVFP4_1X16.global_amax and L.NVFP4_16X16.block == (16, 16)
    assert not any(a.global_amax for a in (L.TENSORWISE, L.MX_ROWWISE, L.BLOCK_1X128, L.BLOCK_128X128))
    assert L.MX_ROWWISE.family == (L.MX_ROWWISE, L.MX_COLUMNWISE)
    assert L.BLOCK_128X128.family == (L.BLOCK_1X128, L.BLOCK_128X128)
    # scale shapes at the edges: empty, one row, partial blocks
    assert L.MX_ROWWISE.scale_shape(0, 33) == (0, 2) and L.MX_COLUMNWISE.scale_shape(33, 0) == (2, 0)
    assert L.BLOCK_1X128.scale_shape(3, 129) == (3, 2) and L.BLOCK_128X128.scale_shape(129, 1) == (2, 1)
    assert (L.MX_ROWWISE.transposed, L.MX_COLUMNWISE.transposed, L.BLOCK_128X128.transposed) == \
        (L.MX_COLUMNWISE, L.MX_ROWWISE, L.BLOCK_128X128)
    assert L.BLOCK_1X128.transposed is None and L.NVFP4_1X16.transposed is None
    # one scale per row / column: the block spans the data along the other axis, whatever its length
    assert (L.ROWWISE.block, L.COLUMNWISE.block) == ((1, None), (None, 1)) and L.ROWWISE.inverse
    assert L.ROWWISE.scale_shape(5, 7) == (5, 1) and L.COLUMNWISE.scale_shape(5, 7) == (1, 7)
    assert L.ROWWISE.scale_shape(0, 7) == (0, 1) and L.ROWWISE.scale_shape(3, 0) == (3, 1)
    assert L.ROWWISE.block_for(5, 7) == (1, 7) and L.COLUMNWISE.block_for(0, 7) == (1, 1)
    assert (L.ROWWISE.transposed, L.COLUMNWISE.transposed) == (L.COLUMNWISE, L.ROWWISE)
    assert L.ROWWISE.family == (L.ROWWISE, L.COLUMNWISE) and L.parse("rowwise") is L.ROWWISE


# ---- ScaledTensor round trips -----------------------------------------------------------------------------

def _same(a, b) -> None:
    assert type(a) is type(b) and a.layout is b.layout
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and np.array_equal(bits(u), bits(v))


def test_quantizers_name_their_layouts(x):
    assert quantize_mxfp8(x).layout is Layout.MX_ROWWISE
    assert quantize_mxfp8(x, columnwise=True).layout is Layout.MX_COLUMNWISE
    row, col = quantize_mxfp8_both(x)
    assert (row.layout, col.layout) == (Layout.MX_ROWWISE, Layout.MX_COLUMNWISE)
    assert quantize_blockwise(x).layout is Layout.BLOCK_1X128
    assert quantize_blockwise(x, block="128x128").layout is Layout.BLOCK_128X128
    for t in (row, quantize_blockwise(x, "e5m2")):
        assert t.encoding is fp8core.as_format(t.data.dtype).encoding and isinstance(t, ScaledTensor)


def test_pickle_keeps_type_layout_and_bits(x):
    q = quantize_mxfp8(x, "e5m2", columnwise=True)
    for t in (q, quantize_blockwise(x, block="128x128"), ScaledTensor(q.data, q.scale, "32x1"),
              MXTensor(q.data, q.scale), BlockScaledTensor(*quantize_blockwise(x))):
        for back in [pickle.loads(pickle.dumps(t, p)) for p in (0, 2, pickle.HIGHEST_PROTOCOL)] + [copy.deepcopy(t)]:
            _same(back, t)
            assert back._layout is t._layout and back.encoding is t.encoding


def test_unpacks_as_the_pair_it_always_was(x):
    q = quantize_mxfp8(x)
    data, scale = q
    assert data is q.data is q[0] and scale is q.scale is q[1] and len(q) == 2 and isinstance(q, tuple)
    b = quantize_blockwise(x)
    assert b.scale_inv is b[1] is b.scale and BlockScaledTensor._fields == ("data", "scale_inv")
    # rebuilt from the pair alone: the layout comes back from the scale's shape and dtype
    _same(MXTensor(*q), q)
    _same(MXTensor(*quantize_mxfp8(x, columnwise=True)), quantize_mxfp8(x, columnwise=True))
    _same(BlockScaledTensor(*quantize_blockwise(x, block="128x128")), quantize_blockwise(x, block="128x128"))
    assert ScaledTensor(*q).layout is Layout.MX_ROWWISE and ScaledTensor(*b).layout is Layout.BLOCK_1X128
    assert ScaledTensor(b.data, np.float32([0.5])).layout is Layout.TENSORWISE
    assert "MXTensor(data=" in repr(q) and "layout=<Layout.MX_ROWWISE" in repr(q)


def test_a_scale_no_layout_fits_is_a_named_error():
    t = MXTensor(np.zeros((4, 64), ml_dtypes.float8_e4m3fn), np.zeros((3, 3), ml_dtypes.float8_e8m0fnu))
    with pytest.raises(ValueError, match=r"^t\.scale: expected shape \(4, 2\) \(rowwise\) or \(1, 64\) "
                                         r"\(columnwise\) for data viewed as \(4, 64\), got \(3, 3\)"):
        t.layout


# ---- dispatch by layout ------------------------------------------------------------------------------------

def test_dequantize_goes_by_the_layout(x):
    for q in (quantize_mxfp8(x), quantize_mxfp8(x, columnwise=True), quantize_blockwise(x),
              quantize_blockwise(x, block="128x128")):
        want = dequantize_mxfp8(q) if q.kind == "mx" else dequantize_blockwise(q)
        for t in (q, ScaledTensor(q.data, q.scale, q.layout), ScaledTensor(*q)):
            assert np.array_equal(bits(dequantize_blocks(t, "bfloat16")), bits(dequantize_blocks(q, "bfloat16")))
            assert np.array_equal(bits(dequantize_blocks(t)), bits(want))


def test_a_named_layout_is_checked_against_the_scale(x):
    q = quantize_mxfp8(x, columnwise=True)
    with pytest.raises(ValueError, match=r"^t\.scale: expected shape \(64, 8\) \(rowwise\) for data viewed as "
                                         r"\(64, 256\), got \(2, 256\)"):
        dequantize_blocks(ScaledTensor(q.data, q.scale, Layout.MX_ROWWISE))
    with pytest.raises(ValueError, match=r"^t: expected a 1x32 or 32x1 layout, got 1x128"):
        dequantize_mxfp8(ScaledTensor(q.data, q.scale, Layout.BLOCK_1X128))
    with pytest.raises(ValueError, match=r"^t: expected a 1x32 or 32x1 or 1x128 or 128x128 or rowwise or "
                                         r"columnwise layout, got 1x16"):
        dequantize_blocks(ScaledTensor(q.data, q.scale.view(np.uint8).view(ml_dtypes.float8_e4m3fn), "1x16"))
    with pytest.raises(ValueError, match=r"^t: expected a 1x32 or 32x1 or 1x128 or 128x128 or rowwise or "
                                         r"columnwise layout, got tensor"):
        dequantize_blocks(ScaledTensor(q.data, np.float32([1.0])))
    with pytest.raises(TypeError, match=r"^t: expected a ScaledTensor \(data, scale\), got tuple"):
        transpose_blocks(tuple(q))


def test_the_encoding_a_tensor_names_reads_its_uint8_storage(x):
    q = quantize_mxfp8(x, "e5m2")
    u8 = ScaledTensor(q.data.view(np.uint8), q.scale, q.layout, q.encoding)
    assert np.array_equal(bits(dequantize_blocks(u8)), bits(dequantize_mxfp8(q)))
    with pytest.raises(TypeError, match="t.data: uint8 data is fp8 storage only with fmt="):
        dequantize_blocks(ScaledTensor(q.data.view(np.uint8), q.scale, q.layout))
    # an E2M1 tensor is FP4's (dequantize_mxfp4's, by the layout), whose data is packed uint8
    with pytest.raises(TypeError, match=r"^t\.data: expected uint8 \(E2M1 codes, two a byte\), got float8_e5m2"):
        dequantize_blocks(ScaledTensor(q.data, q.scale, q.layout, E2M1))


def test_transpose_blocks_names_the_transposed_layout(x):
    for q in (quantize_mxfp8(x), quantize_mxfp8(x, columnwise=True), quantize_blockwise(x, block="128x128")):
        t = transpose_blocks(q)
        assert type(t) is type(q) and t._layout is q.layout.transposed
        _same(t, type(q)(*t))  # the named layout is the one the shapes mean
    single = quantize_blockwise(x[:1])  # one row of 1x128 blocks: a 128x128 tile's scales, transposed
    assert transpose_blocks(single).layout is Layout.BLOCK_128X128
    with pytest.raises(ValueError, match="t: 1x128 blocks lie along rows and have no transpose"):
        transpose_blocks(quantize_blockwise(x))


def test_gemm_goes_by_the_layout(x, rng):
    w = rng.standard_normal((32, 256)).astype(np.float32)
    for qa, qw in [(quantize_mxfp8(x), quantize_mxfp8(w)),
                   (quantize_blockwise(x), quantize_blockwise(w, block="128x128")),
                   (quantize_blockwise(x, block="128x128"), quantize_blockwise(w))]:
        want = fp8core.gemm(qa, qw, out_dtype="float32")
        for a, b in [(ScaledTensor(*qa), ScaledTensor(*qw)), (type(qa)(*qa), type(qw)(*qw)),
                     (ScaledTensor(*qa, qa.layout), ScaledTensor(*qw, qw.layout))]:
            got = fp8core.gemm(a, b, out_dtype="float32")
            assert np.array_equal(bits(got), bits(want))
    # the GEMM takes rowwise MX only: a columnwise operand, named or read from its shape, is refused by name
    col = quantize_mxfp8(w, columnwise=True)
    for b in (col, MXTensor(*col)):
        with pytest.raises(ValueError, match=r"^b\.scale: the GEMM takes rowwise MXFP8 \(blocks along K\)"):
            fp8core.gemm(quantize_mxfp8(x), b)


def test_a_tensorwise_scaled_tensor_is_the_per_tensor_gemm(x, rng):
    w = rng.standard_normal((32, 256)).astype(np.float32)
    qa, sa, _ = fp8core.quantize_dynamic(x, "e4m3")
    qw, sw, _ = fp8core.quantize_dynamic(w, "e4m3")
    want = fp8core.gemm(qa, qw, sa, sw, out_dtype="float32")
    for a, b in [(ScaledTensor(qa, sa, "tensor"), ScaledTensor(qw, sw, "tensor")),
                 (ScaledTensor(qa, sa), ScaledTensor(qw, sw))]:
        assert a.layout is Layout.TENSORWISE
        assert np.array_equal(bits(fp8core.gemm(a, b, out_dtype="float32")), bits(want))
    with pytest.raises(ValueError, match=r"^b: a is ScaledTensor but b is MXTensor \(tensor E4M3 and 1x32 E4M3\); "
                                         r"a scaled GEMM takes two operands of one scheme"):
        fp8core.gemm(ScaledTensor(qa, sa), quantize_mxfp8(w))
    with pytest.raises(ValueError, match="^a_scale_inv: block-scaled operands carry their own scales"):
        fp8core.gemm(ScaledTensor(qa, sa), ScaledTensor(qw, sw), 1.0)


def test_jax_carries_a_scaled_tensor_through_jit(x):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import fp8core.jax as fj

    q = fj.blocks.quantize_mxfp8(jnp.asarray(x), columnwise=True)
    back = jax.jit(lambda t: t)(q)
    assert type(back) is MXTensor and back.layout is Layout.MX_COLUMNWISE
    assert np.array_equal(bits(back.scale), bits(quantize_mxfp8(x, columnwise=True).scale))
    a = fj.blocks.quantize_blockwise(jnp.asarray(x))
    b = fj.blocks.quantize_blockwise(jnp.asarray(x[:32]), block="128x128")
    named = (ScaledTensor(a.data, a.scale, "1x128"), ScaledTensor(b.data, b.scale, "128x128"))
    got = jax.jit(lambda a, b: fj.blocks.block_gemm(a, b, jnp.float32))(*named)
    want = fp8core.gemm(quantize_blockwise(x), quantize_blockwise(x[:32], block="128x128"), out_dtype="float32")
    ok = ~np.isnan(want)
    assert np.array_equal(np.asarray(got)[ok], want[ok])
    assert np.array_equal(bits(fj.blocks.dequantize_blockwise(named[1])),
                          bits(dequantize_blockwise(quantize_blockwise(x[:32], block="128x128"))))


def test_torch_ops_take_the_layout_by_name(x):
    torch = pytest.importorskip("torch")
    from fp8core.torch import block_ops as bo

    tx = torch.from_numpy(x)
    a, b = bo.quantize_blockwise(tx), bo.quantize_blockwise(tx[:32].contiguous(), block=Layout.BLOCK_128X128)
    assert (a.layout, b.layout) == (Layout.BLOCK_1X128, Layout.BLOCK_128X128)
    got = bo.block_gemm(ScaledTensor(*a, "1x128"), ScaledTensor(*b), torch.float32)
    want = fp8core.gemm(quantize_blockwise(x), quantize_blockwise(x[:32], block="128x128"), out_dtype="float32")
    ok = ~np.isnan(want)
    assert np.array_equal(got.numpy()[ok], want[ok])
    col = bo.quantize_mxfp8(tx, columnwise=True)
    t = bo.transpose_blocks(col)
    assert t.layout is Layout.MX_ROWWISE and t._layout is Layout.MX_ROWWISE
    assert np.array_equal(t.scale.view(torch.uint8).numpy(), bits(quantize_mxfp8(x.T.copy()).scale))
    with pytest.raises(ValueError, match=r"^t\.scale: expected shape \(64, 8\) \(rowwise\)"):
        torch.ops.fp8core.transpose_blocks(col.data, col.scale, "1x32")
    with pytest.raises(ValueError, match=r"^layout: expected 'tensor' or '1x32' .* got '1x64'"):
        torch.ops.fp8core.block_gemm(a.data, a.scale, b.data, b.scale, "1x64", "128x128", torch.float32)
    with pytest.raises(ValueError, match=r"^block: expected '1x128' or '128x128', got '1x32'"):
        torch.ops.fp8core.quantize_blockwise(tx, "e4m3", "1x32", True, 0.0)


# ---- FP4: NVFP4 and MXFP4 are scaled tensors of E2M1 data ---------------------------------------------------

def _same_fp4(a, b) -> None:
    """Same type, layout, encoding and bits in every field (the global amax too)."""
    assert type(a) is type(b) and a.layout is b.layout and a.encoding is b.encoding and len(a) == len(b)
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.shape == v.shape and np.array_equal(bits(u), bits(v))


def test_fp4_results_are_scaled_tensors_with_their_layouts(x):
    nv = [quantize_nvfp4(x), quantize_nvfp4(x, columnwise=True, hadamard=True), *quantize_nvfp4_both(x)]
    tiles = [quantize_nvfp4(x, weight_2d=True), *quantize_nvfp4_both(x, weight_2d=True)]
    mx = [quantize_mxfp4(x), quantize_mxfp4(x, columnwise=True, rounding="floor"), *quantize_mxfp4_both(x)]
    for ts, cls, layout in ((nv, NVFP4Tensor, Layout.NVFP4_1X16), (tiles, NVFP4Tensor, Layout.NVFP4_16X16),
                            (mx, MXFP4Tensor, Layout.MX_ROWWISE)):
        for t in ts:
            assert isinstance(t, ScaledTensor) and type(t) is cls and t._layout is layout and t.layout is layout
            assert t.encoding is E2M1 and t.kind == layout.kind and t.data.dtype == np.uint8
            assert t.scale.dtype == layout.scale.numpy_dtype
    # a columnwise operand is x^T stored with its blocks along rows: 1x16 / 1x32 of the stored data
    assert nv[1].data.shape == (256, 32) and nv[1].scale.shape == (256, 4) and mx[1].scale.shape == (256, 2)
    finite = np.nan_to_num(x, nan=0.0, posinf=0.0)
    t = quantize_nvfp4(finite)
    assert t.global_amax.dtype == np.float32 and t.global_amax.shape == (1,)
    assert t.global_amax[0] == np.abs(finite).max() and t[2] is t.global_amax


def test_fp4_tensors_unpack_construct_and_replace_as_their_namedtuples_did(x):
    t = quantize_nvfp4(x, weight_2d=True)
    data, scale, amax = t
    assert (data, scale, amax) == (t.data, t.scale, t.global_amax) and t[2] is amax and len(t) == 3
    assert NVFP4Tensor._fields == ("data", "scale", "global_amax") and MXFP4Tensor._fields == ("data", "scale")
    _same_fp4(NVFP4Tensor(data, scale, amax), t)  # from its parts alone: 16x16 read back from the scale's shape
    _same_fp4(NVFP4Tensor(*quantize_nvfp4(x)), quantize_nvfp4(x))
    m = quantize_mxfp4(x)
    _same_fp4(MXFP4Tensor(*m), m)
    r = t._replace(global_amax=np.float32([2.0]))
    assert type(r) is NVFP4Tensor and r._layout is t._layout and r.encoding is E2M1 and r.data is data
    assert r.global_amax[0] == 2.0 and t.global_amax is amax
    with pytest.raises(ValueError, match=r"^_replace: NVFP4Tensor has fields data, scale, global_amax; got scale_inv"):
        t._replace(scale_inv=scale)
    assert repr(t).startswith("NVFP4Tensor(data=") and "global_amax=array([" in repr(t)
    assert "layout=<Layout.NVFP4_16X16" in repr(t)


@pytest.mark.parametrize("make", [lambda x: quantize_nvfp4(x), lambda x: quantize_nvfp4(x, weight_2d=True),
                                  lambda x: quantize_mxfp4(x),
                                  lambda x: NVFP4Tensor(*quantize_nvfp4(x[:1, :64]))],  # one row: 1x16 = 16x16
                         ids=["nvfp4", "nvfp4_tiles", "mxfp4", "nvfp4_unnamed"])
def test_fp4_pickle_and_deepcopy_keep_type_layout_encoding_and_global_amax(x, make):
    t = make(x)
    for back in [pickle.loads(pickle.dumps(t, p)) for p in range(pickle.HIGHEST_PROTOCOL + 1)] + [copy.deepcopy(t)]:
        _same_fp4(back, t)
        assert back._layout is t._layout
        if isinstance(t, NVFP4Tensor):
            assert back.global_amax.dtype == np.float32 and np.array_equal(bits(back.global_amax),
                                                                           bits(t.global_amax))
            assert np.array_equal(bits(dequantize_nvfp4(back)), bits(dequantize_nvfp4(t)))


def test_fp4_goes_by_the_layout_and_encoding(x, rng):
    w = rng.standard_normal((32, 256)).astype(np.float32)
    n, m = quantize_nvfp4(x), quantize_mxfp4(x)
    assert np.array_equal(bits(dequantize_blocks(n, "bfloat16")), bits(dequantize_nvfp4(n, "bfloat16")))
    tiles = quantize_nvfp4(x, weight_2d=True)
    assert np.array_equal(bits(dequantize_blocks(tiles)), bits(dequantize_nvfp4(tiles)))
    assert np.array_equal(bits(dequantize_blocks(m)), bits(dequantize_mxfp4(m)))
    # MXFP4 is any ScaledTensor of E2M1 data in 1x32 blocks
    plain = ScaledTensor(m.data, m.scale, "1x32", E2M1)
    assert np.array_equal(bits(dequantize_mxfp4(plain)), bits(dequantize_mxfp4(m)))
    assert np.array_equal(bits(dequantize_blocks(plain)), bits(dequantize_mxfp4(m)))
    for qa, qb in ((n, quantize_nvfp4(w, weight_2d=True)), (m, quantize_mxfp4(w))):
        want = fp8core.gemm(qa, qb, out_dtype="float32")
        rebuilt = type(qa)(*qa), type(qb)(*qb)  # layouts read back from the shapes
        assert np.array_equal(bits(fp8core.gemm(*rebuilt, out_dtype="float32")), bits(want))
    got = fp8core.gemm(plain, ScaledTensor(*quantize_mxfp4(w), "1x32", E2M1), out_dtype="float32")
    assert np.array_equal(bits(got), bits(fp8core.gemm(m, quantize_mxfp4(w), out_dtype="float32")))


def test_fp4_layouts_and_kinds_are_refused_by_name(x):
    n, m = quantize_nvfp4(x), quantize_mxfp4(x)
    cases = [
        (lambda: dequantize_nvfp4(ScaledTensor(n.data, n.scale, "1x16", E2M1)), TypeError,
         r"^t: expected an NVFP4Tensor \(data, scale, global_amax\), got ScaledTensor"),
        (lambda: dequantize_mxfp4(MXFP4Tensor(m.data, m.scale, "32x1")), ValueError,
         r"^t: expected a 1x32 layout, got 32x1"),
        (lambda: dequantize_nvfp4(NVFP4Tensor(*n, layout="1x128")), ValueError,
         r"^t: expected a 1x16 or 16x16 layout, got 1x128"),
        (lambda: dequantize_nvfp4(NVFP4Tensor(*n, layout="16x16")), ValueError,
         r"^t.scale: expected shape \(4, 16\) \(16x16 tiles\) for data viewed as \(64, 256\), got \(64, 16\)"),
        (lambda: dequantize_mxfp4(quantize_mxfp8(x)), TypeError, r"^t: expected an MXFP4Tensor \(data, scale\), got "
                                                                 r"MXTensor"),
        (lambda: dequantize_mxfp8(m), TypeError, r"^t: expected fp8 data, got MXFP4Tensor of E2M1 \(FP4\) data"),
        (lambda: transpose_blocks(n), TypeError, r"^t: expected fp8 data, got NVFP4Tensor of E2M1 \(FP4\) data"),
        (lambda: dequantize_blocks(n, fmt="e4m3"), ValueError, r"^fmt: t names its data's encoding, E2M1; pass no fmt"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


def test_gemm_of_mixed_schemes_names_both_layouts(x, rng):
    w = rng.standard_normal((32, 256)).astype(np.float32)
    qa, sa, _ = fp8core.quantize_dynamic(x, "e4m3")
    # (operand, its type and layout as the error names them, its scheme)
    ops = [(quantize_nvfp4(x), "NVFP4Tensor", "1x16 E2M1", 0), (quantize_nvfp4(w, weight_2d=True), "NVFP4Tensor",
                                                                "16x16 E2M1", 0),
           (quantize_mxfp4(x), "MXFP4Tensor", "1x32 E2M1", 1), (quantize_mxfp8(x), "MXTensor", "1x32 E4M3", 2),
           (quantize_mxfp8(w, "e5m2"), "MXTensor", "1x32 E5M2", 2), (quantize_blockwise(w), "BlockScaledTensor",
                                                                     "1x128 E4M3", 3),
           (ScaledTensor(qa, sa), "ScaledTensor", "tensor E4M3", 4),
           (fp8core.quantize_rowwise(w), "RowwiseTensor", "rowwise E4M3", 5)]
    for a, ta, la, sa_ in ops:
        for b, tb, lb, sb_ in ops:
            if sa_ == sb_:
                continue
            want = (f"b: a is {ta} but b is {tb} ({la} and {lb}); a scaled GEMM takes two operands of one scheme: "
                    "MXFP8, fp32 blocks, one scale per row, one scale each, NVFP4 or MXFP4")
            with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
                fp8core.gemm(a, b, out_dtype="float32")


def test_jax_carries_fp4_tensors_through_jit(x):
    jnp = pytest.importorskip("jax.numpy")
    import jax

    for t in (quantize_nvfp4(jnp.asarray(x), weight_2d=True), quantize_mxfp4(jnp.asarray(x))):
        back = jax.jit(lambda t: t)(t)  # rebuilt from its fields: the layout read back, the encoding the class's
        assert type(back) is type(t) and back.layout is t.layout and back.encoding is E2M1
        for u, v in zip(back, t):
            assert np.array_equal(bits(u), bits(v))
