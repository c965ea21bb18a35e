"""record_numerics(..., blocks=True): per layer, operand and step, the per-block statistics of each compared block
recipe, the same as fp8core.numerics_blocks.block_stats of the operand; a record holds them (and rows of block
recipes' layers, which have no per-tensor scale) through save and load; bad ones are refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fp8core  # noqa: E402
import fp8core.torch as te  # noqa: E402
from fp8core.numerics_blocks import block_stats  # noqa: E402
from fp8core.numerics_record import from_json  # noqa: E402
from fp8core.numerics_recipes import RECIPES  # noqa: E402
from fp8core.numerics_stats import strict_json  # noqa: E402
from fp8core.torch import NumericsRecord, record_numerics  # noqa: E402


def recorded(tmp_path):
    torch.manual_seed(0)
    net = te.convert_to_float8(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)),
                               fp8core.Float8CurrentScaling())
    x = torch.randn(16, 32)
    x[3, :16] *= 1e-6  # NVFP4 gives this block a zero or subnormal E4M3 scale: flushed elements to count
    with record_numerics(net, recipes="e4m3,nvfp4,mxfp8_rceil", blocks=True) as rec:
        with te.autocast(enabled=True):
            net(x).sum().backward()
    return net, x, rec


def test_each_row_holds_the_block_statistics_of_its_operand(tmp_path):
    net, x, rec = recorded(tmp_path)
    assert len(rec) == 6 and all(set(r["blocks"]) == {"nvfp4", "mxfp8_rceil"} for r in rec.rows)
    first = next(r for r in rec.rows if r["module"] == "0" and r["operand"] == "input")
    weight = next(r for r in rec.rows if r["module"] == "2" and r["operand"] == "weight")
    for name in ("nvfp4", "mxfp8_rceil"):
        assert first["blocks"][name] == block_stats(x.numpy(), RECIPES[name])
        assert weight["blocks"][name] == block_stats(net[2].weight.detach().numpy(), RECIPES[name])
    assert first["blocks"]["nvfp4"]["flushed"]["blocks"] >= 1
    worst = first["blocks"]["nvfp4"]["worst"][0]
    assert (worst["row_block"], worst["col_block"]) == (3, 0) and worst["flushed"] > 0


def test_blocks_survive_save_and_load_and_strict_json(tmp_path):
    _, _, rec = recorded(tmp_path)
    path = rec.save(tmp_path / "rec.json")
    assert "Infinity" not in path.read_text() and "NaN" not in path.read_text()
    loaded = NumericsRecord.load(path)
    assert [r["blocks"] for r in loaded.rows] == [r["blocks"] for r in rec.rows]


def row(**changes):
    base = {"module": "fc", "operand": "input", "step": 0, "recipe": "DelayedScaling", "format": "E4M3",
            "amax": 1.0, "scale": 448.0, "scale_inv": 1 / 448, "sqnr_db": 30.0, "underflow": 0.0, "clipped": 0.0,
            "at_max": 0.0, "max_rel_error": 0.1, "lost": 0.0}
    base.update(changes)
    return base


def test_a_block_recipes_row_has_no_per_tensor_scale():
    for recipe in ("MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling"):
        got = from_json([row(recipe=recipe, scale=None, scale_inv=None, format="E2M1" if "FP4" in recipe else "E4M3",
                             blocks={"nvfp4": {"n/a": "a scalar has no blocks"}})])
        assert got[0]["scale"] is None and got[0]["blocks"] == {"nvfp4": {"n/a": "a scalar has no blocks"}}
    with pytest.raises(ValueError, match="row 0's 'scale' is None, not a number"):
        from_json([row(scale=None)])  # a per-tensor recipe's row has its scale


@pytest.mark.parametrize("blocks, message", [
    ([1], "row 0's 'blocks' is not an object"),
    ({"e4m3": {}}, "row 0's 'blocks' has 'e4m3', not one of mxfp8_rceil"),
    ({"\x1b[2J": {}}, r"has '\\x1b\[2J'"),
    ({"nvfp4": 3}, "row 0's blocks of 'nvfp4' is not an object"),
])
def test_bad_blocks_are_refused_by_name(blocks, message):
    with pytest.raises(ValueError, match=message):
        from_json(json.loads(json.dumps([row(blocks=blocks)])))


def test_blocks_without_a_block_recipe_is_refused_naming_the_argument():
    net = te.convert_to_float8(torch.nn.Sequential(torch.nn.Linear(32, 32)), fp8core.Float8CurrentScaling())
    with pytest.raises(ValueError, match="^blocks: True needs a block recipe"):
        with record_numerics(net, recipes="e4m3", blocks=True):
            pass
    with pytest.raises(TypeError, match="blocks"):
        with record_numerics(net, recipes="nvfp4", blocks="yes"):
            pass
    assert strict_json({"a": float("inf")}) == {"a": "inf"}


def test_inspect_of_a_record_shows_the_worst_steps_blocks(tmp_path, capsys):
    from fp8core.cli import main

    torch.manual_seed(0)
    net = te.convert_to_float8(torch.nn.Sequential(torch.nn.Linear(32, 32)), fp8core.Float8CurrentScaling())
    xs = [torch.randn(16, 32), torch.randn(16, 32)]
    xs[1][5, 16:] *= 1e-6  # step 1's input has the block NVFP4 loses
    with record_numerics(net, recipes="nvfp4", blocks=True) as rec:
        for x in xs:
            with te.autocast(enabled=True):
                net(x)
    path = rec.save(tmp_path / "rec.json")
    assert main(["inspect", str(path), "--json"]) == 0
    entry = strict_json(json.loads(capsys.readouterr()[0]))["tensors"]["0.input"]
    assert entry["blocks"]["nvfp4"] == strict_json({**block_stats(xs[1].numpy(), RECIPES["nvfp4"]), "step": 1})
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr()[0]
    worst = entry["blocks"]["nvfp4"]["worst"][0]
    assert (worst["row_block"], worst["col_block"]) == (5, 1)
    assert "blocks nvfp4 (step 1): 32 of 1x16" in out and f"(5,1) {worst['sqnr_db']:.1f} dB" in " ".join(out.split())
    assert main(["inspect", str(path), "--blocks"]) == 2


@pytest.mark.parametrize("edit, message", [
    (lambda b: b.pop("worst"), "has no 'worst'"),
    (lambda b: b["scale"].update(log2_min="x"), "'scale.log2_min' is 'x', not a number"),
    (lambda b: b.update(all_zero=1.5), "'all_zero' is 1.5, not a count"),
    (lambda b: b["scale"].update(format=3), "'scale.format' is not a string"),
    (lambda b: b.update(worst=[{"row_block": 0}]), "'worst' is not a list of blocks"),
])
def test_a_records_blocks_are_checked_as_far_as_they_are_read(edit, message):
    b = strict_json(block_stats(np.ones((2, 32), np.float32), RECIPES["nvfp4"]))
    edit(b)
    with pytest.raises(ValueError, match=message):
        from_json(json.loads(json.dumps([row(blocks={"nvfp4": b})])))
