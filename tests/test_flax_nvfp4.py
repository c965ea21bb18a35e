"""NVFP4BlockScaling in flax: the Linen Fp8DotGeneral / Fp8Einsum and the NNX dot give fp8core.jax.dense's bits (so
fp8core.torch's), with and without jit, the random state advancing per call in its own collection or variable;
with batch dimensions, the core's quantize_nvfp4 of each operand with its batch flattened into its rows and
fp8core.gemm per batch element, bits."""

from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax")
flax = pytest.importorskip("flax", minversion="0.12", reason="fp8core.jax.nnx is tried with flax 0.12.8 only")
nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

import jax.numpy as jnp  # noqa: E402

import fp8core  # noqa: E402
import fp8core.jax as fj  # noqa: E402
from fp8core.jax import fp4 as jfp4  # noqa: E402
from fp8core.jax import nnx as fnnx  # noqa: E402

NVFP4 = fp8core.NVFP4BlockScaling()


def bits(a):
    return np.asarray(a).view(np.uint32)


def dense_grads(x, kernel, rng, dy):
    """(y, dx, dkernel) of fp8core.jax.dense with the kernel [K, N] as flax stores it, K zero-padded to 64 (the
    flax dots pad it themselves; zeros change no block and no sum)."""
    k = x.shape[-1]
    xp = jnp.pad(x, ((0, 0), (0, 0), (0, 64 - k)))
    kp = jnp.pad(kernel, ((0, 64 - k), (0, 0)))
    y, vjp, _ = jax.vjp(lambda x, kp: fj.dense(x, kp.T, {"rng": rng}, NVFP4), xp, kp, has_aux=True)
    dx, dk = vjp(dy)
    return y, dx[..., :k], dk[:k]


@pytest.fixture
def data():
    kx, kd = jax.random.split(jax.random.key(1))
    # 40 tokens and K = 48 (padded to 64 and 64), N = 32
    return jax.random.normal(kx, (5, 8, 48)), jax.random.normal(kd, (5, 8, 32))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_linen_dense_equals_fj_dense_and_advances_its_collection(data, jit):
    x, dy = data
    layer = nn.Dense(32, use_bias=False, dot_general_cls=partial(fj.Fp8DotGeneral, recipe=NVFP4))
    v = layer.init(jax.random.key(0), x)
    rng0 = v[fj.linen.FP4_RNG]["Fp8DotGeneral_0"]["rng"]
    assert rng0.dtype == jnp.uint32 and np.asarray(rng0)[2:].tolist() == [0, 0]  # init draws a seed, takes no step

    def step(params, rngs, x, dy):
        y, vjp, upd = jax.vjp(lambda p, x: layer.apply({"params": p, fj.linen.FP4_RNG: rngs}, x,
                                                      mutable=[fj.linen.FP4_RNG]), params, x, has_aux=True)
        return (y, *vjp(dy), upd)

    step = jax.jit(step) if jit else step
    rngs = v[fj.linen.FP4_RNG]
    for i in range(2):
        y, dp, dx, upd = step(v["params"], rngs, x, dy)
        rng = rngs["Fp8DotGeneral_0"]["rng"]
        want = dense_grads(x, v["params"]["kernel"], rng, dy)
        for got, ref in zip((y, dx, dp["kernel"]), want):
            np.testing.assert_array_equal(bits(got), bits(ref))
        rngs = upd[fj.linen.FP4_RNG]
        assert np.asarray(rngs["Fp8DotGeneral_0"]["rng"])[2] == 2 * (i + 1)
    y_eval = layer.apply(v, x)  # not mutable: evaluation draws nothing and needs nothing
    np.testing.assert_array_equal(bits(y_eval), bits(dense_grads(x, v["params"]["kernel"], rng0, dy)[0]))


def test_linen_einsum_equals_fj_dense(data):
    x, dy = data

    class Proj(nn.Module):
        @nn.compact
        def __call__(self, x):
            k = self.param("kernel", nn.initializers.lecun_normal(), (48, 32))
            return fj.Fp8Einsum(recipe=NVFP4)("btd,dD->btD", x, k)

    model = Proj()
    v = model.init(jax.random.key(0), x)
    y, vjp, upd = jax.vjp(lambda p, x: model.apply({**v, "params": p}, x, mutable=[fj.linen.FP4_RNG]),
                          v["params"], x, has_aux=True)
    dp, dx = vjp(dy)
    rng = v[fj.linen.FP4_RNG]["Fp8Einsum_0"]["rng"]
    want = dense_grads(x, v["params"]["kernel"], rng, dy)
    for got, ref in zip((y, dx, dp["kernel"]), want):
        np.testing.assert_array_equal(bits(got), bits(ref))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nnx_linear_equals_fj_dense_and_advances_its_variable(data, jit):
    x, dy = data
    model = nnx.Linear(48, 32, use_bias=False, dot_general=fnnx.Fp8DotGeneral(NVFP4, seed=2 ** 40 + 3),
                       rngs=nnx.Rngs(0))

    def step(model, x):
        return fnnx.grad(lambda m, x: jnp.vdot(m(x), dy))(model, x)

    step = nnx.jit(step) if jit else step
    for i in range(2):
        kernel = model.kernel.get_value()
        grads = step(model, x)
        want = dense_grads(x, kernel, jfp4.rng_state(2 ** 40 + 3, 2 * i), dy)
        np.testing.assert_array_equal(bits(grads["kernel"].get_value()), bits(want[2]))
        assert np.asarray(model.dot_general.fp4_rng.get_value()).tolist() == [3, 256, 2 * (i + 1), 0]


# ---- batch dimensions -----------------------------------------------------------------------------------

def _padded(a, *sizes):
    """a [B, ., .] zero-padded to sizes (the dots' multiples of 32)."""
    return np.pad(a, [(0, 0)] + [(0, s - n) for s, n in zip(sizes, a.shape[1:])])


def _element(t, b, parts, axis, layout):
    """Batch element b's NVFP4 operand of t quantized over the whole batch: its piece of the data and scales."""
    data, scale = np.asarray(t.data), np.asarray(t.scale)
    d, s = data.shape[axis] // parts, scale.shape[axis] // parts
    cut = (lambda a, n: a[b * n:(b + 1) * n]) if axis == 0 else (lambda a, n: a[:, b * n:(b + 1) * n])
    return fp8core.NVFP4Tensor(np.ascontiguousarray(cut(data, d)), np.ascontiguousarray(cut(scale, s)),
                               np.asarray(t.global_amax), layout)


def batched_by_hand(x, w, dy, seed, offset):
    """(y [B, M, N], dx [B, M, K], dw [B, N, K]) of y_b = x_b . w_b^T under NVFP4BlockScaling's defaults, by the
    core alone: M, K, N zero-padded to 32, each operand quantized once with its batch flattened into its rows
    (x [B*M, K], w [B*N, K], dy [B*M, N]; the wgrad operands columnwise, transformed), fp8core.gemm per batch
    element on its rows (rowwise) or its columns (columnwise operands), cut back."""
    parts, m, k = x.shape
    n = w.shape[1]
    mp, kp, np_ = (-(-v // 32) * 32 for v in (m, k, n))
    x2 = _padded(x, mp, kp).reshape(-1, kp)
    w2 = _padded(w, np_, kp).reshape(-1, kp)
    g2 = _padded(dy, mp, np_).reshape(-1, np_)
    q = fp8core.quantize_nvfp4
    row, tiles = fp8core.Layout.NVFP4_1X16, fp8core.Layout.NVFP4_16X16
    xq, xt = q(x2), q(x2, hadamard=True, columnwise=True)
    wq, wt = q(w2, weight_2d=True), q(w2, weight_2d=True, columnwise=True)
    gq = q(g2, rounding="stochastic", seed=seed, offset=offset)
    gt = q(g2, hadamard=True, rounding="stochastic", seed=seed, offset=offset + 1, columnwise=True)

    def gemms(a, a_axis, a_layout, b_op, b_axis, b_layout):
        return np.stack([np.asarray(fp8core.gemm(_element(a, b, parts, a_axis, a_layout),
                                                 _element(b_op, b, parts, b_axis, b_layout), out_dtype="float32"))
                         for b in range(parts)])

    y = gemms(xq, 0, row, wq, 0, tiles)[:, :m, :n]
    dx = gemms(gq, 0, row, wt, 1, tiles)[:, :m, :k]
    dw = gemms(gt, 1, row, xt, 1, row)[:, :n, :k]
    return y, dx, dw


@pytest.fixture
def batched():
    kx, kw, kd = jax.random.split(jax.random.key(3), 3)
    # 3 batch elements of 20 tokens (padded to 32), K = 48 (padded to 64), N = 40 (padded to 64)
    return (jax.random.normal(kx, (3, 20, 48)), jax.random.normal(kw, (3, 40, 48)),
            jax.random.normal(kd, (3, 20, 40)))


def _check(got, want):
    for g, r in zip(got, want):
        np.testing.assert_array_equal(bits(g), bits(r))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_fp8_dot_general_with_batch_dims_anywhere_equals_the_core_by_hand(batched, jit):
    x, w, dy = batched
    lhs = jnp.transpose(x, (1, 0, 2))  # [M, B, K]: the batch dim in the middle
    rhs = jnp.transpose(w, (2, 0, 1))  # [K, B, N]
    dims = (((2,), (0,)), ((1,), (1,)))  # out: (batch, lhs free, rhs free) = [B, M, N]
    rng = jfp4.rng_state(2 ** 33 + 5, 6)

    def f(lhs, rhs):
        return fj.fp8_dot_general(lhs, rhs, dims, {"rng": rng}, NVFP4)

    f = jax.jit(f) if jit else f
    y, vjp = jax.vjp(f, lhs, rhs)
    dl, dr = vjp(dy)
    want = batched_by_hand(*(np.asarray(a) for a in (x, w, dy)), 2 ** 33 + 5, 6)
    _check((y, jnp.transpose(dl, (1, 0, 2)), jnp.transpose(dr, (1, 2, 0))), want)
    assert y.shape == (3, 20, 40)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_linen_einsum_with_a_batch_dim_equals_the_core_by_hand(batched, jit):
    x, w, dy = batched

    class Scores(nn.Module):
        @nn.compact
        def __call__(self, x, w):
            return fj.Fp8Einsum(recipe=NVFP4)("bqd,bkd->bqk", x, w)

    model = Scores()
    v = model.init(jax.random.key(0), x, w)
    rng = v[fj.linen.FP4_RNG]["Fp8Einsum_0"]["rng"]

    def step(x, w):
        y, vjp, upd = jax.vjp(lambda x, w: model.apply(v, x, w, mutable=[fj.linen.FP4_RNG]), x, w, has_aux=True)
        return (y, *vjp(dy), upd)

    step = jax.jit(step) if jit else step
    y, dx, dw, upd = step(x, w)
    seed, offset = (int(a) | int(b) << 32 for a, b in np.asarray(rng).reshape(2, 2))
    _check((y, dx, dw), batched_by_hand(*(np.asarray(a) for a in (x, w, dy)), seed, offset))
    assert np.asarray(upd[fj.linen.FP4_RNG]["Fp8Einsum_0"]["rng"])[2] == np.asarray(rng)[2] + 2


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nnx_einsum_with_a_batch_dim_equals_the_core_by_hand(batched, jit):
    x, w, dy = batched

    class Scores(nnx.Module):
        def __init__(self, w):
            self.w = nnx.Param(w)
            self.dot = fnnx.Fp8Einsum(NVFP4, seed=2 ** 40 + 9)

        def __call__(self, x):
            return self.dot("bqd,bkd->bqk", x, self.w[...])

    model = Scores(w)

    def step(model, x):
        return fnnx.grad(lambda m, x: jnp.vdot(m(x), dy))(model, x)

    step = nnx.jit(step) if jit else step
    for i in range(2):
        grads = step(model, x)
        want = batched_by_hand(*(np.asarray(a) for a in (x, w, dy)), 2 ** 40 + 9, 2 * i)
        np.testing.assert_array_equal(bits(grads["w"].get_value()), bits(want[2]))
        assert np.asarray(model.dot.fp4_rng.get_value()).tolist() == [9, 256, 2 * (i + 1), 0]
    np.testing.assert_array_equal(bits(Scores(w)(x)), bits(want[0]))


def test_an_empty_batch_gives_an_empty_product():
    q = jnp.ones((0, 32, 32))
    y = fj.fp8_dot_general(q, q, (((2,), (2,)), ((0,), (0,))), {"rng": jfp4.rng_state(0)}, NVFP4)
    assert y.shape == (0, 32, 32)
