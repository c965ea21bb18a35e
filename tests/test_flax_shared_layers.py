"""fp8core.jax.Fp8DotGeneral called more than once in a step (weight tying, a shared encoder): the step ends
with the state one call over all the calls' inputs leaves, bit for bit (the amaxes combined by MAX, the update
taken once), for 2 and 3 calls, across steps, inside nn.remat and in the body of nn.scan; and the outputs
are that call's rows. The twin is a model that makes the one call over the concatenated inputs (its
grad_output the concatenation of the calls' grad_outputs)."""

from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nn = pytest.importorskip("flax.linen")
jnp = jax.numpy

import fp8core  # noqa: E402
import fp8core.jax as fj  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
TOKENS, D_IN, D_OUT = 16, 32, 16
RECIPES = {"max": fp8core.DelayedScaling(amax_history_len=4, amax_compute_algo="max"),
           "most_recent": fp8core.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent", margin=1)}


def bits(v):
    return np.asarray(v).view(np.uint32)


def assert_same(got, want, what):
    flat_got, flat_want = jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(want)
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want], what
    for (path, g), (_, w) in zip(flat_got, flat_want):
        np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"{what}: {jax.tree_util.keystr(path)}")


class Tied(nn.Module):
    """One Dense called on each input: its outputs, one per call."""
    recipe: object

    @nn.compact
    def __call__(self, xs):
        d = nn.Dense(D_OUT, dot_general_cls=partial(fj.Fp8DotGeneral, recipe=self.recipe), name="d")
        return [d(x) for x in xs]


class OneCall(nn.Module):
    """The same Dense (same variables) called once on the inputs concatenated: its output split per input."""
    recipe: object
    features: int = D_OUT

    @nn.compact
    def __call__(self, xs):
        d = nn.Dense(self.features, dot_general_cls=partial(fj.Fp8DotGeneral, recipe=self.recipe), name="d")
        return jnp.split(d(jnp.concatenate(xs)), len(xs))


def data(n, step=0):
    """n inputs of different amaxes, n grad_outputs of different amaxes (the largest not always the last)."""
    k = jax.random.split(jax.random.PRNGKey(100 + step), 2 * n)
    xs = [jax.random.normal(k[i], (TOKENS, D_IN)) * (1 + (i * 7 + step) % n) for i in range(n)]
    gs = [jax.random.normal(k[n + i], (TOKENS, D_OUT)) * (1 + (i * 5 + step + 1) % n) for i in range(n)]
    return xs, gs


def step(model, variables, xs, gs):
    """(outputs, the state's gradient: its next value) of sum_i <y_i, g_i>, whose grad_output for call i is g_i."""
    def loss(v):
        ys = model.apply(v, xs)
        return sum(jnp.vdot(y, g) for y, g in zip(ys, gs)), ys

    grads, ys = jax.jit(jax.grad(loss, has_aux=True))(variables)
    return ys, grads[OWG]


@pytest.mark.parametrize("algo", list(RECIPES))
@pytest.mark.parametrize("n", [2, 3])
def test_calls_end_the_step_as_one_call_over_all_inputs(n, algo):
    recipe = RECIPES[algo]
    xs, _ = data(n)
    variables = Tied(recipe).init(jax.random.PRNGKey(0), xs)
    assert jax.tree.structure(variables) == jax.tree.structure(OneCall(recipe).init(jax.random.PRNGKey(0), xs))
    for s in range(3):  # the later steps start from the state the earlier ones left
        xs, gs = data(n, s)
        ys, state = step(Tied(recipe), variables, xs, gs)
        ys_ref, state_ref = step(OneCall(recipe), variables, xs, gs)
        assert_same(state, state_ref, f"step {s} state")
        assert_same(ys, ys_ref, f"step {s} outputs")
        h = np.asarray(state["d"]["Fp8DotGeneral_0"]["amax_history"])
        assert (h[-1] > 0).all() and (bits(state["d"]["Fp8DotGeneral_0"]["scale"]) != bits(np.float32(1.0))).all()
        variables = {**variables, OWG: state}


def test_the_issue_example_d_x_plus_d_2x():
    """y = d(x) + d(2x): scales as one call over [x; 2x] with the grad_output [g; g]."""
    recipe = RECIPES["max"]
    x = jax.random.normal(jax.random.PRNGKey(1), (TOKENS, D_IN))

    class Sum(nn.Module):
        @nn.compact
        def __call__(self, x):
            d = nn.Dense(D_OUT, dot_general_cls=partial(fj.Fp8DotGeneral, recipe=recipe), name="d")
            return d(x) + d(2 * x)

    variables = Sum().init(jax.random.PRNGKey(0), x)
    got = jax.jit(jax.grad(lambda v: Sum().apply(v, x).sum()))(variables)[OWG]
    _, want = step(OneCall(recipe), variables, [x, 2 * x], [jnp.ones((TOKENS, D_OUT))] * 2)
    assert_same(got, want, "state")
    amax = np.asarray(got["d"]["Fp8DotGeneral_0"]["amax_history"])[-1]
    assert amax[0] == fp8core.amax(np.asarray(2 * x))[0] and amax[2] == 1.0


def test_calls_inside_nn_remat():
    recipe = RECIPES["max"]
    n = 3
    xs, gs = data(n)
    tied = nn.remat(Tied)(recipe)
    variables = tied.init(jax.random.PRNGKey(0), xs)
    ys, state = step(tied, variables, xs, gs)
    ys_ref, state_ref = step(OneCall(recipe), variables, xs, gs)
    assert_same(state, state_ref, "state")
    assert_same(ys, ys_ref, "outputs")


class Block(nn.Module):
    """A residual block calling its Dense twice, for nn.scan (carry, None) -> (carry, None)."""
    recipe: object

    @nn.compact
    def __call__(self, h, _):
        d = nn.Dense(D_IN, dot_general_cls=partial(fj.Fp8DotGeneral, recipe=self.recipe), name="d")
        return h + d(h) + d(h * h), None


def test_calls_inside_an_nn_scan_body_each_layer_its_own_state():
    """nn.scan over 3 layers (parameters and state stacked), each calling its Dense twice: each layer's state
    and the output equal those of the same 3 blocks unrolled, and layer 0's state that of one call over both
    of its calls' inputs."""
    recipe, layers = RECIPES["max"], 3
    x = jax.random.normal(jax.random.PRNGKey(2), (TOKENS, D_IN))
    scanned = nn.scan(Block, variable_axes={"params": 0, OWG: 0}, split_rngs={"params": True}, length=layers)(recipe)
    variables = scanned.init(jax.random.PRNGKey(0), x, None)

    def scan_loss(v):
        return jnp.sum(jnp.sin(scanned.apply(v, x, None)[0]))

    def unrolled(per_layer):
        h = x
        for v in per_layer:
            h = Block(recipe).apply(v, h, None)[0]
        return h

    per_layer = [jax.tree.map(lambda a: a[i], variables) for i in range(layers)]
    got = jax.jit(jax.grad(scan_loss))(variables)[OWG]
    want = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(unrolled(p)))))(per_layer)
    for i in range(layers):
        assert_same(jax.tree.map(lambda a: a[i], got), want[i][OWG], f"layer {i}")
    np.testing.assert_array_equal(bits(jax.jit(scanned.apply)(variables, x, None)[0]),
                                  bits(jax.jit(unrolled)(per_layer)))
    # and layer 0's two calls, d(x) and d(x*x), both fed the grad_output of the layers above: one call
    h1 = Block(recipe).apply(per_layer[0], x, None)[0]
    g1 = jax.grad(lambda h: jnp.sum(jnp.sin(unrolled_from(h, per_layer[1:], recipe))))(h1)
    one = {"params": {"d": per_layer[0]["params"]["d"]}, OWG: {"d": per_layer[0][OWG]["d"]}}
    _, want0 = step(OneCall(recipe, D_IN), one, [x, x * x], [g1, g1])
    assert_same(jax.tree.map(lambda a: a[0], got)["d"], want0["d"], "layer 0 as one call")


def unrolled_from(h, per_layer, recipe):
    for v in per_layer:
        h = Block(recipe).apply(v, h, None)[0]
    return h


def test_two_layers_keep_their_chains_apart():
    """Two layers each called twice, interleaved: each state is its own calls' (the chains are per layer)."""
    recipe = RECIPES["max"]
    xs, gs = data(2)

    class Two(nn.Module):
        @nn.compact
        def __call__(self, xs):
            a = nn.Dense(D_OUT, dot_general_cls=partial(fj.Fp8DotGeneral, recipe=recipe), name="a")
            b = nn.Dense(D_OUT, dot_general_cls=partial(fj.Fp8DotGeneral, recipe=recipe), name="b")
            return [a(xs[0]), b(3 * xs[1]), a(xs[1]), b(xs[0])]

    variables = Two().init(jax.random.PRNGKey(0), xs)
    gs4 = gs + [2 * g for g in gs]
    _, state = step(Two(), variables, xs, gs4)
    for name, (ins, outs) in {"a": ([xs[0], xs[1]], [gs4[0], gs4[2]]),
                              "b": ([3 * xs[1], xs[0]], [gs4[1], gs4[3]])}.items():
        one = {"params": {"d": variables["params"][name]}, OWG: {"d": variables[OWG][name]}}
        _, want = step(OneCall(recipe), one, ins, outs)
        assert_same(state[name], want["d"], name)


def test_functional_state_gradient_is_still_the_next_state():
    """fp8_dot_general with an explicit state, one call: its gradient is ScalingState's next state."""
    recipe = RECIPES["max"]
    x = jax.random.normal(jax.random.PRNGKey(5), (TOKENS, D_IN)) * 3
    w = jax.random.normal(jax.random.PRNGKey(6), (D_IN, D_OUT))
    state = fj.init_state(recipe)
    dn = (((1,), (0,)), ((), ()))
    got = jax.jit(jax.grad(lambda s: fj.fp8_dot_general(x, w, dn, s, recipe).sum()))(state)
    ref = fp8core.ScalingState(3, recipe, formats=["e4m3", "e4m3", "e5m2"])
    ref.amax_history[0] = [fp8core.amax(np.asarray(x))[0], fp8core.amax(np.asarray(w))[0], 1.0]
    ref.update()
    for key in ("amax_history", "scale", "scale_inv"):
        np.testing.assert_array_equal(bits(got[key]), bits(getattr(ref, key)), err_msg=key)


DEFAULTS = [None, jax.lax.Precision.DEFAULT, "default", "fastest", (None, jax.lax.Precision.DEFAULT)]
REFUSED = [jax.lax.Precision.HIGH, jax.lax.Precision.HIGHEST, "highest", "float32", (None, "highest"),
           jax.lax.DotAlgorithmPreset.BF16_BF16_F32, ("default",), 0, "nonsense"]


def _doors(precision, recipe):
    """precision= through every door: nn.Dense, nn.DenseGeneral, Fp8Einsum, fp8_dot_general."""
    x = jax.random.normal(jax.random.PRNGKey(7), (TOKENS, D_IN))
    dot = partial(fj.Fp8DotGeneral, recipe=recipe)
    out = {}
    for name, m in (("Dense", nn.Dense(D_OUT, precision=precision, dot_general_cls=dot)),
                    ("DenseGeneral", nn.DenseGeneral(D_OUT, precision=precision, dot_general_cls=dot))):
        out[name] = m.apply(m.init(jax.random.PRNGKey(0), x), x)

    class E(nn.Module):
        @nn.compact
        def __call__(self, x):
            k = self.param("kernel", nn.initializers.lecun_normal(), (D_IN, D_OUT))
            return fj.Fp8Einsum(recipe=recipe)("tk,kn->tn", x, k, precision=precision)

    out["Fp8Einsum"] = E().apply(E().init(jax.random.PRNGKey(0), x), x)
    w = jax.random.normal(jax.random.PRNGKey(8), (D_IN, D_OUT))
    state = fj.init_state(recipe) if isinstance(recipe, fp8core.DelayedScaling) else None
    out["fp8_dot_general"] = fj.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), state, recipe, precision=precision)
    return out


@pytest.mark.parametrize("recipe", [RECIPES["max"], fp8core.Float8CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("precision", DEFAULTS, ids=repr)
def test_precision_default_is_taken_and_changes_nothing(precision, recipe):
    assert_same(_doors(precision, recipe), _doors(None, recipe), f"precision={precision!r}")


@pytest.mark.parametrize("precision", REFUSED, ids=repr)
def test_precision_asking_for_more_is_refused_by_name(precision):
    """The fp8 GEMM cannot honour HIGH/HIGHEST or an algorithm: refused at trace time, never ignored."""
    x = jax.random.normal(jax.random.PRNGKey(7), (TOKENS, D_IN))
    dense = nn.Dense(D_OUT, precision=precision, dot_general_cls=fj.Fp8DotGeneral)
    with pytest.raises(ValueError, match=r"^precision: fp8 GEMMs take None or lax\.Precision\.DEFAULT .* got "):
        dense.init(jax.random.PRNGKey(0), x)
    w = jnp.ones((D_IN, D_OUT))
    with pytest.raises(ValueError, match=r"^precision: "):
        jax.jit(lambda x, w: fj.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), None,
                                                fp8core.Float8CurrentScaling(), precision=precision))(x, w)
    with pytest.raises(ValueError, match=r"^precision: "):
        fj.Fp8Einsum().init(jax.random.PRNGKey(0), "tk,kn->tn", x, w, precision=precision)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("interval", [2, 3])
def test_interval_moves_the_scales_as_scaling_state(interval, n):
    """recipe.interval > 1: every step's state equals ScalingState's fed the same amaxes (taken outside: the
    inputs, the kernel, the grad_outputs; MAX over the n calls), bit for bit; interval_step is its
    steps % interval."""
    recipe = fp8core.DelayedScaling(amax_history_len=4, amax_compute_algo="max", interval=interval)
    xs, _ = data(n)
    variables = Tied(recipe).init(jax.random.PRNGKey(0), xs)
    st = variables[OWG]["d"]["Fp8DotGeneral_0"]
    assert set(st) == {"amax_history", "scale", "scale_inv", "interval_step"} and float(st["interval_step"]) == 0
    ref = fp8core.ScalingState(3, recipe, formats=["e4m3", "e4m3", "e5m2"])
    moved = 0
    for s in range(2 * interval + 1):
        xs, gs = data(n, s)
        kernel = np.asarray(variables["params"]["d"]["kernel"])
        _, state = step(Tied(recipe), variables, xs, gs)
        ref.amax_history[0] = [max(fp8core.amax(np.asarray(v))[0] for v in vs) for vs in (xs, [kernel], gs)]
        before = ref.scale.copy()
        ref.update()
        moved += not np.array_equal(before, ref.scale)
        got = state["d"]["Fp8DotGeneral_0"]
        for key in ("amax_history", "scale", "scale_inv"):
            np.testing.assert_array_equal(bits(got[key]), bits(getattr(ref, key)), err_msg=f"step {s}: {key}")
        assert float(got["interval_step"]) == ref.steps % interval, s
        variables = {**variables, OWG: state}
    assert moved == 3  # steps 0, interval and 2*interval moved the scales (the amaxes differ step to step)


def test_interval_without_a_step_count_is_refused_by_name():
    """fp8_dot_general's explicit state has no step count: interval > 1 is refused at trace time, not ignored."""
    recipe = fp8core.DelayedScaling(amax_history_len=4, interval=2)
    x, w = jnp.ones((TOKENS, D_IN)), jnp.ones((D_IN, D_OUT))
    with pytest.raises(ValueError, match=r"^recipe: fp8_dot_general's state has no step count.* got interval 2"):
        jax.jit(lambda x, w: fj.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), fj.init_state(recipe), recipe))(x, w)


def test_next_state_with_interval_takes_the_schedule_or_refuses():
    """fj.next_state: interval > 1 without update_scale is refused by name; with it, ScalingState's state at
    steps 0 (the scales move) and 1 (only the history rolls), bit for bit."""
    recipe = fp8core.DelayedScaling(amax_history_len=4, interval=2)
    x = jax.random.normal(jax.random.PRNGKey(9), (TOKENS, D_IN)) * 2
    w = jax.random.normal(jax.random.PRNGKey(10), (D_OUT, D_IN))
    g = jax.random.normal(jax.random.PRNGKey(11), (TOKENS, D_OUT)) * 5

    def loss(w, state):
        y, new = fj.dense(x, w, state, recipe)
        return jnp.vdot(y, g), new

    (_, new), (_, sg) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(w, fj.init_state(recipe))
    with pytest.raises(ValueError, match=r"^update_scale: .* recipe interval 2 needs update_scale="):
        fj.next_state(new, sg, recipe)
    amaxes = [fp8core.amax(np.asarray(v))[0] for v in (x, w, g)]
    for steps in (0, 1):
        ref = fp8core.ScalingState(3, recipe, formats=["e4m3", "e4m3", "e5m2"])
        ref.steps = steps
        ref.amax_history[0] = amaxes
        ref.update()
        got = fj.next_state(new, sg, recipe, update_scale=steps % recipe.interval == 0)
        for key in ("amax_history", "scale", "scale_inv"):
            np.testing.assert_array_equal(bits(got[key]), bits(getattr(ref, key)), err_msg=f"steps {steps}: {key}")
    assert (bits(ref.scale) == bits(np.float32(1))).all()  # steps 1: the scales stayed


def test_a_bound_module_traced_again_starts_a_new_chain():
    """Module.bind keeps one root scope and the same variable arrays across jits: a call in a new trace must
    not take the previous trace's state (it would be an escaped tracer); outputs equal a fresh apply's."""
    recipe = RECIPES["max"]
    xs, gs = data(2)
    tied = Tied(recipe)
    variables = tied.init(jax.random.PRNGKey(0), xs)
    bound = tied.bind(variables)
    for shape_rows in (TOKENS, 2 * TOKENS, TOKENS):
        ins = [jnp.tile(x, (shape_rows // TOKENS, 1)) for x in xs]
        got = jax.jit(lambda ins: bound(ins))(ins)
        assert_same(got, jax.jit(tied.apply)(variables, ins), f"{shape_rows} rows")
    assert_same(bound(xs), tied.apply(variables, xs), "eager")


def test_fp8einsum_called_twice_as_one_call():
    """Fp8Einsum (its dot inside jnp.einsum) chains its calls the same way."""
    recipe = RECIPES["max"]
    xs, gs = data(2)

    class Ein(nn.Module):
        one: bool

        @nn.compact
        def __call__(self, xs):
            k = self.param("kernel", nn.initializers.lecun_normal(), (D_IN, D_OUT))
            e = fj.Fp8Einsum(recipe=recipe, name="e")
            if self.one:
                return jnp.split(e("tk,kn->tn", jnp.concatenate(xs), k), len(xs))
            return [e("tk,kn->tn", x, k) for x in xs]

    variables = Ein(False).init(jax.random.PRNGKey(0), xs)
    ys, state = step(Ein(False), variables, xs, gs)
    ys_ref, state_ref = step(Ein(True), variables, xs, gs)
    assert_same(state, state_ref, "state")
    assert_same(ys, ys_ref, "outputs")


@pytest.mark.parametrize("key, bad, match", [
    ("amax_history", jnp.zeros((3, 3)), r"state\['amax_history'\]: expected shape \(4, 3\), got \(3, 3\)"),
    ("scale", jnp.ones(3, jnp.bfloat16), r"state\['scale'\]: expected float32, got bfloat16"),
    ("interval_step", jnp.zeros(1), r"state\['interval_step'\]: expected a float32 scalar, got float32 \(1,\)"),
])
def test_a_bad_state_in_the_variables_is_refused_by_name(key, bad, match):
    """A checkpoint whose scaling state does not fit the recipe: refused at trace time, naming the entry."""
    recipe = fp8core.DelayedScaling(amax_history_len=4, interval=2)
    xs, _ = data(1)
    variables = Tied(recipe).init(jax.random.PRNGKey(0), xs)
    st = dict(variables[OWG]["d"]["Fp8DotGeneral_0"], **{key: bad})
    variables = {**variables, OWG: {"d": {"Fp8DotGeneral_0": st}}}
    with pytest.raises((ValueError, TypeError), match=match):
        jax.jit(Tied(recipe).apply)(variables, xs)


# Calls JAX traces apart: fj.combine_calls at the top of the loss makes them one call too


class Single(nn.Module):
    """One Dense, one call: applied once per input by the loss."""
    recipe: object

    @nn.compact
    def __call__(self, x):
        return nn.Dense(D_OUT, dot_general_cls=partial(fj.Fp8DotGeneral, recipe=self.recipe), name="d")(x)


@pytest.mark.parametrize("algo", list(RECIPES))
@pytest.mark.parametrize("n", [2, 3])
def test_applies_of_the_same_variables_combine_as_one_call(n, algo):
    """A siamese loss, sum_i <d.apply(v, x_i), g_i>: with combine_calls each step's state is the one call's,
    across steps; without it JAX adds the n updated states (what combine_calls is for)."""
    recipe = RECIPES[algo]
    xs, _ = data(n)
    variables = Single(recipe).init(jax.random.PRNGKey(0), xs[0])
    for s in range(3):
        xs, gs = data(n, s)

        def loss(v, tie=True):
            v = fj.combine_calls(v, recipe) if tie else v
            return sum(jnp.vdot(Single(recipe).apply(v, x), g) for x, g in zip(xs, gs))

        state = jax.jit(jax.grad(loss))(variables)[OWG]
        ys_ref, state_ref = step(OneCall(recipe), variables, xs, gs)  # Single's variables: the one call's
        assert_same(state, state_ref, f"step {s} state")
        assert_same([Single(recipe).apply(variables, x) for x in xs], ys_ref, f"step {s} outputs")
        summed = jax.jit(jax.grad(partial(loss, tie=False)))(variables)[OWG]
        assert not np.array_equal(bits(summed["d"]["Fp8DotGeneral_0"]["scale"]),
                                  bits(state["d"]["Fp8DotGeneral_0"]["scale"]))
        variables = {**variables, OWG: state}


def test_each_call_under_its_own_remat_combines_as_one_call():
    recipe, n = RECIPES["max"], 3
    xs, gs = data(n)

    class RematCalls(nn.Module):
        @nn.compact
        def __call__(self, xs):
            d = nn.Dense(D_OUT, dot_general_cls=partial(fj.Fp8DotGeneral, recipe=recipe), name="d")
            call = nn.remat(lambda mdl, x: mdl(x))
            return [call(d, x) for x in xs]

    variables = RematCalls().init(jax.random.PRNGKey(0), xs)

    def loss(v):
        ys = RematCalls().apply(fj.combine_calls(v, recipe), xs)
        return sum(jnp.vdot(y, g) for y, g in zip(ys, gs))

    state = jax.jit(jax.grad(loss))(variables)[OWG]
    _, want = step(OneCall(recipe), variables, xs, gs)
    assert_same(state, want, "state")


class SharedBlock(nn.Module):
    """A residual block calling its Dense twice, for nn.scan with the parameters and the state broadcast (one
    block applied `layers` times); probes p (zeros) added to each call's output give its grad_output."""
    recipe: object

    @nn.compact
    def __call__(self, h, p):
        d = nn.Dense(D_IN, dot_general_cls=partial(fj.Fp8DotGeneral, recipe=self.recipe), name="d")
        out = jnp.tanh(h + d(h) + p[0] + d(h * h) + p[1])
        return out, h


@pytest.mark.parametrize("interval", [1, 2])
def test_one_state_broadcast_over_nn_scan_combines_as_one_call(interval):
    """nn.scan broadcasting the parameters and the state over 3 iterations, 2 calls each: the state is that of
    one call over the 6 calls' inputs with their grad_outputs (each read from a zero probe's gradient)."""
    recipe = fp8core.DelayedScaling(amax_history_len=4, amax_compute_algo="max", interval=interval)
    layers = 3
    x = jax.random.normal(jax.random.PRNGKey(2), (TOKENS, D_IN))
    probes = jnp.zeros((layers, 2, TOKENS, D_IN))
    scanned = nn.scan(SharedBlock, variable_broadcast=["params", OWG], split_rngs={"params": False},
                      length=layers)(recipe)
    variables = scanned.init(jax.random.PRNGKey(0), x, probes)

    def loss(v, p):
        out, _ = scanned.apply(fj.combine_calls(v, recipe), x, p)
        return jnp.sum(jnp.sin(out))

    grads, g = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables, probes)
    _, hs = jax.jit(scanned.apply)(variables, x, probes)  # each iteration's input h
    ins = [v for h in hs for v in (h, h * h)]
    outs = [g[i, j] for i in range(layers) for j in range(2)]
    one = {"params": {"d": variables["params"]["d"]}, OWG: {"d": variables[OWG]["d"]}}
    _, want = step(OneCall(recipe, D_IN), one, ins, outs)
    assert_same(grads[OWG], want, "state")


def test_combine_calls_refuses_what_does_not_fit_by_name():
    recipe = RECIPES["max"]
    xs, _ = data(1)
    variables = Single(recipe).init(jax.random.PRNGKey(0), xs[0])
    with pytest.raises(ValueError, match=r"state\['amax_history'\]: expected shape \(8, 3\), got \(4, 3\)"):
        fj.combine_calls(variables, fp8core.DelayedScaling(amax_history_len=8))
    with pytest.raises(TypeError, match=r"^variables: expected a flax variables dict with a '_overwrite_with_grad"):
        fj.combine_calls(variables["params"], recipe)
    with pytest.raises(TypeError, match=r"^recipe: expected DelayedScaling"):
        fj.combine_calls(variables, fp8core.Float8CurrentScaling())
    with pytest.raises(ValueError, match=r"^state: already tied"):
        fj.combine_calls(fj.combine_calls(variables, recipe), recipe)


def test_functional_state_tied_takes_the_calls_as_one():
    """fp8_dot_general's explicit state, tied by combine_calls and given to two calls each under its own
    jax.checkpoint: its gradient is the next state of one call over both inputs (untied, the two add)."""
    recipe = RECIPES["max"]
    xs, gs = data(2)
    w = jax.random.normal(jax.random.PRNGKey(6), (D_IN, D_OUT))
    dn = (((1,), (0,)), ((), ()))

    def loss(state, xs, gs):
        tied = fj.combine_calls({OWG: {"layer": state}}, recipe)[OWG]["layer"]
        call = jax.checkpoint(lambda x: fj.fp8_dot_general(x, w, dn, tied, recipe))
        return sum(jnp.vdot(call(x), g) for x, g in zip(xs, gs))

    got = jax.jit(jax.grad(loss))(fj.init_state(recipe), xs, gs)
    want = jax.jit(jax.grad(lambda s: jnp.vdot(fj.fp8_dot_general(jnp.concatenate(xs), w, dn, s, recipe),
                                               jnp.concatenate(gs))))(fj.init_state(recipe))
    assert_same(got, want, "state")


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_applies_with_a_non_finite_input_combine_as_one_call(bad):
    """One of two applies sees a NaN (or inf) input: the tied state is the one call's over both inputs, bit
    for bit (MAX keeps the NaN, the update keeps the scale), whichever apply it is in."""
    recipe = RECIPES["max"]
    xs, gs = data(2)
    variables = Single(recipe).init(jax.random.PRNGKey(0), xs[0])
    for i in range(2):
        ins = [x.at[3, 5].set(bad) if j == i else x for j, x in enumerate(xs)]

        def loss(v):
            v = fj.combine_calls(v, recipe)
            return sum(jnp.vdot(Single(recipe).apply(v, x), g) for x, g in zip(ins, gs))

        state = jax.jit(jax.grad(loss))(variables)[OWG]
        _, want = step(OneCall(recipe), variables, ins, gs)
        assert_same(state, want, f"{bad} in apply {i}")
        assert not np.isfinite(np.asarray(state["d"]["Fp8DotGeneral_0"]["amax_history"])[-1, 0])
