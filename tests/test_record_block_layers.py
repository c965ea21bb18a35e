"""record_numerics on layers that train under the block recipes (MXFP8BlockScaling, Float8BlockScaling,
NVFP4BlockScaling): a row per layer, operand and step, under the layer's recipe name with no per-tensor scale, each
the statistics of the layer's own cast of the operand (numerics_recipes.layer_recipe), compared recipes and
per-block statistics beside it; the training's bits are unchanged and the record loads back."""

import copy
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fp8core  # noqa: E402
from fp8core.numerics_record import from_json  # noqa: E402
from fp8core.numerics_recipes import layer_recipe  # noqa: E402
from fp8core.numerics_stats import measure  # noqa: E402
from fp8core.torch import autocast, convert_to_float8, record_numerics  # noqa: E402

RECIPES = {"mxfp8_hybrid": fp8core.MXFP8BlockScaling(fp8core.Format.HYBRID),
           "blocks": fp8core.Float8BlockScaling(),
           "nvfp4": fp8core.NVFP4BlockScaling()}


def net(recipe):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
    return convert_to_float8(model, recipe)


@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
def test_each_row_is_the_layers_own_block_cast_and_the_bits_do_not_move(recipe):
    model, twin = net(recipe), net(recipe)
    x = torch.randn(2, 20, 128)
    grads = {}

    def keep(name):
        return lambda g: grads.__setitem__(name, g.detach().clone())

    with record_numerics(model, recipes="e4m3,nvfp4", blocks=True) as rec:
        with autocast():
            h = model[0](x)
            h.register_hook(keep("0"))
            y = model[2](model[1](h))
            y.register_hook(keep("2"))
        y.square().sum().backward()
    with autocast():
        y_twin = twin(x)
    y_twin.square().sum().backward()
    assert torch.equal(y, y_twin)  # recording changes nothing
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters()))
    assert [(r["module"], r["operand"]) for r in rec.rows] == [
        ("0", "input"), ("0", "weight"), ("2", "input"), ("2", "weight"), ("2", "grad_output"), ("0", "grad_output")]
    operands = {("0", "input"): x, ("0", "weight"): model[0].weight, ("2", "input"): model[1](h),
                ("2", "weight"): model[2].weight, ("2", "grad_output"): grads["2"], ("0", "grad_output"): grads["0"]}
    for r in rec.rows:
        assert r["recipe"] == type(recipe).__name__ and r["scale"] is None and r["scale_inv"] is None
        own = layer_recipe(recipe, r["operand"])
        t = operands[(r["module"], r["operand"])].detach()
        want = measure(t.reshape(-1, t.shape[-1]).float().numpy(), own)
        assert r["format"] == own.fmt.name and r["sqnr_db"] == want["sqnr_db"] and r["lost"] == want["lost"]
        assert r["amax"] == t.abs().max().item()
        assert set(r["recipes"]) == {"e4m3", "nvfp4"} and set(r["blocks"]) == {"nvfp4"}
    assert from_json(json.loads(rec.to_json())) == json.loads(rec.to_json())
    assert "grad_output" in str(rec)  # the summary prints a row with no per-tensor scale


def test_the_layer_recipe_is_the_operands_format_and_block():
    hybrid = fp8core.MXFP8BlockScaling(fp8core.Format.HYBRID, "floor")
    assert layer_recipe(hybrid, "input").fmt is fp8core.Format.E4M3
    assert layer_recipe(hybrid, "grad_output").fmt is fp8core.Format.E5M2
    blocks = fp8core.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)
    assert layer_recipe(blocks, "input").block == (128, 128) and layer_recipe(blocks, "weight").block == (1, 128)
    nvfp4 = fp8core.NVFP4BlockScaling()
    assert layer_recipe(nvfp4, "weight").block == (16, 16) and layer_recipe(nvfp4, "input").block == (1, 16)
    assert layer_recipe(fp8core.NVFP4BlockScaling(disable_2d_quantization=True), "weight").block == (1, 16)
    # 16x16 tiles: the measured values are the core's dequantized tiles
    w = np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32)
    r = layer_recipe(nvfp4, "weight")
    q = r.quantize(w)
    data, y = r.dequantize_part(q, 16, 40, 16, 64)
    full = fp8core.dequantize_nvfp4(fp8core.quantize_nvfp4(np.pad(w, ((0, 8), (0, 0))), weight_2d=True))
    np.testing.assert_array_equal(y, full[16:40, 16:64])
    with pytest.raises(TypeError, match="recipe: expected MXFP8BlockScaling, Float8BlockScaling or NVFP4BlockScaling"):
        layer_recipe(fp8core.Float8CurrentScaling(), "input")


def test_a_compiled_model_records_its_eager_twins_block_rows():
    model = net(fp8core.NVFP4BlockScaling())
    eager = copy.deepcopy(model)
    compiled = torch.compile(model)
    x = torch.randn(32, 128)
    with record_numerics(model) as rec_c, record_numerics(eager) as rec_e:
        compiled(x).sum().backward()
        eager(x).sum().backward()
    strip = [{k: v for k, v in r.items()} for r in rec_c.rows]
    assert strip == rec_e.rows and len(strip) == 6
