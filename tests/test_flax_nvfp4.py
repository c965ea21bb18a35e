"""NVFP4BlockScaling in flax: the Linen Fp8DotGeneral / Fp8Einsum and the NNX dot give fp8core.jax.dense's bits (so
fp8core.torch's), with and without jit, the random state advancing per call in its own collection or variable;
batch dimensions are refused by name."""

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


def test_batch_dims_are_refused_by_name():
    q = jnp.ones((2, 32, 32))
    with pytest.raises(NotImplementedError, match=r"dimension_numbers: Fp8DotGeneral under NVFP4BlockScaling takes "
                                                  r"no batch dimensions"):
        fj.fp8_dot_general(q, q, (((2,), (2,)), ((0,), (0,))), {"rng": jfp4.rng_state(0)}, NVFP4)
