"""Float8RowwiseScaling in fp8core.jax: dense and Fp8DotGeneral (flax linen) with and without jit, the same bits
as the torch Linear's three GEMMs, and quantize_rowwise inside jit."""

from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
jnp = jax.numpy

import fp8core  # noqa: E402
import fp8core.jax as fj  # noqa: E402
from fp8core.jax import blocks as jblocks  # noqa: E402
from fp8core.torch import Float8Linear, autocast  # noqa: E402

RECIPES = [fp8core.Float8RowwiseScaling(), fp8core.Float8RowwiseScaling(wgrad_high_precision=True)]


def operands(seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((40, 64)) * np.exp2(rng.integers(-6, 6, (40, 1)))).astype(np.float32)
    x[5] = 0.0
    w = rng.standard_normal((32, 64)).astype(np.float32)
    g = rng.standard_normal((40, 32)).astype(np.float32)
    return x, w, g


def torch_linear(x, w, g, recipe):
    lin = Float8Linear(64, 32, bias=False, recipe=recipe)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
    xt = torch.from_numpy(x).requires_grad_(True)
    with autocast():
        y = lin(xt)
        y.backward(torch.from_numpy(g))
    return y.detach().numpy(), xt.grad.numpy(), lin.weight.grad.numpy()


def bits(a):
    return np.asarray(a).view(np.uint32)


@pytest.mark.parametrize("recipe", RECIPES, ids=["rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("jit", [False, True])
def test_dense_is_the_torch_linear_bit_for_bit(recipe, jit):
    x, w, g = operands()

    def f(x, w):
        y, state = fj.dense(x, w, None, recipe)
        assert state is None  # stateless, like current scaling
        return y

    y, vjp = jax.vjp(jax.jit(f) if jit else f, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    ty, tdx, tdw = torch_linear(x, w, g, recipe)
    np.testing.assert_array_equal(bits(y), bits(ty))
    np.testing.assert_array_equal(bits(dx), bits(tdx))
    np.testing.assert_array_equal(bits(dw), bits(tdw))


@pytest.mark.parametrize("jit", [False, True])
def test_fp8_dot_general_in_a_linen_dense_is_the_torch_linear(jit):
    nn = pytest.importorskip("flax.linen")
    recipe = RECIPES[0]
    x, w, g = operands(1)
    layer = nn.Dense(32, use_bias=False, dot_general_cls=partial(fj.Fp8DotGeneral, recipe=recipe))
    params = {"params": {"kernel": jnp.asarray(w.T)}}

    def f(kernel, x):
        return layer.apply({"params": {"kernel": kernel}}, x)

    y, vjp = jax.vjp(jax.jit(f) if jit else f, params["params"]["kernel"], jnp.asarray(x))
    dk, dx = vjp(jnp.asarray(g))
    ty, tdx, tdw = torch_linear(x, w, g, recipe)
    np.testing.assert_array_equal(bits(y), bits(ty))
    np.testing.assert_array_equal(bits(dx), bits(tdx))
    np.testing.assert_array_equal(bits(dk), bits(tdw.T))


def test_quantize_rowwise_under_jit_is_the_cores():
    x, _, _ = operands(2)
    for axis in (-1, 0):
        got = jax.jit(partial(jblocks.quantize_rowwise, axis=axis))(jnp.asarray(x))
        ref = fp8core.quantize_rowwise(x, axis=axis)
        np.testing.assert_array_equal(np.asarray(got.data).view(np.uint8), np.asarray(ref.data).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(got.scale_inv), ref.scale_inv)


def test_refusals_name_the_argument():
    with pytest.raises(TypeError, match="recipe: expected DelayedScaling, Float8CurrentScaling, "
                                        "Float8RowwiseScaling or NVFP4BlockScaling, got MXFP8BlockScaling"):
        fj.dense(jnp.ones((16, 32)), jnp.ones((16, 32)), None, fp8core.MXFP8BlockScaling())
    with pytest.raises(ValueError, match="axis: expected -1 or 1"):
        jblocks.quantize_rowwise(jnp.ones((4, 4)), axis=3)
