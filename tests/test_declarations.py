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
