"""NVFP4BlockScaling in fp8core.jax.dense, CPU, with and without jit: the same bits as fp8core.torch's Float8Linear on
the same data and seed (forward, dgrad and wgrad, step after step as the offset advances), and a run repeated with
the same seed is bit-identical."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402

import fp8core  # noqa: E402
import fp8core.jax as fj  # noqa: E402
from fp8core.jax import fp4 as jfp4  # noqa: E402
from fp8core.torch import Float8Linear, autocast  # noqa: E402

NVFP4 = fp8core.NVFP4BlockScaling()
RECIPES = {"default": NVFP4, "no_rht_1x16": fp8core.NVFP4BlockScaling(disable_rht=True, disable_2d_quantization=True),
           "nearest": fp8core.NVFP4BlockScaling(disable_stochastic_rounding=True)}
DTYPES = {"float32": (torch.float32, jnp.float32), "bfloat16": (torch.bfloat16, jnp.bfloat16)}


def bits(a):
    a = np.asarray(a.detach().float() if isinstance(a, torch.Tensor) else jnp.asarray(a, jnp.float32))
    return a.view(np.uint32)


def to_jax(t, dtype):
    return jnp.asarray(t.detach().float().numpy()).astype(dtype)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
def test_dense_equals_torch_float8_linear_bit_for_bit(recipe, dtype, jit):
    tdt, jdt = DTYPES[dtype]
    torch.manual_seed(2)
    lin = Float8Linear(64, 32, recipe=recipe, bias=False, dtype=tdt)
    state = fj.init_state(recipe, seed=int(lin.fp4_rng[0]))
    w = to_jax(lin.weight, jdt)

    def grads(x, w, state, dy):
        y, vjp, new = jax.vjp(lambda x, w: fj.dense(x, w, state, recipe), x, w, has_aux=True)
        return (y, *vjp(dy), new)

    run = jax.jit(grads) if jit else grads
    for _ in range(2):  # the second step: offset 2, new bytes on both sides
        x = torch.randn(3, 17, 64, dtype=tdt)  # 51 tokens, padded to 64
        dy = torch.randn(3, 17, 32, dtype=tdt)
        xa = x.clone().requires_grad_()
        with autocast():
            y = lin(xa)
        y.backward(dy)
        yj, dx, dw, state = run(to_jax(x, jdt), w, state, to_jax(dy, jdt))
        assert yj.dtype == jdt and dw.dtype == jdt
        np.testing.assert_array_equal(bits(yj), bits(y))
        np.testing.assert_array_equal(bits(dx), bits(xa.grad))
        np.testing.assert_array_equal(bits(dw), bits(lin.weight.grad))
        lin.weight.grad = None
    rng = np.asarray(state["rng"]).astype(np.uint64)
    assert int(rng[0] | rng[1] << np.uint64(32)) == int(lin.fp4_rng[0]) and int(rng[2]) == int(lin.fp4_rng[1]) == 4


def relu_mlp_torch(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(128, 64, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(64, 32, bias=False))
    return fp8core.torch.convert_to_float8(model, NVFP4)


def jax_sgd(params, states, batches, lr, jit):
    """SGD steps of the two-layer ReLU MLP on (x, dy) batches: (params, states) after them."""
    def forward(params, states, x):
        h, s0 = fj.dense(x, params[0], states[0], NVFP4)
        y, s1 = fj.dense(jax.nn.relu(h), params[1], states[1], NVFP4)
        return y, (s0, s1)

    def grads(params, states, x, dy):
        _, vjp, states = jax.vjp(lambda p: forward(p, states, x), params, has_aux=True)
        return vjp(dy)[0], list(states)

    grads = jax.jit(grads) if jit else grads
    for x, dy in batches:
        g, states = grads(params, states, x, dy)
        params = [p - lr * gp for p, gp in zip(params, g)]  # outside jit: XLA would fuse it into one FMA
    return params, states


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_mlp_trained_in_jax_and_in_torch_gives_the_same_weights(jit):
    # ReLU, no bias, a given grad_output and plain SGD: every operation outside fp8core is exact or one rounding in
    # both frameworks, so the weights after 3 steps agree bit for bit only if every NVFP4 GEMM does
    model = relu_mlp_torch(4)
    params = [jnp.asarray(m.weight.detach().numpy()) for m in (model[0], model[2])]
    states = [fj.init_state(NVFP4, seed=int(m.fp4_rng[0])) for m in (model[0], model[2])]
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(40, 128, generator=g), torch.randn(40, 32, generator=g)) for _ in range(3)]
    for x, dy in batches:
        model(x).backward(dy)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad  # two roundings, as in JAX (torch's SGD fuses them)
                p.grad = None
    params, states = jax_sgd(params, states, [(jnp.asarray(x.numpy()), jnp.asarray(dy.numpy())) for x, dy in batches],
                             0.05, jit)
    for p, m in zip(params, (model[0], model[2])):
        np.testing.assert_array_equal(bits(p), bits(m.weight))
    assert all(int(s["rng"][2]) == 6 for s in states)


def test_a_run_repeated_with_the_same_seed_is_bit_identical_and_another_seed_differs():
    rng = np.random.default_rng(0)
    w0 = [jnp.asarray(rng.standard_normal((64, 128)), jnp.float32) * 0.1,
          jnp.asarray(rng.standard_normal((32, 64)), jnp.float32) * 0.1]
    batches = [(jnp.asarray(rng.standard_normal((40, 128)), jnp.float32),
                jnp.asarray(rng.standard_normal((40, 32)), jnp.float32)) for _ in range(2)]
    runs = [jax_sgd(w0, [fj.init_state(NVFP4, seed=s) for s in seeds], batches, 0.05, True)[0]
            for seeds in ((7, 8), (7, 8), (9, 8))]
    for a, b in zip(runs[0], runs[1]):
        np.testing.assert_array_equal(bits(a), bits(b))
    assert not np.array_equal(bits(runs[0][0]), bits(runs[2][0]))


def test_the_offset_carries_into_the_high_word():
    state = {"rng": jfp4.rng_state(5, 2 ** 32 - 1)}
    _, new = fj.dense(jnp.ones((32, 32)), jnp.ones((32, 32)), state, NVFP4)
    assert np.asarray(new["rng"]).tolist() == [5, 0, 1, 1]


def test_bad_state_and_shapes_are_named():
    with pytest.raises(TypeError, match=r"state: expected NVFP4BlockScaling's state \{'rng': uint32 \[4\]\}"):
        fj.dense(jnp.ones((32, 32)), jnp.ones((32, 32)), None, NVFP4)
    with pytest.raises(ValueError, match=r"state\['rng'\]: expected uint32 \[4\]"):
        fj.dense(jnp.ones((32, 32)), jnp.ones((32, 32)), {"rng": jnp.zeros(2, jnp.int32)}, NVFP4)
    with pytest.raises(ValueError, match=r"N, K multiples of 32 under NVFP4BlockScaling"):
        fj.dense(jnp.ones((32, 48)), jnp.ones((32, 48)), fj.init_state(NVFP4), NVFP4)
    with pytest.raises(ValueError, match=r"seed: expected an unsigned 64-bit integer"):
        fj.init_state(NVFP4, seed=-1)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_the_primitives_are_the_cores_bits(jit):
    x = np.random.default_rng(3).standard_normal((48, 64)).astype(np.float32)
    x[5, 7] = np.nan
    seed, offset = 2 ** 63 + 11, 2 ** 32 + 5
    rng = jfp4.rng_state(seed, offset)

    def run(x, rng):
        t = jfp4.quantize_nvfp4(x, hadamard=True, stochastic=True, rng=rng, stream=1, columnwise=True)
        w = jfp4.quantize_nvfp4(x, weight_2d=True)
        return tuple(t), tuple(w), jfp4.nvfp4_gemm(w, w, jnp.float32)

    t, w, y = (jax.jit(run) if jit else run)(jnp.asarray(x), rng)
    want_t = fp8core.quantize_nvfp4(x, hadamard=True, rounding="stochastic", seed=seed, offset=offset + 1,
                                    columnwise=True)
    want_w = fp8core.quantize_nvfp4(x, weight_2d=True)
    for got, want in zip(t + w, tuple(want_t) + tuple(want_w)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    np.testing.assert_array_equal(bits(y), bits(fp8core.gemm(want_w, want_w, out_dtype="float32")))


def test_the_quantize_callback_hands_its_state_buffer_on_unread(monkeypatch):
    """Under jit the callback passes the state's own buffer as rng_state and the stream as the offset to add: the
    kernel reads it where XLA keeps it (on a GPU, device memory on XLA's stream), nothing reads it to the host. The
    state's offset 2**64 - 1 plus stream 1 wraps to 0, as by value."""
    from fp8core._tensor import Tensor

    seen = []
    quantize = fp8core.quantize_nvfp4

    def spy(x, **kw):
        seen.append(kw)
        return quantize(x, **kw)

    monkeypatch.setattr(fp8core, "quantize_nvfp4", spy)
    x = np.random.default_rng(4).standard_normal((32, 64)).astype(np.float32)
    rng = jfp4.rng_state(2 ** 40 + 9, 2 ** 64 - 1)
    got = jax.jit(lambda x, r: tuple(jfp4.quantize_nvfp4(x, stochastic=True, rng=r, stream=1)))(jnp.asarray(x), rng)
    (kw,) = seen
    state = kw["rng_state"]
    assert isinstance(state, Tensor) and state.dtype == "uint32" and state.shape == (4,) and kw["offset"] == 1
    assert "seed" not in kw
    want = quantize(x, rounding="stochastic", seed=2 ** 40 + 9, offset=0)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_mxfp4_and_the_dequantizers_are_the_cores_bits(jit):
    x = np.random.default_rng(4).standard_normal((64, 96)).astype(np.float32)
    x[1, :3] = [np.nan, np.inf, -0.0]

    def run(x):
        m = jfp4.quantize_mxfp4(x, rounding="floor", columnwise=True)
        n = jfp4.quantize_nvfp4(x, weight_2d=True)
        return tuple(m), jfp4.dequantize_mxfp4(m, jnp.bfloat16), jfp4.dequantize_nvfp4(n)

    m, ym, yn = (jax.jit(run) if jit else run)(jnp.asarray(x))
    want = fp8core.quantize_mxfp4(x, rounding="floor", columnwise=True)
    for got, ref in zip(m, want):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(ref).view(np.uint8))
    np.testing.assert_array_equal(bits(ym), bits(fp8core.dequantize_mxfp4(want, "bfloat16")))
    np.testing.assert_array_equal(bits(yn), bits(fp8core.dequantize_nvfp4(fp8core.quantize_nvfp4(x, weight_2d=True))))
    x40 = np.ascontiguousarray(x[:, :40])  # K = 40: not whole blocks of 32
    with pytest.raises(ValueError) as core:
        fp8core.quantize_mxfp4(x40)
    with pytest.raises(ValueError) as ours:
        jfp4.quantize_mxfp4(jnp.asarray(x40))
    assert str(ours.value) == str(core.value)
    with pytest.raises(TypeError, match="t: expected an MXFP4Tensor"):
        jfp4.dequantize_mxfp4(tuple(m))


def test_the_primitives_refuse_as_the_core_does():
    with pytest.raises(ValueError) as core:
        fp8core.quantize_nvfp4(np.ones((20, 32), np.float32), columnwise=True)
    with pytest.raises(ValueError) as ours:
        jfp4.quantize_nvfp4(jnp.ones((20, 32)), columnwise=True)
    assert str(ours.value) == str(core.value)
    with pytest.raises(TypeError, match="b: expected an NVFP4Tensor"):
        jfp4.nvfp4_gemm(jfp4.quantize_nvfp4(jnp.ones((32, 32))), (1, 2, 3))
