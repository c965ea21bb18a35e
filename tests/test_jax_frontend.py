"""fp8core.jax: every primitive gives the core's bits with and without jit (and under vmap); the functional
update matches ScalingState; amax reduction over 2 CPU devices with shard_map."""

import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import fp8core  # noqa: E402
import fp8core.jax as fj  # noqa: E402


def u8(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.fixture
def x(rng):
    v = (rng.standard_normal((48, 32)) * 100).astype(np.float32)
    v.reshape(-1)[:6] = [np.nan, np.inf, -0.0, 1e-40, 1e30, 448.0]
    return v.astype(ml_dtypes.bfloat16)


CASES = {
    "amax": (lambda x: fj.amax(x), lambda x: (fp8core.amax(x),)),
    "quantize": (lambda x: fj.quantize(x, 2.0, "e4m3"),
                 lambda x: (fp8core.quantize(x, 2.0, "e4m3"), fp8core.amax(x))),
    "quantize_dynamic": (lambda x: fj.quantize_dynamic(x, "e5m2", margin=1, power_of_2=True),
                         lambda x: fp8core.quantize_dynamic(x, "e5m2", margin=1, power_of_2=True)),
    "cast_transpose": (lambda x: fj.cast_transpose(x, 0.25, "e4m3"),
                       lambda x: (*fp8core.cast_transpose(x, 0.25, "e4m3"), fp8core.amax(x))),
    "dequantize": (lambda x: fj.dequantize(fj.quantize(x, 1.0, "e5m2")[0], 3.0, jnp.bfloat16),
                   lambda x: (fp8core.dequantize(fp8core.quantize(x, 1.0, "e5m2"), 3.0, "bfloat16"),)),
    "transpose": (lambda x: fj.transpose(fj.quantize(x, 1.0)[0]),
                  lambda x: (fp8core.transpose(fp8core.quantize(x, 1.0)),)),
    # the core on jax arrays, on the device ours runs on: the GEMM's bits are the device's (NUMERICS.md)
    "gemm": (lambda x: fj.gemm(fj.quantize(x, 0.01)[0], fj.quantize(x[:16], 0.02)[0], 100.0, 50.0, jnp.float32),
             lambda x: (fp8core.gemm(fp8core.quantize(jnp.asarray(x), 0.01),
                                     fp8core.quantize(jnp.asarray(x[:16]), 0.02), 100.0, 50.0, out_dtype="float32"),)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_same_bits_with_and_without_jit_as_the_core(name, x):
    ours, core = CASES[name]
    xj = jnp.asarray(x)
    eager = jax.tree.leaves(ours(xj))
    jitted = jax.tree.leaves(jax.jit(ours)(xj))
    expected = core(x)
    assert len(eager) == len(expected)
    for e, j, c in zip(eager, jitted, expected):
        assert isinstance(e, jax.Array) and e.dtype == np.asarray(c).dtype and e.shape == np.asarray(c).shape
        np.testing.assert_array_equal(u8(e), u8(c))
        np.testing.assert_array_equal(u8(j), u8(c))


def test_vmap_runs_per_element(x):
    xj = jnp.asarray(x).reshape(3, 16, 32)
    got = jax.jit(jax.vmap(fj.amax))(xj)
    np.testing.assert_array_equal(u8(got).reshape(-1), np.concatenate([u8(fp8core.amax(x.reshape(3, 16, 32)[i]))
                                                                     for i in range(3)]))


def test_functional_update_matches_scaling_state(rng):
    recipe = fp8core.DelayedScaling(amax_history_len=4, margin=1)
    st = fp8core.ScalingState(5, recipe)
    h = rng.uniform(0, 50, (4, 5)).astype(np.float32)
    h[0, 2] = 0  # did not run
    st.amax_history[...] = h
    new = jax.jit(lambda h, s, si: fj.update(h, s, si, recipe, st.formats))(
        jnp.asarray(h), jnp.ones(5, jnp.float32), jnp.ones(5, jnp.float32))
    st.update()
    for got, want in zip(new, (st.amax_history, st.scale, st.scale_inv)):
        np.testing.assert_array_equal(u8(got), u8(want))


def test_errors_surface_from_the_core():
    a = fj.quantize(jnp.ones((16, 24)), 1.0)[0]
    with pytest.raises(Exception, match="K = 24"):
        fj.gemm(a, a, 1.0, 1.0)


def test_shard_map_over_two_cpu_devices_reduces_amax():
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        import fp8core.jax as fj
        assert len(jax.devices()) == 2
        mesh = Mesh(np.array(jax.devices()), ("d",))
        x = jnp.concatenate([jnp.full((4, 16), 3.0), jnp.full((4, 16), -7.0)])

        def step(xs):
            a = fj.amax(xs)
            return a, fj.reduce_amax(a, "d")

        local, reduced = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P("d"))))(x)
        print(np.asarray(local).tolist(), np.asarray(reduced).tolist())
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("] [")[0] == "[3.0, 7.0" and r.stdout.strip().endswith("[7.0, 7.0]")


def _sqnr(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return 20 * np.log10(np.linalg.norm(ref) / np.linalg.norm(x - ref))


@pytest.mark.parametrize("recipe", [fp8core.DelayedScaling(amax_history_len=8), fp8core.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_dense_against_float32_and_the_same_with_jit(recipe):
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (3, 20, 64))  # 60 tokens: padded to 64 for the wgrad GEMM
    w = jax.random.normal(kw, (32, 64)) * 0.1
    g = jax.random.normal(kg, (3, 20, 32))
    state = fj.init_state(recipe) if isinstance(recipe, fp8core.DelayedScaling) else None

    def loss(x, w, state):
        y, new = fj.dense(x, w, state, recipe)
        return jnp.sum(y * g), (y, new)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    if state is not None:  # one step to learn scales from the amaxes
        (_, (_, new)), (_, _, sg) = grad(x, w, state)
        state = fj.next_state(new, sg, recipe)
    (_, (y, _)), (dx, dw, _) = grad(x, w, state)
    (_, (yj, _)), (dxj, dwj, _) = jax.jit(grad)(x, w, state)
    for a, b in ((y, yj), (dx, dxj), (dw, dwj)):
        np.testing.assert_array_equal(u8(a), u8(b))
    ref_y = jnp.einsum("btk,nk->btn", x, w)
    ref_dx, ref_dw = jnp.einsum("btn,nk->btk", g, w), jnp.einsum("btn,btk->nk", g, x)
    assert _sqnr(y, ref_y) >= 18 and _sqnr(dx, ref_dx) >= 17 and _sqnr(dw, ref_dw) >= 17


def test_dense_state_carries_every_amax_into_the_update():
    recipe = fp8core.DelayedScaling(amax_history_len=4)
    x = jnp.linspace(-3, 5, 32 * 64, dtype=jnp.float32).reshape(32, 64)
    w = jnp.full((16, 64), 0.25, jnp.float32)
    g = jnp.full((32, 16), -2.0, jnp.float32)

    def loss(w, state):
        y, new = fj.dense(x, w, state, recipe)
        return jnp.sum(y * g), new

    (_, new), (_, sg) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(w, fj.init_state(recipe))
    state = fj.next_state(new, sg, recipe)
    np.testing.assert_array_equal(np.asarray(state["amax_history"][-1]), [5.0, 0.25, 2.0])
    np.testing.assert_allclose(np.asarray(state["scale"]), [448 / 5.0, 448 / 0.25, 57344 / 2.0], rtol=1e-7)


def test_dense_runs_the_gemms_override_linear_precision_names_in_high_precision_and_keeps_every_cast():
    """The plan's per-GEMM override (Transformer Engine's, as the torch Linear runs it): wgrad in the caller's
    dtype on the unquantized tensors, fprop and dgrad the fp8 GEMMs' bits, and delayed scaling's history still fed
    by every cast (grad_output's included)."""
    fp8, wgrad_hp = (fp8core.DelayedScaling(amax_history_len=4, override_linear_precision=o)
                     for o in ((False, False, False), (False, False, True)))
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(kx, (32, 64))  # 32 tokens: no padding, so the reference is the same product
    w = jax.random.normal(kw, (16, 64)) * 0.1
    g = jax.random.normal(kg, (32, 16))

    def run(recipe):
        def loss(x, w, state):
            y, new = fj.dense(x, w, state, recipe)
            return jnp.sum(y * g), (y, new)

        (_, (y, new)), (dx, dw, sg) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
            x, w, fj.init_state(recipe))
        return y, dx, dw, fj.next_state(new, sg, recipe)

    y, dx, dw, state = run(fp8)
    y_hp, dx_hp, dw_hp, state_hp = run(wgrad_hp)
    np.testing.assert_array_equal(u8(y_hp), u8(y))
    np.testing.assert_array_equal(u8(dx_hp), u8(dx))
    np.testing.assert_array_equal(u8(dw_hp), u8(g.T @ x))
    assert not np.array_equal(u8(dw_hp), u8(dw))  # the fp8 wgrad rounds otherwise
    for key in ("amax_history", "scale", "scale_inv"):
        np.testing.assert_array_equal(np.asarray(state_hp[key]), np.asarray(state[key]))
    assert np.all(np.asarray(state_hp["amax_history"][-1]) > 0)
