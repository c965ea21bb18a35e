"""fp8core.jax.from_flax_fp8_state / to_flax_fp8_state: a model trained with flax's Fp8DirectDotGeneralOp continues
with fp8core.jax.Fp8DotGeneral (and back) with the same next step, proved two ways: fp8core's step from the
converted state equals a NumPy computation of the contract (written here, fed the amaxes taken from outside the
op), and, the amaxes being the same in both frameworks here (two parallel Dense layers under a loss linear in
their outputs: the grad_output is the loss's coefficients), flax's own next step, converted, equals fp8core's
bit for bit, with flax's next scale equal to the converted scale_inv. fp8core -> flax -> fp8core is the
identity, bit for bit (states from the contract's update, every path of the converter); refusals by name."""

import contextlib
from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nn = pytest.importorskip("flax.linen")
jnp = jax.numpy

import fp8core  # noqa: E402
import fp8core.jax as fj  # noqa: E402
from jax_places import JAX_CPU, jax_gpu  # noqa: E402
from flax.core import FrozenDict  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
L, K_STEPS, TOKENS, D_IN = 4, 6, 32, 24  # 6 steps: flax's window of 4 has wrapped
FMAX = np.array([448, 448, 57344], np.float32)
FLAX = partial(fp8_ops.Fp8DirectDotGeneralOp, amax_history_length=L)
FP8CORE = partial(fj.Fp8DotGeneral, recipe=fp8core.DelayedScaling(amax_history_len=L, amax_compute_algo="max"))


class Inner(nn.Module):
    dot: object

    @nn.compact
    def __call__(self, x):
        return nn.Dense(10, dot_general_cls=self.dot)(x)


class Two(nn.Module):
    """Two layers on the same input, one nested; the loss is linear in their outputs."""
    dot: object

    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, dot_general_cls=self.dot, name="a")(x), Inner(self.dot, name="inner")(x)


_rng = np.random.default_rng(3)
COEF = (_rng.standard_normal((TOKENS, 16)).astype(np.float32),
        _rng.standard_normal((TOKENS, 10)).astype(np.float32) * 3)
# amaxes that rise and fall, so the oldest amax of a window is sometimes its max
XS = [(_rng.standard_normal((TOKENS, D_IN)) * s).astype(np.float32) for s in (1, 8, 2, 3, 0.5, 1, 0.25, 2, 4)]


@partial(jax.jit, static_argnums=0)
def _step(model, variables, x):
    def loss(v):
        a, b = model.apply(v, x)
        return jnp.sum(a * COEF[0]) + jnp.sum(b * COEF[1])

    g = jax.grad(loss)(variables)
    return {"params": jax.tree.map(lambda p, d: p - 0.05 * d, variables["params"], g["params"]), OWG: g[OWG]}


# flax's steps are compared with fp8core's bit for bit where XLA divides as IEEE does: on the CPU. XLA:GPU lowers
# float32 division to PTX's div.full (within 2 ulp), and flax computes its scale as 1 / (fp8_max / amax): the H200
# run found it 1 ulp from the contract's (NumPy's, fp8core's). So training runs on the CPU device unless told.


def train(dot, steps, variables=None, first=0, device=JAX_CPU):
    with jax.default_device(device):
        model = Two(dot)
        if variables is None:
            variables = model.init(jax.random.PRNGKey(0), jnp.asarray(XS[0]))
        for x in XS[first:first + steps]:
            variables = _step(model, variables, jnp.asarray(x))
    return variables


def bits(tree):
    return jax.tree.map(lambda v: np.asarray(v).view(np.uint32).tolist(), tree)


def contract_step(state, amaxes):
    """The contract's delayed-scaling step (docs/numerics.md), "max" over L, margin 0, every amax > 0: NumPy."""
    h = np.asarray(state["amax_history"]).copy()
    h[0] = np.maximum(h[0], amaxes)
    s = FMAX / h.max(axis=0)
    return {"amax_history": np.concatenate([np.zeros((1, 3), np.float32), h[2:], h[:1]]), "scale": s,
            "scale_inv": np.float32(1) / s}


def layers(variables, name):
    owg = variables[OWG]
    return {"a": owg["a"][f"{name}_0"], "inner": owg["inner"]["Dense_0"][f"{name}_0"]}


def kernels(variables):
    p = variables["params"]
    return {"a": p["a"]["kernel"], "inner": p["inner"]["Dense_0"]["kernel"]}


@pytest.fixture(scope="module")
def flax_k():
    return train(FLAX, K_STEPS)


def assert_the_contracts_step(ours, converted, flax_k):
    """fp8core's step from the converted state, ``ours``, is the contract's on the step's amaxes."""
    x = XS[K_STEPS]
    for name, coef in zip(("a", "inner"), COEF):
        amaxes = np.array([np.abs(x).max(), np.abs(np.asarray(kernels(flax_k)[name])).max(), np.abs(coef).max()],
                          np.float32)
        want = contract_step(jax.tree.map(np.asarray, layers(converted, "Fp8DotGeneral")[name]), amaxes)
        assert bits(layers(ours, "Fp8DotGeneral")[name]) == bits(want), name


def test_flax_checkpoint_continues_with_fp8core_as_the_contract_and_as_flax(flax_k):
    converted = fj.from_flax_fp8_state(flax_k)
    assert jax.tree.structure(converted["params"]) == jax.tree.structure(flax_k["params"])
    assert all(a is b for a, b in zip(jax.tree.leaves(converted["params"]), jax.tree.leaves(flax_k["params"])))
    ours = train(FP8CORE, 1, converted, first=K_STEPS)
    assert_the_contracts_step(ours, converted, flax_k)
    # where the recipes agree (the same amaxes here): flax's own next step
    theirs = train(FLAX, 1, flax_k, first=K_STEPS)
    for name in ("a", "inner"):
        used = np.concatenate([np.asarray(layers(theirs, "Fp8DirectDotGeneralOp")[name][f"{o}_scale"])
                               for o in ("input", "kernel", "output_grad")])
        assert bits(used) == bits(layers(converted, "Fp8DotGeneral")[name]["scale_inv"]), name
    assert bits(fj.from_flax_fp8_state(theirs)[OWG]) == bits(ours[OWG])


def test_on_a_gpu_fp8core_continues_a_flax_checkpoint_as_the_contract(flax_k):
    gpu = jax_gpu()
    converted = fj.from_flax_fp8_state(flax_k)
    ours = train(FP8CORE, 1, converted, first=K_STEPS, device=gpu)
    assert all(v.devices() == {gpu} for v in jax.tree.leaves(ours[OWG]))
    assert_the_contracts_step(ours, converted, flax_k)


@pytest.mark.parametrize("flax_cls", ["Fp8DirectDotGeneralOp", "Fp8DotGeneralOp"])
def test_a_fresh_flax_init_converts_to_a_fresh_fp8core_init(flax_cls):
    x = jnp.asarray(XS[0])
    with pytest.warns(DeprecationWarning) if flax_cls == "Fp8DotGeneralOp" else contextlib.nullcontext():
        theirs = Two(partial(getattr(fp8_ops, flax_cls), amax_history_length=L)).init(jax.random.PRNGKey(0), x)
    ours = Two(FP8CORE).init(jax.random.PRNGKey(0), x)
    assert bits(fj.from_flax_fp8_state(theirs)[OWG]) == bits(ours[OWG])
    assert bits(fj.to_flax_fp8_state(ours)[OWG]) == bits(Two(FLAX).init(jax.random.PRNGKey(0), x)[OWG])


def test_fp8core_checkpoint_continues_with_flax(flax_k):
    ours = train(FP8CORE, K_STEPS)
    back = fj.to_flax_fp8_state(ours)
    assert sorted(back[OWG]["a"]) == ["Fp8DirectDotGeneralOp_0"]
    theirs = train(FLAX, 1, back, first=K_STEPS)
    ours_next = train(FP8CORE, 1, ours, first=K_STEPS)
    for name in ("a", "inner"):
        used = np.concatenate([np.asarray(layers(theirs, "Fp8DirectDotGeneralOp")[name][f"{o}_scale"])
                               for o in ("input", "kernel", "output_grad")])
        assert bits(used) == bits(layers(ours, "Fp8DotGeneral")[name]["scale_inv"]), name
    assert bits(fj.from_flax_fp8_state(theirs)[OWG]) == bits(ours_next[OWG])
    assert bits(fj.from_flax_fp8_state(back)) == bits(ours)


def test_a_flax_state_through_fp8core_and_back_takes_flax_s_next_step(flax_k):
    """flax -> fp8core -> flax loses what no next step reads (the scale of the last step, the oldest amax once
    consumed): the next step is the same, bit for bit."""
    again = fj.to_flax_fp8_state(fj.from_flax_fp8_state(flax_k))
    assert bits(train(FLAX, 1, again, first=K_STEPS)[OWG]) == bits(train(FLAX, 1, flax_k, first=K_STEPS)[OWG])


def _contract_states(length, seed):
    """fp8core states after random steps of the contract's update (fp8core.ScalingState): amaxes that rise and
    fall over decades, exact-0 steps (no roll), one NaN step, at every history length."""
    rng = np.random.default_rng(seed)
    st = fp8core.ScalingState(3, fp8core.DelayedScaling(amax_history_len=length), formats=["e4m3", "e4m3", "e5m2"])
    out = [{k: np.asarray(getattr(st, k)).copy() for k in ("amax_history", "scale", "scale_inv")}]
    for i in range(12):
        a = (10.0 ** rng.uniform(-4, 4, 3)).astype(np.float32)
        a[rng.random(3) < 0.2] = 0
        if i == 5:
            a[1] = np.nan
        st.amax_history[0] = a
        st.update()
        out.append({k: np.asarray(getattr(st, k)).copy() for k in ("amax_history", "scale", "scale_inv")})
    return out


@pytest.mark.parametrize("length", [1, 2, 3, 5])
def test_fp8core_to_flax_and_back_is_the_identity(length):
    for i, state in enumerate(_contract_states(length, length)):
        tree = {OWG: {"layer": {"Fp8DotGeneral_3": state}}, "params": {"w": np.ones(2, np.float32)}}
        flax_tree = fj.to_flax_fp8_state(tree)
        layer = flax_tree[OWG]["layer"]["Fp8DirectDotGeneralOp_3"]
        assert all(type(v) is np.ndarray and v.dtype == np.float32 for v in layer.values())
        assert flax_tree["params"]["w"] is tree["params"]["w"]
        assert bits(fj.from_flax_fp8_state(flax_tree)) == bits(tree), f"step {i}"


def test_the_identity_cases_take_every_path_of_the_oldest_slot():
    """flax's oldest slot: 0 (fp8core's scale follows from what it still holds, or flax keeps its scale), an amax
    giving fp8core's scale (the consumed amax was the max), NaN (fp8core kept its scale past a NaN step)."""
    kinds = set()
    for length in (1, 2, 3, 5):
        for state in _contract_states(length, length):
            layer = fj.to_flax_fp8_state({"v": {"Fp8DotGeneral_0": state}})["v"]["Fp8DirectDotGeneralOp_0"]
            for o in ("input", "kernel", "output_grad"):
                v = layer[f"{o}_amax_history"][min(1, length - 1)]
                kinds.add("nan" if np.isnan(v) else "zero" if v == 0 else "amax")
    assert kinds == {"zero", "amax", "nan"}


def test_frozen_dicts_stay_frozen_and_einsum_keeps_its_name(flax_k):
    state = {k: np.asarray(v) for k, v in layers(fj.from_flax_fp8_state(flax_k), "Fp8DotGeneral")["a"].items()}
    tree = FrozenDict({OWG: {"Fp8Einsum_0": state, "mine": state}})
    out = fj.to_flax_fp8_state(tree)
    assert isinstance(out, FrozenDict) and sorted(out[OWG]) == ["Fp8Einsum_0", "mine"]
    assert bits(fj.from_flax_fp8_state(out)) == bits(tree)
    assert sorted(fj.to_flax_fp8_state(tree, rename=False)[OWG]) == ["Fp8Einsum_0", "mine"]


def _flax_layer(**changes):
    layer = {f"{o}_amax_history": np.array([3, 1, 2, 0], np.float32) for o in ("input", "kernel", "output_grad")}
    layer.update({f"{o}_scale": np.array([0.5], np.float32) for o in ("input", "kernel", "output_grad")})
    layer.update(changes)
    return {OWG: {"Fp8DirectDotGeneralOp_0": {k: v for k, v in layer.items() if v is not None}}}


_ODD = np.array([8.3773505e+06, 1, 1], np.float32)
assert not any(np.float32(1) / v == _ODD[0] for v in np.float32(1) / _ODD[0] * np.float32([0.999, 1, 1.001]))


def _core_layer(**changes):
    layer = {"amax_history": np.zeros((2, 3), np.float32), "scale": np.full(3, 4, np.float32),
             "scale_inv": np.full(3, 0.25, np.float32)}
    layer.update(changes)
    return {OWG: {"Fp8DotGeneral_0": {k: v for k, v in layer.items() if v is not None}}}


@pytest.mark.parametrize("tree, match", [
    (_flax_layer(kernel_amax_history=np.zeros(5, np.float32)), r"history lengths differ.*\[4, 5, 4\]"),
    (_flax_layer(input_scale=np.array([0], np.float32)), r"input/kernel/output_grad_scale.*finite scales > 0"),
    (_flax_layer(kernel_scale=np.array([np.inf], np.float32)), r"finite scales > 0"),
    (_flax_layer(output_grad_scale=np.array([np.nan], np.float32)), r"finite scales > 0"),
    (_flax_layer(input_scale=np.array([-1], np.float32)), r"finite scales > 0"),
    (_flax_layer(input_scale=np.array([1e-45], np.float32)), r"1 / \(input/kernel/output_grad_scale\)"),
    (_flax_layer(input_scale=np.array([1, 1], np.float32)), r"input_scale'\]: expected shape \(1,\)"),
    (_flax_layer(input_amax_history=np.zeros(4, np.float64)), r"input_amax_history'\]: expected a float32"),
    (_flax_layer(kernel_scale=None), r"holds exactly .*input_scale"),
    ({"params": {}}, r"no flax fp8 op state"),
    ({OWG: {"Fp8DotGeneralOp_0": _flax_layer()[OWG]["Fp8DirectDotGeneralOp_0"],
            "Fp8DirectDotGeneralOp_0": _flax_layer()[OWG]["Fp8DirectDotGeneralOp_0"]}},
     r"renamed to 'Fp8DotGeneral_0'"),
])
def test_from_flax_refuses_by_name(tree, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fj.from_flax_fp8_state(tree)


@pytest.mark.parametrize("tree, match", [
    (_core_layer(interval_step=np.zeros((), np.float32)), r"interval_step.*interval > 1"),
    (_core_layer(amax_history=np.ones((2, 3), np.float32)), r"row 0 holds amaxes"),
    (_core_layer(scale_inv=np.full(3, 0.5, np.float32)), r"scale_inv'\]: expected 1 / scale"),
    (_core_layer(scale=np.zeros(3, np.float32)), r"scale'\]: expected finite scales > 0"),
    # a 'most_recent' scale under a larger amax, and no float32 number's reciprocal: flax can neither compute
    # nor keep it
    (_core_layer(amax_history=np.array([[0, 0, 0], [1000, 0, 0]], np.float32), scale=_ODD,
                 scale_inv=np.float32(1) / _ODD), r"scale'\]\[0\] \(input\): 8377350.5 is neither"),
    (_core_layer(amax_history=np.zeros((2, 2), np.float32)), r"amax_history \[L >= 1, 3\]"),
    (_core_layer(scale=None), r"fp8core.jax layer's state holds"),
    ({"params": {"scale": np.ones(1, np.float32)}}, r"no fp8core.jax layer state"),
])
def test_to_flax_refuses_by_name(tree, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fj.to_flax_fp8_state(tree)
