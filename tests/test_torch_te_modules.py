"""``import fp8core.torch as te``, the rest of Transformer Engine's spelling as TE users write it: ``te.autocast(True)``
and ``calibrating=``, ``te.fp8_autocast``, ``te.LayerNorm``/``RMSNorm``/``LayerNormLinear``/``LayerNormMLP``,
``te.is_fp8_available()`` and ``te.fp8_model_init``/``quantized_model_init``. Each is checked bit for bit against
what it is made of (torch's norm, te.Linear), and what fp8core does not do is refused by name."""

import pytest

torch = pytest.importorskip("torch")

import fp8core  # noqa: E402
import fp8core.torch as te  # noqa: E402

RECIPE = te.recipe.DelayedScaling(amax_history_len=8)
F = torch.nn.functional


def bits(t):
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def inputs(shape=(4, 8, 64), seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def linear_twin(weight, bias):
    twin = te.Linear(weight.shape[1], weight.shape[0], bias is not None)
    with torch.no_grad():
        twin.weight.copy_(weight)
        if bias is not None:
            twin.bias.copy_(bias)
    return twin


# ---- autocast as TE spells it --------------------------------------------------------------------------------

def test_autocast_takes_enabled_first_as_te_does():
    torch.manual_seed(0)
    layer = te.Linear(64, 64)
    x = inputs()
    hp = F.linear(x, layer.weight, layer.bias)
    with te.autocast(False):
        assert same(layer(x), hp)
    with te.autocast(True, recipe=RECIPE):
        y = layer(x)
    assert not same(y, hp) and layer.recipe is RECIPE
    with pytest.raises(TypeError, match=r"enabled: expected a bool, got DelayedScaling \(the recipe goes by keyword"):
        with te.autocast(RECIPE):
            pass


def test_fp8_autocast_is_te_older_name_with_its_argument_names():
    torch.manual_seed(0)
    a = te.Linear(64, 64)
    b = linear_twin(a.weight, a.bias)
    for step in range(3):
        x = inputs(seed=step) * (1 + step)
        with te.fp8_autocast(enabled=True, fp8_recipe=RECIPE, fp8_group=None):
            ya = a(x)
            ya.sum().backward()
        with te.autocast(enabled=True, recipe=RECIPE, amax_reduction_group=None):
            yb = b(x)
            yb.sum().backward()
        assert same(ya, yb) and same(a.weight.grad, b.weight.grad)
    assert same(a.fp8_scale, b.fp8_scale) and a.fp8_steps.item() == 3


def test_calibrating_records_amaxes_in_high_precision_then_fp8_starts_calibrated():
    torch.manual_seed(0)
    layer = te.Linear(64, 64, recipe=RECIPE)
    x = inputs() * 3
    with te.autocast(enabled=False, calibrating=True, recipe=RECIPE):
        y = layer(x)
    assert same(y, F.linear(x, layer.weight, layer.bias))  # the GEMM in high precision
    assert layer.fp8_amax_history[-1, 0].item() == x.abs().max().item()
    assert layer.fp8_amax_history[-1, 1].item() == layer.weight.abs().max().item()
    assert layer.fp8_scale[0].item() == pytest.approx(448 / x.abs().max().item(), rel=1e-6)
    assert layer.fp8_scale[2].item() == 1  # no backward calibrated
    with te.autocast(enabled=True, calibrating=True, recipe=RECIPE):  # enabled: fp8 runs, calibrating changes nothing
        y8 = layer(x)
    assert not same(y8, y)
    with pytest.raises(TypeError, match="calibrating: expected a bool"):
        with te.autocast(enabled=False, calibrating="yes"):
            pass


# ---- the norms and the fused modules -----------------------------------------------------------------------

@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_layernorm_and_rmsnorm_are_torchs_with_te_arguments(zero_centered_gamma):
    x = inputs()
    ln = te.LayerNorm(64, eps=1e-6, zero_centered_gamma=zero_centered_gamma)
    rms = te.RMSNorm(64, zero_centered_gamma=zero_centered_gamma)
    with torch.no_grad():
        for p in (ln.weight, ln.bias, rms.weight):
            p.copy_(torch.randn(64, generator=torch.Generator().manual_seed(3)))
    offset = 1 if zero_centered_gamma else 0
    assert same(ln(x), F.layer_norm(x, (64,), ln.weight + offset, ln.bias, 1e-6))
    assert same(rms(x), F.rms_norm(x, (64,), rms.weight + offset, 1e-5))
    assert dict(ln.named_parameters()).keys() == {"weight", "bias"} and rms.eps == 1e-5
    fresh = te.RMSNorm(64, zero_centered_gamma=zero_centered_gamma, params_dtype=torch.bfloat16)
    assert fresh.weight.dtype == torch.bfloat16 and fresh.weight.eq(0 if zero_centered_gamma else 1).all()


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_is_the_norm_then_te_linear(normalization):
    torch.manual_seed(0)
    layer = te.LayerNormLinear(64, 32, eps=1e-5, normalization=normalization, return_layernorm_output=True)
    names = {"layer_norm_weight", "weight", "bias"} | ({"layer_norm_bias"} if normalization == "LayerNorm" else set())
    assert dict(layer.named_parameters()).keys() == names
    norm = (te.LayerNorm if normalization == "LayerNorm" else te.RMSNorm)(64)
    twin = linear_twin(layer.weight, layer.bias)
    for step in range(2):
        x = inputs(seed=step)
        with te.autocast(enabled=True, recipe=RECIPE):
            out, normed = layer(x)
            out.sum().backward()
            want_normed = norm(x)
            want = twin(want_normed)
            want.sum().backward()
        assert same(normed, want_normed) and same(out, want)
        assert same(layer.weight.grad, twin.weight.grad)
    assert same(layer.fp8_scale, twin.fp8_scale)


@pytest.mark.parametrize("activation", ["gelu", "swiglu", "srelu"])
def test_layernorm_mlp_is_norm_fc1_activation_fc2(activation):
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(64, 96, activation=activation, bias=True)
    gated = activation == "swiglu"
    assert mlp.fc1_weight.shape == (192 if gated else 96, 64) and mlp.fc2_weight.shape == (64, 96)
    assert mlp.fc1_weight is mlp.fc1.weight and mlp.fc2_bias is mlp.fc2.bias
    act = {"gelu": lambda h: F.gelu(h, approximate="tanh"), "srelu": lambda h: F.relu(h) ** 2,
           "swiglu": lambda h: F.silu(h[..., :96]) * h[..., 96:]}[activation]
    fc1 = linear_twin(mlp.fc1.weight, mlp.fc1.bias)
    fc2 = linear_twin(mlp.fc2.weight, mlp.fc2.bias)
    x = inputs()
    with te.autocast(enabled=True, recipe=RECIPE):
        y = mlp(x)
        want = fc2(act(fc1(F.layer_norm(x, (64,), mlp.layer_norm_weight, mlp.layer_norm_bias, 1e-5))))
    assert same(y, want)
    with pytest.raises(ValueError, match="activation: expected one of gelu, relu.*got 'gelu_new'"):
        te.LayerNormMLP(64, 96, activation="gelu_new")


@pytest.mark.parametrize("make,arg", [
    (lambda **k: te.LayerNorm(64, **k), "sequence_parallel"),
    (lambda **k: te.RMSNorm(64, **k), "sequence_parallel"),
    (lambda **k: te.LayerNormLinear(64, 32, **k), "return_bias"),
    (lambda **k: te.LayerNormLinear(64, 32, **k), "parallel_mode"),
    (lambda **k: te.LayerNormMLP(64, 96, **k), "set_parallel_mode"),
    (lambda **k: te.LayerNormMLP(64, 96, **k), "tp_size"),
])
def test_parallel_arguments_are_refused_by_name(make, arg):
    with pytest.raises(TypeError, match=f"{arg}: Transformer Engine's .* arguments for parallel or fused paths"):
        make(**{arg: True})


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="normalization: expected 'LayerNorm' or 'RMSNorm', got 'BatchNorm'"):
        te.LayerNormLinear(64, 32, normalization="BatchNorm")
    with pytest.raises(ValueError, match="eps: expected a float >= 0"):
        te.LayerNorm(64, eps=-1.0)
    with pytest.raises(TypeError, match="zero_centered_gamma: expected a bool"):
        te.RMSNorm(64, zero_centered_gamma=1)
    with pytest.raises(TypeError, match="LayerNormMLP: unexpected keyword argument.*fc_hidden"):
        te.LayerNormMLP(64, 96, fc_hidden=3)
    with pytest.raises(TypeError):  # after eps, TE's positional arguments are parallel options: keywords here
        te.LayerNormLinear(64, 32, 1e-5, False)


# ---- is_fp8_available ---------------------------------------------------------------------------------------

def test_is_fp8_available_answers_as_te_does():
    for ask in (te.is_fp8_available, te.is_mxfp8_available, te.is_fp8_block_scaling_available):
        ok = ask()
        assert isinstance(ok, bool)
        pair = ask(return_reason=True)
        assert isinstance(pair, tuple) and pair[0] is ok and isinstance(pair[1], str) and (pair[1] == "") == ok
    if not torch.cuda.is_available():
        assert te.is_fp8_available(return_reason=True) == (True, "")  # the CPU reference: always
    with pytest.raises(TypeError, match="return_reason: expected a bool"):
        te.is_fp8_available("yes")


def test_is_fp8_available_names_what_a_cuda_device_lacks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 6))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    ok, why = te.is_fp8_available(return_reason=True)
    assert not ok and why == "the FP8 GEMM needs compute capability 8.9 or newer; cuda:0 is 8.6"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    assert te.is_fp8_available() and te.is_mxfp8_available()
    assert te.is_fp8_block_scaling_available(return_reason=True)[1].startswith(
        "the 1x128/128x128 block GEMM needs compute capability 9.0;")


# ---- fp8_model_init / quantized_model_init -----------------------------------------------------------------

@pytest.mark.parametrize("init", [te.fp8_model_init, te.quantized_model_init])
def test_model_init_keeps_weights_in_fp8_with_the_master_where_asked(init):
    torch.manual_seed(0)
    hp = te.Linear(64, 32)
    torch.manual_seed(0)
    with init(enabled=True, recipe=RECIPE, preserve_high_precision_init_val=True):
        layer = te.Linear(64, 32)
        mlp = te.LayerNormMLP(64, 96)
    assert layer.weight.dtype == torch.float8_e4m3fn and not layer.weight.requires_grad
    assert mlp.fc1.weight.dtype == mlp.fc2.weight.dtype == torch.float8_e4m3fn
    master = layer.weight.get_high_precision_init_val()
    assert same(master, hp.weight.detach())  # the initial values, kept on the CPU
    scale = 448 / hp.weight.abs().max()
    assert same(layer.weight, fp8core.torch.ops.quantize(hp.weight.detach(), scale.reshape(1), "e4m3"))
    assert same(layer.weight_scale_inv, (1 / scale).reshape(1))
    layer.weight.clear_high_precision_init_val()
    assert layer.weight.get_high_precision_init_val() is None
    assert {"weight", "weight_scale_inv"} <= layer.state_dict().keys()

    x = inputs()
    with te.autocast(enabled=True, recipe=RECIPE):  # fp8: the kept codes, no cast of the weight
        y = layer(x)
    one = torch.ones(1)  # the input's scale at the first delayed-scaling step
    x_q = fp8core.torch.ops.quantize(x.reshape(-1, 64), one, "e4m3")
    want = fp8core.torch.ops.gemm(x_q, layer.weight, one, layer.weight_scale_inv, torch.float32) + layer.bias
    assert same(y, want.reshape(4, 8, 32))
    dequantized = F.linear(x, fp8core.torch.ops.dequantize(layer.weight, layer.weight_scale_inv, torch.float32),
                           layer.bias)
    assert same(layer(x), dequantized)  # outside autocast: high precision, the weight dequantized

    with te.fp8_model_init(enabled=False):
        assert te.Linear(64, 32).weight.dtype == torch.float32
    assert te.Linear(64, 32).weight.dtype == torch.float32


def test_a_layer_kept_in_fp8_compiles_fullgraph_to_the_eager_bits():
    """The kept codes and their scale_inv reach the Linear's Function as tensors: nothing the compiler must build
    (a tensor subclass made per call did not trace under fullgraph=True)."""
    recipe = te.recipe.Float8CurrentScaling()
    torch.manual_seed(0)
    with te.fp8_model_init(recipe=recipe):
        layer = te.Linear(64, 32)
    x = inputs().requires_grad_(True)
    compiled = torch.compile(layer, fullgraph=True)
    outs = []
    for run in (layer, compiled):
        with te.autocast(enabled=True, recipe=recipe):
            y = run(x)
        (dx,) = torch.autograd.grad((y * y).sum(), x)
        outs.append((y, dx))
    assert same(outs[0][0], outs[1][0]) and same(outs[0][1], outs[1][1])


def test_model_init_refuses_what_fp8core_does_not_do():
    with te.fp8_model_init(recipe=RECIPE):
        layer = te.Linear(64, 32)
    layer.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="weight: kept only in fp8 .*trains high-precision weights only"):
        with te.autocast(enabled=True, recipe=RECIPE):
            layer(inputs())
    with pytest.raises(TypeError, match="recipe: fp8core keeps weights in fp8 under DelayedScaling or "
                                        "Float8CurrentScaling .*not MXFP8BlockScaling"):
        with te.fp8_model_init(recipe=te.recipe.MXFP8BlockScaling()):
            pass
    with te.fp8_model_init(recipe=RECIPE):
        kept = te.Linear(64, 32)
    with pytest.raises(TypeError, match="weight: kept in fp8 as torch.float8_e4m3fn under one scale .*"
                                        "MXFP8BlockScaling scales blocks"):
        with te.autocast(enabled=True, recipe=te.recipe.MXFP8BlockScaling()):
            kept(inputs())
    with te.fp8_model_init(recipe=RECIPE):
        kept = te.Linear(64, 32)  # a layer keeps the recipe of its first autocast: a new one for NVFP4
    rng = None
    for _ in range(2):  # the first call takes the recipe (and makes the layer's random state), the second reuses it
        with pytest.raises(TypeError, match="weight: kept in fp8 as .*NVFP4BlockScaling scales blocks"):
            with te.autocast(enabled=True, recipe=te.recipe.NVFP4BlockScaling()):
                kept(inputs())
        assert rng is None or torch.equal(kept.fp4_rng, rng)  # refused before the random state moved
        rng = kept.fp4_rng.clone()
