"""A numerics record's rows without torch: read back from JSON (and what is refused, naming the file), per cast
and per layer and operand over the steps (worst step, winner), and `fp8core inspect record.json` (table, JSON,
plot, the refusals)."""

from __future__ import annotations

import json
import math
import struct

import pytest

from fp8core.numerics_record import from_json, per_cast, per_operand
from test_cli import inspect, strict_json


def stats(sqnr, underflow=0.0, clipped=0.0, at_max=0.0, rel=0.1, lost=0.0, **extra):
    return {"sqnr_db": sqnr, "underflow": underflow, "clipped": clipped, "at_max": at_max, "max_rel_error": rel,
            "lost": lost, **extra}


def row(module, operand, step, own, compared=None, recipe="DelayedScaling", fmt="E4M3", amax=1.0):
    r = {"module": module, "step": step, "operand": operand, "recipe": recipe, "format": fmt, "amax": amax,
         "scale": 2.0, "scale_inv": 0.5, **own}
    if compared is not None:
        r["recipes"] = compared
    return r


def record():
    """Two steps of one layer's input: the layer's cast wins step 0, mxfp8_rceil step 1; over both steps e4m3's
    worst (29) beats the cast's (25) and mxfp8_rceil's (27)."""
    return [
        row("l", "input", 0, stats(35.0, underflow=0.1), {"e4m3": stats(30.0), "mxfp8_rceil": stats(27.0,
                                                                                                    padded=True)},
            amax=3.0),
        row("l", "input", 1, stats(25.0, clipped=0.2), {"e4m3": stats(29.0, rel=0.5),
                                                         "mxfp8_rceil": stats(40.0, padded=False)}, amax=4.0),
        row("", "grad_output", 0, stats(None), {"e4m3": {"n/a": "a scalar has no blocks"},
                                                "mxfp8_rceil": stats(math.inf)}, fmt="E5M2"),
    ]


def test_per_operand_is_each_recipes_worst_step_and_the_best_worst_wins():
    got = per_operand(record())
    assert list(got) == ["l.input", "<model>.grad_output"]
    e = got["l.input"]
    assert (e["steps"], e["format"], e["recipe"], e["amax_min"], e["amax_max"]) == (2, "E4M3", "DelayedScaling", 3.0,
                                                                                      4.0)
    assert list(e["recipes"]) == ["DelayedScaling", "e4m3", "mxfp8_rceil"]
    own, e4, mx = (e["recipes"][n] for n in ("DelayedScaling", "e4m3", "mxfp8_rceil"))
    assert (own["sqnr_db"], own["underflow"], own["clipped"], own["best_steps"]) == (25.0, 0.1, 0.2, 1)
    assert (e4["sqnr_db"], e4["max_rel_error"], e4["best_steps"]) == (29.0, 0.5, 0)
    assert (mx["sqnr_db"], mx["padded"], mx["best_steps"]) == (27.0, True, 1)
    assert "padded" not in own
    assert e["winner"] == "e4m3"  # wins no step, but serves both best
    g = got["<model>.grad_output"]
    assert g["recipes"]["DelayedScaling"]["sqnr_db"] is None  # no signal
    assert g["recipes"]["e4m3"] == {"n/a": "a scalar has no blocks"}
    assert g["winner"] == "mxfp8_rceil" and g["recipes"]["mxfp8_rceil"]["sqnr_db"] == math.inf


def test_per_cast_fills_what_a_row_lacks_and_ties_go_to_the_layers_cast():
    rows = [row("a", "weight", 0, stats(30.0), {"e4m3": stats(30.0)}),
            row("b", "weight", 0, stats(20.0), recipe="Float8CurrentScaling")]
    got = per_cast(rows)
    assert list(got) == ["a.weight@0", "b.weight@0"]
    assert list(got["a.weight@0"]["recipes"]) == ["DelayedScaling", "Float8CurrentScaling", "e4m3"]
    assert got["a.weight@0"]["winner"] == "DelayedScaling"  # a tie: the first listed
    assert got["a.weight@0"]["recipes"]["Float8CurrentScaling"] == {"n/a": "not this layer's recipe"}
    assert got["b.weight@0"]["recipes"]["e4m3"] == {"n/a": "not compared at this cast"}
    assert got["b.weight@0"]["winner"] == "Float8CurrentScaling"


def test_from_json_gives_the_rows_back_with_infinities():
    rows = record()
    rows[0]["amax"] = math.nan
    text = json.dumps(json.loads(json.dumps(rows).replace("Infinity", '"inf"').replace("NaN", '"nan"')))
    back = from_json(json.loads(text))
    assert back[2]["recipes"]["mxfp8_rceil"]["sqnr_db"] == math.inf
    assert math.isnan(back[0]["amax"])
    assert back[1] == rows[1]


@pytest.mark.parametrize("data,says", [
    ({"rows": []}, "its top level is a JSON object"),
    ([], "an empty record: no cast was recorded"),
    ([1], "row 0 is not an object (int)"),
    ([{"module": "l"}], "row 0 has no 'operand', 'step'"),
    ([dict(row("l", "input", 0, stats(1.0)), operand="bias")], "row 0's 'operand' is 'bias', not one of input"),
    ([dict(row("l", "input", 0, stats(1.0)), step=-1)], "row 0's 'step' is -1, not a count from 0"),
    ([dict(row("l", "input", 0, stats(1.0)), step=True)], "row 0's 'step' is True"),
    ([dict(row("l", "input", 0, stats(1.0)), module=3)], "row 0's 'module' is 3, not a string"),
    ([dict(row("l", "input", 0, stats(1.0)), amax="big")], "row 0's 'amax' is 'big', not a number"),
    ([row("l", "input", 0, stats(1.0), {"e4m3": [1]})], "row 0's recipe 'e4m3' is not an object (list)"),
    ([row("l", "input", 0, stats(1.0), {"e4m3": {"sqnr_db": 1.0}})], "row 0's recipe 'e4m3' has no 'underflow'"),
    ([row("l", "input", 0, stats(1.0), ["e4m3"])], "row 0's 'recipes' is not an object of recipe names"),
    ([row("l", "input", 0, stats(1.0), {"DelayedScaling": stats(90.0)})],
     "row 0's 'recipes' has 'DelayedScaling', the name of the layer's own cast"),
    ([row("l", "input", 0, stats(1.0), {"e4m3": stats(1.0, padded="no")})],
     "row 0's recipe 'e4m3''s 'padded' is 'no', not true or false"),
])
def test_what_is_not_a_record_is_refused_saying_what_one_is(data, says):
    with pytest.raises(ValueError) as e:
        from_json(data)
    assert says in str(e.value)
    if data:  # a list of rows that is not one: what one is
        assert "expected a JSON list of rows as NumericsRecord.save and .to_json() write them" in str(e.value)


def save(tmp_path, rows, name="run.json"):
    path = tmp_path / name
    path.write_text(json.dumps(rows).replace("Infinity", '"inf"'))
    return path


def test_inspect_prints_a_record_per_layer_and_operand(tmp_path, capsys):
    code, out, err = inspect(capsys, save(tmp_path, record()))
    assert code == 0, err
    lines = out.splitlines()
    at = lines.index("l.input  DelayedScaling E4M3  2 step(s)  amax 3..4")
    assert lines[at + 1].split()[:2] == ["DelayedScaling", "25.00"]
    assert lines[at + 2].split()[:2] == ["*e4m3", "29.00"]
    assert lines[at + 3].split()[:2] == ["mxfp8_rceil", "27.00"] and lines[at + 3].endswith("padded")
    assert "over 2 layer operand(s) with a signal" in out


def test_inspect_json_of_a_record_is_per_operand_strict(tmp_path, capsys):
    code, out, err = inspect(capsys, save(tmp_path, record()), "--json")
    assert code == 0, err
    got = strict_json(out)
    assert list(got["recipes"]) == ["DelayedScaling", "e4m3", "mxfp8_rceil"]
    assert got["recipes"]["DelayedScaling"].startswith("the layer's own cast")
    assert got["recipes"]["e4m3"].startswith("Float8CurrentScaling")
    assert got["tensors"]["<model>.grad_output"]["recipes"]["mxfp8_rceil"]["sqnr_db"] == "inf"
    assert got["tensors"]["l.input"]["winner"] == "e4m3"
    assert got["summary"]["tensors"] == 2
    assert got["summary"]["recipes"]["mxfp8_rceil"] == {"best": 1, "within_1db": 1}


def test_two_records_are_keyed_by_file_and_plotted_at_the_given_path(tmp_path, capsys):
    a, b = save(tmp_path, record(), "a.json"), save(tmp_path, record()[:1], "b.json")
    code, out, err = inspect(capsys, a, b, "--json", "--plot", tmp_path / "chart.png")
    assert code == 0, err
    assert list(strict_json(out)["tensors"]) == [f"{a}:l.input", f"{a}:<model>.grad_output", f"{b}:l.input"]
    width = struct.unpack(">I", (tmp_path / "chart.png").read_bytes()[16:20])[0]  # the PNG's IHDR
    # two panels, SQNR and underflow: 12 inches at 90 dpi (one panel is 9), and the names' column beyond the
    # margin that takes ~40 characters: these names are whole, a path's length each
    names = max(len(f"{a}:<model>.grad_output"), len(f"{b}:l.input"))
    assert width == int(90 * (12 + 0.6 * 7 / 72 * names - 2.5))
    assert not (tmp_path / "chart.recipes.png").exists()


@pytest.mark.parametrize("content,says", [
    ("{not json", "not JSON"),
    ('{"weight": [1, 2]}', "not a record: its top level is a JSON object; expected a JSON list of rows"),
    ("[]", "an empty record"),
    ('[{"module": "x"}]', "not a record: row 0 has no 'operand'"),
    ("[" * 100_000, "JSON nested too deeply to be a record"),  # json's decoder: RecursionError
])
def test_inspect_names_the_file_that_is_not_a_record(tmp_path, capsys, content, says):
    path = tmp_path / "other.json"
    path.write_text(content)
    code, out, err = inspect(capsys, path)
    assert code == 2 and out == ""
    assert f"{path}: " in err and says in err
    assert len(err.strip().splitlines()) == 1


def test_inspect_refuses_a_record_with_tensor_files_recipes_or_scale(tmp_path, capsys):
    path = save(tmp_path, record())
    code, _, err = inspect(capsys, path, tmp_path / "x.npy")
    assert code == 2 and "a record (.json) is inspected on its own" in err
    code, _, err = inspect(capsys, path, "--recipes", "all")
    assert code == 2 and "--recipes: not with a record" in err
    code, _, err = inspect(capsys, path, "--scale", "2")
    assert code == 2 and "--scale: not with a record" in err
    code, _, err = inspect(capsys, tmp_path / "missing.json")
    assert code == 2 and "missing.json: no such file" in err
