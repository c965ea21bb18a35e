"""fp8core.jax.nnx: the FP8 dot in flax NNX's slots (nnx.Linear, nnx.LinearGeneral, nnx.Einsum, attention's
einsums written out). A small MLP and a one-block transformer train with nnx.Optimizer under nnx.jit and
eagerly, and every step's scaling state (and parameters) equals, bit for bit, that of the same model in Linen
with fp8core.jax.Fp8DotGeneral / Fp8Einsum on the same data; a layer called twice (and under nnx.remat per call)
ends the step as one call over all its inputs; the state in its own Variable type (nnx.state filters,
nnx.Optimizer leaves it alone, nnx.split/merge and orbax round-trip); Linen's layout in and out; out_sharding;
errors."""

from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax")
flax = pytest.importorskip("flax", minversion="0.12", reason="fp8core.jax.nnx is tried with flax 0.12.8 only")
nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")
jnp = jax.numpy

import fp8core  # noqa: E402
import fp8core.jax as fj  # noqa: E402
from fp8core.jax import nnx as fnnx  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
B, T, D, H, HD, F = 2, 8, 32, 2, 16, 48
STEPS, LR = 3, 0.05
RECIPES = {"delayed": fp8core.DelayedScaling(amax_history_len=4, amax_compute_algo="max"),
           "interval": fp8core.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent", margin=1,
                                              interval=2),
           "current": fp8core.Float8CurrentScaling()}


def bits(v):
    return np.asarray(v).view(np.uint32)


def assert_same(got, want, what):
    flat_got, flat_want = jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(want)
    assert len(flat_got) == len(flat_want), what
    for (path, g), (_, w) in zip(flat_got, flat_want):
        np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"{what}: {jax.tree_util.keystr(path)}")


def values(state):
    """An nnx.State as nested dicts of arrays."""
    return nnx.to_pure_dict(state)


def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


# The models, NNX and Linen: the same computation, parameters copied from NNX to Linen


class MLP(nnx.Module):
    def __init__(self, recipe, rngs):
        self.fc1 = nnx.Linear(D, F, dot_general=fnnx.Fp8DotGeneral(recipe), rngs=rngs)
        self.fc2 = nnx.Linear(F, D, dot_general=fnnx.Fp8DotGeneral(recipe), rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class LinenMLP(nn.Module):
    recipe: object

    @nn.compact
    def __call__(self, x):
        dot = partial(fj.Fp8DotGeneral, recipe=self.recipe)
        return nn.Dense(D, dot_general_cls=dot, name="fc2")(jax.nn.gelu(nn.Dense(F, dot_general_cls=dot,
                                                                                   name="fc1")(x)))


def mlp_linen_vars(model):
    p = values(nnx.state(model, nnx.Param))
    s = values(nnx.state(model, fnnx.Fp8State))
    return {"params": {k: p[k] for k in ("fc1", "fc2")},
            **({OWG: {k: {"Fp8DotGeneral_0": s[k]["dot_general"]} for k in ("fc1", "fc2")}} if s else {})}


class Block(nnx.Module):
    """Pre-norm attention (qkv by nnx.LinearGeneral, scores and mixing by Fp8Einsum, the output projection by
    nnx.Einsum) and an MLP (nnx.Linear), every matmul in fp8."""

    def __init__(self, recipe, rngs):
        self.qkv = nnx.LinearGeneral(D, (3, H, HD), dot_general=fnnx.Fp8DotGeneral(recipe), rngs=rngs)
        self.scores = fnnx.Fp8Einsum(recipe)
        self.mix = fnnx.Fp8Einsum(recipe)
        self.out = nnx.Einsum("bthd,hdD->btD", (H, HD, D), einsum_op=fnnx.Fp8Einsum(recipe), rngs=rngs)
        self.fc1 = nnx.Linear(D, F, dot_general=fnnx.Fp8DotGeneral(recipe), rngs=rngs)
        self.fc2 = nnx.Linear(F, D, dot_general=fnnx.Fp8DotGeneral(recipe), rngs=rngs)

    def __call__(self, x):
        q, k, v = jnp.moveaxis(self.qkv(rms(x)), 2, 0)
        p = jax.nn.softmax(self.scores("bqhd,bkhd->bhqk", q, k) / np.sqrt(HD), axis=-1)
        x = x + self.out(self.mix("bhqk,bkhd->bqhd", p, v))
        return x + self.fc2(jax.nn.gelu(self.fc1(rms(x))))


class LinenBlock(nn.Module):
    recipe: object

    @nn.compact
    def __call__(self, x):
        dot = partial(fj.Fp8DotGeneral, recipe=self.recipe)
        qkv = nn.DenseGeneral((3, H, HD), dot_general_cls=dot, name="qkv")(rms(x))
        q, k, v = jnp.moveaxis(qkv, 2, 0)
        s = fj.Fp8Einsum(recipe=self.recipe, name="scores")("bqhd,bkhd->bhqk", q, k)
        p = jax.nn.softmax(s / np.sqrt(HD), axis=-1)
        a = fj.Fp8Einsum(recipe=self.recipe, name="mix")("bhqk,bkhd->bqhd", p, v)
        kernel = self.param("out_kernel", nn.initializers.zeros, (H, HD, D))
        x = x + fj.Fp8Einsum(recipe=self.recipe, name="out")("bthd,hdD->btD", a, kernel)
        h = nn.Dense(F, dot_general_cls=dot, name="fc1")(rms(x))
        return x + nn.Dense(D, dot_general_cls=dot, name="fc2")(jax.nn.gelu(h))


def block_linen_vars(model):
    p = values(nnx.state(model, nnx.Param))
    s = values(nnx.state(model, fnnx.Fp8State))
    params = {"qkv": p["qkv"], "fc1": p["fc1"], "fc2": p["fc2"], "out_kernel": p["out"]["kernel"]}
    if not s:
        return {"params": params}
    owg = {"qkv": {"Fp8DotGeneral_0": s["qkv"]["dot_general"]}, "scores": s["scores"], "mix": s["mix"],
           "out": s["out"]["einsum_op"], "fc1": {"Fp8DotGeneral_0": s["fc1"]["dot_general"]},
           "fc2": {"Fp8DotGeneral_0": s["fc2"]["dot_general"]}}
    return {"params": params, OWG: owg}


MODELS = {"mlp": (MLP, LinenMLP, mlp_linen_vars, (B * T, D)), "block": (Block, LinenBlock, block_linen_vars, (B, T, D))}


def batch(shape, step):
    k1, k2 = jax.random.split(jax.random.PRNGKey(10 + step))
    return jax.random.normal(k1, shape) * (1 + step), jax.random.normal(k2, shape)


def loss_of(y, target):
    return jnp.mean((y - target) ** 2)


@pytest.mark.parametrize("jit", [True, False], ids=["nnx.jit", "eager"])
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("name", list(MODELS))
def test_trains_as_the_linen_op_bit_for_bit(name, recipe, jit):
    """STEPS steps of SGD: after every step the NNX model's Fp8State and parameters equal the Linen model's
    (its _overwrite_with_gradient written back from the gradient, the parameters moved by the same optax
    update), bit for bit; the losses too."""
    nnx_cls, linen_cls, to_linen, shape = MODELS[name]
    r = RECIPES[recipe]
    model = nnx_cls(r, nnx.Rngs(0))
    if name == "block":  # nnx.Einsum's kernel, not zeros: the attention path carries gradient from step 0
        model.out.kernel.set_value(jax.random.normal(jax.random.PRNGKey(3), (H, HD, D)) * 0.2)
    variables = to_linen(model)
    tx = optax.sgd(LR)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    linen = linen_cls(r)

    def nnx_step(model, optimizer, x, target):
        loss, grads = fnnx.value_and_grad(lambda m: loss_of(m(x), target))(model)
        optimizer.update(model, grads)
        return loss

    def linen_step(variables, opt_state, x, target):
        loss, grads = jax.value_and_grad(lambda v: loss_of(linen.apply(v, x), target))(variables)
        updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
        new = {"params": optax.apply_updates(variables["params"], updates)}
        if OWG in grads:
            new[OWG] = grads[OWG]
        return new, opt_state, loss

    # eager against eager: XLA fuses the high-precision ops (gelu) differently inside a jit
    nnx_step, linen_step = (nnx.jit(nnx_step), jax.jit(linen_step)) if jit else (nnx_step, linen_step)
    opt_state = tx.init(variables["params"])
    for s in range(STEPS):
        x, target = batch(shape, s)
        loss = nnx_step(model, optimizer, x, target)
        variables, opt_state, linen_loss = linen_step(variables, opt_state, x, target)
        assert_same(to_linen(model), variables, f"step {s}")
        assert bits(loss) == bits(linen_loss), s
    if recipe != "current":
        scale = values(nnx.state(model, fnnx.Fp8State))["fc1"]["dot_general"]["scale"]
        assert (bits(scale) != bits(np.float32(1))).all()  # the state moved


class Tied(nnx.Module):
    def __init__(self, recipe, rngs, remat=False):
        self.d = nnx.Linear(D, D, dot_general=fnnx.Fp8DotGeneral(recipe), rngs=rngs)
        self.remat = remat

    def __call__(self, xs):
        if self.remat:
            call = nnx.remat(lambda d, x: d(x))
            return [call(self.d, x) for x in xs]
        return [self.d(x) for x in xs]


@pytest.mark.parametrize("remat", [False, True], ids=["twice", "nnx.remat per call"])
def test_a_layer_called_twice_is_one_call_over_both_inputs(remat):
    """A layer called on x1, 3*x2 and x3 in one step (each call under its own nnx.remat too): its state is
    that of the Linen op's one call over the three inputs concatenated with their grad_outputs."""
    r = RECIPES["delayed"]
    model = Tied(r, nnx.Rngs(0), remat)
    xs = [batch((T, D), i)[0] for i in range(3)]
    xs[1] = 3 * xs[1]
    gs = [batch((T, D), 5 + i)[1] * (1 + 2 * (i == 2)) for i in range(3)]
    variables = {"params": {"d": values(nnx.state(model, nnx.Param))["d"]},
                 OWG: {"d": {"Fp8DotGeneral_0": values(nnx.state(model, fnnx.Fp8State))["d"]["dot_general"]}}}
    ys = model(xs)
    nnx.jit(lambda m: fnnx.grad(lambda m: sum(jnp.vdot(y, g) for y, g in zip(m(xs), gs)))(m))(model)
    one = nn.Dense(D, dot_general_cls=partial(fj.Fp8DotGeneral, recipe=r))

    def one_call(v):
        return one.apply({"params": v["params"]["d"], OWG: v[OWG]["d"]}, jnp.concatenate(xs))

    want = jax.grad(lambda v: jnp.vdot(one_call(v), jnp.concatenate(gs)))(variables)
    assert_same(values(nnx.state(model, fnnx.Fp8State))["d"]["dot_general"], want[OWG]["d"]["Fp8DotGeneral_0"],
                "state")
    assert_same(jnp.concatenate(ys), one_call(variables), "outputs: the one call's rows")


class LinenShared(nn.Module):
    """The Linen twin of an nnx.scan over one shared block: nn.scan broadcasting parameters and state."""
    recipe: object

    @nn.compact
    def __call__(self, h, _):
        d = nn.Dense(D, dot_general_cls=partial(fj.Fp8DotGeneral, recipe=self.recipe), name="d")
        return jnp.tanh(h + d(h)), None


def test_nnx_scan_over_a_shared_block_is_one_call_over_every_iteration():
    """nnx.scan applying one block (its layer's state broadcast) 3 times: the state equals the Linen twin's
    under fj.combine_calls (which tests/test_flax_shared_layers.py checks against one call over the 3
    iterations' inputs), bit for bit."""
    r, layers = RECIPES["interval"], 3
    x = batch((T, D), 0)[0]
    model = Tied(r, nnx.Rngs(0))

    def loss(m):
        @nnx.scan(in_axes=(None, nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def body(block, h, _):
            return jnp.tanh(h + block.d(h)), None

        return jnp.sum(jnp.sin(body(m, x, jnp.zeros(layers))[0]))

    variables = {"params": {"d": values(nnx.state(model, nnx.Param))["d"]},
                 OWG: {"d": {"Fp8DotGeneral_0": values(nnx.state(model, fnnx.Fp8State))["d"]["dot_general"]}}}
    nnx.jit(lambda m: fnnx.grad(loss)(m))(model)
    scanned = nn.scan(LinenShared, variable_broadcast=["params", OWG], split_rngs={"params": False},
                      length=layers)(r)
    want = jax.jit(jax.grad(lambda v: jnp.sum(jnp.sin(scanned.apply(fj.combine_calls(v, r), x, None)[0]))))(
        variables)[OWG]
    got = values(nnx.state(model, fnnx.Fp8State))["d"]["dot_general"]
    assert_same(got, want["d"]["Fp8DotGeneral_0"], "state")
    assert float(got["interval_step"]) == 1


def test_a_layer_the_step_does_not_call_keeps_its_state():
    r = RECIPES["delayed"]
    model = MLP(r, nnx.Rngs(0))
    model.fc2.dot_general.scale.set_value(jnp.full(3, 2.0, jnp.float32))
    before = values(nnx.state(model.fc2, fnnx.Fp8State))
    x = batch((T, D), 0)[0]
    fnnx.grad(lambda m: jnp.sum(m.fc1(x)))(model)
    assert_same(values(nnx.state(model.fc2, fnnx.Fp8State)), before, "fc2")
    assert (bits(model.fc1.dot_general.scale.get_value()) != bits(np.float32(1))).all()


def test_the_state_is_its_own_variable_type():
    """nnx.state filters it; nnx.Optimizer over nnx.Param holds no optimizer state for it; nnx.split and
    nnx.merge round-trip it (and the outputs)."""
    model = Block(RECIPES["interval"], nnx.Rngs(0))
    state = values(nnx.state(model, fnnx.Fp8State))
    assert set(state) == {"qkv", "scores", "mix", "out", "fc1", "fc2"}
    assert set(state["scores"]) == {"amax_history", "scale", "scale_inv", "interval_step"}
    params = nnx.state(model, nnx.Param)
    assert not jax.tree.leaves(nnx.filter_state(params, fnnx.Fp8State)) and not issubclass(fnnx.Fp8State, nnx.Param)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    n_params = len(jax.tree.leaves(params))
    assert len(jax.tree.leaves(optimizer.opt_state)) == 2 * n_params + 1  # mu, nu, count: no Fp8State
    x = batch((B, T, D), 0)[0]
    fnnx.grad(lambda m: jnp.sum(m(x)))(model)
    graphdef, params, fp8, rest = nnx.split(model, nnx.Param, fnnx.Fp8State, ...)
    merged = nnx.merge(graphdef, params, fp8, rest)
    assert_same(values(nnx.state(merged, fnnx.Fp8State)), values(nnx.state(model, fnnx.Fp8State)), "merged state")
    assert_same(merged(x), model(x), "outputs")


def test_orbax_checkpoint_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is not installed")
    model = MLP(RECIPES["interval"], nnx.Rngs(0))
    x = batch((T, D), 0)[0]
    fnnx.grad(lambda m: jnp.sum(m(x)))(model)
    _, state = nnx.split(model)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", nnx.to_pure_dict(state))
    fresh = MLP(RECIPES["interval"], nnx.Rngs(1))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: MLP(RECIPES["interval"], nnx.Rngs(1))))
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ckpt", nnx.to_pure_dict(abstract))
    nnx.replace_by_pure_dict(abstract, restored)
    fresh = nnx.merge(graphdef, abstract)
    assert_same(values(nnx.state(fresh)), values(nnx.state(model)), "restored")
    assert (bits(fresh.fc1.dot_general.scale.get_value()) != bits(np.float32(1))).all()


def test_linen_state_moves_over_and_back():
    """A Linen model trained two steps, its state loaded into the NNX model layer by layer: the next step of
    both gives the same state; linen_state gives it back in the Linen layout."""
    r = RECIPES["interval"]
    model = MLP(r, nnx.Rngs(0))
    variables = mlp_linen_vars(model)
    linen = LinenMLP(r)
    for s in range(2):
        x, target = batch((T, D), s)
        grads = jax.jit(jax.grad(lambda v: loss_of(linen.apply(v, x), target)))(variables)
        variables = {**variables, OWG: grads[OWG]}
    for name in ("fc1", "fc2"):
        fnnx.load_linen_state(getattr(model, name).dot_general, variables[OWG][name]["Fp8DotGeneral_0"])
        assert_same(fnnx.linen_state(getattr(model, name).dot_general), variables[OWG][name]["Fp8DotGeneral_0"],
                    name)
    x, target = batch((T, D), 2)
    fnnx.grad(lambda m: loss_of(m(x), target))(model)
    want = jax.grad(lambda v: loss_of(linen.apply(v, x), target))(variables)[OWG]
    assert_same(mlp_linen_vars(model)[OWG], want, "the step after the move")


def test_load_linen_state_refuses_what_does_not_fit_and_writes_nothing():
    layer = fnnx.Fp8DotGeneral(RECIPES["delayed"])
    before = fnnx.linen_state(layer)
    good = {k: v + 1 for k, v in before.items()}
    for bad, match in (({**good, "amax_history": jnp.zeros((8, 3))}, r"state\['amax_history'\]: expected shape"),
                       ({**good, "interval_step": jnp.zeros(())}, r"state: keys \['interval_step'\] are not"),
                       ({k: v for k, v in good.items() if k != "scale"}, r"state: missing key 'scale'"),
                       ([1, 2], r"state: expected a Linen layer state")):
        with pytest.raises((ValueError, TypeError, KeyError), match=match):
            fnnx.load_linen_state(layer, bad)
        assert_same(fnnx.linen_state(layer), before, "nothing written")
    with pytest.raises(ValueError, match=r"^layer: Fp8DotGeneral with Float8CurrentScaling keeps no state"):
        fnnx.linen_state(fnnx.Fp8DotGeneral(fp8core.Float8CurrentScaling()))


def test_plain_nnx_grad_is_refused_by_name():
    """nnx.grad differentiates the nnx.Param only: the update would be lost, so the FP8 layer refuses it while
    tracing, naming what to use; a forward pass needs nothing."""
    model = MLP(RECIPES["delayed"], nnx.Rngs(0))
    x = batch((T, D), 0)[0]
    assert model(x).shape == (T, D)
    with pytest.raises(ValueError, match=r"^Fp8DotGeneral \(nnx\): its scaling state was not differentiated.*"
                                         r"fp8core\.jax\.nnx\.value_and_grad"):
        nnx.grad(lambda m: jnp.sum(m(x)))(model)
    current = MLP(RECIPES["current"], nnx.Rngs(0))  # no state: plain nnx.grad is all it needs
    assert jax.tree.leaves(nnx.grad(lambda m: jnp.sum(m(x)))(current))


def test_out_sharding_is_applied_or_none():
    x = batch((T, D), 0)[0]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
    for recipe in ("delayed", "current"):
        layer = nnx.Linear(D, F, dot_general=fnnx.Fp8DotGeneral(RECIPES[recipe]), rngs=nnx.Rngs(0))
        plain = layer(x)
        y = nnx.jit(lambda m, x: m(x, out_sharding=sharding))(layer, x)
        assert y.sharding.is_equivalent_to(sharding, y.ndim)  # one device: every sharding is this one
        assert_same(y, plain, recipe)
        e = nnx.Einsum("td,dF->tF", (D, F), einsum_op=fnnx.Fp8Einsum(RECIPES[recipe]), rngs=nnx.Rngs(0))
        for m in (layer, e):  # the program asks XLA for it
            jaxpr = str(jax.make_jaxpr(lambda x: m(x, out_sharding=sharding))(x))
            assert "sharding_constraint" in jaxpr and "P('data', None)" in jaxpr, jaxpr[-400:]
            assert "sharding_constraint" not in str(jax.make_jaxpr(lambda x: m(x))(x))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_a_second_derivative_is_refused_by_name(recipe):
    model = MLP(RECIPES[recipe], nnx.Rngs(0))
    x = batch((T, D), 0)[0]
    f = lambda x: jnp.sum(model(x) ** 2)  # noqa: E731
    with pytest.raises(NotImplementedError, match=r"^Fp8DotGeneral \(nnx\): fp8core's FP8 dot has first derivatives"):
        jax.grad(lambda x: jnp.sum(jax.grad(f)(x)))(x)


def test_bad_recipes_are_refused_by_name():
    with pytest.raises(TypeError, match=r"^recipe: expected DelayedScaling, Float8CurrentScaling, Float8RowwiseScaling "
                                        r"or NVFP4BlockScaling"):
        fnnx.Fp8DotGeneral("e4m3")
    with pytest.raises(ValueError, match=r"^recipe: Fp8DotGeneral's functional update takes amax_compute_algo"):
        fnnx.Fp8DotGeneral(fp8core.DelayedScaling(amax_compute_algo=lambda h: h.max(axis=0)))
    with pytest.raises(TypeError, match=r"^argnums: expected an int or an nnx.DiffState"):
        fnnx.value_and_grad(lambda m: 0.0, argnums=(0, 1))


def test_axis_name_under_shard_map_reduces_in_the_tie():
    """axis_name: the tie's update MAX-reduces the amaxes over the mesh axis inside shard_map (a one-device
    mesh here: the state equals the layer's without axis_name, bit for bit; the reduction over two devices is
    the Linen op's, tests/test_flax.py)."""
    r = RECIPES["interval"]
    x = batch((T, D), 0)[0]
    mesh = jax.make_mesh((1,), ("data",))
    sharded = nnx.Linear(D, F, dot_general=fnnx.Fp8DotGeneral(r, axis_name="data"), rngs=nnx.Rngs(0))
    plain = nnx.Linear(D, F, dot_general=fnnx.Fp8DotGeneral(r), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(sharded)

    def step(state, x):
        model = nnx.merge(graphdef, state)
        fnnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        return nnx.state(model, fnnx.Fp8State)

    spec = jax.sharding.PartitionSpec()
    got = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec), out_specs=spec))(state, x)
    fnnx.grad(lambda m: jnp.sum(m(x) ** 2))(plain)
    assert_same(values(got), values(nnx.state(plain, fnnx.Fp8State)), "state")
    assert float(values(got)["dot_general"]["interval_step"]) == 1


@pytest.mark.parametrize("rows", [5, 0], ids=["odd", "empty"])
def test_odd_and_empty_shapes_as_the_linen_op(rows):
    """nnx.Linear(10, 7) on 5 tokens (K, N and the tokens padded inside the op) and on an empty batch: the
    outputs and the state after one step equal the Linen op's, bit for bit."""
    r = RECIPES["delayed"]
    x = jax.random.normal(jax.random.PRNGKey(4), (rows, 10)) * 3
    layer = nnx.Linear(10, 7, dot_general=fnnx.Fp8DotGeneral(r), rngs=nnx.Rngs(0))
    dense = nn.Dense(7, dot_general_cls=partial(fj.Fp8DotGeneral, recipe=r))
    variables = {"params": values(nnx.state(layer, nnx.Param)),
                 OWG: {"Fp8DotGeneral_0": values(nnx.state(layer, fnnx.Fp8State))["dot_general"]}}
    assert_same(layer(x), dense.apply(variables, x), "outputs")
    fnnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(layer)
    want = jax.grad(lambda v: jnp.sum(jnp.sin(dense.apply(v, x))))(variables)[OWG]["Fp8DotGeneral_0"]
    assert_same(values(nnx.state(layer, fnnx.Fp8State))["dot_general"], want, "state")


@pytest.mark.parametrize("jit", [False, True])
def test_rowwise_recipe_in_an_nnx_linear_is_the_cores_rowwise_gemm(jit):
    """Float8RowwiseScaling through the NNX slot: x per token and the kernel per output channel, each along K,
    then the core's rowwise GEMM: the same bits, eager and under jit."""
    recipe = fp8core.Float8RowwiseScaling()
    layer = nnx.Linear(64, 32, use_bias=False, dot_general=fnnx.Fp8DotGeneral(recipe), rngs=nnx.Rngs(0))
    x = np.random.default_rng(5).standard_normal((16, 64)).astype(np.float32)
    run = nnx.jit(lambda m, v: m(v)) if jit else (lambda m, v: m(v))
    got = np.asarray(run(layer, jnp.asarray(x)))
    w = np.asarray(layer.kernel.value)
    q = lambda v: fp8core.quantize_rowwise(v, power_of_2=recipe.power_of_2, epsilon=recipe.epsilon)  # noqa: E731
    want = fp8core.gemm(q(x), q(np.ascontiguousarray(w.T)), out_dtype="float32")
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
