"""convert_to_float8 as torchao users call it: what converts (nn.Linear, its subclasses that keep Linear's forward,
transformers' Conv1D), what stays in high precision and is said to, and fp8 without a context (a plain loop, with
gradient accumulation: the delayed-scaling update once per optimizer step, bit for bit the autocast loop's)."""

import copy
import logging
import warnings

import pytest

torch = pytest.importorskip("torch")

import fp8core  # noqa: E402
from fp8core.torch import Float8Conv1D, Float8Linear, autocast, convert_to_float8  # noqa: E402

DELAYED = fp8core.DelayedScaling(amax_history_len=4)
RECIPES = [DELAYED, fp8core.Float8CurrentScaling(), fp8core.MXFP8BlockScaling()]
IDS = ["delayed", "current", "mxfp8"]


def bits(t):
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same(a, b):
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


class MyLinear(torch.nn.Linear):
    """A subclass that changes nothing Linear does (torchao converts it)."""


class ScaledLinear(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class GatedLinear(torch.nn.Linear):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.gate = torch.nn.Parameter(torch.ones(self.out_features))


def mlp(first=torch.nn.Linear, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(first(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))


def test_a_linear_subclass_with_linears_forward_converts():
    model = mlp(MyLinear)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_to_float8(model, DELAYED)
    assert type(model[0]) is Float8Linear and type(model[2]) is Float8Linear
    assert model[0]._fp8_group is model[2]._fp8_group


@pytest.mark.parametrize("kind,why", [(ScaledLinear, "ScaledLinear has its own forward"),
                                      (GatedLinear, r"GatedLinear holds more than Linear's state \(gate\)")])
def test_a_subclass_fp8core_would_change_is_kept_and_named(kind, why):
    model = mlp(kind)
    with pytest.warns(UserWarning, match=f"kept in high precision, a subclass.*: 0 \\({why}\\)$"):
        convert_to_float8(model, DELAYED)
    assert type(model[0]) is kind and type(model[2]) is Float8Linear


def test_what_the_filter_declines_is_logged(caplog):
    model = mlp()
    with caplog.at_level(logging.INFO, logger="fp8core.torch"):
        convert_to_float8(model, DELAYED, module_filter_fn=lambda m, fqn: fqn != "2")
    assert "kept in high precision by module_filter_fn: 2" in caplog.text
    assert type(model[2]) is torch.nn.Linear


def micro_batches(steps=4, micro=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(16, 32, generator=g) * (1 + s) for _ in range(micro)] for s in range(steps)]


def train(model, data, context, fused=None):
    """Gradient accumulation over each step's micro-batches, then one optimizer step; the whole step inside one
    autocast when ``context`` (Transformer Engine's loop), no context otherwise (torchao's). ``fused``: torch's
    fused AdamW, which writes the parameters without counting it in their version (the step is then seen by
    zero_grad clearing the gradients)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    for step in data:
        with autocast() if context else torch.enable_grad():
            for x in step:
                model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_without_autocast_a_converted_model_trains_in_fp8_as_inside_one(recipe):
    ctx, plain, fused = (convert_to_float8(mlp(), recipe) for _ in range(3))
    hp = mlp()
    data = micro_batches()
    train(ctx, data, context=True)
    train(plain, data, context=False)
    train(fused, data, context=False, fused=True)
    train(hp, data, context=False)
    for a, b, c, d in zip(ctx.parameters(), plain.parameters(), hp.parameters(), fused.parameters()):
        assert same(a, b)
        assert torch.allclose(b, d, rtol=0, atol=1e-6)  # fused AdamW rounds its own way; the scales the same
        assert not same(b, c)  # fp8 ran: the high-precision twin took other steps
    if isinstance(recipe, fp8core.DelayedScaling):
        # one update per optimizer step, not per micro-batch: the last step closes at the next fp8 forward
        assert ctx[0].fp8_steps.item() == 4 and plain[0].fp8_steps.item() == 3 and fused[0].fp8_steps.item() == 3
        with torch.no_grad():
            plain(data[0][0])
        assert plain[0].fp8_steps.item() == 4
        for m, n in ((ctx[0], plain[0]), (ctx[2], plain[2])):
            assert same(m.fp8_amax_history[1:], n.fp8_amax_history[1:])
            assert same(m.fp8_scale, n.fp8_scale) and same(m.fp8_scale_inv, n.fp8_scale_inv)


def test_without_autocast_the_update_waits_for_the_optimizer():
    model = convert_to_float8(mlp(), DELAYED)
    x = micro_batches(1, 1)[0][0]
    for _ in range(3):  # micro-batches: no parameter written, one step
        model(x).sum().backward()
    assert model[0].fp8_steps.item() == 0 and model[0].fp8_amax_history[0, 0].item() == x.abs().max().item()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0)  # what an optimizer does: an in-place write
    model(x)
    assert model[0].fp8_steps.item() == 1
    assert model[0].fp8_scale[0].item() == pytest.approx(448 / x.abs().max().item(), rel=1e-6)


def test_a_frozen_model_updates_at_every_forward():
    model = convert_to_float8(mlp(), DELAYED).requires_grad_(False)
    x = micro_batches(1, 1)[0][0]
    for i in range(3):
        model(x)
        assert model[0].fp8_steps.item() == i  # the first forward finds no step to close


def test_autocast_disabled_keeps_a_converted_model_in_high_precision():
    model = convert_to_float8(mlp(), DELAYED)
    ref = copy.deepcopy(mlp())
    x = micro_batches(1, 1)[0][0]
    with autocast(enabled=False):
        assert same(model(x), ref(x))
    assert model[0].fp8_amax_history.abs().sum().item() == 0
    assert not same(model(x), ref(x))


def test_a_float8_linear_made_directly_keeps_transformer_engines_rule_unless_told():
    x = micro_batches(1, 1)[0][0]
    torch.manual_seed(0)
    te_rule = Float8Linear(32, 32, recipe=DELAYED)
    torch.manual_seed(0)
    torchao_rule = Float8Linear(32, 32, recipe=DELAYED, autocast_only=False)
    ref = torch.nn.functional.linear(x, te_rule.weight, te_rule.bias)
    assert same(te_rule(x), ref)
    assert not same(torchao_rule(x), ref)
    with pytest.raises(TypeError, match="autocast_only: expected a bool"):
        Float8Linear(32, 16, autocast_only=1)


@pytest.mark.parametrize("recipe,fullgraph", [(fp8core.Float8CurrentScaling(), True), (DELAYED, False)],
                         ids=["current_fullgraph", "delayed_graph_break"])
def test_without_autocast_a_compiled_model_equals_eager(recipe, fullgraph):
    """Current scaling has no step boundary: fullgraph compiles. Delayed scaling's boundary is Python (a graph
    break; fullgraph=True refuses it, so such a model runs its steps inside autocast): the same bits as eager."""
    eager = convert_to_float8(mlp(), recipe)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=fullgraph, backend="aot_eager")
    oe, oc = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, twin))
    for step in micro_batches(3, 1):
        ye, yc = eager(step[0]), compiled(step[0])
        assert same(ye, yc)
        ye.square().mean().backward()
        yc.square().mean().backward()
        for o in (oe, oc):
            o.step()
            o.zero_grad()
    for a, b in zip(eager.parameters(), twin.parameters()):
        assert same(a, b)
    if isinstance(recipe, fp8core.DelayedScaling):
        assert eager[0].fp8_steps.item() == twin[0].fp8_steps.item() == 2
        assert same(eager[0].fp8_scale, twin[0].fp8_scale)


# ---- transformers' Conv1D (GPT-2) -------------------------------------------------------------------------

def hf():
    return pytest.importorskip("transformers", reason="transformers is not installed (not among fp8core's test "
                                                      "dependencies)")


# wgrad kept in high precision (override_linear_precision): Conv1D's [in, out] gradient is the Linear's transposed
WGRAD_HP = fp8core.DelayedScaling(amax_history_len=8, override_linear_precision=(False, False, True))


@pytest.mark.parametrize("recipe", [*RECIPES, WGRAD_HP], ids=[*IDS, "delayed-wgrad-hp"])
def test_conv1d_is_bit_for_bit_a_float8_linear_of_the_transposed_weight(recipe):
    transformers = hf()
    torch.manual_seed(0)
    conv = transformers.pytorch_utils.Conv1D(96, 64)  # nf, nx: weight [64, 96]
    torch.nn.init.normal_(conv.bias)
    layer = Float8Conv1D.from_layer(conv, recipe)
    twin = Float8Linear(64, 96, recipe=recipe)
    with torch.no_grad():
        twin.weight.copy_(conv.weight.t())
        twin.bias.copy_(conv.bias)
    assert layer.weight is conv.weight and layer.weight.shape == (64, 96)
    assert layer.state_dict().keys() == twin.state_dict().keys()
    for step in range(2):
        x = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(step))
        with autocast():
            y, yt = layer(x), twin(x)
            (y * y).sum().backward()
            (yt * yt).sum().backward()
        assert same(y, yt)
        assert same(layer.weight.grad, twin.weight.grad.t()) and same(layer.bias.grad, twin.bias.grad)
    with pytest.raises(TypeError, match="conv: expected transformers' Conv1D .*got GELU"):
        Float8Conv1D.from_layer(torch.nn.GELU(), recipe)
    outside = Float8Conv1D.from_layer(conv, recipe)
    outside.autocast_only = True  # high precision: Conv1D's own addmm
    x = torch.randn(5, 64)
    assert same(outside(x), conv(x))


def gpt2(seed=0):
    transformers = hf()
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0,
                                     embd_pdrop=0, attn_pdrop=0)  # no dropout: a resumed run draws no other mask
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def lm_steps(model, steps, seed=0, opt=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 32), generator=g)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


def test_gpt2_converts_every_conv1d_and_lm_head_and_trains_like_fp32():
    transformers = hf()
    model = gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_to_float8(model, DELAYED)
    convs = [n for n, m in model.named_modules() if isinstance(m, Float8Conv1D)]
    assert len(convs) == 8  # c_attn, attn.c_proj, c_fc, mlp.c_proj per layer
    assert not any(isinstance(m, transformers.pytorch_utils.Conv1D) for m in model.modules())
    assert type(model.lm_head) is Float8Linear and model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert model.transformer.h[0].attn.c_attn.weight.shape == (64, 192)
    fp8, _ = lm_steps(model, 6)
    fp32, _ = lm_steps(gpt2(), 6)
    assert fp8 != fp32  # fp8 ran
    for a, b in zip(fp8, fp32):
        assert abs(a - b) / b < 0.02
    assert model.transformer.h[1].mlp.c_proj.fp8_steps.item() == 5
    assert (model.transformer.h[1].mlp.c_proj.fp8_scale != 1).all()


def test_gpt2_checkpoint_loads_in_transformers_and_resumes_bit_for_bit(tmp_path):
    transformers = hf()
    safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")
    model = convert_to_float8(gpt2(), DELAYED)
    _, opt = lm_steps(model, 3)
    model.save_pretrained(tmp_path / "hf")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")

    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")  # transformers reads it as GPT-2
    conv = plain.transformer.h[0].attn.c_attn
    assert type(conv) is transformers.pytorch_utils.Conv1D
    assert same(conv.weight, model.transformer.h[0].attn.c_attn.weight)
    resumed = convert_to_float8(plain, DELAYED)
    saved = safetensors_torch.load_file(tmp_path / "hf" / "model.safetensors")
    missing, unexpected = resumed.load_state_dict(saved, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # tied to wte: saved once
    for (k, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert same(a, b), k

    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    again = convert_to_float8(gpt2(seed=5), DELAYED)
    again.load_state_dict(ckpt["model"])
    for (k, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert same(a, b), k

    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-3)
    opt2.load_state_dict(ckpt["opt"])
    lm_steps(model, 2, seed=9, opt=opt)
    lm_steps(again, 2, seed=9, opt=opt2)
    for (k, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert same(a, b), k


def test_hf_trainer_trains_a_converted_llama_in_fp8_with_no_context(tmp_path):
    """HF's Trainer as written (no subclass, no context to wrap its steps in), gradient accumulation 2: the fp8
    path ran (history and scales moved), one delayed-scaling update per optimizer step."""
    transformers = hf()
    pytest.importorskip("accelerate", reason="accelerate is not installed (transformers' Trainer needs it)")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = convert_to_float8(transformers.LlamaForCausalLM(config), DELAYED)
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(layers) == 8
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (24, 16), generator=g)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                          gradient_accumulation_steps=2, learning_rate=1e-3, use_cpu=True,
                                          report_to=[], save_strategy="no", disable_tqdm=True,
                                          dataloader_num_workers=0)
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    for m in layers:
        assert m.fp8_steps.item() == 2  # 6 forwards, 3 optimizer steps: steps 1 and 2 closed, 3 open
        assert (m.fp8_amax_history[-1] > 0).all() and (m.fp8_amax_history[0] > 0).all()
        assert (m.fp8_scale != 1).all()
