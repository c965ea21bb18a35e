"""fp8core.torch survives what a training program does to a model (issue 14): each transform is checked against a
twin model that was not put through it, bit for bit after several training steps. CPU here; the CUDA variants
are in test_gpu_torch.py, DDP and FSDP2 in test_torch_distributed.py."""

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")

import fp8core  # noqa: E402
from fp8core.torch import Float8Linear, SharedScaling, autocast, convert_to_float8  # noqa: E402

RECIPE = fp8core.DelayedScaling(amax_history_len=8)
# the stateless block recipes, each with the width its GEMM takes (whole 1x32 or 128-element blocks along K)
BLOCK_RECIPES = {"mxfp8": (fp8core.MXFP8BlockScaling(), 32), "blocks": (fp8core.Float8BlockScaling(), 128)}
RECIPES = {"delayed": (RECIPE, 32), **BLOCK_RECIPES}


def make(seed=0, dtype=torch.float32, recipe=RECIPE, device=None, d=32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(d, 2 * d, device=device, dtype=dtype), torch.nn.ReLU(),
                                torch.nn.Linear(2 * d, d, device=device, dtype=dtype))
    return convert_to_float8(model, recipe)


def fp8_modules(model):
    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def bits(t):
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def snapshot(model):
    """Every parameter and every fp8 tensor of the model, and each group's step count."""
    out = [bits(p).clone() for p in model.parameters()]
    for m in fp8_modules(model):
        if m.recipe.__class__ is fp8core.DelayedScaling:
            out += [bits(m.fp8_amax_history).clone(), bits(m.fp8_scale).clone(), bits(m.fp8_scale_inv).clone(),
                    torch.tensor(m._fp8_group.steps)]
    return out


def same(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def train(model, steps, seed, dtype=torch.float32, device="cpu", scale=1.0):
    """``steps`` SGD steps under autocast on inputs drawn from ``seed``; returns the outputs' bits."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed)
    d = fp8_modules(model)[0].in_features
    outs = []
    for i in range(steps):
        x = (torch.randn(24, d, generator=g) * scale * (1 + i)).to(device=device, dtype=dtype)
        with autocast():
            y = model(x)
            y.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append(bits(y).clone())
    return outs


def assert_twins(model, twin, steps=3, seed=1, **kw):
    assert same(snapshot(model), snapshot(twin))
    assert same(train(model, steps, seed, **kw), train(twin, steps, seed, **kw))
    assert same(snapshot(model), snapshot(twin))


# ---- 1, 2: device and dtype moves ---------------------------------------------------------------------------

@pytest.mark.parametrize("move", [lambda m: m.to("cpu"), lambda m: m.cpu(), lambda m: m.to(torch.device("cpu")),
                                  lambda m: m.float(), lambda m: m.to(torch.float64).to(torch.float32)],
                         ids=["to_cpu", "cpu", "to_device", "float", "f64_and_back"])
def test_moves_after_training_keep_the_state(move):
    model, twin = make(), make()
    train(model, 2, 0), train(twin, 2, 0)
    assert move(model) is model
    for m in fp8_modules(model):
        assert m.fp8_amax_history.dtype == torch.float32 and m.fp8_scale.dtype == torch.float32
    assert_twins(model, twin)


@pytest.mark.parametrize("cast,dtype", [(lambda m: m.bfloat16(), torch.bfloat16),
                                        (lambda m: m.half(), torch.float16),
                                        (lambda m: m.to(torch.bfloat16), torch.bfloat16),
                                        (lambda m: m.to(dtype=torch.float16), torch.float16)],
                         ids=["bfloat16", "half", "to_bf16", "to_f16"])
@pytest.mark.parametrize("recipe,d", list(RECIPES.values()), ids=list(RECIPES))
def test_dtype_cast_after_conversion_equals_cast_then_convert(cast, dtype, recipe, d):
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.ReLU(), torch.nn.Linear(2 * d, d))
    twin = convert_to_float8(copy.deepcopy(base).to(dtype), recipe)
    model = cast(convert_to_float8(base, recipe))
    for m in fp8_modules(model):
        assert m.weight.dtype == dtype
        if m._fp8_group is not None:
            assert {t.dtype for t in (m.fp8_amax_history, m.fp8_scale, m.fp8_scale_inv)} == {torch.float32}
    assert_twins(model, twin, dtype=dtype)


def test_a_cast_of_a_trained_model_keeps_the_state_bits():
    model = make()
    train(model, 2, 0)
    before = [bits(m.fp8_amax_history).clone() for m in fp8_modules(model)]
    model.half().bfloat16().float()
    assert same(before, [bits(m.fp8_amax_history) for m in fp8_modules(model)])


# ---- 3: meta-device construction --------------------------------------------------------------------------

def test_meta_construction_to_empty_then_load_state_dict():
    twin = make()
    train(twin, 2, 0)
    with torch.device("meta"):
        model = make()
    assert all(m.fp8_amax_history.is_meta for m in fp8_modules(model))
    model.to_empty(device="cpu")
    for m in fp8_modules(model):  # the initial state, never garbage
        assert m.fp8_amax_history.abs().sum() == 0 and torch.equal(m.fp8_scale, torch.ones(3))
    model.load_state_dict(twin.state_dict())
    assert_twins(model, twin)


def test_meta_construction_to_empty_is_a_fresh_model():
    with torch.device("meta"):
        model = make()
    model.to_empty(device="cpu")
    twin = make()
    with torch.no_grad():
        for p, q in zip(model.parameters(), twin.parameters()):
            p.copy_(q)
    assert_twins(model, twin)  # the update finds the new tensors (before: outputs of zeros, scales frozen)


def test_load_state_dict_assign_into_a_meta_model():
    twin = make()
    train(twin, 2, 0)
    with torch.device("meta"):
        model = make()
    model.load_state_dict(copy.deepcopy(twin.state_dict()), assign=True)
    assert not any(t.is_meta for m in fp8_modules(model) for t in (m.weight, m.fp8_amax_history))
    assert_twins(model, twin)


def test_float8_linear_on_meta_device_and_forward_error():
    lin = Float8Linear(32, 32, device="meta")
    assert lin.fp8_scale.is_meta and lin.weight.is_meta
    with autocast(), pytest.raises(RuntimeError, match="meta device"):
        lin(torch.randn(4, 32, device="meta"))
    lin.to_empty(device="cpu")
    assert torch.equal(lin.fp8_scale, torch.ones(3))


# ---- 4: share_memory, deepcopy, save/load, pickling -------------------------------------------------------

def test_share_memory_then_training():
    model, twin = make(), make()
    train(model, 2, 0), train(twin, 2, 0)
    model.share_memory()
    assert all(m.fp8_amax_history.is_shared() for m in fp8_modules(model))
    assert_twins(model, twin)  # before: a segfault on a view of the freed storage


def test_deepcopy_is_an_independent_twin():
    model = make()
    train(model, 2, 0)
    twin = copy.deepcopy(model)
    assert fp8_modules(twin)[0]._fp8_group is not fp8_modules(model)[0]._fp8_group
    assert [m._fp8_slot for m in fp8_modules(twin)] == [0, 1]
    before = snapshot(model)
    train(twin, 2, 5)  # training the copy leaves the original alone
    assert same(snapshot(model), before)
    again = copy.deepcopy(model)
    assert_twins(model, again)


def test_deepcopy_of_one_layer_takes_only_that_layer():
    model = make()
    train(model, 2, 0)
    layer = copy.deepcopy(model[0])
    assert layer._fp8_group.modules() == [layer] and layer._fp8_group.steps == 2
    assert len(fp8_modules(model)[0]._fp8_group.modules()) == 2


@pytest.mark.parametrize("via", ["torch.save", "pickle"])
def test_whole_model_save_and_load(via, tmp_path):
    model = make()
    train(model, 2, 0)
    if via == "pickle":
        loaded = pickle.loads(pickle.dumps(model))
    else:
        torch.save(model, tmp_path / "model.pt")
        loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert loaded[0]._fp8_group is loaded[2]._fp8_group and loaded[0]._fp8_group.modules() == [loaded[0], loaded[2]]
    assert_twins(loaded, model)


@pytest.mark.parametrize("recipe,d", list(BLOCK_RECIPES.values()), ids=list(BLOCK_RECIPES))
def test_block_recipes_are_stateless_through_copies_pickles_and_checkpoints(recipe, d, tmp_path):
    model = make(recipe=recipe, d=d)
    train(model, 2, 0)
    assert all(m._fp8_group is None and m.recipe == recipe for m in fp8_modules(model))
    assert set(model.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # nothing but nn.Linear's
    copied, pickled = copy.deepcopy(model), pickle.loads(pickle.dumps(model))
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    loaded = make(seed=9, recipe=recipe, d=d)
    loaded.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    for twin in (copied, pickled, loaded):
        assert [m.recipe for m in fp8_modules(twin)] == [recipe, recipe]
    before = snapshot(model)
    assert_twins(copied, pickled)
    assert same(snapshot(model), before)  # training the copies left the original alone
    assert_twins(loaded, model)


# ---- 5: load_state_dict validates before it writes --------------------------------------------------------

def _bad(key, value):
    def edit(sd):
        sd[key] = value(sd[key]) if callable(value) else value
    return edit


BAD_CHECKPOINTS = {
    "history_len": (_bad("0.fp8_amax_history", lambda t: torch.zeros(16, 3)), RuntimeError, "amax_history_len 16"),
    "history_f64": (_bad("0.fp8_amax_history", lambda t: t.double()), RuntimeError, "expected float32, got float64"),
    "scale_i64": (_bad("2.fp8_scale", lambda t: t.long()), RuntimeError, "2.fp8_scale: expected float32, got int64"),
    "scale_shape": (_bad("2.fp8_scale", lambda t: t[:2]), RuntimeError, r"expected shape \(3,\)"),
    "scale_nan": (_bad("2.fp8_scale", lambda t: torch.tensor([1.0, float("nan"), 1.0])), RuntimeError, "finite"),
    "scale_neg": (_bad("2.fp8_scale", lambda t: -t), RuntimeError, "finite values > 0"),
    "scale_zero": (_bad("2.fp8_scale_inv", lambda t: t * 0), RuntimeError, "fp8_scale_inv"),
    "scale_inf": (_bad("2.fp8_scale", lambda t: t / 0), RuntimeError, "inf"),
    "history_neg0": (_bad("2.fp8_amax_history", lambda t: torch.where(t == 0, -0.0, t)), RuntimeError, "negative"),
    "steps_neg": (_bad("2.fp8_steps", torch.tensor(-1)), RuntimeError, "fp8_steps: expected an int >= 0"),
    "steps_float": (_bad("2.fp8_steps", torch.tensor(1.5)), RuntimeError, "fp8_steps: expected an integer"),
    "missing": (lambda sd: sd.pop("2.fp8_scale_inv"), RuntimeError, "missing 2.fp8_scale_inv"),
}


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_a_bad_checkpoint_raises_and_leaves_the_model_unchanged(case, strict):
    edit, err, match = BAD_CHECKPOINTS[case]
    source, model = make(seed=1), make()
    train(source, 2, 0), train(model, 1, 3)
    sd = {k: v.clone() for k, v in source.state_dict().items()}
    edit(sd)
    before = snapshot(model)
    with pytest.raises(err, match=match):  # torch's convention: RuntimeError, the model unchanged
        model.load_state_dict(sd, strict=strict)
    assert same(snapshot(model), before)


def test_missing_fp8_entries_strict_or_not():
    model, twin = make(), make()
    train(model, 2, 0), train(twin, 2, 0)
    sd = {k: v for k, v in make(seed=3).state_dict().items() if "fp8" not in k}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"0.fp8_amax_history\""):
        model.load_state_dict(sd)  # reported as torch reports any missing key
    model.load_state_dict(twin.state_dict())
    model.load_state_dict(sd, strict=False)  # not strict: the weights load, the fp8 state stays
    twin.load_state_dict(sd, strict=False)
    assert same(snapshot(model), snapshot(twin)) and model[0]._fp8_group.steps == 2


# ---- 7: activation checkpointing ----------------------------------------------------------------------------

class Checkpointed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def test_activation_checkpointing_gives_the_same_bits():
    model, twin = Checkpointed(make()), make()
    assert_twins(model.inner, twin)  # the same start
    a, b = train(model, 3, 4), train(twin, 3, 4)
    assert same(a, b) and same(snapshot(model.inner), snapshot(twin))


# ---- 10: two models, each in its own autocast ----------------------------------------------------------------

def test_two_models_each_follow_only_their_own_amaxes():
    a, b = make(seed=1), make(seed=2)
    a_alone, b_alone = make(seed=1), make(seed=2)
    train(a_alone, 2, 10, scale=1.0), train(b_alone, 2, 11, scale=50.0)
    for i in range(2):  # interleaved: each exit updates only the model that ran inside it
        train_step(a, 10, i, 1.0)
        train_step(b, 11, i, 50.0)
    assert same(snapshot(a), snapshot(a_alone)) and same(snapshot(b), snapshot(b_alone))


def train_step(model, seed, i, scale):
    g = torch.Generator().manual_seed(seed)
    for _ in range(i + 1):
        x = torch.randn(24, 32, generator=g) * scale * (1 + i)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with autocast():
        model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_nested_contexts_update_each_model_at_its_own_exit():
    teacher, student = make(seed=1), make(seed=2)
    teacher_alone, student_alone = make(seed=1), make(seed=2)
    x = torch.randn(24, 32)
    with autocast():
        ys = student(x)
        with autocast():
            teacher(x * 3).sum().backward()
        assert student[0]._fp8_group.steps == 0 and teacher[0]._fp8_group.steps == 1
        ys.sum().backward()
    with autocast():
        student_alone(x).sum().backward()
    with autocast():
        teacher_alone(x * 3).sum().backward()
    assert same(snapshot(student), snapshot(student_alone)) and same(snapshot(teacher), snapshot(teacher_alone))


def test_interval_counts_only_the_models_own_steps():
    recipe = fp8core.DelayedScaling(amax_history_len=4, interval=2)
    a, a_alone, other = make(recipe=recipe), make(recipe=recipe), make(seed=5, recipe=recipe)
    for i in range(3):
        train_step(a, 3, i, 1.0)
        train_step(other, 4, i, 1.0)
        train_step(other, 4, i, 2.0)
        train_step(a_alone, 3, i, 1.0)
    assert same(snapshot(a), snapshot(a_alone)) and a[0]._fp8_group.steps == 3


# ---- 11: clear errors ---------------------------------------------------------------------------------------

def test_clear_errors():
    with pytest.raises(ValueError, match="in_features: 24"):
        Float8Linear(24, 32)
    with pytest.raises(ValueError, match="out_features: 10"):
        Float8Linear.from_linear(torch.nn.Linear(32, 10))
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        Float8Linear(32, 32, recipe=fp8core.Float8CurrentScaling(fp8_format=fp8core.Format.E5M2))
    with pytest.raises(ValueError, match="recipe: expected a recipe or one of torchao's recipe names 'tensorwise', "
                                         "'rowwise', 'rowwise_with_gw_hp', got 'delayed'"):
        Float8Linear(32, 32, recipe="delayed")
    with pytest.raises(TypeError, match="recipe: expected DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, "
                                        "Float8BlockScaling, NVFP4BlockScaling, Float8RowwiseScaling or one of "
                                        "torchao's recipe names"):
        Float8Linear(32, 32, recipe=3)
    with pytest.raises(ValueError, match=r"in_features: 48 is not a positive multiple of 32 under MXFP8BlockScaling "
                                         r"\(the MXFP8 GEMM's K takes whole 1x32 blocks\)"):
        Float8Linear(48, 32, recipe=fp8core.MXFP8BlockScaling())
    with pytest.raises(ValueError, match="out_features: 64 is not a positive multiple of 128 under Float8BlockScaling"):
        Float8Linear.from_linear(torch.nn.Linear(128, 64), fp8core.Float8BlockScaling())
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        Float8Linear(32, 32, recipe=fp8core.MXFP8BlockScaling(fp8_format=fp8core.Format.E5M2))
    with pytest.raises(ValueError, match="x_block_scaling_dim and w_block_scaling_dim are both 2.*forward GEMM"):
        Float8Linear(128, 128, recipe=fp8core.Float8BlockScaling(x_block_scaling_dim=2))
    with pytest.raises(ValueError, match="grad_block_scaling_dim and x_block_scaling_dim are both 2.*wgrad GEMM"):
        Float8Linear(128, 128, recipe=fp8core.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1,
                                                                 grad_block_scaling_dim=2))
    with pytest.raises(ValueError, match="recipe:"):
        Float8Linear(32, 32, recipe=fp8core.DelayedScaling(margin=1), shared=SharedScaling(RECIPE))
    lin = Float8Linear(32, 32)
    with autocast():
        with pytest.raises(ValueError, match=r"x: expected shape \[..., 32\], got \(4, 16\)"):
            lin(torch.randn(4, 16))
        with pytest.raises(TypeError, match="x: expected float32, bfloat16 or float16, got torch.float64"):
            lin(torch.randn(4, 32, dtype=torch.float64))
        assert lin(torch.randn(0, 32)).shape == (0, 32)  # an empty batch: an empty output, nothing recorded
        y = lin(torch.randn(2, 3, 32))  # any leading shape; rows padded for the GEMM
        assert y.shape == (2, 3, 32)



@pytest.mark.parametrize("shape", [(2, 3, 32), (16, 32), (5, 32)])
@pytest.mark.parametrize("recipe", [RECIPE, fp8core.MXFP8BlockScaling()], ids=["delayed", "mxfp8"])
def test_the_output_is_not_a_view(shape, recipe):
    # FSDP2 hooks a module's output for its backward all-gather; an in-place op on a view output loses the hook
    lin = Float8Linear(32, 64, recipe=recipe)
    x = torch.randn(*shape, requires_grad=True)
    with autocast():
        y = lin(x)
        assert not y._is_view() and y.shape == (*shape[:-1], 64)
        y.sum().backward()
    assert x.grad.shape == x.shape


def test_fp8_all_gather_weights_train_as_they_are_when_not_sharded():
    # FSDP2's part is in test_torch_distributed.py; unsharded, the wrapped weight is the weight
    from fp8core.torch import enable_fsdp_float8_all_gather
    from fp8core.torch.fsdp import Float8AllGatherWeight

    model, twin = enable_fsdp_float8_all_gather(make()), make()
    assert all(isinstance(m.weight, Float8AllGatherWeight) for m in fp8_modules(model))
    assert_twins(model, twin)
    copied = copy.deepcopy(model)
    assert isinstance(copied[0].weight, Float8AllGatherWeight)
    assert_twins(copied, twin)
    with pytest.raises(TypeError, match="0 uses MXFP8BlockScaling; fp8 all-gather takes"):
        enable_fsdp_float8_all_gather(make(recipe=fp8core.MXFP8BlockScaling()))
