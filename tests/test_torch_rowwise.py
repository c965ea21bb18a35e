"""Float8Linear under torchao's rowwise recipes (Float8RowwiseScaling, "rowwise" / "rowwise_with_gw_hp"), CPU: its
three GEMMs equal the core's rowwise primitives bit for bit, training tracks fp32, a layer agrees with torchao's
own rowwise recipe (when torchao is installed), and Transformer Engine's override_linear_precision runs the GEMMs
it names in high precision."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fp8core  # noqa: E402
from fp8core import Float8RowwiseScaling, Layout, RowwiseTensor, quantize_rowwise, transpose_blocks  # noqa: E402
from fp8core.torch import Float8Linear, autocast, convert_to_float8  # noqa: E402
from test_torch_block_linear import PER_TENSOR, padded  # noqa: E402
from twins import fp32_and_converted_losses  # noqa: E402

ROWWISE, GW_HP = Float8RowwiseScaling(), Float8RowwiseScaling(wgrad_high_precision=True)


def bits(t):
    return t.view(torch.int16)


def rows(t, epsilon=ROWWISE.epsilon):
    return quantize_rowwise(t, epsilon=epsilon)


def columns(t, epsilon=ROWWISE.epsilon):
    return transpose_blocks(quantize_rowwise(t, axis=0, epsilon=epsilon))


def run(recipe, dtype=torch.bfloat16):
    torch.manual_seed(3)
    lin = Float8Linear(64, 32, recipe=recipe, dtype=dtype)
    x = torch.randn(3, 17, 64, dtype=dtype) * torch.logspace(-3, 3, 17, dtype=torch.float32)[:, None].to(dtype)
    x.requires_grad_(True)
    g = torch.randn(3, 17, 32, dtype=dtype)
    with autocast():
        y = lin(x)
        y.backward(g)
    return lin, x, g, y


def test_the_three_gemms_are_the_cores_rowwise_gemms_bit_for_bit():
    # 51 tokens: zero-padded to 64 for the wgrad GEMM, which leaves every column's amax (so every bit) alone
    lin, x, g, y = run(ROWWISE)
    x2, g2 = padded(x.detach().reshape(51, 64), 16), padded(g.reshape(51, 32), 16)
    w = lin.weight.detach()
    y_ref = fp8core.gemm(rows(x2), rows(w), out_dtype=torch.bfloat16)[:51] + lin.bias.detach()
    dx_ref = fp8core.gemm(rows(g2), columns(w), out_dtype=torch.bfloat16)[:51]
    dw_ref = fp8core.gemm(columns(g2), columns(x2), out_dtype=torch.bfloat16)
    assert torch.equal(bits(y.detach().reshape(51, 32)), bits(y_ref))
    assert torch.equal(bits(x.grad.reshape(51, 64)), bits(dx_ref))
    assert torch.equal(bits(lin.weight.grad), bits(dw_ref))
    assert torch.equal(lin.bias.grad, g.double().sum((0, 1)).to(torch.bfloat16))


def test_rowwise_with_gw_hp_keeps_wgrad_in_high_precision_and_a_tensorwise_weight_for_dgrad():
    lin, x, g, y = run(GW_HP)
    x2, g2 = x.detach().reshape(51, 64), g.reshape(51, 32)
    w = lin.weight.detach()
    y_ref = fp8core.gemm(rows(x2), rows(w), out_dtype=torch.bfloat16) + lin.bias.detach()
    s, s_inv = fp8core.compute_scale(fp8core.amax(w), "e4m3", power_of_2=True, epsilon=GW_HP.epsilon)
    w_t = RowwiseTensor(fp8core.quantize(w, s, "e4m3").t().contiguous(), s_inv.expand(64, 1).contiguous(),
                        Layout.ROWWISE)
    dx_ref = fp8core.gemm(rows(g2), w_t, out_dtype=torch.bfloat16)
    assert torch.equal(bits(y.detach().reshape(51, 32)), bits(y_ref))
    assert torch.equal(bits(x.grad.reshape(51, 64)), bits(dx_ref))
    assert torch.equal(bits(lin.weight.grad), bits(g2.t() @ x2))  # the caller's dtype, unquantized


def test_torchaos_recipe_names_are_accepted():
    for name, want in (("rowwise", ROWWISE), ("rowwise_with_gw_hp", GW_HP),
                       ("tensorwise", fp8core.Float8CurrentScaling())):
        m = convert_to_float8(torch.nn.Sequential(torch.nn.Linear(32, 16)), name)
        assert m[0].recipe == want
        assert Float8Linear(32, 16, recipe=name).recipe == want
    assert Float8RowwiseScaling.from_recipe_name("rowwise_with_gw_hp") == GW_HP
    with pytest.raises(ValueError, match="recipe: expected a recipe or one of torchao's recipe names 'tensorwise', "
                                         "'rowwise', 'rowwise_with_gw_hp', got 'axiswise'"):
        convert_to_float8(torch.nn.Sequential(torch.nn.Linear(32, 16)), "axiswise")
    with pytest.raises(ValueError, match="name: expected 'rowwise' or 'rowwise_with_gw_hp', got 'tensorwise'"):
        Float8RowwiseScaling.from_recipe_name("tensorwise")
    with pytest.raises(ValueError, match="fp8_format: expected Format.E4M3 .* got Format.HYBRID"):
        Float8RowwiseScaling(fp8core.Format.HYBRID)


def test_rowwise_scaling_beats_per_tensor_scaling_on_outlier_tokens():
    # A few tokens 3e4 x the rest: one scale per tensor pushes the other tokens into E4M3's subnormals and
    # towards zero; one scale per token keeps them whole. SQNR of the other tokens' outputs, measured (CPU
    # emulation, exact): per-tensor E4M3 17.6 dB, rowwise 28.4 dB.
    torch.manual_seed(0)
    ref = torch.nn.Linear(512, 256)
    x = torch.randn(256, 512)
    outliers = [3, 40, 77]
    x[outliers] *= 3e4
    rest = [i for i in range(256) if i not in outliers]
    want = ref(x).detach()[rest]

    def sqnr(recipe):
        lin = Float8Linear.from_linear(copy.deepcopy(ref), recipe)
        with autocast():
            got = lin(x).detach()[rest]
        return (20 * torch.log10(want.norm() / (got - want).norm())).item()

    per_tensor, rowwise = sqnr(PER_TENSOR), sqnr(ROWWISE)
    assert per_tensor < 18 and rowwise > per_tensor + 9, (rowwise, per_tensor)


@pytest.mark.parametrize("recipe", [ROWWISE, GW_HP], ids=["rowwise", "rowwise_with_gw_hp"])
def test_training_50_steps_tracks_the_fp32_loss(recipe):
    first, last = fp32_and_converted_losses(recipe)
    assert last[0] < 0.5 * first[0]  # the task is being learnt
    assert abs(last[1] - last[0]) <= 0.02 * last[0], f"fp32 {last[0]:.4g}, fp8 {last[1]:.4g}"


def test_codes_and_scales_are_torchaos_rowwise_casts():
    """torchao 0.17's axiswise cast (tensor_to_scale with round_scales_to_power_of_2, EPS 1e-12, then the
    saturated cast) and Float8RowwiseScaling's, on rows from 1e-30 to 1e30 and a zero row: the same bits."""
    pytest.importorskip("torchao", reason="torchao is not installed (CI lacks it)")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale

    torch.manual_seed(0)
    x = torch.randn(300, 257) * torch.logspace(-30, 30, 300)[:, None]
    x[7] = 0.0
    for axis in (-1, 0):
        s = tensor_to_scale(x, torch.float8_e4m3fn, scaling_granularity=ScalingGranularity.AXISWISE,
                            axiswise_dim=axis, round_scales_to_power_of_2=True)
        q = (x * s).clamp(-448, 448).to(torch.float8_e4m3fn)
        t = quantize_rowwise(x, axis=axis, epsilon=ROWWISE.epsilon)
        assert torch.equal(1 / s, t.scale_inv)
        assert torch.equal(q.view(torch.uint8), t.data.view(torch.uint8))


@pytest.mark.parametrize("name", ["rowwise", "rowwise_with_gw_hp"])
def test_agrees_with_torchaos_rowwise_recipe(name):
    """One layer, the same input and grad_output: fp8core's rowwise Linear and torchao 0.17's (emulate=True on the
    CPU). Measured: y 172.7 dB, dx 177.1 dB, dw 154.9 dB (rowwise; gw_hp's dw identical): the codes and scales
    agree (above), torchao's emulated GEMM rounds its fp32 sums in another order (differences of an fp32 ulp)."""
    pytest.importorskip("torchao", reason="torchao is not installed (CI lacks it)")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    import dataclasses

    torch.manual_seed(1)
    ref = torch.nn.Sequential(torch.nn.Linear(128, 64))
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(name), emulate=True)
    ao = convert_to_float8_training(copy.deepcopy(ref), config=config)
    ours = convert_to_float8(copy.deepcopy(ref), name)
    x = torch.randn(48, 128) * torch.logspace(-2, 2, 48)[:, None]
    g = torch.randn(48, 64)
    outs = []
    for model in (ao, ours):
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        y.backward(g)
        outs.append((y.detach(), xi.grad, model[0].weight.grad))
    for (a, b), what in zip(zip(*outs), ("y", "dx", "dw")):
        db = 20 * torch.log10(a.norm() / (a - b).norm().clamp_min(1e-30)).item()
        assert db > 150, f"{what}: {db:.1f} dB"


def test_torch_compile_fullgraph_gives_the_eager_bits():
    torch.manual_seed(0)
    m = convert_to_float8(torch.nn.Sequential(torch.nn.Linear(64, 32)), "rowwise")
    x = torch.randn(20, 64, requires_grad=True)
    y0 = m(x)
    y0.sum().backward()
    g0, x.grad = x.grad.clone(), None
    y1 = torch.compile(m, fullgraph=True)(x)
    y1.sum().backward()
    assert torch.equal(y0, y1) and torch.equal(g0, x.grad)


# ---- Transformer Engine's override_linear_precision ---------------------------------------------------------

@pytest.mark.parametrize("recipe_cls", [fp8core.DelayedScaling, fp8core.Float8CurrentScaling])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_override_linear_precision_runs_that_gemm_in_high_precision(recipe_cls, which):
    flags = [False, False, False]
    flags[which] = True
    torch.manual_seed(2)
    base = torch.nn.Linear(64, 32)
    x = torch.randn(20, 64)
    g = torch.randn(20, 32)
    results = {}
    for key, recipe in (("fp8", recipe_cls()), ("override", recipe_cls(override_linear_precision=tuple(flags)))):
        lin = Float8Linear.from_linear(copy.deepcopy(base), recipe)
        xi = x.clone().requires_grad_(True)
        with autocast():
            y = lin(xi)
            y.backward(g)
        results[key] = (y.detach(), xi.grad, lin.weight.grad)
    w = base.weight.detach()
    high = (x @ w.t() + base.bias.detach(), g @ w, g.t() @ x)
    for i in range(3):
        got, fp8 = results["override"][i], results["fp8"][i]
        if i == which:
            assert torch.equal(got, high[i])
            assert not torch.equal(fp8, high[i])
        else:
            assert torch.equal(got, fp8)  # the other GEMMs are untouched


def test_override_linear_precision_is_tes_named_tuple_and_checked():
    r = fp8core.DelayedScaling(override_linear_precision=(False, False, True))
    assert r.override_linear_precision == fp8core.OverrideLinearPrecision(wgrad=True)
    assert r.override_linear_precision.wgrad and not r.override_linear_precision.fprop
    with pytest.raises(TypeError, match=r"override_linear_precision: expected \(fprop, dgrad, wgrad\)"):
        fp8core.Float8CurrentScaling(override_linear_precision=(True,))
    with pytest.raises(TypeError, match="override_linear_precision.dgrad"):
        fp8core.Float8CurrentScaling(override_linear_precision=(False, "yes", False))


# ---- record_numerics and inspect --recipes --------------------------------------------------------------------

def test_record_numerics_measures_a_rowwise_layers_casts(tmp_path):
    """Each operand's row: the layer's recipe, no per-tensor scale, the SQNR of its rowwise cast (computed here
    from the core's quantize_rowwise), and the grad_output row from the backward."""
    from fp8core.torch import record_numerics

    torch.manual_seed(0)
    net = convert_to_float8(torch.nn.Sequential(torch.nn.Linear(32, 16)), "rowwise")
    x = torch.randn(16, 32)
    x[2] *= 1e4
    with record_numerics(net, recipes="e4m3,rowwise") as rec:
        net(x).square().sum().backward()
    rows = {r["operand"]: r for r in rec.rows}
    assert sorted(rows) == ["grad_output", "input", "weight"]
    r = rows["input"]
    assert r["recipe"] == "Float8RowwiseScaling" and r["format"] == "E4M3" and r["scale"] is None
    y = fp8core.dequantize_rowwise(quantize_rowwise(x, epsilon=1e-12)).double()
    want = 10 * np.log10((x.double() ** 2).sum().item() / ((y - x.double()) ** 2).sum().item())
    assert abs(r["sqnr_db"] - want) < 1e-9
    assert r["recipes"]["rowwise"]["sqnr_db"] == r["sqnr_db"]  # the compared recipe is the same cast
    assert r["underflow"] == 0.0 and r["recipes"]["e4m3"]["underflow"] > 0.01  # per-tensor flushes other tokens
    assert np.isfinite(rows["grad_output"]["sqnr_db"])
    assert rec.by_operand()["0.input"]["recipes"]["Float8RowwiseScaling"]["sqnr_db"] == r["sqnr_db"]
    back = type(rec).load(rec.save(tmp_path / "record.json"))  # the JSON check knows the layer recipe
    assert back.rows == rec.rows


def test_inspect_recipes_lists_rowwise():
    from fp8core.numerics_recipes import RECIPES, select
    from fp8core.numerics_stats import measure

    assert "rowwise" in RECIPES and select("rowwise")[0].fmt is fp8core.Format.E4M3
    x = np.random.default_rng(0).standard_normal((64, 300)).astype(np.float32)
    x[3] *= 1e4
    rowwise, e4m3 = measure(x, RECIPES["rowwise"]), measure(x, RECIPES["e4m3"])
    assert rowwise["underflow"] == 0.0 and e4m3["underflow"] > 0.04  # the other tokens keep their small values
    assert measure(np.zeros((0, 5), np.float32), RECIPES["rowwise"])["sqnr_db"] is None
