"""fp8core.jax under hostile input, as a table: every bad call is refused while jit traces (nothing compiled,
nothing run), with the named exception and a message that starts with the argument's name, the same eagerly
and under jax.jit; never an error from inside a callback (XLA's INTERNAL wrapper) nor a bare IndexError.
Then the fixes the table cannot show: callable recipe algorithms in the functional update (against
ScalingState), margin and epsilon as data (one program for every value, the core's bits), empty batches."""

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import fp8core  # noqa: E402
import fp8core.jax as fj  # noqa: E402
from jax_places import JAX_CPU, jax_gpu  # noqa: E402
from fp8core import DelayedScaling, Float8CurrentScaling, Format  # noqa: E402
from fp8core.blocks import BlockScaledTensor, MXTensor  # noqa: E402

fb = fj.blocks
X = jnp.ones((32, 32), jnp.float32)
Q = X.astype(jnp.float8_e4m3fn)
S0 = jnp.float32(1.0)  # a 0-d input
H = jnp.zeros((4, 3), jnp.float32)
ONE3 = jnp.ones(3, jnp.float32)
E4 = ["e4m3"] * 3
MX = MXTensor(Q, jnp.ones((32, 1), jnp.float8_e8m0fnu))
BS = BlockScaledTensor(jnp.ones((128, 128), jnp.float8_e4m3fn), jnp.ones((128, 1), jnp.float32))
STATE = {"amax_history": H, "scale": ONE3, "scale_inv": ONE3}
D4 = DelayedScaling(amax_history_len=4)
NT = (((1,), (0,)), ((), ()))

# (id, call, exception, argument, fragment of the message after "argument: ")
CASES = [
    # 0-d inputs where the primitive views its input as [rows, cols]
    ("transpose 0-d", lambda: fj.transpose(Q[0, 0]), ValueError, "q", "at least 1 dimension"),
    ("cast_transpose 0-d", lambda: fj.cast_transpose(S0, 1.0), ValueError, "x", "at least 1 dimension"),
    ("quantize_mxfp8 0-d", lambda: fb.quantize_mxfp8(S0), ValueError, "x", "at least 1 dimension"),
    ("quantize_mxfp8_both 0-d", lambda: fb.quantize_mxfp8_both(S0), ValueError, "x", "at least 1 dimension"),
    ("quantize_blockwise 0-d", lambda: fb.quantize_blockwise(S0), ValueError, "x", "at least 1 dimension"),
    ("dense 0-d x", lambda: fj.dense(S0, X[:16], STATE, D4), ValueError, "x", "at least 1 dimension"),
    ("fp8_dot_general 0-d lhs", lambda: fj.fp8_dot_general(S0, X, (((0,), (0,)), ((), ())), None,
                                                            Float8CurrentScaling()), ValueError, "lhs",
     "at least 1 dimension"),
    # scales: one float32 element or a Python number
    ("quantize scale [2]", lambda: fj.quantize(X, jnp.ones(2)), ValueError, "scale", "expected 1 element"),
    ("cast_transpose scale [2]", lambda: fj.cast_transpose(X, jnp.ones(2)), ValueError, "scale", "1 element"),
    ("dequantize scale_inv [2]", lambda: fj.dequantize(Q, jnp.ones(2)), ValueError, "scale_inv", "1 element"),
    ("gemm a_scale_inv [2]", lambda: fj.gemm(Q, Q, jnp.ones(2), 1.0), ValueError, "a_scale_inv", "1 element"),
    ("gemm b_scale_inv str", lambda: fj.gemm(Q, Q, 1.0, "2"), TypeError, "b_scale_inv", "got str"),
    ("quantize scale int32 array", lambda: fj.quantize(X, jnp.ones(1, jnp.int32)), TypeError, "scale",
     "expected float32, got int32"),
    ("quantize scale float64 array", lambda: fj.quantize(X, np.ones(1)), TypeError, "scale",
     "expected float32, got float64"),
    ("quantize scale str", lambda: fj.quantize(X, "1"), TypeError, "scale", "got str"),
    ("quantize scale bool", lambda: fj.quantize(X, True), TypeError, "scale", "got bool"),
    ("quantize scale None", lambda: fj.quantize(X, None), TypeError, "scale", "got NoneType"),
    ("quantize scale huge int", lambda: fj.quantize(X, 10**400), ValueError, "scale", "too large"),
    # data of the wrong kind: named as data, not blamed on fmt
    ("dequantize float32 q", lambda: fj.dequantize(X, 1.0), TypeError, "q", "expected fp8 data"),
    ("transpose float32 q", lambda: fj.transpose(X), TypeError, "q", "expected fp8 data"),
    ("gemm float32 a", lambda: fj.gemm(X, Q, 1.0, 1.0), TypeError, "a", "expected fp8 data"),
    ("dequantize_mxfp8 float32 data", lambda: fb.dequantize_mxfp8(MXTensor(X, MX.scale)), TypeError, "t.data",
     "expected fp8 data"),
    ("dequantize_blockwise float32 data", lambda: fb.dequantize_blockwise(BlockScaledTensor(BS.data.astype(
        jnp.float32), BS.scale_inv)), TypeError, "t.data", "expected fp8 data"),
    ("amax int32 x", lambda: fj.amax(jnp.ones(4, jnp.int32)), TypeError, "x", "got int32"),
    ("amax fp8 x", lambda: fj.amax(Q), TypeError, "x", "dequantize it first"),
    ("quantize fp8 x", lambda: fj.quantize(Q, 1.0), TypeError, "x", "dequantize it first"),
    ("quantize_mxfp8 fp8 x", lambda: fb.quantize_mxfp8(Q), TypeError, "x", "dequantize it first"),
    ("amax a list", lambda: fj.amax([1.0, 2.0]), TypeError, "x", "expected a JAX or NumPy array"),
    ("compute_scale int32 amax", lambda: fj.compute_scale(jnp.ones(2, jnp.int32), "e4m3"), TypeError, "amax",
     "expected float32"),
    # out_dtype, gemm shapes and bias (were callback errors)
    ("dequantize out_dtype int32", lambda: fj.dequantize(Q, 1.0, jnp.int32), ValueError, "out_dtype",
     "float32, bfloat16 or float16"),
    ("dequantize out_dtype nonsense", lambda: fj.dequantize(Q, 1.0, "fp64ish"), ValueError, "out_dtype",
     "float32, bfloat16 or float16"),
    ("dequantize out_dtype None", lambda: fj.dequantize(Q, 1.0, None), ValueError, "out_dtype", "got None"),
    ("gemm out_dtype int32", lambda: fj.gemm(Q, Q, 1.0, 1.0, jnp.int32), ValueError, "out_dtype", "float32"),
    ("gemm 1-D a", lambda: fj.gemm(Q[0], Q, 1.0, 1.0), ValueError, "a", "2-D [M, K]"),
    ("gemm K mismatch", lambda: fj.gemm(Q, Q[:, :16], 1.0, 1.0), ValueError, "b", "K = 32"),
    ("gemm K not 16k", lambda: fj.gemm(Q[:, :8], Q[:, :8], 1.0, 1.0), ValueError, "a", "multiple of 16"),
    ("gemm E5M2 x E5M2", lambda: fj.gemm(X.astype(jnp.float8_e5m2), X.astype(jnp.float8_e5m2), 1.0, 1.0),
     ValueError, "a, b", "E5M2 x E5M2"),
    ("gemm bias shape", lambda: fj.gemm(Q, Q, 1.0, 1.0, bias=jnp.ones(5, jnp.bfloat16)), ValueError, "bias",
     "(32,)"),
    ("gemm bias dtype", lambda: fj.gemm(Q, Q, 1.0, 1.0, bias=jnp.ones(32, jnp.float32)), TypeError, "bias",
     "bfloat16"),
    # block tensors
    ("dequantize_mxfp8 scale shape", lambda: fb.dequantize_mxfp8(MXTensor(Q, MX.scale[:3])), ValueError,
     "t.scale", "rowwise"),
    ("dequantize_mxfp8 scale float32", lambda: fb.dequantize_mxfp8(MXTensor(Q, jnp.ones((32, 1)))), TypeError,
     "t.scale", "float8_e8m0fnu"),
    ("dequantize_mxfp8 not a pair", lambda: fb.dequantize_mxfp8(Q), TypeError, "t", "MXTensor"),
    ("dequantize_blockwise scale_inv shape", lambda: fb.dequantize_blockwise(BlockScaledTensor(BS.data,
                                                                                               BS.scale_inv[:2])),
     ValueError, "t.scale_inv", "1x128 blocks"),
    ("block_gemm mixed kinds", lambda: fb.block_gemm(MX, BS), ValueError, "b", "MXTensor but b is"),
    ("block_gemm plain arrays", lambda: fb.block_gemm(Q, Q), TypeError, "a", "expected a ScaledTensor (MXTensor, BlockScaledTensor"),
    ("block_gemm MX K", lambda: fb.block_gemm(MXTensor(Q[:, :16], MX.scale), MXTensor(Q[:, :16], MX.scale)),
     ValueError, "a", "multiple of 32"),
    ("block_gemm columnwise MX", lambda: fb.block_gemm(MX, MXTensor(Q, jnp.ones((1, 32), jnp.float8_e8m0fnu))),
     ValueError, "b.scale", "rowwise MXFP8"),
    ("block_gemm 128x128 twice", lambda: fb.block_gemm(*[BlockScaledTensor(jnp.ones((256, 128), jnp.float8_e4m3fn),
                                                                           jnp.ones((2, 1)))] * 2),
     ValueError, "a, b", "128x128 x 128x128"),
    ("quantize_blockwise block", lambda: fb.quantize_blockwise(X, block="2x2"), ValueError, "block", "1x128"),
    ("quantize_mxfp8 scale_mode", lambda: fb.quantize_mxfp8(X, scale_mode="ceil"), ValueError, "scale_mode",
     "rceil"),
    # booleans are booleans
    ("quantize_mxfp8 columnwise 'False'", lambda: fb.quantize_mxfp8(X, columnwise="False"), TypeError,
     "columnwise", "expected a bool"),
    ("quantize_mxfp8 columnwise 0", lambda: fb.quantize_mxfp8(X, columnwise=0), TypeError, "columnwise", "bool"),
    ("quantize_dynamic power_of_2 'False'", lambda: fj.quantize_dynamic(X, power_of_2="False"), TypeError,
     "power_of_2", "expected a bool"),
    ("compute_scale power_of_2 None", lambda: fj.compute_scale(ONE3, "e4m3", power_of_2=None), TypeError,
     "power_of_2", "bool"),
    ("quantize_blockwise power_of_2 'True'", lambda: fb.quantize_blockwise(X, power_of_2="True"), TypeError,
     "power_of_2", "bool"),
    ("update update_scale 'no'", lambda: fj.update(H, ONE3, ONE3, D4, E4, update_scale="no"), TypeError,
     "update_scale", "bool"),
    # numbers that are data: the core's rules, at trace time
    ("quantize_dynamic margin float", lambda: fj.quantize_dynamic(X, margin=1.5), TypeError, "margin", "int"),
    ("quantize_dynamic margin 1000", lambda: fj.quantize_dynamic(X, margin=1000), ValueError, "margin", "512"),
    ("quantize_dynamic epsilon -1", lambda: fj.quantize_dynamic(X, epsilon=-1.0), ValueError, "epsilon",
     "finite"),
    ("quantize_dynamic epsilon nan", lambda: fj.quantize_dynamic(X, epsilon=float("nan")), ValueError,
     "epsilon", "finite"),
    ("quantize_dynamic epsilon array", lambda: fj.quantize_dynamic(X, epsilon=np.array(0.1)), TypeError,
     "epsilon", "float"),
    ("compute_scale margin str", lambda: fj.compute_scale(ONE3, "e4m3", margin="1"), TypeError, "margin", "int"),
    ("quantize_blockwise epsilon inf", lambda: fb.quantize_blockwise(X, epsilon=float("inf")), ValueError,
     "epsilon", "finite"),
    # the functional update (were AttributeError/IndexError in the callback)
    ("update Float8CurrentScaling", lambda: fj.update(H, ONE3, ONE3, Float8CurrentScaling(), E4), TypeError,
     "recipe", "DelayedScaling"),
    ("update recipe None", lambda: fj.update(H, ONE3, ONE3, None, E4), TypeError, "recipe", "DelayedScaling"),
    ("update scale [2]", lambda: fj.update(H, jnp.ones(2), ONE3, D4, E4), ValueError, "scale", "(3,)"),
    ("update scale_inv [2]", lambda: fj.update(H, ONE3, jnp.ones(2), D4, E4), ValueError, "scale_inv", "(3,)"),
    ("update scale bf16", lambda: fj.update(H, ONE3.astype(jnp.bfloat16), ONE3, D4, E4), TypeError, "scale",
     "float32"),
    ("update history 1-D", lambda: fj.update(ONE3, ONE3, ONE3, D4, E4), ValueError, "amax_history", "[L, N]"),
    ("update history int32", lambda: fj.update(H.astype(jnp.int32), ONE3, ONE3, D4, E4), TypeError,
     "amax_history", "float32"),
    ("update one format for 3 tensors", lambda: fj.update(H, ONE3, ONE3, D4, ["e4m3"]), ValueError, "formats",
     "expected 3 formats"),
    ("update formats a string", lambda: fj.update(H, ONE3, ONE3, D4, "e4m3"), TypeError, "formats",
     "list or tuple"),
    ("update formats HYBRID", lambda: fj.update(H, ONE3, ONE3, D4, [Format.HYBRID] * 3), ValueError, "formats",
     "HYBRID"),
    # layer state and recipes
    ("init_state 2**62 rows", lambda: fj.init_state(DelayedScaling(amax_history_len=2**62)), ValueError,
     "amax_history_len", "[1, 2147483647]"),
    ("init_state Float8CurrentScaling", lambda: fj.init_state(Float8CurrentScaling()), TypeError, "recipe",
     "DelayedScaling"),
    ("dense recipe str", lambda: fj.dense(X, X[:16], STATE, "delayed"), TypeError, "recipe", "DelayedScaling"),
    ("dense state None", lambda: fj.dense(X, X[:16], None, D4), TypeError, "state", "init_state"),
    ("dense state of another length", lambda: fj.dense(X, X[:16], STATE, DelayedScaling(amax_history_len=8)),
     ValueError, "state['amax_history']", "amax_history_len 4 in the state, 8 in the recipe"),
    ("dense 1-D w", lambda: fj.dense(X, X[0], STATE, D4), ValueError, "w", "2-D [N, K]"),
    ("dense bias shape", lambda: fj.dense(X, X[:16], STATE, D4, bias=jnp.ones(3)), ValueError, "bias", "(16,)"),
    ("next_state grad None", lambda: fj.next_state(STATE, None, D4), TypeError, "state_grad", "amax_history"),
    ("fp8_dot_general state None", lambda: fj.fp8_dot_general(X, X[:, :16], NT, None, D4), TypeError, "state",
     "init_state"),
    ("Fp8DotGeneral 2**62 rows", lambda: fj.fp8_dot_general(X, X[:, :16], NT, STATE,
                                                             DelayedScaling(amax_history_len=2**62)),
     ValueError, "amax_history_len", "[1, 2147483647]"),
]


def _raised(call):
    with pytest.raises(Exception) as info:
        jax.block_until_ready(call())
    return info.value


def _message(e):
    return e.args[0] if isinstance(e, KeyError) else str(e)


@pytest.mark.parametrize("case,call,exc,arg,text", CASES, ids=[c[0] for c in CASES])
def test_refused_at_trace_time_by_name_with_and_without_jit(case, call, exc, arg, text):
    eager = _raised(call)
    # lower(): traced and lowered, never compiled nor run, so the error cannot come from a callback
    traced = _raised(lambda: jax.jit(call).lower())
    for e in (eager, traced):
        assert type(e) is exc, f"{type(e).__name__}: {e}"
        assert _message(e).startswith(f"{arg}: "), _message(e)
        assert text in _message(e)
    assert _message(eager) == _message(traced)


def test_good_calls_of_the_table_still_run():
    """The table's inputs with the one bad thing put right: the checks refuse no valid call."""
    jax.block_until_ready([
        fj.transpose(Q[0]), fj.cast_transpose(X[0], 1.0), fb.quantize_mxfp8(X[0], columnwise=True),
        fj.quantize(X, jnp.ones((1, 1))), fj.quantize(X, np.float32(2)), fj.quantize(X, 2**40),
        fj.dequantize(Q, jnp.float32(2.0), "bfloat16"), fj.gemm(Q, Q, 1.0, 1.0, bias=jnp.ones(32, jnp.bfloat16)),
        fb.quantize_mxfp8(X, columnwise=np.bool_(True)), fb.dequantize_mxfp8((MX.data, MX.scale)),
        fb.quantize_blockwise(X, block=[128, 128]), fj.update(H, ONE3, ONE3, D4, tuple(E4), update_scale=False),
        fj.compute_scale(S0, "e5m2", margin=np.int64(2)), fj.dense(X, X[:16], STATE, D4)])


def test_compute_scale_of_a_0d_amax_gives_1_element_arrays_as_the_core():
    for got in (fj.compute_scale(jnp.float32(3.0), "e4m3"), jax.jit(fj.compute_scale, static_argnums=1)(
            jnp.float32(3.0), "e4m3")):
        want = fp8core.compute_scale(np.float32(3.0), "e4m3")
        assert [g.shape for g in got] == [(1,), (1,)]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---- the functional update with callable recipe algorithms: ScalingState.update's results -------------------

HISTORY = np.array([[1, 2, 0], [3, 4, 5], [6, 0.5, 1], [2, 2, 2]], np.float32)
RECIPES = {
    "amax callable": DelayedScaling(amax_history_len=4, amax_compute_algo=lambda h: h[1:].max(axis=0) / 7),
    "scale callable": DelayedScaling(amax_history_len=4, scaling_factor_compute_algo=lambda a, s, fm, r: s * 2),
    "both, margin": DelayedScaling(amax_history_len=4, margin=1, amax_compute_algo=lambda h: h.min(axis=0) + 3,
                                   scaling_factor_compute_algo=lambda a, s, fm, r: fm / a / 2 ** r.margin + 1),
    "interval 3": DelayedScaling(amax_history_len=4, interval=3, amax_compute_algo=lambda h: h[0] * 0 + 0.5),
    # subnormal amaxes and scales: XLA:CPU runs the callback with FTZ/DAZ set, ScalingState here without
    "subnormals": DelayedScaling(amax_history_len=4, amax_compute_algo=lambda h: h.max(axis=0) * np.float32(1e-39),
                                 scaling_factor_compute_algo=lambda a, s, fm, r: s * np.float32(1e-39)),
}


def _state(recipe, formats, device="cpu"):
    st = fp8core.ScalingState(3, recipe, formats, device=device)
    xp = fp8core.backends.for_device(st.device).xp
    st.amax_history[...] = xp.asarray(HISTORY)
    st.scale[...] = xp.asarray(np.array([3, 0.5, 5], np.float32))
    st.scale_inv[...] = 1 / st.scale
    return st


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)  # CuPy's, or NumPy's


def _update_device(where):
    """(the JAX device, ScalingState's device) for "cpu", or for JAX's first GPU where there is one."""
    return (JAX_CPU, "cpu") if where == "cpu" else (jax_gpu(), "cuda:0")


# The callables run on the state's NumPy or CuPy arrays (fj.update's docstring): CuPy's arithmetic flushes
# subnormals (its kernels are built with -ftz=true), so the twin is ScalingState on the JAX arrays' device.
@pytest.mark.parametrize("where", ["cpu", "gpu"])
@pytest.mark.parametrize("update_scale", [True, False])
@pytest.mark.parametrize("name", list(RECIPES))
def test_update_with_callables_gives_scaling_state_results(name, update_scale, where):
    recipe, formats = RECIPES[name], ["e4m3", "e5m2", "e4m3"]
    device, core_device = _update_device(where)
    st = _state(recipe, formats, core_device)
    args = [jax.device_put(_host(a).copy(), device) for a in (st.amax_history, st.scale, st.scale_inv)]
    before = (st.scale.copy(), st.scale_inv.copy())
    with np.errstate(over="ignore"):  # "subnormals": 1 / a subnormal scale overflows to inf in ScalingState
        st.update()
    # update_scale False: the history rolls as ScalingState's does, and the scales stay
    want = (st.amax_history, st.scale, st.scale_inv) if update_scale else (st.amax_history, *before)
    eager = fj.update(*args, recipe, formats, update_scale)
    jitted = jax.jit(lambda h, s, si: fj.update(h, s, si, recipe, formats, update_scale))(*args)
    for got in (eager, jitted):
        for g, w in zip(got, want):
            assert g.devices() == {device}
            np.testing.assert_array_equal(np.asarray(g).view(np.uint32), _host(w).view(np.uint32))


def test_update_with_a_callable_is_not_most_recent():
    """The bug: a callable amax_compute_algo was read as 'most_recent' (scale 448 instead of the callable's)."""
    recipe = RECIPES["amax callable"]
    most_recent = dataclasses.replace(recipe, amax_compute_algo="most_recent")
    args = [jnp.asarray(a) for a in (HISTORY, np.ones(3, np.float32), np.ones(3, np.float32))]
    ours = fj.update(*args, recipe, ["e4m3"] * 3)[1]
    theirs = fj.update(*args, most_recent, ["e4m3"] * 3)[1]
    assert not np.array_equal(np.asarray(ours), np.asarray(theirs))


def test_update_callable_errors_are_scaling_states():
    """A callable returning the wrong number of values is refused with ScalingState's own message (from the
    callback: the callable runs on the step's data)."""
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=lambda h: h.max())
    with pytest.raises(Exception, match=r"amax_compute_algo: returned 1 float32 values"):
        jax.block_until_ready(fj.update(jnp.asarray(HISTORY), ONE3, ONE3, recipe, E4))


# ---- margin and epsilon are data: one program for every value, the core's bits ----------------------------

EPSILONS = [float(e) for e in np.geomspace(1e-6, 10.0, 47)] + [1e-40, 0.1, 3e-39]  # 50, some not fp32 values


def _x():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((64, 256)) * 1e-3).astype(np.float32)
    x[0, :4] = [0.0, 1e-40, -2e-39, 5e-3]
    return x


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _programs(fn):
    return fn.jitted._cache_size()


CURRENT = {
    "quantize_dynamic": (fj.primitives._quantize_dynamic,
                         lambda x, e, m: fj.quantize_dynamic(jnp.asarray(x), "e5m2", margin=m, epsilon=e),
                         lambda x, e, m: fp8core.quantize_dynamic(x, "e5m2", margin=m, epsilon=e)),
    "compute_scale": (fj.primitives._compute_scale,
                      lambda x, e, m: fj.compute_scale(jnp.asarray(x[0, :8]), "e4m3", margin=m, epsilon=e),
                      lambda x, e, m: fp8core.compute_scale(x[0, :8], "e4m3", margin=m, epsilon=e)),
    "quantize_blockwise": (fb._quantize_blockwise,
                           lambda x, e, m: tuple(fb.quantize_blockwise(jnp.asarray(x), epsilon=e, power_of_2=False)),
                           lambda x, e, m: tuple(fp8core.blocks.quantize_blockwise(x, epsilon=e, power_of_2=False))),
}


@pytest.mark.parametrize("op", list(CURRENT))
def test_50_epsilons_and_margins_compile_once_with_the_cores_bits(op):
    prim, ours, core = CURRENT[op]
    x = _x()
    ours(x, 0.5, 0)  # the program for these shapes
    before = _programs(prim)
    for i, eps in enumerate(EPSILONS):
        m = i % 9 - 4
        for g, w in zip(ours(x, eps, m), core(x, eps, m)):
            np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"epsilon {eps!r}, margin {m}")
    # where a GPU needs them by value at launch they stay static: one program per (epsilon, margin)
    assert _programs(prim) - before == (len(EPSILONS) if fj.primitives.numbers_static() else 0)


def test_epsilon_under_an_outer_jit_and_vmap_same_bits():
    x = _x().reshape(4, 16, 256)
    for eps in (1e-40, 0.1):
        f = jax.vmap(lambda v: fj.quantize_dynamic(v, epsilon=eps, margin=-2))
        got = jax.jit(f)(jnp.asarray(x))
        for i in range(4):
            want = fp8core.quantize_dynamic(x[i], epsilon=eps, margin=-2)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(_bits(g[i]), _bits(w))


def test_numbers_travel_as_their_float64_bits():
    from fp8core.jax import _args

    values = (0.1, 1e-320, 3e38, -0.0, 512.0)
    assert [np.float64(v).tobytes() for v in _args.unpack(_args.pack(values))] == \
        [np.float64(v).tobytes() for v in values]


@pytest.mark.parametrize("op", list(CURRENT))
def test_static_numbers_as_on_a_gpu_machine_same_bits(op, monkeypatch):
    """Where a GPU needs margin and epsilon by value (fp8core.jax.numbers_static), they reach the callback as
    static values: that branch, taken here on the CPU, gives the same bits, one program per value."""
    monkeypatch.setattr(fj.primitives, "numbers_static", lambda: True)
    prim, ours, core = CURRENT[op]
    x = _x()
    # values the test above never passes: on a machine with a GPU its epsilons are static too, and their programs
    # are cached already (quantize_blockwise takes no margin: only the epsilon tells its programs apart)
    values = ((2e-40, 3), (0.3, -2), (2e-3, 0))
    assert not {e for e, _ in values} & set(EPSILONS)
    before = _programs(prim)
    for eps, m in values:
        for g, w in zip(ours(x, eps, m), core(x, eps, m)):
            np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"epsilon {eps!r}, margin {m}")
    assert _programs(prim) - before == 3


# ---- issue 37 item 5: `fp8core inspect` on a flax checkpoint reports fp8core.jax's scaling state apart ------------

def test_inspect_reports_a_flax_checkpoints_fp8_state_apart(tmp_path, capsys):
    """A flax model's variables flattened into an .npz (as a user saves a checkpoint): the fp8 collection's
    amax_history, scale and scale_inv are fp8core's state, not model tensors, and stay out of the summary."""
    import json

    from flax import linen as nn
    from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
    from flax.traverse_util import flatten_dict

    from fp8core import cli

    model = nn.Dense(32, dot_general_cls=fj.Fp8DotGeneral)
    variables = model.init(jax.random.PRNGKey(0), jnp.ones((16, 32), jnp.float32))
    flat = {"/".join(k): np.asarray(v) for k, v in flatten_dict(jax.device_get(variables)).items()}
    state = sorted(k for k in flat if k.startswith(OVERWRITE_WITH_GRADIENT + "/"))
    assert len(state) == 3 and sorted(k.rsplit("/", 1)[1] for k in state) == ["amax_history", "scale", "scale_inv"]
    np.savez(tmp_path / "flax.npz", **flat)
    assert cli.main(["inspect", str(tmp_path / "flax.npz"), "--recipes", "e4m3", "--json"]) == 0
    got = json.loads(capsys.readouterr()[0])
    assert sorted(got["fp8_state"]) == state and sorted(got["tensors"]) == ["params/bias", "params/kernel"]
    assert got["summary"]["tensors"] == 1  # the kernel (the zero bias has no signal)
