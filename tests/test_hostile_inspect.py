"""The hostile-input probes of `fp8core inspect` (issue 28, issue 27 item 9), one row each: the file is made in
tmp_path, the command runs in process, and the row's check says what must (and must not) come out."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from typing import Any, Callable

import numpy as np
import pytest

from conftest import GPU_REASON
from fp8core import cli
from fp8core.cli import files

ESC = "\x1b[31mred\x1b[0m"


def strict(text: str) -> Any:
    def refuse(name):
        raise AssertionError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def npz(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def declare_every_size(path, size: int):
    """Rewrite the uncompressed size the central directory declares for every member."""
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        data[at + 24:at + 28] = size.to_bytes(4, "little")
        at = data.find(b"PK\x01\x02", at + 4)
    path.write_bytes(bytes(data))
    return path


def torch_save(path, obj):
    torch = pytest.importorskip("torch")
    torch.save(obj, path)
    return path


def shared_nest(depth: int):
    import torch

    a = [torch.zeros(1)]
    for _ in range(depth):
        a = [a, a]
    return a


def deep_nest(depth: int):
    import torch

    inner: Any = {"w": torch.ones(2)}
    for _ in range(depth):
        inner = [inner]
    return {"top": torch.ones(3), "deep": inner}


def no_escape_codes(code, out, err):
    assert "\x1b" not in out + err and "\u202e" not in out + err and "\r" not in out


def widest(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def be_twin(tmp_path, dtype: str, values) -> tuple[list, Callable]:
    """A big-endian .npy and its native twin: the same statistics, the byte order noted."""
    x = np.asarray(values).astype(dtype)
    np.save(tmp_path / "be.npy", x.astype(np.dtype(dtype).newbyteorder(">")))
    np.save(tmp_path / "le.npy", x.astype(np.dtype(dtype).newbyteorder("<")))

    def check(code, out, err):
        assert code == 0, err
        rows = strict(out)
        be, le = rows[f"{tmp_path / 'be.npy'}:be"], rows[f"{tmp_path / 'le.npy'}:le"]
        assert "big-endian" in be["note"] and "byte order" in be["note"]
        for k in ("amax", "elements", "nan", "inf", "E4M3", "E5M2", "shape", "dtype"):
            assert be[k] == le[k], k
    return [tmp_path / "be.npy", tmp_path / "le.npy", "--json"], check


def legend_colours_drawn(tmp_path) -> tuple[list, Callable]:
    pytest.importorskip("matplotlib")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal(4096).astype(np.float32))

    def check(code, out, err):
        assert code == 0, err
        import matplotlib.image

        rgb = (matplotlib.image.imread(tmp_path / "p.png")[..., :3] * 255).round().astype(int)
        count = lambda c: int(np.all(rgb == c, axis=-1).sum())  # noqa: E731
        blue, orange = count((0x1F, 0x77, 0xB4)), count((0xFF, 0x7F, 0x0E))  # tab:blue, tab:orange
        assert blue > 2000 and orange > 2000, (blue, orange)  # each range a strip in the legend's own colour
        # the old bands: blue and orange at alpha 0.15 over white, and over each other (brown)
        for c in ((0xDD, 0xEB, 0xF4), (0xFF, 0xEF, 0xE2), (0xE0, 0xE0, 0xCF)):
            assert count(c) < 50, c
    return [tmp_path / "x.npy", "--plot", tmp_path / "p.png"], check


PROBES: list[Any] = [
    # ---- names from the file reach the terminal escaped; JSON stays strict and keeps them intact
    pytest.param(lambda p: [torch_save(p / "e.pt", {ESC: __import__("torch").ones(3)})],
                 lambda code, out, err: (no_escape_codes(code, out, err), code == 0 and "\\x1b[31mred" in out)[1],
                 id="escape-codes-in-a-pt-key-table"),
    pytest.param(lambda p: [torch_save(p / "e.pt", {ESC: __import__("torch").ones(3)}), "--json"],
                 lambda code, out, err: "\x1b" not in out and list(strict(out)) == [ESC],
                 id="escape-codes-in-a-pt-key-json"),
    pytest.param(lambda p: [npz(p / "e.npz", {f"\x1b[2J{ESC}.npy": npy(np.ones(3, np.float32))})],
                 lambda code, out, err: (no_escape_codes(code, out, err), code == 0 and "\\x1b[2J" in out)[1],
                 id="escape-codes-in-an-npz-member"),
    pytest.param(lambda p: [npz(p / "e.npz", {f"{ESC}.txt": b"hi"})],
                 lambda code, out, err: (no_escape_codes(code, out, err), code == 2 and "\\x1b[31m" in err
                                         and "not a .npy array" in err)[1],
                 id="escape-codes-in-an-error-message"),
    pytest.param(lambda p: [torch_save(p / "e.pt", {"ok\u202eevil\rX": __import__("torch").ones(3)})],
                 lambda code, out, err: (no_escape_codes(code, out, err), "ok\\u202eevil\\rX" in out)[1],
                 id="bidi-override-and-carriage-return-in-a-key"),
    pytest.param(lambda p: [torch_save(p / "e.pt", {f"{ESC}$x^2$ {{": __import__("torch").ones(3)}),
                            "--plot", p / "e.png"],
                 lambda code, out, err: code == 0 and "\x1b" not in out + err and "plot written" in out,
                 id="escape-codes-and-mathtext-in-a-plot-title"),
    pytest.param(lambda p: [np.save(p / "x.npy", np.ones(3, np.float32)) or p / "x.npy",
                            "--plot", p / f"no{ESC}dir" / "x.png"],
                 lambda code, out, err: (no_escape_codes(code, out, err), code == 2 and "\\x1b[31m" in err)[1],
                 id="escape-codes-in-an-os-error"),
    # ---- a .pt walk visits each container once, bounded, and says what it skipped
    pytest.param(lambda p: [torch_save(p / "n.pt", shared_nest(26))],
                 lambda code, out, err: code == 0 and out.count("(1,) float32") == 1
                 and "skipped 26 references to a dict/list/tuple already walked" in err,
                 id="shared-nesting-2^26-paths"),
    pytest.param(lambda p: [torch_save(p / "n.pt", deep_nest(100)), "--json"],
                 lambda code, out, err: code == 0 and list(strict(out)) == ["top"]
                 and f"nested more than {files.MAX_DEPTH} levels down" in err,
                 id="nesting-deeper-than-the-bound"),
    pytest.param(lambda p: [torch_save(p / "n.pt", {str(i): __import__("torch").ones(1) for i in range(20)}),
                            "--json", "MAX_ENTRIES=10"],
                 lambda code, out, err: code == 2 and "holds no tensors" in err and "beyond the first 10" in err,
                 id="more-entries-than-the-bound"),
    # ---- the .npz cap is the file's, checked on the declared sizes before anything is inflated
    pytest.param(lambda p: [npz(p / "t.npz", {f"{k}.npy": npy(np.zeros(1 << 19, np.float32)) for k in "abc"}),
                            "--max-bytes", str(5 << 20)],
                 lambda code, out, err: code == 2 and out == "" and "3 member(s) would inflate to 6291840 bytes in "
                 "all" in err and "--max-bytes" in err,
                 id="three-members-each-under-the-cap-together-over"),
    pytest.param(lambda p: [declare_every_size(npz(p / "t.npz", {f"{k}.npy": npy(np.zeros(4, np.float32))
                                                                for k in "abc"}), 1 << 30)],
                 lambda code, out, err: code == 2 and out == "" and f"would inflate to {3 << 30} bytes in all" in err,
                 id="three-members-declaring-1GiB-each"),
    pytest.param(lambda p: [npz(p / "t.npz", {f"{k}.npy": npy(np.ones(1 << 10, np.float32)) for k in "abc"}),
                            "--max-bytes", str(3 * (4096 + 128)), "--json"],
                 lambda code, out, err: code == 0 and sorted(strict(out)) == ["a", "b", "c"],
                 id="three-members-exactly-at-the-cap"),
    # ---- a big-endian file is the user's data: read in our byte order, same statistics as its twin
    pytest.param(lambda p: be_twin(p, "float32", [1.5, -3.0, np.nan, np.inf, 1e-40, 0.0, 448.0, 6e4]),
                 None, id="big-endian-float32"),
    pytest.param(lambda p: be_twin(p, "float16", [1.5, -3.0, np.nan, -np.inf, 6e-8, 0.0, 448.0, 6e4]),
                 None, id="big-endian-float16"),
    pytest.param(lambda p: be_twin(p, "float64", [1.5, -3.0, 1e300, 1e-300, 0.0]), None, id="big-endian-float64"),
    pytest.param(lambda p: be_twin(p, "int32", [1, -3, 2 ** 30, 0]), None, id="big-endian-int32"),
    # ---- the table fits 100 columns, whatever the names and notes
    pytest.param(lambda p: [torch_save(p / ("w" * 150 + ".pt"), {"model.layers.12.self_attn.q_proj." + "x" * 120:
                                                               __import__("torch").ones(3, dtype=__import__("torch")
                                                                                        .int32)}),
                            np.save(p / "n.npy", np.array([1.0, np.nan], ">f8")) or p / "n.npy"],
                 lambda code, out, err: code == 0 and widest(out) <= 100 and "q_proj." in out
                 and ("x" * 120) in out.replace("\n", ""),
                 id="table-fits-100-columns"),
    # ---- the plot's range strips are drawn in the legend's colours, nowhere blended
    pytest.param(legend_colours_drawn, None, id="plot-legend-matches-what-is-drawn"),
]


@pytest.mark.parametrize("build,check", PROBES)
def test_probe(tmp_path, capsys, monkeypatch, build, check):
    made = build(tmp_path)
    args, check = made if check is None else (made, check)
    for a in [a for a in args if isinstance(a, str) and a.startswith("MAX_")]:
        name, value = a.split("=")
        monkeypatch.setattr(files, name, int(value))
        args.remove(a)
    code = cli.main(["inspect", *map(str, args)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert check(code, out, err) is not False, (code, out, err)


@pytest.mark.skipif(GPU_REASON is None, reason="needs a machine without a GPU")
def test_probe_selftest_json_without_a_gpu_writes_the_verdict_to_stdout():
    p = subprocess.run([sys.executable, "-m", "fp8core", "selftest", "--json"], capture_output=True, text=True,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert p.returncode == 3, p.stderr
    report = strict(p.stdout)
    assert report["verdict"].startswith("NO GPU") and report["ok"] is False and report["cases"] == 0
    assert len(p.stderr.strip().splitlines()) == 1


# ---- issue 39 and issue 37 item 5: degenerate shapes, records through one reader, fp8core's own state --------

def in_child(args: list, limit: float = 120) -> subprocess.CompletedProcess:
    """``fp8core inspect ARGS`` in its own process with a time limit: a hang fails the test instead of stalling
    it (subprocess.TimeoutExpired)."""
    return subprocess.run([sys.executable, "-m", "fp8core", "inspect", *map(str, args)], capture_output=True,
                          text=True, timeout=limit)


def huge_empty_npy(path):
    """A 128-byte .npy whose header declares shape (10**15, 0): no data, a quadrillion rows."""
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000000, 0), }"
    header += b" " * (117 - len(header)) + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)
    return path


@pytest.mark.parametrize("suffix", [".npy", ".safetensors"])
def test_an_empty_tensor_of_a_quadrillion_rows_costs_nothing_under_recipes(tmp_path, suffix):
    if suffix == ".npy":
        path = huge_empty_npy(tmp_path / "e.npy")
        assert path.stat().st_size == 128
    else:
        pytest.importorskip("safetensors")
        header = json.dumps({"e": {"dtype": "F32", "shape": [10 ** 15, 0], "data_offsets": [0, 0]}}).encode()
        path = tmp_path / "e.safetensors"
        path.write_bytes(len(header).to_bytes(8, "little") + header)
    p = in_child([path, "--recipes", "all", "--json"], limit=120)  # was: ~3.8e9 empty chunks, never done
    assert p.returncode == 0, p.stderr
    row = strict(p.stdout)["tensors"]["e"]
    assert row["shape"] == [10 ** 15, 0] and row["elements"] == 0
    assert all(r.get("sqnr_db") is None for r in row["recipes"].values()) and row["winner"] is None


def test_measure_of_an_empty_tensor_of_any_shape_is_immediate():
    from fp8core.numerics_recipes import RECIPES
    from fp8core.numerics_stats import measure

    x = np.lib.stride_tricks.as_strided(np.empty(0, np.float32), (10 ** 15, 0), (0, 4))
    for name, recipe in RECIPES.items():
        got = measure(x, recipe)
        assert got["sqnr_db"] is None and got["underflow"] == 0.0 and got["lost"] == 0.0, name


def peak_of(fn) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", ["e4m3", "mxfp8_rceil", "block_1x128", "block_128x128", "nvfp4", "mxfp4"])
def test_a_flat_tensor_costs_what_the_same_data_as_a_matrix_costs(name):
    """Peak memory near the tensor whatever its shape: a 1-D (one-row) tensor was measured in one chunk, three
    float64 copies of it (32 MiB float32 -> 258 MiB); the statistics equal the matrix's but for summation
    order."""
    from fp8core.numerics_recipes import RECIPES
    from fp8core.numerics_stats import measure

    x = np.random.default_rng(39).standard_normal(1 << 22).astype(np.float32)  # 16 MiB
    recipe = RECIPES[name]
    flat, square = peak_of(lambda: measure(x, recipe)), peak_of(lambda: measure(x.reshape(1024, 4096), recipe))
    assert flat <= 1.25 * square + (4 << 20), (flat, square)
    assert flat < 2 * x.nbytes, flat  # was 7-8x the tensor
    a, b = measure(x, recipe), measure(x.reshape(1024, 4096), recipe)
    if name == "block_128x128":  # one row of 128x128 tiles is 1x128 blocks: other figures from other blocks
        return
    assert a["sqnr_db"] == pytest.approx(b["sqnr_db"], rel=1e-12)
    assert {k: a[k] for k in a if k != "sqnr_db"} == {k: b[k] for k in b if k != "sqnr_db"}


def record_rows(n: int = 1, **edit) -> list:
    stats = {"sqnr_db": 30.0, "underflow": 0.0, "clipped": 0.0, "at_max": 0.0, "max_rel_error": 0.1, "lost": 0.0}
    rows = [{"module": f"model.layers.{i}.self_attn.q_proj", "operand": "input", "step": 0,
             "recipe": "DelayedScaling", "format": "E4M3", "amax": 1.0, "scale": 2.0, "scale_inv": 0.5, **stats,
             "recipes": {"e4m3": dict(stats)}} for i in range(n)]
    rows[0].update(edit)
    return rows


def write_record(path, rows) -> Any:
    path.write_text(json.dumps(rows))
    return path


@pytest.mark.parametrize("edit,says", [
    ({"recipe": ESC}, "row 0's 'recipe' is '\\x1b[31mred\\x1b[0m', not one of DelayedScaling, Float8CurrentScaling"),
    ({"format": ESC}, "row 0's 'format' is '\\x1b[31mred\\x1b[0m', not one of E4M3, E5M2"),
    ({"recipes": {ESC: {"n/a": "x"}}}, "row 0's 'recipes' has '\\x1b[31mred\\x1b[0m', not one of e4m3"),
    ({"recipes": {"$\\frac$": {"n/a": "x"}}}, "row 0's 'recipes' has '$\\\\frac$', not one of e4m3"),
])
def test_a_record_names_only_fp8cores_recipes_and_formats(tmp_path, capsys, edit, says):
    """A record's recipe, format and compared names reached the terminal raw (and a "$" in one broke --plot):
    they are fp8core's own names, so others are refused, by the one reader both doors use."""
    from fp8core.torch import NumericsRecord

    path = write_record(tmp_path / "r.json", record_rows(**edit))
    for extra in ([], ["--plot", tmp_path / "r.png"]):
        code = cli.main(["inspect", str(path), *map(str, extra)])
        out, err = capsys.readouterr()
        no_escape_codes(code, out, err)
        assert code == 2 and says in err and out == "", err
    with pytest.raises(ValueError) as info:
        NumericsRecord.load(path)
    assert says in str(info.value) and str(info.value).startswith(f"{path}: not a record")


def test_a_records_module_names_reach_the_terminal_escaped(tmp_path, capsys):
    from fp8core.torch import NumericsRecord

    path = write_record(tmp_path / "r.json", record_rows(module=ESC + "\u202e"))
    assert cli.main(["inspect", str(path)]) == 0
    out, err = capsys.readouterr()
    no_escape_codes(0, out, err)
    assert "\\x1b[31mred\\x1b[0m\\u202e.input" in out
    text = str(NumericsRecord.load(path))
    assert "\x1b" not in text and "\u202e" not in text and "\\x1b[31mred\\x1b[0m\\u202e" in text


def test_reading_a_record_is_linear_in_its_rows(tmp_path, capsys):
    """2,000 rows, each a recipe name of its own, took 72 s and 3.5 GiB (rows x names): such names are refused,
    and 2,000 rows of 2,000 layers take a moment."""
    rows = record_rows(2000)
    for i, r in enumerate(rows):
        r["recipe"] = f"recipe{i}"
    p = in_child([write_record(tmp_path / "names.json", rows), "--json"], limit=60)
    assert p.returncode == 2 and "row 0's 'recipe' is 'recipe0', not one of" in p.stderr and p.stdout == ""
    import time

    path = write_record(tmp_path / "layers.json", record_rows(2000))
    start = time.perf_counter()
    assert cli.main(["inspect", str(path), "--json"]) == 0
    out, _ = capsys.readouterr()
    assert time.perf_counter() - start < 20
    got = strict(out)
    assert len(got["tensors"]) == 2000 and all(len(e["recipes"]) == 2 for e in got["tensors"].values())


def one_reader_both_doors(tmp_path, capsys, path, says, max_bytes=None):
    from fp8core.torch import NumericsRecord

    extra = [] if max_bytes is None else ["--max-bytes", str(max_bytes)]
    code = cli.main(["inspect", str(path), *extra])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and says in err, err
    with pytest.raises((ValueError, OSError)) as info:
        NumericsRecord.load(path) if max_bytes is None else NumericsRecord.load(path, max_bytes)
    assert says in str(info.value)
    assert err.strip().endswith(str(info.value).splitlines()[0]) or str(info.value) in err


def test_a_record_link_to_dev_zero_is_refused_unread(tmp_path, capsys):
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    one_reader_both_doors(tmp_path, capsys, link, f"{link}: not a regular file")


def test_a_record_fifo_is_refused_without_waiting_for_a_writer(tmp_path, capsys):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    one_reader_both_doors(tmp_path, capsys, fifo, f"{fifo}: not a regular file")


def test_a_record_over_the_byte_limit_is_refused_by_both_doors(tmp_path, capsys):
    path = write_record(tmp_path / "big.json", record_rows(50))
    size = path.stat().st_size
    one_reader_both_doors(tmp_path, capsys, path, f"{path}: {size} bytes, more than the 1000", max_bytes=1000)


def test_a_5000_digit_integer_names_the_file_and_what_a_record_is(tmp_path, capsys):
    path = tmp_path / "digits.json"
    path.write_text(json.dumps(record_rows())[:-2] + ', "amax2": ' + "9" * 5000 + "}]")
    one_reader_both_doors(tmp_path, capsys, path, f"{path}: not a record: not JSON (Exceeds the limit")
    path.write_text(json.dumps(record_rows()).replace('"amax": 1.0', '"amax": 1' + "0" * 400))
    one_reader_both_doors(tmp_path, capsys, path, "row 0's 'amax' is an integer of about 10^400, beyond float64")


@pytest.mark.parametrize("bad,err,says", [(0, ValueError, "max_bytes: expected a positive number of bytes, got 0"),
                                          (1.5, TypeError, "max_bytes: expected an int, got float"),
                                          (True, TypeError, "max_bytes: expected an int, got bool")])
def test_record_load_checks_max_bytes_by_name(tmp_path, bad, err, says):
    from fp8core.torch import NumericsRecord

    path = write_record(tmp_path / "r.json", record_rows())
    with pytest.raises(err, match=says):
        NumericsRecord.load(path, bad)


def test_duplicate_npz_members_are_refused_by_name(tmp_path, capsys):
    path = tmp_path / "d.npz"
    with warnings_ignored():
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("w.npy", npy(np.ones(3, np.float32)))
            z.writestr("w.npy", npy(np.full(3, 7.0, np.float32)))
            z.writestr("b.npy", npy(np.ones(2, np.float32)))
    code = cli.main(["inspect", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "member name(s) w.npy appear more than once" in err


def warnings_ignored():
    import warnings

    manager = warnings.catch_warnings()
    manager.__enter__()
    warnings.simplefilter("ignore")  # zipfile warns of the duplicate name it writes on purpose

    class Exit:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            manager.__exit__(*exc)
    return Exit()


def test_one_name_twice_in_a_pt_shows_both_tensors(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    path = torch_save(tmp_path / "t.pt", {"a.b": torch.ones(2), "a": {"b": torch.full((3,), 2.0)}})
    assert cli.main(["inspect", str(path), "--json"]) == 0
    out, _ = capsys.readouterr()
    got = strict(out)
    assert list(got) == ["a.b", "a.b#2"] and got["a.b"]["shape"] == [2] and got["a.b#2"]["shape"] == [3]


def test_one_record_named_twice_shows_both(tmp_path, capsys):
    path = write_record(tmp_path / "r.json", record_rows(1))
    assert cli.main(["inspect", str(path), str(path), "--json"]) == 0
    got = strict(capsys.readouterr()[0])
    key = f"{path}:model.layers.0.self_attn.q_proj.input"
    assert list(got["tensors"]) == [key, f"{key}#2"] and got["summary"]["tensors"] == 2


def float8_checkpoint(path):
    torch = pytest.importorskip("torch")
    from fp8core.torch import autocast, convert_to_float8

    torch.manual_seed(0)
    model = convert_to_float8(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16)))
    with autocast():
        model(torch.randn(16, 32)).sum().backward()
    sd = model.state_dict()
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    else:
        torch.save(sd, path)
    return path, sd


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_fp8cores_own_state_is_reported_apart(tmp_path, capsys, suffix):
    """Issue 37 item 5: the fp8_* entries of a Float8Linear checkpoint (60 of the Llama checkpoint's 81 rows) were
    measured as model tensors, counted in the best-recipe summary and stretched the chart's axis."""
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    path, sd = float8_checkpoint(tmp_path / f"m{suffix}")
    state = [k for k in sd if k.rsplit(".", 1)[-1].startswith("fp8_")]
    model = [k for k in sd if k not in state]
    assert len(state) == 8 and model == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert cli.main(["inspect", str(path), "--recipes", "all", "--json"]) == 0
    got = strict(capsys.readouterr()[0])
    assert sorted(got["tensors"]) == sorted(model) and sorted(got["fp8_state"]) == sorted(state)
    assert got["summary"]["tensors"] == len(model)
    assert all("recipes" not in r and "fp8core's delayed-scaling state" in r["fp8_state"]
               for r in got["fp8_state"].values())
    assert cli.main(["inspect", str(path), "--json"]) == 0
    plain = strict(capsys.readouterr()[0])
    assert all(("E4M3" in plain[k]) == (k in model) for k in sd)
    assert cli.main(["inspect", str(path), "--recipes", "e4m3"]) == 0
    out = capsys.readouterr()[0]
    at = out.index("tensor(s) of fp8core's delayed-scaling state")
    assert all(out.index(k) < at for k in model) and all(out.index(k) > at for k in state)


def test_the_state_names_are_the_front_ends():
    """What inspect recognises is what fp8core's front-ends write: a Float8Linear's state_dict, and fp8core.jax's
    (flax's) collection."""
    torch = pytest.importorskip("torch")
    from fp8core.cli.inspect import FP8_STATE_COLLECTION, FP8_STATE_KEYS, is_fp8_state
    from fp8core.torch import Float8Linear, Linear

    for layer in (Float8Linear(16, 16), Linear(16, 16)):
        assert [k for k in layer.state_dict() if k not in ("weight", "bias")] == list(FP8_STATE_KEYS)
    assert not is_fp8_state("model.layers.0.mlp.scale") and is_fp8_state("model.layers.0.fp8_scale")
    assert is_fp8_state(f"{FP8_STATE_COLLECTION}/Dense_0/Fp8DotGeneral_0/scale")
    del torch
    linen = pytest.importorskip("flax.linen.fp8_ops")
    assert linen.OVERWRITE_WITH_GRADIENT == FP8_STATE_COLLECTION


def recipe_rows(keys: list, names: list) -> dict:
    stats = {"sqnr_db": 30.0, "underflow": 0.01, "clipped": 0.0, "at_max": 0.0, "max_rel_error": 0.1, "lost": 0.0}
    return {k: {"recipes": {n: dict(stats, sqnr_db=30.0 + j) for j, n in enumerate(names)}, "winner": names[-1]}
            for k in keys}


@pytest.mark.parametrize("underflow", [False, True])
def test_the_recipe_chart_shows_every_name_whole_inside_the_figure(underflow):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from fp8core.cli.compare import recipe_figure

    keys = [f"model.layers.{i}.self_attn.q_proj.weight" + "_long" * 12 for i in range(3)] + ["w"]
    fig = recipe_figure(recipe_rows(keys, ["e4m3", "a$b$"]), ["e4m3", "a$b$"], "t$x$", underflow)
    try:
        fig.canvas.draw()  # mathtext would fail here on an unescaped "$"
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_yticklabels()] == keys  # was: the last 40 characters
        renderer = fig.canvas.get_renderer()
        for t in ax.get_yticklabels():
            box = t.get_window_extent(renderer)
            assert box.x0 >= 0 and box.x1 <= fig.bbox.x1, (t.get_text(), box)
        legend = next(a.get_legend() for a in fig.axes if a.get_legend() is not None)
        assert [t.get_text() for t in legend.get_texts()] == ["e4m3", "a\\$b\\$"]
    finally:
        plt.close(fig)


def _safetensors_file(path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path))


def test_safetensors_replaced_while_checked_is_refused(tmp_path, monkeypatch):
    """A file renamed into the path between the open and safetensors' check of the header (a writer's `latest`)
    is refused by name: the header read and the maps are the opened file's, which is not the one checked."""
    safetensors = pytest.importorskip("safetensors")
    p, other = tmp_path / "m.safetensors", tmp_path / "other.safetensors"
    _safetensors_file(p, {"w": np.ones((4, 4), np.float32)})
    _safetensors_file(other, {"w": np.full((8, 8), 2, np.float32)})
    real = safetensors.safe_open

    def swapping(*a, **k):
        f = real(*a, **k)
        if other.exists():
            os.replace(other, p)
        return f

    monkeypatch.setattr(safetensors, "safe_open", swapping)
    with pytest.raises(cli.CliError, match="changed while it was being read"):
        list(files.iter_tensors(str(p)))


def test_safetensors_replaced_mid_read_reads_on_from_the_opened_file(tmp_path, monkeypatch):
    """Replaced after the check, between two tensors and across a new map: every tensor is still the opened
    file's (its maps are of the open descriptor, not of the path)."""
    pytest.importorskip("safetensors")
    monkeypatch.setattr(files, "_MAPPED_BYTES", 1)  # a new map for every tensor
    p, other = tmp_path / "m.safetensors", tmp_path / "other.safetensors"
    _safetensors_file(p, {f"w{i}": np.full((4, 4), i, np.float32) for i in range(3)})
    _safetensors_file(other, {f"w{i}": np.full((4, 4), 10 + i, np.float32) for i in range(3)})
    got = {}
    for name, x in files.iter_tensors(str(p)):
        got[name] = float(x[0, 0])
        if other.exists():
            os.replace(other, p)
    assert got == {"w0": 0.0, "w1": 1.0, "w2": 2.0}


def test_a_safetensors_extent_that_does_not_hold_its_tensor_is_refused(tmp_path):
    """Each tensor's data_offsets are checked against its dtype and shape and the file's data as it is read (the
    check safetensors made of the same file, made again where the map is cut): an error naming the tensor."""
    import mmap

    data = np.arange(4, dtype=np.float32).tobytes()
    with open(tmp_path / "d", "wb") as f:
        f.write(data)
    with open(tmp_path / "d", "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        f32 = np.dtype("<f4")
        ok = files._mapped_tensor(m, tmp_path / "d", "w", {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                                  f32, 0, 16)
        assert ok.tolist() == [[0.0, 1.0], [2.0, 3.0]]
        for entry in ({"dtype": "F32", "shape": [4], "data_offsets": [0, 4]},     # too short for its shape
                      {"dtype": "F32", "shape": [4], "data_offsets": [4, 20]},    # past the data
                      {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}):   # before it
            with pytest.raises(cli.CliError, match="tensor 'w': its data_offsets"):
                files._mapped_tensor(m, tmp_path / "d", "w", entry, f32, 0, 16)
        del ok
        m.close()


def _misaligned_safetensors(path, x: np.ndarray) -> None:
    """A .safetensors holding one byte (U8 "pad") and then x (BF16) at data offset 1: the format allows any offset,
    so x lies one byte past a 2-byte boundary of the file's map (safetensors' own writer would order them)."""
    header = {"pad": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "x": {"dtype": "BF16", "shape": list(x.shape), "data_offsets": [1, 1 + x.nbytes]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"\x07" + x.tobytes())


def test_a_safetensors_tensor_at_an_offset_not_a_multiple_of_its_element_size_is_measured(tmp_path, capsys):
    """fp8core's primitives refuse an array not aligned to its elements (a GPU would fault on it); inspect reads such
    a tensor from a file's map as a copy, and its figures are those of the same tensor from an .npy."""
    pytest.importorskip("safetensors")
    import ml_dtypes

    x = (np.random.default_rng(3).standard_normal((48, 64)) * 10).astype(ml_dtypes.bfloat16)
    _misaligned_safetensors(tmp_path / "m.safetensors", x)
    got = dict(files.iter_tensors(str(tmp_path / "m.safetensors")))
    assert got["x"].flags.aligned and got["x"].tobytes() == x.tobytes()
    np.save(tmp_path / "x.npy", x)
    rows = []
    for path in (tmp_path / "m.safetensors", tmp_path / "x.npy"):
        assert cli.main(["inspect", str(path), "--recipes", "all", "--json"]) == 0
        rows.append(strict(capsys.readouterr().out)["tensors"]["x"])
    assert rows[0] == rows[1]


def _misaligned_npy(path, x: np.ndarray) -> None:
    """An .npy whose data starts at an odd byte: a v1 header padded to 129 bytes (NumPy's writer pads to 64, but
    NumPy's reader accepts any length)."""
    head = repr({"descr": np.lib.format.dtype_to_descr(x.dtype), "fortran_order": False, "shape": x.shape})
    body = (head + " " * (129 - 10 - len(head) - 1) + "\n").encode("latin1")
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body + x.tobytes())


def test_an_npy_whose_data_starts_off_its_element_size_is_measured(tmp_path, capsys):
    """An .npy from a writer that does not pad its header keeps its data at an odd offset: inspect copies it (the
    primitives refuse an unaligned array), and its figures are those of the same tensor from NumPy's own .npy."""
    x = (np.random.default_rng(4).standard_normal((40, 64)) * 10).astype(np.float32)
    _misaligned_npy(tmp_path / "odd.npy", x)
    assert np.array_equal(np.load(tmp_path / "odd.npy"), x)
    assert not np.load(tmp_path / "odd.npy", mmap_mode="r").flags.aligned
    got = dict(files.iter_tensors(str(tmp_path / "odd.npy")))
    assert got["odd"].flags.aligned and got["odd"].tobytes() == x.tobytes()
    np.save(tmp_path / "even.npy", x)
    rows = []
    for path in (tmp_path / "odd.npy", tmp_path / "even.npy"):
        assert cli.main(["inspect", str(path), "--recipes", "all", "--json"]) == 0
        rows.append(next(iter(strict(capsys.readouterr().out)["tensors"].values())))
    assert rows[0] == rows[1]
