"""fp8core.jax.Fp8DotGeneral on shapes the fp8 GEMM cannot take (K or N not a multiple of 16: ``nn.Dense(10)``,
a 20-feature input, tokens not a multiple of 16): the op pads to the GEMM's multiples inside; the forward
output, both gradients and the next scaling state are the unpadded definition's, computed here with NumPy from
the core's quantize (the contract's D = (sum_k a*b) * sa * sb, summed in float64 and rounded once to fp32, as
the CPU backend does), bit for bit."""

from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nn = pytest.importorskip("flax.linen")
jnp = jax.numpy

import fp8core  # noqa: E402
import fp8core.jax as fj  # noqa: E402
from jax_places import on_the_cpu  # noqa: E402,F401  (a fixture)
from flax.linen import fp8_ops  # noqa: E402

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
DELAYED = fp8core.DelayedScaling(amax_history_len=4)
CURRENT = fp8core.Float8CurrentScaling()


def bits(v):
    return np.asarray(v).view(np.uint32)


def q(v, fmt, scale, recipe):
    """(fp8 values as float64, scale_inv) of v by the recipe: the delayed scale given, or v's own."""
    v = np.asarray(v, np.float32)
    if isinstance(recipe, fp8core.DelayedScaling):
        data = fp8core.quantize(v, np.float32(scale), fmt)
        s_inv = np.float32(1) / np.float32(scale)
    else:
        data, s_inv, _ = fp8core.quantize_dynamic(v, fmt)
        s_inv = np.asarray(s_inv).reshape(-1)[0]
    return np.asarray(data).view(fp8core.as_format(fmt).numpy_dtype).astype(np.float64), np.float64(s_inv)


def gemm(a, sa, b, sb):
    """The contract's GEMM on the unpadded operands: a [M, K] · b [K, N]."""
    return ((a @ b) * sa * sb).astype(np.float32)


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
@pytest.mark.parametrize("tokens, k, n", [(16, 20, 10), (5, 32, 10), (24, 7, 16), (3, 1, 1), (40, 33, 17)])
def test_any_shape_is_the_unpadded_definition(tokens, k, n, recipe):
    x = jax.random.normal(jax.random.PRNGKey(1), (tokens, k)) * 3
    g = jax.random.normal(jax.random.PRNGKey(2), (tokens, n)) * 7
    model = nn.Dense(n, use_bias=False, dot_general_cls=partial(fj.Fp8DotGeneral, recipe=recipe))
    variables = model.init(jax.random.PRNGKey(0), x)
    grad = jax.jit(jax.value_and_grad(lambda v, x: jnp.vdot(model.apply(v, x), g), argnums=(0, 1)))
    if isinstance(recipe, fp8core.DelayedScaling):  # a step first, so that the scales are not 1
        variables = {**variables, OWG: grad(variables, x * 0.5)[1][0][OWG]}
        state = variables[OWG]["Fp8DotGeneral_0"]
        scales = np.asarray(state["scale"])
        assert (scales != 1).all()
    else:
        scales = [None] * 3
    kernel = np.asarray(variables["params"]["kernel"])
    y = jax.jit(model.apply)(variables, x)
    _, (gv, dx) = grad(variables, x)

    fwd, bwd = recipe.fp8_format.fwd.value, recipe.fp8_format.bwd.value
    qx, sx = q(x, fwd, scales[0], recipe)
    qk, sk = q(kernel, fwd, scales[1], recipe)
    qg, sg = q(g, bwd, scales[2], recipe)
    assert y.shape == (tokens, n) and dx.shape == (tokens, k)
    np.testing.assert_array_equal(bits(y), bits(gemm(qx, sx, qk, sk)))
    np.testing.assert_array_equal(bits(dx), bits(gemm(qg, sg, qk.T, sk)))
    np.testing.assert_array_equal(bits(gv["params"]["kernel"]), bits(gemm(qx.T, sx, qg, sg)))
    if isinstance(recipe, fp8core.DelayedScaling):  # the padding changed no amax
        ref = fp8core.ScalingState(3, recipe, formats=["e4m3", "e4m3", "e5m2"])
        for key in ("amax_history", "scale", "scale_inv"):
            getattr(ref, key)[...] = np.asarray(state[key])
        ref.amax_history[0] = [fp8core.amax(np.asarray(v, np.float32))[0] for v in (x, kernel, g)]
        ref.update()
        for key in ("amax_history", "scale", "scale_inv"):
            np.testing.assert_array_equal(bits(gv[OWG]["Fp8DotGeneral_0"][key]), bits(getattr(ref, key)), key)


def test_dense_10_head_trains_under_jit():
    """The issue's case: an MLP whose head is nn.Dense(10) takes gradient steps and its loss falls."""
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            dot = partial(fj.Fp8DotGeneral, recipe=DELAYED)
            return nn.Dense(10, dot_general_cls=dot)(nn.relu(nn.Dense(32, dot_general_cls=dot)(x)))

    x = jax.random.normal(jax.random.PRNGKey(3), (24, 12))
    t = jax.nn.one_hot(jnp.arange(24) % 10, 10)
    v = Net().init(jax.random.PRNGKey(0), x)

    @jax.jit
    def step(v):
        loss, gr = jax.value_and_grad(lambda v: jnp.mean((Net().apply(v, x) - t) ** 2))(v)
        return loss, {"params": jax.tree.map(lambda p, d: p - 0.5 * d, v["params"], gr["params"]), OWG: gr[OWG]}

    losses = []
    for _ in range(30):
        loss, v = step(v)
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
@pytest.mark.parametrize("lshape, rshape, dn", [
    ((5, 0), (0, 3), (((1,), (0,)), ((), ()))),               # K = 0: a sum over nothing, zeros
    ((5, 20), (20, 0), (((1,), (0,)), ((), ()))),             # N = 0: an empty output
    ((2, 5, 0), (2, 0, 3), (((2,), (1,)), ((0,), (0,)))),     # the same with a batch dim
    ((2, 5, 20), (2, 20, 0), (((2,), (1,)), ((0,), (0,)))),
], ids=["k0", "n0", "batched-k0", "batched-n0"])
def test_an_empty_contraction_or_output_is_dot_generals(lshape, rshape, dn, recipe):
    """K = 0 or N = 0 (any K and N, as the docstring says): padded to 16 like zero tokens, so the output and
    both gradients are lax.dot_general's (zeros, or empty) and the state takes the operands' own amaxes."""
    lhs = jax.random.normal(jax.random.PRNGKey(1), lshape) * 3
    rhs = jax.random.normal(jax.random.PRNGKey(2), rshape)
    g = jnp.ones(jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dn), lhs, rhs).shape)
    delayed = isinstance(recipe, fp8core.DelayedScaling)
    state = fj.init_state(recipe) if delayed else None
    y, back = jax.vjp(jax.jit(lambda s, a, b: fj.fp8_dot_general(a, b, dn, s, recipe)), state, lhs, rhs)
    ty, tback = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dn), lhs, rhs)
    dv, dl, dr = back(g)
    for ours, twin in ((y, ty), (dl, tback(g)[0]), (dr, tback(g)[1])):
        assert ours.shape == twin.shape and ours.dtype == twin.dtype
        np.testing.assert_array_equal(bits(ours), bits(twin))
    if delayed:
        ref = fp8core.ScalingState(3, recipe, formats=["e4m3", "e4m3", "e5m2"])
        ref.amax_history[0] = [np.abs(np.asarray(v, np.float32)).max(initial=0) for v in (lhs, rhs, g)]
        ref.update()
        for key in ("amax_history", "scale", "scale_inv"):
            np.testing.assert_array_equal(bits(dv[key]), bits(getattr(ref, key)), key)
