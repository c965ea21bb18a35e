"""Per-block statistics (``fp8core inspect --recipes ... --blocks``, fp8core.numerics_blocks): each figure against
a direct computation from the public API on crafted tensors (a block at the E8M0 ceiling, one at its floor, an
all-zero block, NVFP4 blocks with E4M3-subnormal and zero scales, blocks with flushed elements), the JSON's keys,
the text and the chart, escaped names."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import fp8core
from fp8core.numerics_blocks import block_stats
from fp8core.numerics_recipes import RECIPES
from test_cli import inspect, strict_json
from test_inspect_recipes import roundtrip, rht_operand

BLOCK_RECIPES = ["mxfp8_rceil", "mxfp8_floor", "block_1x128", "block_128x128", "nvfp4", "nvfp4_rht", "mxfp4"]
KEYS = {"blocks", "grid", "block", "all_zero", "scale", "dynamic_range_log2", "flushed", "sqnr_db", "sqnr_hist",
        "worst"}
SCALE_KEYS = {"format", "limits", "log2_floor", "log2_ceiling", "log2_min", "log2_median", "log2_max", "spread",
              "at_floor", "at_ceiling", "subnormal", "zero", "nan", "hist"}
WORST_KEYS = {"row_block", "col_block", "sqnr_db", "amax", "scale", "flushed"}


def crafted() -> np.ndarray:
    """[4, 64] float32: 1x32 blocks (0,0) with an inf (E8M0 saturates at 2^127), (0,1) of subnormals (E8M0 floor
    2^-127), (1,0) all zero, (1,1) a large value beside tiny ones (flushed); rows 2-3 smooth, and in row 3 two
    1x16 blocks far below the tensor's amax: with (0, 3) finite, NVFP4 scale E4M3-subnormal (3, 0) and zero
    (3, 1)."""
    rng = np.random.default_rng(7)
    x = rng.uniform(0.5, 2, (4, 64)).astype(np.float32)
    x[0, 3] = np.inf
    x[0, 32:] = np.float32(1e-40) * np.arange(1, 33, dtype=np.float32)
    x[1, :32] = 0
    x[1, 32:] = 1e-12
    x[1, 40] = 448
    # under the global amax 448 (the inf at (0, 3) replaced), NVFP4's block scale is the block's amax
    x[3, :16] = 0.005 * np.linspace(0.5, 1, 16, dtype=np.float32)
    x[3, 16:32] = 1e-4
    return x


def direct(x: np.ndarray, name: str) -> dict:
    """The per-block figures computed here, block by block: from the public API's round trip and its scales."""
    q, y = roundtrip(x, name)
    v = rht_operand(x) if name == "nvfp4_rht" else x
    br, bc = RECIPES[name].block
    rows, cols = v.shape
    grid = (-(-rows // br), -(-cols // bc))
    if name.startswith("mxfp8"):
        scales = np.asarray(fp8core.quantize_mxfp8(x, "e4m3", scale_mode=name[6:]).scale).view(np.uint8)
    elif name == "mxfp4":
        scales = np.asarray(fp8core.quantize_mxfp4(np.pad(x, ((0, 0), (0, -cols % 32)))).scale).view(np.uint8)
    elif name.startswith("nvfp4"):
        t = (fp8core.quantize_nvfp4(np.pad(x, ((0, -x.shape[0] % 16), (0, 0))), columnwise=True, hadamard=True)
             if name == "nvfp4_rht" else fp8core.quantize_nvfp4(np.pad(x, ((0, 0), (0, -cols % 16)))))
        scales = np.asarray(t.scale).view(np.uint8)
    else:
        scales = np.asarray(fp8core.quantize_blockwise(x, "e4m3", block=name[6:]).scale_inv)
    out = {"grid": list(grid), "blocks": {}}
    for i in range(grid[0]):
        for j in range(grid[1]):
            b = (slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))
            xv, yv = v[b].astype(np.float64), y[b]
            fin = np.isfinite(xv)
            nz = fin & (xv != 0)
            if not nz.any():
                out["blocks"][i, j] = None
                continue
            noise = np.sum((yv[fin] - xv[fin]) ** 2) if np.isfinite(yv[fin]).all() else math.inf
            signal = np.sum(xv[fin] ** 2)
            out["blocks"][i, j] = {
                "scale": scales[i, j], "flushed": int((nz & (yv == 0)).sum()), "nonzero": int(nz.sum()),
                "sqnr": math.inf if noise == 0 else 10 * math.log10(signal / noise),
                "range": math.log2(np.abs(xv[nz]).max() / np.abs(xv[nz]).min()), "amax": float(np.abs(xv[fin]).max())}
    return out


@pytest.mark.parametrize("name", BLOCK_RECIPES)
def test_every_figure_equals_a_block_by_block_computation(name):
    x = crafted()
    got = block_stats(x, RECIPES[name], worst=1000)
    want = direct(x, name)
    assert set(got) == KEYS and set(got["scale"]) == SCALE_KEYS
    assert got["grid"] == want["grid"] and got["block"] == list(RECIPES[name].block)
    live = {k: b for k, b in want["blocks"].items() if b is not None}
    assert got["blocks"] == len(want["blocks"]) and got["all_zero"] == len(want["blocks"]) - len(live)
    assert got["flushed"]["blocks"] == sum(b["flushed"] > 0 for b in live.values())
    fractions = [b["flushed"] / b["nonzero"] for b in live.values()]
    assert got["flushed"]["max_fraction"] == max(fractions)
    assert got["flushed"]["mean_fraction"] == pytest.approx(np.mean(fractions), rel=1e-12)
    ranges = [b["range"] for b in live.values()]
    assert got["dynamic_range_log2"]["max"] == pytest.approx(max(ranges), rel=1e-12)
    # every live block is listed, lowest SQNR first, at its position, with its own figures
    assert len(got["worst"]) == len(live)
    order = sorted(live, key=lambda k: (live[k]["sqnr"], k))
    assert [(w["row_block"], w["col_block"]) for w in got["worst"]] == order
    for w in got["worst"]:
        b = live[w["row_block"], w["col_block"]]
        assert set(w) == WORST_KEYS
        assert w["sqnr_db"] == pytest.approx(b["sqnr"], rel=1e-9) or w["sqnr_db"] == b["sqnr"]
        assert w["flushed"] == b["flushed"] / b["nonzero"] and w["amax"] == b["amax"]
    assert sum(got["sqnr_hist"]["counts"]) + got["sqnr_hist"]["exact"] + got["sqnr_hist"]["lost"] == len(live)


def test_the_scale_formats_floor_and_ceiling_are_counted_where_the_crafted_blocks_put_them():
    x = crafted()
    mx = block_stats(x, RECIPES["mxfp8_rceil"])
    e = np.asarray(fp8core.quantize_mxfp8(x, "e4m3").scale).view(np.uint8)
    assert e[0, 0] == 254 and e[0, 1] == 0  # the crafted blocks: the inf saturates, the subnormals floor
    assert mx["scale"]["at_ceiling"] == 1 and mx["scale"]["at_floor"] == 1  # (1, 0) is all zero: not counted
    assert mx["all_zero"] == 1 and mx["scale"]["format"] == "E8M0"
    assert mx["scale"]["log2_max"] == 127 and mx["scale"]["log2_min"] == -127 and mx["scale"]["spread"] == 254
    assert sum(mx["scale"]["hist"]["counts"]) == mx["blocks"] - mx["all_zero"]
    worst = mx["worst"][0]  # the inf's block: its scale 2^127 flushes every finite value of it to 0
    assert (worst["row_block"], worst["col_block"]) == (0, 0) and worst["flushed"] == 1.0 and worst["sqnr_db"] == 0
    x[0, 3] = 1  # an inf makes NVFP4's global amax inf, and its global scale 1
    nv = block_stats(x, RECIPES["nvfp4"], worst=100)
    s = np.asarray(fp8core.quantize_nvfp4(x).scale).view(np.uint8)
    assert 1 <= s[3, 0] <= 7 and s[3, 1] == 0  # E4M3-subnormal and zero scales, as crafted
    assert nv["scale"]["subnormal"] == int(((s >= 1) & (s <= 7)).sum()) >= 1
    assert nv["scale"]["zero"] == int(((s == 0) & (np.abs(x).reshape(4, 4, 16).max(axis=2) > 0)).sum()) >= 1
    zero_block = next(w for w in nv["worst"] if (w["row_block"], w["col_block"]) == (3, 1))
    assert zero_block["flushed"] == 1.0 and zero_block["scale"] == 0 and zero_block["sqnr_db"] == 0.0
    flushed = block_stats(x, RECIPES["mxfp8_floor"], worst=100)
    big = next(w for w in flushed["worst"] if (w["row_block"], w["col_block"]) == (1, 1))
    assert big["flushed"] == 31 / 32  # 448 beside 1e-12: the E4M3 block scale leaves the rest below its subnormals


def test_a_scalar_and_a_recipe_without_blocks():
    assert block_stats(np.float32(3.0), RECIPES["nvfp4"]) == {"n/a": "a scalar has no blocks"}
    assert "n/a" in block_stats(np.ones(64, np.float32), RECIPES["nvfp4_rht"])
    with pytest.raises(ValueError, match="recipe: e4m3 has no blocks"):
        block_stats(np.ones((2, 32), np.float32), RECIPES["e4m3"])


def test_inspect_blocks_text_json_and_chart(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    evil = "w\x1b[31m\u202e.weight"
    np.savez(tmp_path / "m.npz", **{evil: crafted(), "bias": np.ones(64, np.float32)})
    code, out, err = inspect(capsys, tmp_path / "m.npz", "--recipes", "e4m3,mxfp8_rceil,nvfp4", "--blocks", "--json")
    assert code == 0, err
    got = strict_json(out)
    assert got["blocks"]["recipes"] == ["mxfp8_rceil", "nvfp4"] and "row_block" in got["blocks"]["positions"]
    row = got["tensors"][evil]  # JSON keeps the name whole, escaped by json itself
    assert set(row["blocks"]) == {"mxfp8_rceil", "nvfp4"} and set(row["blocks"]["nvfp4"]) == KEYS
    assert row["blocks"]["mxfp8_rceil"]["scale"]["at_ceiling"] == 1
    assert json.loads(json.dumps(row["blocks"]))  # strict: no NaN, inf as strings
    code, out, err = inspect(capsys, tmp_path / "m.npz", "--recipes", "all", "--blocks", "--plot", tmp_path / "o")
    assert code == 0, err
    assert "\x1b" not in out and "\u202e" not in out
    nv = row["blocks"]["nvfp4"]["scale"]
    assert "blocks nvfp4: 16 of 1x16, 2 all zero; E4M3 scales" in out
    shown = ", ".join(f"{k.replace('_', ' ')} {nv[k]}" for k in ("at_floor", "at_ceiling", "subnormal", "zero", "nan")
                      if nv[k])
    assert nv["zero"] > 0 and shown in " ".join(out.split())
    assert "blocks nvfp4_rht: n/a" in out  # the 1-D bias
    assert max(map(len, out.splitlines())) <= 100
    data = (tmp_path / "o.blocks.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000
    assert f"block plot written to {tmp_path / 'o.blocks.png'}" in out


@pytest.mark.parametrize("argv, message", [
    (["--blocks"], "--blocks: with --recipes"),
    (["--recipes", "e4m3,e5m2", "--blocks"], "has no block recipe"),
])
def test_blocks_refused_without_a_block_recipe(tmp_path, capsys, argv, message):
    np.save(tmp_path / "x.npy", np.ones((2, 32), np.float32))
    code, out, err = inspect(capsys, tmp_path / "x.npy", *argv)
    assert code != 0 and message in err
