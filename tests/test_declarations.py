"""A primitive is declared once (fp8core.declarations): the torch custom ops and their fakes, the JAX primitives'
output shapes and selftest's coverage all follow the declaration; a hand-written op still works beside them."""

import numpy as np
import pytest

import fp8core
from fp8core import selftest
from fp8core.declarations import PRIMITIVES
from fp8core.declare import Arg, Spec, declare

XS = [(5,), (3, 32), (2, 16, 32), (130, 260), (0, 4)]


def test_every_declared_backend_function_exists():
    functions = set(selftest.backend_functions())
    for name, p in PRIMITIVES.items():
        assert p.backend and set(p.backend) <= functions, name


def test_argument_names_are_unique_and_types_known():
    with pytest.raises(ValueError, match="argument names repeat"):
        declare("twice", (Arg("x"), Arg("x")), returns=1, call=lambda x: x)(lambda x: (Spec.of(x),))
    with pytest.raises(ValueError, match="type: expected one of Tensor"):
        Arg("x", "Tensor[]")


@pytest.mark.parametrize("shape", XS, ids=str)
def test_the_rule_gives_the_core_results_shapes(shape):
    x = np.linspace(-3, 3, int(np.prod(shape)), dtype=np.float32).reshape(shape)
    s = np.ones(1, np.float32)
    calls = {"amax": dict(x=x), "quantize": dict(x=x, scale=s, fmt="e5m2"), "quantize_dynamic": dict(x=x, fmt="e4m3"),
             "cast_transpose": dict(x=x, scale=s, fmt="e4m3"), "compute_scale": dict(amax=s, fmt="e4m3"),
             "quantize_mxfp8": dict(x=x, fmt="e4m3", scale_mode="rceil", columnwise=True),
             "quantize_mxfp8_both": dict(x=x, fmt="e4m3", scale_mode="floor"),
             "quantize_blockwise": dict(x=x, fmt="e4m3", block="128x128", power_of_2=True, epsilon=0.0)}
    for name, kwargs in calls.items():
        p = PRIMITIVES[name]
        out = p.call(**kwargs)
        out = out if isinstance(out, tuple) else (out,)
        assert [Spec.of(o) for o in out] == list(p.specs(**kwargs)), name
    q = fp8core.quantize(x, 1.0, "e4m3")
    assert Spec.of(PRIMITIVES["transpose"].call(q)) == PRIMITIVES["transpose"].specs(q=q)[0]
    assert PRIMITIVES["dequantize"].specs(q=q, scale_inv=s, out_dtype="bfloat16") == (Spec(shape, "bfloat16"),)


def test_the_rule_raises_the_core_error():
    x = np.float32(1.0).reshape(())
    for name, kwargs, arg in (("transpose", dict(q=fp8core.quantize(x, 1.0)), "q"),
                              ("cast_transpose", dict(x=x, scale=x, fmt="e4m3"), "x")):
        with pytest.raises(ValueError) as core:
            PRIMITIVES[name].call(**kwargs)
        with pytest.raises(ValueError) as rule:
            PRIMITIVES[name].specs(**kwargs)
        assert str(rule.value) == str(core.value) == f"{arg}: expected at least 1 dimension, got a scalar"


def test_functional_outputs_add_the_slots():
    x = Spec((4, 8), "bfloat16")
    p = PRIMITIVES["cast_transpose"]
    assert p.functional(x=x, scale=Spec((1,), "float32"), fmt="e4m3") == (
        Spec((4, 8), "float8_e4m3fn"), Spec((8, 4), "float8_e4m3fn"), Spec((1,), "float32"))


def test_selftest_coverage_reads_the_declarations():
    from fp8core.selftest.coverage import declared_functions

    assert set(declared_functions()) == set(PRIMITIVES)
    cover = selftest.run("cpu", quick=True).checks[-1]
    assert cover.failed == 0 and cover.cases >= len(selftest.backend_functions()) + len(PRIMITIVES)


# ---- the torch ops follow the declarations --------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch")


def test_every_declaration_is_a_torch_op_with_its_arguments():
    torch = _torch()
    import fp8core.torch  # noqa: F401  (registers the ops)

    for name, p in PRIMITIVES.items():
        ops = [name] + ([f"{name}_amax"] if any(a.slot for a in p.args) else [])
        for op in ops:
            schema = getattr(torch.ops.fp8core, op).default._schema
            want = [a.name for a in p.args if op.endswith("_amax") or a.slot is None]
            assert [a.name for a in schema.arguments] == want, op
            mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
            assert mutated == {a.name for a in p.args if a.mutated and a.name in want}, op


def test_a_declared_op_beside_hand_written_ones():
    """A new declaration becomes an op with its fake (compile fullgraph, opcheck) through custom_ops alone."""
    torch = _torch()
    from fp8core.torch.custom_ops import custom_ops

    @declare("test_scaled_pair", (Arg("x"), Arg("fmt", "str"), Arg("columns", "int", 2)), returns=2,
             call=lambda x, fmt, columns=2: (fp8core.quantize(x, 1.0, fmt), x.new_zeros((x.shape[0], columns))))
    def rule(x, fmt, columns=2):
        """(x in fmt, zeros [rows, columns])."""
        return Spec(x.shape, fp8core.as_format(fmt).dtype_name), Spec((x.shape[0], columns), x.dtype)

    (op,) = custom_ops(rule)
    x = torch.randn(6, 5)
    torch.library.opcheck(op, (x, "e5m2", 3))
    q, z = torch.compile(lambda t: torch.ops.fp8core.test_scaled_pair(t, "e4m3", 4), fullgraph=True,
                         backend="aot_eager")(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and z.shape == (6, 4)
    assert torch.equal(q.view(torch.uint8), fp8core.quantize(x, 1.0, "e4m3").view(torch.uint8))


def test_a_declared_default_reaches_the_call():
    """The dispatcher drops trailing arguments equal to their schema defaults before it calls a Python kernel:
    the op's body and fake put the declared default back (here not the call's own)."""
    torch = _torch()
    from fp8core.torch.custom_ops import custom_ops

    @declare("test_default_rows", (Arg("x"), Arg("rows", "int", 3)), returns=1,
             call=lambda x, rows=1: x.new_zeros((rows, x.shape[-1])))
    def rule(x, rows=3):
        """zeros [rows, x's last dim]."""
        return (Spec((rows, x.shape[-1]), x.dtype),)

    (op,) = custom_ops(rule)
    x = torch.ones(2, 5)
    assert op(x).shape == op(x, 3).shape == (3, 5) and op(x, 4).shape == (4, 5)
    assert torch.compile(lambda t: op(t), fullgraph=True, backend="aot_eager")(x).shape == (3, 5)
    assert op(x.to("meta")).shape == (3, 5)


def test_a_remembered_answer_lets_no_refused_value_through():
    """specs remembers answers by their inputs; 1 == True in Python, so a key without the values' types would
    answer power_of_2=1 from power_of_2=True's entry instead of refusing it, as fp8core.jax's checks did."""
    p = PRIMITIVES["quantize_dynamic"]
    x = np.ones((4, 16), np.float32)
    for good, bad in ((True, 1), (False, 0), (True, 1.0)):
        p.specs(x=x, fmt="e4m3", power_of_2=good)
        with pytest.raises(TypeError, match="power_of_2: expected a bool"):
            p.specs(x=x, fmt="e4m3", power_of_2=bad)


def test_the_gradient_check_of_torch_2_7_answers_as_torchs_own():
    """torch 2.7, the declared minimum, lacks torch._C._any_requires_grad: the autograd kernel's Python check
    answers there, and must say what torch's helper says (a wrong False drops the gradient, a wrong True sends a
    plain call through autograd)."""
    torch = _torch()
    from fp8core.torch.custom_ops import _any_requires_grad_py

    leaf = torch.ones(3, requires_grad=True)
    cases = [((), False), ((torch.ones(3), 2.0, None, "e4m3"), False), ((torch.ones(3), leaf), True),
             ((leaf * 2, 7), True), ((leaf.detach(), [torch.ones(2), leaf]), True), (((leaf.detach(),),), False)]
    for values, want in cases:
        assert _any_requires_grad_py(*values) is want, values
        if hasattr(torch._C, "_any_requires_grad"):
            assert torch._C._any_requires_grad(*values) is want, values


@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "columnwise"])
def test_the_fp4_rules_give_the_core_results_shapes(columnwise):
    x = np.linspace(-3, 3, 64 * 96, dtype=np.float32).reshape(2, 32, 96)  # [M, K] = [64, 96]
    rng = np.array([3, 9], np.int64)
    cases = [("quantize_nvfp4", dict(x=x, weight_2d=w2d, hadamard=False, stochastic=True, rng=rng, stream=1,
                                     columnwise=columnwise)) for w2d in (False, True)]
    cases.append(("quantize_mxfp4", dict(x=x, rounding="floor", columnwise=columnwise)))
    for name, kwargs in cases:
        p = PRIMITIVES[name]
        out = p.call(**kwargs)
        assert [Spec.of(o) for o in out] == list(p.specs(**kwargs)), name
        dq = "dequantize_nvfp4" if name == "quantize_nvfp4" else "dequantize_mxfp4"
        parts = dict(zip(("data", "scale", "global_amax"), out), **({"layout": out.layout.value}
                                                                   if dq == "dequantize_nvfp4" else {}))
        y = PRIMITIVES[dq].call(**parts, out_dtype="bfloat16")
        assert Spec.of(y) == PRIMITIVES[dq].specs(**parts, out_dtype="bfloat16")[0] == Spec((
            (96, 64) if columnwise else (64, 96)), "bfloat16")
    a = PRIMITIVES["quantize_nvfp4"].call(**cases[0][1])
    b = PRIMITIVES["quantize_nvfp4"].call(**cases[1][1])
    gemm = dict(a=a[0], a_scale=a[1], a_amax=a[2], b=b[0], b_scale=b[1], b_amax=b[2], a_layout="1x16",
                b_layout="16x16", out_dtype="float32")
    assert Spec.of(PRIMITIVES["nvfp4_gemm"].call(**gemm)) == PRIMITIVES["nvfp4_gemm"].specs(**gemm)[0]


def test_the_fp4_rules_raise_the_core_error():
    x = np.ones((40, 40), np.float32)  # neither M nor K whole blocks of 16 or 32
    for name, kwargs in (("quantize_nvfp4", dict(weight_2d=False, hadamard=False, stochastic=False,
                                                 rng=np.zeros(2, np.int64), stream=0)),
                         ("quantize_mxfp4", dict(rounding="rceil"))):
        for columnwise in (False, True):
            with pytest.raises(ValueError) as core:
                PRIMITIVES[name].call(x, columnwise=columnwise, **kwargs)
            with pytest.raises(ValueError) as rule:
                PRIMITIVES[name].specs(x=x, columnwise=columnwise, **kwargs)
            assert str(rule.value) == str(core.value) and "must be a multiple of" in str(core.value)


def test_the_nvfp4_state_is_checked_by_its_metadata_and_read_where_it_lives():
    """The declared quantize_nvfp4 hands its int64 [2] (seed, offset) state on to the core unread (the kernel reads
    it where it lives); the bytes are those of the same seed and offset + stream by value, the offset wrapping as
    an unsigned 64-bit int."""
    from fp8core.declarations import check_rng

    x = np.random.default_rng(5).standard_normal((32, 64)).astype(np.float32)
    for state, stream, seed, offset in (([-1, 7], 2, 2 ** 64 - 1, 9), ([5, -1], 1, 5, 0)):
        got = PRIMITIVES["quantize_nvfp4"].call(x, weight_2d=False, hadamard=False, stochastic=True,
                                                rng=np.array(state, np.int64), stream=stream, columnwise=False)
        want = fp8core.quantize_nvfp4(x, rounding="stochastic", seed=seed, offset=offset)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
    with pytest.raises(ValueError, match=r"^rng: expected int64 \[2\] \(seed, offset\), got int32 \(2,\)$"):
        check_rng(np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"^rng: expected int64 \[2\] \(seed, offset\), got int64 \(3,\)$"):
        check_rng(np.zeros(3, np.int64))


# ---- the JAX primitives' shapes follow the declarations -------------------------------------------------------

@pytest.mark.parametrize("shape", [(5,), (3, 32), (2, 16, 32)], ids=str)
def test_jax_shapes_are_the_declared_ones(shape):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import fp8core.jax as fj

    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    got = jax.eval_shape(lambda v: fj.cast_transpose(v, 2.0, "e5m2"), x)
    want = PRIMITIVES["cast_transpose"].functional(x=x, scale=Spec((1,), "float32"), fmt="e5m2")
    assert [Spec.of(g) for g in got] == list(want)
    got = jax.eval_shape(lambda v: fj.blocks.quantize_blockwise(v, "e4m3", block="1x128"), x)
    want = PRIMITIVES["quantize_blockwise"].specs(x=x, fmt="e4m3", block="1x128", power_of_2=True, epsilon=0.0)
    assert [Spec.of(g) for g in got] == list(want)
