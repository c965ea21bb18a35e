"""Batch dimensions in fp8core.jax's GEMM path (issue 25 item 2): ``fp8_dot_general``, ``Fp8DotGeneral``,
``Fp8Einsum`` and ``nn.DenseGeneral(batch_dims=...)`` take ``lax.dot_general``'s batch dims, anywhere.

The contract: one per-tensor scale per operand (the amax over the whole operand), and each batch element's GEMM
the unbatched fp8 GEMM. So the twin here is the unbatched op applied per batch element, with the same scales:
for delayed scaling the same layer called once per element (its calls combine by MAX: the next state is the one
a call over all the elements leaves), for current scaling the unbatched op under a delayed state holding the
scales current scaling takes from the whole operands. Forward, both gradients and the next delayed state are
compared bit for bit, and one attention contraction against NumPy (quantize and GEMM written out)."""

from functools import partial
from typing import Any

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
nn = pytest.importorskip("flax.linen")
jnp = jax.numpy

import fp8core  # noqa: E402
import fp8core.jax as fj  # noqa: E402
from jax_places import on_the_cpu  # noqa: E402,F401  (a fixture)
from flax.linen import fp8_ops  # noqa: E402
from jax import lax  # noqa: E402

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
DELAYED = fp8core.DelayedScaling(amax_history_len=4)
CURRENT = fp8core.Float8CurrentScaling()
KEYS = ("amax_history", "scale", "scale_inv")

# (lhs shape, rhs shape, dot_general dimension numbers)
CASES = {
    "qk": ((2, 5, 3, 10), (2, 7, 3, 10), (((3,), (3,)), ((0, 2), (0, 2)))),        # "bqhd,bkhd->bhqk"
    "pv": ((2, 3, 5, 7), (2, 7, 3, 10), (((3,), (1,)), ((0, 1), (0, 2)))),         # "bhqk,bkhd->bqhd"
    "batch_last_unordered": ((6, 4, 3, 2), (2, 5, 3, 6), (((0,), (3,)), ((3, 2), (0, 2)))),
    "no_lhs_free": ((3, 20), (3, 20, 17), (((1,), (1,)), ((0,), (0,)))),
    "two_contracting_aligned": ((4, 16, 2, 16), (4, 2, 16, 32), (((2, 3), (1, 2)), ((0,), (0,)))),
    "outer_product": ((3, 9), (3, 11), (((), ()), ((0,), (0,)))),                  # "bi,bj->bij": K = 1
}


def bits(v: Any) -> np.ndarray:
    v = np.asarray(v)
    return v.view({4: np.uint32, 2: np.uint16}[v.dtype.itemsize])


def unbatched(dn: Any) -> Any:
    """The dimension numbers of one batch element (batch dims removed, the others renumbered)."""
    (lc, rc), (lb, rb) = dn

    def renumber(dims, batch):
        return tuple(d - sum(b < d for b in batch) for d in dims)

    return (renumber(lc, lb), renumber(rc, rb)), ((), ())


def elements(x: Any, batch: tuple[int, ...]) -> list[Any]:
    """x's batch elements, in the order dot_general's output lays its batch dims out (batch's order)."""
    front = jnp.moveaxis(x, batch, tuple(range(len(batch))))
    return list(front.reshape(-1, *front.shape[len(batch):]))


class Contract(nn.Module):
    """``dot_general(lhs, rhs, dn)`` by one Fp8DotGeneral ("dot"): in one batched call, or (the twin) one
    unbatched call per batch element, stacked into dot_general's output layout."""

    dn: Any
    recipe: Any
    batched: bool
    preferred_element_type: Any = None

    @nn.compact
    def __call__(self, lhs, rhs):
        dot = partial(fj.Fp8DotGeneral(recipe=self.recipe, name="dot"),
                      preferred_element_type=self.preferred_element_type)
        return dot(lhs, rhs, self.dn) if self.batched else per_element(dot, lhs, rhs, self.dn)


def per_element(dot: Any, lhs: Any, rhs: Any, dn: Any) -> Any:
    """dot_general(lhs, rhs, dn) as one unbatched ``dot`` call per batch element, in dot_general's layout."""
    lb, rb = dn[1]
    outs = [dot(a, b, unbatched(dn)) for a, b in zip(elements(lhs, lb), elements(rhs, rb))]
    return jnp.stack(outs).reshape(*(lhs.shape[d] for d in lb), *outs[0].shape)


def inputs(case: str, dtype: Any = jnp.float32) -> tuple[Any, Any, Any, Any]:
    ls, rs, dn = CASES[case]
    lhs = (jax.random.normal(jax.random.PRNGKey(1), ls) * 3).astype(dtype)
    rhs = (jax.random.normal(jax.random.PRNGKey(2), rs) * 0.5).astype(dtype)
    out = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dn), lhs, rhs)
    g = jax.random.normal(jax.random.PRNGKey(3), out.shape) * 7
    return lhs, rhs, dn, g


def vjp(model: nn.Module, variables: Any, lhs: Any, rhs: Any, g: Any, jit: bool = True) -> tuple[Any, Any]:
    """(y, (variables' cotangent, dlhs, drhs)) for the output cotangent g."""
    def run(v, a, b):
        y, back = jax.vjp(model.apply, v, a, b)
        return y, back(g.astype(y.dtype))

    return (jax.jit(run) if jit else run)(variables, lhs, rhs)


def stepped_state(model: nn.Module, lhs: Any, rhs: Any, g: Any) -> dict[str, Any]:
    """A delayed state after one step (so that the scales are not 1)."""
    v = model.init(jax.random.PRNGKey(0), lhs, rhs)
    state = vjp(model, v, lhs * 2, rhs * 2, g)[1][0][OWG]  # headroom: nothing saturates at this step
    assert (np.asarray(state["dot"]["scale"]) != 1).all()
    return state


def current_as_delayed(lhs: Any, rhs: Any, g: Any, recipe: Any) -> tuple[Any, dict[str, Any]]:
    """A delayed recipe and state whose scales are those current scaling takes from the whole operands."""
    fmts = (recipe.fp8_format.fwd, recipe.fp8_format.fwd, recipe.fp8_format.bwd)
    pairs = [fj.compute_scale(fj.amax(t), f.value, margin=recipe.margin, power_of_2=recipe.power_of_2,
                              epsilon=recipe.amax_epsilon) for t, f in zip((lhs, rhs, g), fmts)]
    delayed = fp8core.DelayedScaling(amax_history_len=1, fp8_format=recipe.fp8_format)
    state = {"amax_history": jnp.zeros((1, 3), jnp.float32), "scale": jnp.concatenate([p[0] for p in pairs]),
             "scale_inv": jnp.concatenate([p[1] for p in pairs])}
    return delayed, {"dot": state}


def assert_same(ours: Any, twin: Any, what: str) -> None:
    assert ours.shape == twin.shape and ours.dtype == twin.dtype, what
    np.testing.assert_array_equal(bits(ours), bits(twin), what)


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
@pytest.mark.parametrize("case", list(CASES))
def test_batched_is_the_unbatched_op_per_element(case, recipe):
    check_against_twin(case, recipe, jit=True)


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
@pytest.mark.parametrize("case", ["qk", "batch_last_unordered"])
def test_batched_is_the_unbatched_op_per_element_eagerly(case, recipe):
    check_against_twin(case, recipe, jit=False)


def callbacks(jaxpr: Any) -> int:
    """The buffer callbacks a jaxpr runs, inner jaxprs (jit, custom_vjp, cond) included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "buffer_callback"
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += callbacks(inner)
    return count


def test_one_callback_per_gemm_whatever_the_batch():
    """A training step's callbacks do not grow with the batch: one batched GEMM primitive per product."""
    def count(batch):
        lhs, rhs, dn = jnp.ones((batch, 5, 3, 10)), jnp.ones((batch, 7, 3, 10)), CASES["qk"][2]
        model = Contract(dn, DELAYED, True)
        v = model.init(jax.random.PRNGKey(0), lhs, rhs)
        step = jax.grad(lambda v, a, b: model.apply(v, a, b).sum(), argnums=(0, 1, 2))
        return callbacks(jax.make_jaxpr(step)(v, lhs, rhs).jaxpr)

    n = count(1)
    assert n >= 6 and count(4) == n  # at least 3 casts and 3 GEMMs
    assert callbacks(jax.make_jaxpr(partial(fj.gemm, a_scale_inv=1.0, b_scale_inv=1.0))(
        q8((4, 3, 16, 16), 1), q8((4, 3, 16, 16), 2)).jaxpr) == 1


def test_interval_two_over_two_steps():
    """recipe.interval 2 (the interval_step count): two steps from the same state, each the twin's."""
    recipe = fp8core.DelayedScaling(amax_history_len=4, interval=2)
    lhs, rhs, dn, g = inputs("pv")
    ours, twin = Contract(dn, recipe, True), Contract(dn, recipe, False)
    v = ours.init(jax.random.PRNGKey(0), lhs, rhs)
    tv = v
    for step in range(2):
        y, (dv, dl, dr) = vjp(ours, v, lhs * (step + 1), rhs, g)
        ty, (tdv, tdl, tdr) = vjp(twin, tv, lhs * (step + 1), rhs, g)
        assert_same(y, ty, f"y {step}")
        assert_same(dl, tdl, f"dlhs {step}")
        assert_same(dr, tdr, f"drhs {step}")
        for key in KEYS + ("interval_step",):
            assert_same(dv[OWG]["dot"][key], tdv[OWG]["dot"][key], f"{key} {step}")
        v, tv = {OWG: dv[OWG]}, {OWG: tdv[OWG]}
    assert float(v[OWG]["dot"]["interval_step"]) == 0 and (np.asarray(v[OWG]["dot"]["scale"]) != 1).all()


def test_bfloat16_operands_float32_output():
    lhs, rhs, dn, g = inputs("pv", jnp.bfloat16)
    v = {OWG: stepped_state(Contract(dn, DELAYED, True), lhs, rhs, g)}
    y, (dv, dl, dr) = vjp(Contract(dn, DELAYED, True, jnp.float32), v, lhs, rhs, g)
    assert y.dtype == jnp.float32 and dl.dtype == dr.dtype == jnp.bfloat16
    ty, (tdv, tdl, tdr) = vjp(Contract(dn, DELAYED, False, jnp.float32), v, lhs, rhs, g)
    for ours, twin, what in ((y, ty, "y"), (dl, tdl, "dlhs"), (dr, tdr, "drhs"),
                             *((dv[OWG]["dot"][k], tdv[OWG]["dot"][k], k) for k in KEYS)):
        assert_same(ours, twin, what)


def check_against_twin(case: str, recipe: Any, jit: bool) -> None:
    lhs, rhs, dn, g = inputs(case)
    ours = Contract(dn, recipe, True)
    if isinstance(recipe, fp8core.DelayedScaling):
        v = {OWG: stepped_state(ours, lhs, rhs, g)}
        twin, tv = Contract(dn, recipe, False), v
    else:
        v = {}
        twin_recipe, state = current_as_delayed(lhs, rhs, g, recipe)
        twin, tv = Contract(dn, twin_recipe, False), {OWG: state}
    y, (dv, dl, dr) = vjp(ours, v, lhs, rhs, g, jit)
    ty, (tdv, tdl, tdr) = vjp(twin, tv, lhs, rhs, g, jit)
    assert y.shape == lax.dot_general(lhs, rhs, dn).shape
    assert_same(y, ty, "y")
    assert_same(dl, tdl, "dlhs")
    assert_same(dr, tdr, "drhs")
    if isinstance(recipe, fp8core.DelayedScaling):
        for key in KEYS:
            assert_same(dv[OWG]["dot"][key], tdv[OWG]["dot"][key], key)
    # and not far from the high-precision contraction (the twin shares the pipeline's bugs, not this)
    exact = lax.dot_general(lhs, rhs, dn, precision=lax.Precision.HIGHEST)
    assert float(jnp.abs(y - exact).max()) <= 0.2 * float(jnp.abs(exact).max()) + 1e-6


def sat_cast(x: np.ndarray, scale: np.float32, dtype: Any) -> np.ndarray:
    """The contract's quantize, written out: one fp32 multiply, saturate, RTNE; as float64 values."""
    big = float(ml_dtypes.finfo(dtype).max)
    return np.clip(np.asarray(x, np.float32) * scale, -big, big).astype(dtype).astype(np.float64)


@pytest.mark.usefixtures("on_the_cpu")
def test_attention_scores_equal_numpy():
    """ "bqhd,bkhd->bhqk" (d = 10, seq 5 and 7: every GEMM dim padded) against NumPy: quantize with the
    delayed scales, D = (sum q·k) · sa · sb in float64 rounded once to fp32, both gradients, next state."""
    lhs, rhs, dn, g = inputs("qk")
    model = Contract(dn, DELAYED, True)
    state = stepped_state(model, lhs, rhs, g)
    y, (dv, dl, dr) = vjp(model, {OWG: state}, lhs, rhs, g)
    s, si = (np.asarray(state["dot"][k]) for k in ("scale", "scale_inv"))
    e4, e5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    q, k, gg = sat_cast(lhs, s[0], e4), sat_cast(rhs, s[1], e4), sat_cast(g, s[2], e5)
    si = si.astype(np.float64)

    def f32(v):
        return v.astype(np.float32)

    np.testing.assert_array_equal(bits(y), bits(f32(np.einsum("bqhd,bkhd->bhqk", q, k) * si[0] * si[1])))
    np.testing.assert_array_equal(bits(dl), bits(f32(np.einsum("bhqk,bkhd->bqhd", gg, k) * si[2] * si[1])))
    np.testing.assert_array_equal(bits(dr), bits(f32(np.einsum("bqhd,bhqk->bkhd", q, gg) * si[0] * si[2])))
    ref = fp8core.ScalingState(3, DELAYED, formats=["e4m3", "e4m3", "e5m2"])
    for key in KEYS:
        getattr(ref, key)[...] = np.asarray(state["dot"][key])
    ref.amax_history[0] = [np.abs(np.asarray(t, np.float32)).max() for t in (lhs, rhs, g)]
    ref.update()
    for key in KEYS:
        np.testing.assert_array_equal(bits(dv[OWG]["dot"][key]), bits(getattr(ref, key)), key)


class Attention(nn.Module):
    """Tiny multi-head self-attention, every matmul in fp8: the projections by nn.DenseGeneral, q·kᵀ and p·v
    by Fp8Einsum. Head dim 10, so every attention GEMM is padded."""

    heads: int = 2
    head_dim: int = 10
    recipe: Any = DELAYED

    @nn.compact
    def __call__(self, x):
        dot = partial(fj.Fp8DotGeneral, recipe=self.recipe)
        qkv = nn.DenseGeneral((3, self.heads, self.head_dim), dot_general_cls=dot)(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = fj.Fp8Einsum(recipe=self.recipe, name="qk")("bqhd,bkhd->bhqk", q, k) / np.sqrt(self.head_dim)
        p = jax.nn.softmax(scores, axis=-1)
        o = fj.Fp8Einsum(recipe=self.recipe, name="pv")("bhqk,bkhd->bqhd", p, v)
        return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), dot_general_cls=dot)(o)


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_attention_trains_under_jit(recipe):
    x = jax.random.normal(jax.random.PRNGKey(4), (3, 7, 12))
    target = jnp.cumsum(x, axis=1) / jnp.arange(1, 8)[:, None]  # the running mean of the tokens
    model = Attention(recipe=recipe)
    v = model.init(jax.random.PRNGKey(0), x)

    @jax.jit
    def step(v):
        loss, gr = jax.value_and_grad(lambda v: jnp.mean((model.apply(v, x) - target) ** 2))(v)
        new = {"params": jax.tree.map(lambda p, d: p - 0.3 * d, v["params"], gr["params"])}
        return loss, (new | {OWG: gr[OWG]}) if OWG in v else new

    losses = []
    for _ in range(8):
        loss, v = step(v)
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses
    if recipe is DELAYED:
        for name in ("qk", "pv"):
            st = v[OWG][name]
            assert np.isfinite(np.asarray(st["scale"])).all() and (np.asarray(st["scale"]) != 1).all(), name
            assert (np.asarray(st["amax_history"]) > 0).any(axis=0).all(), name


def einsum_call(eqn: str, lhs: Any, rhs: Any) -> tuple[bool, Any]:
    """How jnp.einsum calls its dot_general: (operands swapped, dimension numbers). It may pass rhs first."""
    assert lhs.shape != rhs.shape
    seen = []

    def spy(a, b, dn, *args, **kwargs):
        seen.append((a.shape != lhs.shape, dn))
        return lax.dot_general(a, b, dn)

    jnp.einsum(eqn, lhs, rhs, _dot_general=spy)
    (call,) = seen
    return call


class Einsum(nn.Module):
    """Fp8Einsum ("dot"), or (the twin) the same einsum with its one contraction done by an Fp8DotGeneral
    ("dot") called once per batch element with the dims and operand order jnp.einsum uses, then laid out by
    jnp.einsum itself (its dot_general returns the twin's result)."""

    eqn: str
    batched: bool

    @nn.compact
    def __call__(self, a, b):
        if self.batched:
            return fj.Fp8Einsum(recipe=DELAYED, name="dot")(self.eqn, a, b)
        swapped, dn = einsum_call(self.eqn, a, b)
        y = per_element(fj.Fp8DotGeneral(recipe=DELAYED, name="dot"), *((b, a) if swapped else (a, b)), dn)
        return jnp.einsum(self.eqn, a, b, _dot_general=lambda *args, **kwargs: y)


@pytest.mark.parametrize("case, eqn", [("qk", "bqhd,bkhd->bhqk"), ("pv", "bhqk,bkhd->bqhd")])
def test_attention_einsums_are_the_unbatched_op_per_element(case, eqn):
    lhs, rhs, _, _ = inputs(case)
    g = jax.random.normal(jax.random.PRNGKey(3), jnp.einsum(eqn, lhs, rhs).shape) * 7
    state = stepped_state(Einsum(eqn, True), lhs, rhs, g)
    y, (dv, dl, dr) = vjp(Einsum(eqn, True), {OWG: state}, lhs, rhs, g)
    ty, (tdv, tdl, tdr) = vjp(Einsum(eqn, False), {OWG: state}, lhs, rhs, g)
    assert_same(y, ty, "y")
    assert_same(dl, tdl, "dlhs")
    assert_same(dr, tdr, "drhs")
    for key in KEYS:
        assert_same(dv[OWG]["dot"][key], tdv[OWG]["dot"][key], key)


def test_dense_general_batch_dims():
    """nn.DenseGeneral(batch_dims=(0,)): a kernel per batch element, each the unbatched op's."""
    x = jax.random.normal(jax.random.PRNGKey(5), (3, 5, 20))
    layer = nn.DenseGeneral(10, batch_dims=(0,), use_bias=False, dot_general_cls=partial(fj.Fp8DotGeneral,
                                                                                       recipe=DELAYED))
    v = layer.init(jax.random.PRNGKey(0), x)
    kernel = v["params"]["kernel"]
    assert kernel.shape == (3, 20, 10)
    g = jax.random.normal(jax.random.PRNGKey(6), (3, 5, 10))
    dn = (((2,), (1,)), ((0,), (0,)))
    state = {OWG: {"dot": v[OWG]["Fp8DotGeneral_0"]}}
    state = {OWG: vjp(Contract(dn, DELAYED, True), state, x, kernel, g)[1][0][OWG]}

    def apply(params_state, x, kernel):
        return layer.apply({"params": {"kernel": kernel}, OWG: {"Fp8DotGeneral_0": params_state[OWG]["dot"]}}, x)

    y, back = jax.vjp(apply, state, x, kernel)
    dv, dx, dk = back(g)
    ty, (tdv, tdx, tdk) = vjp(Contract(dn, DELAYED, False), state, x, kernel, g)
    assert_same(y, ty, "y")
    assert_same(dx, tdx, "dx")
    assert_same(dk, tdk, "dkernel")
    for key in KEYS:
        assert_same(dv[OWG]["dot"][key], tdv[OWG]["dot"][key], key)


def test_empty_batch():
    """A zero-size batch dim: empty output and gradients, and the state of zero amaxes (no scale moves)."""
    lhs, rhs = jnp.ones((0, 5, 10)), jnp.ones((0, 10, 3))
    dn = (((2,), (1,)), ((0,), (0,)))
    g = jnp.ones((0, 5, 3))
    model = Contract(dn, DELAYED, True)
    v = model.init(jax.random.PRNGKey(0), lhs, rhs)
    y, (dv, dl, dr) = vjp(model, v, lhs, rhs, g)
    assert y.shape == (0, 5, 3) and dl.shape == lhs.shape and dr.shape == rhs.shape
    ref = fp8core.ScalingState(3, DELAYED, formats=["e4m3", "e4m3", "e5m2"])
    ref.update()
    for key in KEYS:
        np.testing.assert_array_equal(bits(dv[OWG]["dot"][key]), bits(getattr(ref, key)), key)


def test_functional_and_sharded_paths():
    """fj.fp8_dot_general with batch dims is Fp8DotGeneral's op; with axis_name inside a one-device shard_map
    (the amaxes MAX-reduced first) the results are the same bits."""
    lhs, rhs, dn, g = inputs("pv")
    state = stepped_state(Contract(dn, DELAYED, True), lhs, rhs, g)
    st = state["dot"]
    ty, (tdv, tdl, tdr) = vjp(Contract(dn, DELAYED, True), {OWG: state}, lhs, rhs, g)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    for axis_name in (None, "data"):
        def f(s, a, b, axis_name=axis_name):
            return fj.fp8_dot_general(a, b, dn, s, DELAYED, axis_name=axis_name)

        if axis_name is not None:
            f = jax.shard_map(f, mesh=mesh, in_specs=jax.sharding.PartitionSpec(),
                              out_specs=jax.sharding.PartitionSpec())
        y, back = jax.vjp(jax.jit(f), st, lhs, rhs)
        dv, dl, dr = back(g)
        assert_same(y, ty, f"y {axis_name}")
        assert_same(dl, tdl, f"dlhs {axis_name}")
        assert_same(dr, tdr, f"drhs {axis_name}")
        for key in KEYS:
            assert_same(dv[key], tdv[OWG]["dot"][key], f"{key} {axis_name}")

    def current(a, b):
        return fj.fp8_dot_general(a, b, dn, None, CURRENT, axis_name="data")

    sharded = jax.jit(jax.shard_map(current, mesh=mesh, in_specs=jax.sharding.PartitionSpec(),
                                    out_specs=jax.sharding.PartitionSpec()))
    assert_same(sharded(lhs, rhs), jax.jit(partial(fj.fp8_dot_general, dimension_numbers=dn, state=None,
                                                   recipe=CURRENT))(lhs, rhs), "current, axis_name")


@pytest.mark.parametrize("lshape, rshape, dn, message", [
    ((2, 5, 16), (3, 16, 16), (((2,), (1,)), ((0,), (0,))), r"dimension_numbers: batch dims \(0,\) of lhs \(2, 5, 16\) "
     r"and \(0,\) of rhs \(3, 16, 16\) do not match"),
    ((2, 3, 16), (2, 3, 16), (((2,), (2,)), ((0, 1), (0,))), r"dimension_numbers: batch dims \(0, 1\) of lhs"),
    ((2, 5, 16), (2, 16, 16), (((2,), (1,)), ((2,), (0,))), r"dimension_numbers: lhs's batch dims \(2,\) and "
     r"contracting dims \(2,\) repeat a dimension"),
    ((2, 5, 16), (2, 16, 16), (((2,), (1,)), ((3,), (0,))), r"dimension_numbers: batch dim 3 of lhs is not a "
     r"dimension of its shape \(2, 5, 16\)"),
    ((2, 5, 16), (2, 12, 16), (((2,), (1,)), ((0,), (0,))), r"dimension_numbers: contracting dims \(2,\) of lhs"),
    # no batch dims: the unbatched layout checks its dims the same way (it once wrapped 3 to 0 silently)
    ((5, 16), (16, 16), (((3,), (0,)), ((), ())), r"dimension_numbers: contracting dim 3 of lhs is not a "
     r"dimension of its shape \(5, 16\)"),
    ((16, 16), (16, 16), (((0, 0), (0, 1)), ((), ())), r"dimension_numbers: lhs's contracting dims \(0, 0\) "
     r"repeat a dimension"),
    ((16, 16), (16, 16), (((True,), (0,)), ((), ())), r"dimension_numbers: contracting dim True of lhs is not a "
     r"dimension"),  # a bool is not a dimension (it was taken as 1)
])
def test_bad_batch_dims_refused_by_name(lshape, rshape, dn, message):
    lhs, rhs = jnp.ones(lshape), jnp.ones(rshape)
    state = fj.init_state(DELAYED)
    with pytest.raises(ValueError, match=message):
        fj.fp8_dot_general(lhs, rhs, dn, state, DELAYED)
    model = Contract(dn, DELAYED, True)
    with pytest.raises(ValueError, match=message):
        jax.jit(model.init)(jax.random.PRNGKey(0), lhs, rhs)


def q8(shape, seed, fmt="e4m3"):
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(seed), shape)) * 4
    return jnp.asarray(fp8core.quantize(x, 1.0, fmt))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_batched_gemm_primitive(jit):
    """fj.gemm on [..., M, K] x [..., N, K]: each element the 2-D GEMM, with the bias; an empty batch."""
    a, b = q8((2, 3, 20, 32), 1), q8((2, 3, 16, 32), 2, "e5m2")
    bias = jnp.asarray(np.arange(16), jnp.bfloat16)
    f = partial(fj.gemm, out_dtype=jnp.float32)
    run = jax.jit(f) if jit else f
    y = run(a, b, 0.5, jnp.full(1, 3.0), bias=bias)
    assert y.shape == (2, 3, 20, 16)
    for i in range(2):
        for j in range(3):
            assert_same(y[i, j], f(a[i, j], b[i, j], 0.5, jnp.full(1, 3.0), bias=bias), f"{i},{j}")
    assert run(a[:0], b[:0], 1.0, 1.0).shape == (0, 3, 20, 16)


@pytest.mark.parametrize("ashape, bshape, message", [
    ((2, 3, 16, 32), (2, 4, 16, 32), r"b: expected batch dims \(2, 3\) \(a's leading dims"),
    ((16, 32), (2, 16, 32), r"b: expected batch dims \(\)"),
    ((32,), (2, 16, 32), r"a: expected a \[\.\.\., M, K\] array, got shape \(32,\)"),
    ((2, 16, 24), (2, 16, 24), r"a: K = 24; cuBLASLt's FP8 GEMM needs K to be a positive multiple of 16"),
    ((2, 16, 32), (2, 10, 32), r"b: N = 10"),
])
def test_batched_gemm_refusals(ashape, bshape, message):
    with pytest.raises(ValueError, match=message):
        fj.gemm(q8(ashape, 1), q8(bshape, 2), 1.0, 1.0)
    with pytest.raises(ValueError, match=message):
        jax.jit(fj.gemm)(q8(ashape, 1), q8(bshape, 2), 1.0, 1.0)


def test_batched_gemm_refuses_e5m2_pair_and_bad_bias():
    with pytest.raises(ValueError, match=r"a, b: E5M2 x E5M2 has no FP8 GEMM"):
        fj.gemm(q8((2, 16, 16), 1, "e5m2"), q8((2, 16, 16), 2, "e5m2"), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"bias: expected shape \(16,\) \(N\), got \(2, 16\)"):
        fj.gemm(q8((2, 16, 16), 1), q8((2, 16, 16), 2), 1.0, 1.0, bias=jnp.zeros((2, 16), jnp.bfloat16))
