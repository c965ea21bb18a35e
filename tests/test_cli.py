"""The fp8core command, run as a subprocess on files the tests make."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import GPU_REASON


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "fp8core", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def files(tmp_path, rng):
    x = (rng.standard_normal((64, 32)) * 3).astype(np.float32)
    x[0, 0] = 1e-12  # underflows in both formats
    np.save(tmp_path / "w.npy", x)
    np.savez(tmp_path / "two.npz", a=x[:8], b=x.astype(np.float16))
    out = {"npy": tmp_path / "w.npy", "npz": tmp_path / "two.npz", "x": x}
    torch = pytest.importorskip("torch")
    torch.save({"weight": torch.from_numpy(x).to(torch.bfloat16)}, tmp_path / "m.pt")
    out["pt"] = tmp_path / "m.pt"
    from safetensors.torch import save_file

    save_file({"layer.weight": torch.from_numpy(x)}, str(tmp_path / "m.safetensors"))
    out["safetensors"] = tmp_path / "m.safetensors"
    return out


def test_info_reports_versions_backend_and_stamp():
    r = run("info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["fp8core"] and info["numpy"] == np.__version__
    assert info["backend"] in ("cuda", "CPU only")
    if info["backend"] == "CPU only":
        assert info["why"]
    assert "stamp" in info["gpu_verified"]
    assert run("info").stdout.startswith("fp8core")


def test_inspect_json_every_format(files):
    r = run("inspect", str(files["npy"]), str(files["npz"]), str(files["pt"]), str(files["safetensors"]), "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == 5
    w = rows[f"{files['npy']}:w"]
    assert w["shape"] == [64, 32] and w["amax"] == float(np.abs(files["x"]).max())
    for fmt, lo in (("E4M3", 20), ("E5M2", 12)):
        f = w[fmt]
        assert f["sqnr_db"] > lo and 0 < f["underflow"] < 0.01 and f["max_rel_error"] <= 1.0
        assert np.log2(f["scale"]) == int(np.log2(f["scale"]))  # power-of-2 scales
    assert rows[f"{files['pt']}:weight"]["dtype"] == "bfloat16"
    assert rows[f"{files['npz']}:b"]["dtype"] == "float16"


def test_inspect_table_and_plot(files, tmp_path):
    png = tmp_path / "hist.png"
    r = run("inspect", str(files["npy"]), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert "SQNR dB" in r.stdout and "E5M2" in r.stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.parametrize("make,message", [
    (lambda p: p / "missing.npy", "no such file"),
    (lambda p: (p / "notes.txt").write_text("hi") and p / "notes.txt", "unknown format .txt"),
    (lambda p: (p / "bad.npy").write_bytes(b"not numpy") and p / "bad.npy", "not an .npy array"),
])
def test_bad_files_give_one_clear_line_and_exit_2(tmp_path, make, message):
    r = run("inspect", str(make(tmp_path)))
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_demo_trains_and_prints_both_curves():
    pytest.importorskip("torch")
    r = run("demo", "--steps", "20", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "fp32 loss" in r.stdout and "input scale" in r.stdout
    final = [line for line in r.stdout.splitlines() if line.startswith("final loss")]
    assert final and "fp8" in final[0]


@pytest.mark.skipif(GPU_REASON is None, reason="needs a machine without a GPU")
def test_demo_on_cuda_without_a_gpu_is_a_clear_error():
    r = run("demo", "--device", "cuda")
    assert r.returncode == 2 and r.stderr.startswith("fp8core: error: --device cuda") and "Traceback" not in r.stderr


# What each script's table gives as (median, p20, p80): bench_cpu.py columns of GB/s ("1.11   0.98-1.22"); on a GPU
# times ("118.7 us (p20 113.6, p80 132.3)"; the MLP step in ms) and bench_gemm.py's TFLOP/s
# ("1242.5 TFLOP/s (p20-p80 1215.5-1269.7)").
_RANGES = {
    "bench_cpu.py": [r" (\d+\.\d+) +(\d+\.\d+)-(\d+\.\d+) "],
    "bench_gpu.py": [r" (\d+\.\d+) us \(p20 (\d+\.\d+), p80 (\d+\.\d+)\)"],
    "bench_gemm.py": [r" (\d+\.\d+) TFLOP/s \(p20-p80 (\d+\.\d+)-(\d+\.\d+)\)"],
    "bench_mlp.py": [r" (\d+\.\d+) ms \(p20 (\d+\.\d+), p80 (\d+\.\d+)\)"],
}


def test_bench_quick_prints_the_table():
    r = run("bench", "--quick", timeout=600)
    assert r.returncode == 0, r.stderr
    sections = re.split(r"^== (\S+) on the (?:GPU|CPU)$", r.stdout, flags=re.M)[1:]
    scripts = sections[::2]
    assert scripts in (["bench_cpu.py"], ["bench_gpu.py", "bench_gemm.py", "bench_mlp.py"]), scripts
    assert "GB/s" in sections[1]  # the bandwidth table, on either device
    for script, text in zip(scripts, sections[1::2]):
        ranges = [m for pattern in _RANGES[script] for m in re.findall(pattern, text)]
        assert ranges, f"{script}: no median with its p20-p80 range"
        for med, lo, hi in ranges:
            assert float(lo) <= float(med) <= float(hi), (script, med, lo, hi)


# ---- inspect against hostile and odd files (in process: fast; each must give one line, never a traceback) ----

def inspect(capsys, *args):
    from fp8core.cli import main

    code = main(["inspect", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def strict_json(text):
    def refuse(name):
        raise AssertionError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("name,array,amax,sqnr", [
    ("zeros", np.zeros((4, 4), np.float32), 0.0, None),  # no signal: SQNR undefined
    ("empty", np.zeros((0, 8), np.float32), 0.0, None),
    ("ints", np.arange(-5, 10, dtype=np.int32), 9.0, "number"),
    ("bools", np.array([True, False, True]), 1.0, "number"),
    ("float64", np.array([1.0, -2.5, 3e300]), "inf", "number"),  # 3e300 overflows float32
])
def test_inspect_json_is_strict_for_zero_empty_and_integer_tensors(tmp_path, capsys, name, array, amax, sqnr):
    np.save(tmp_path / f"{name}.npy", array)
    code, out, err = inspect(capsys, tmp_path / f"{name}.npy", "--json")
    assert code == 0, err
    row = strict_json(out)[name]
    assert row["amax"] == amax and row["elements"] == array.size
    for fmt in ("E4M3", "E5M2"):
        got = row[fmt]["sqnr_db"]
        assert got is None if sqnr is None else (got == "inf" or isinstance(got, float))
    if array.dtype.kind in "ib":
        assert "integer" in row["note"]


def test_inspect_counts_nan_and_inf_and_measures_the_finite_values(tmp_path, capsys):
    x = np.array([1.0, np.nan, np.inf, -2.0, -np.inf, 0.5], np.float32)
    np.save(tmp_path / "x.npy", x)
    code, out, err = inspect(capsys, tmp_path / "x.npy", "--json")
    assert code == 0, err
    row = strict_json(out)["x"]
    assert row["amax"] == "nan" and row["nan"] == 1 and row["inf"] == 2
    for fmt in ("E4M3", "E5M2"):
        assert row[fmt]["scale"] > 1 and row[fmt]["sqnr_db"] == "inf"  # 1, -2, 0.5 are exact in both formats
        assert row[fmt]["clipped"] == 0 and row[fmt]["at_max"] == 0
    code, out, _ = inspect(capsys, tmp_path / "x.npy")
    assert "1 NaN and 2 inf of 6 values" in out


def test_inspect_separates_clipped_from_landing_on_max(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.array([448.0, 440.0, -1.0, 0.0], np.float32))
    code, out, err = inspect(capsys, tmp_path / "x.npy", "--json")
    e4 = strict_json(out)["x"]["E4M3"]
    assert e4["scale"] == 1.0 and e4["clipped"] == 0 and e4["at_max"] == 0.5  # 440 rounds up onto 448
    code, out, err = inspect(capsys, tmp_path / "x.npy", "--json", "--scale", "2")
    e4 = strict_json(out)["x"]["E4M3"]
    assert e4["scale"] == 2.0 and e4["clipped"] == 0.5 and e4["at_max"] == 0.5
    code, out, err = inspect(capsys, tmp_path / "x.npy", "--scale", "inf")
    assert code == 2 and "--scale" in err


def test_inspect_reads_ml_dtypes_fp8_and_bf16_npy(tmp_path, capsys):
    import ml_dtypes

    np.save(tmp_path / "e4.npy", np.ones((4, 8), ml_dtypes.float8_e4m3fn))
    np.save(tmp_path / "bf.npy", np.full(16, -3.0, ml_dtypes.bfloat16))
    np.save(tmp_path / "e5.npy", np.full(16, 2.0, ml_dtypes.float8_e5m2))
    code, out, err = inspect(capsys, tmp_path / "e4.npy", tmp_path / "bf.npy", "--json")
    rows = strict_json(out)
    e4, bf = rows[f"{tmp_path / 'e4.npy'}:e4"], rows[f"{tmp_path / 'bf.npy'}:bf"]
    assert e4["amax"] == 1.0 and e4["dtype"] == "float8_e4m3fn" and "--raw-fp8" in e4["note"]
    assert bf["amax"] == 3.0 and bf["dtype"] == "bfloat16"
    code, out, err = inspect(capsys, tmp_path / "e5.npy", "--json", "--raw-fp8", "e5m2")
    assert strict_json(out)["e5"]["amax"] == 2.0
    np.savez(tmp_path / "z.npz", a=np.ones(8, ml_dtypes.float8_e4m3fn))
    code, out, err = inspect(capsys, tmp_path / "z.npz", "--json")
    assert strict_json(out)["a"]["amax"] == 1.0


def _npy_bytes(shape, dtype="<f4", body=None):
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue() + (body if body is not None else b"\0" * (int(np.prod(shape)) * np.dtype(dtype).itemsize))


def _declare_size(path, size):
    """Rewrite the uncompressed size a zip's central directory declares for its first member."""
    data = bytearray(path.read_bytes())
    at = data.rindex(b"PK\x01\x02")
    data[at + 24:at + 28] = size.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def test_inspect_caps_what_an_npz_inflates(tmp_path, capsys):
    import zipfile

    bomb = tmp_path / "bomb.npz"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("x.npy", _npy_bytes((8 << 20,)))  # 32 MiB of zeros in a ~32 KB file
    assert bomb.stat().st_size < 100_000
    code, out, err = inspect(capsys, bomb, "--max-bytes", str(1 << 20))
    assert code == 2 and "would inflate to 33554560 bytes" in err and "--max-bytes" in err
    declared = tmp_path / "declared.npz"
    declared.write_bytes(bomb.read_bytes())
    _declare_size(declared, 3_100_000_000)  # what a 255 KB bomb declares; refused before any inflating
    code, out, err = inspect(capsys, declared)
    assert code == 2 and "would inflate to 3100000000 bytes" in err
    code, out, err = inspect(capsys, bomb, "--json")  # under the default cap it is read, in chunks
    assert code == 0 and strict_json(out)["x"]["elements"] == 8 << 20


def test_inspect_refuses_a_header_that_claims_more_than_the_member_holds(tmp_path, capsys):
    import zipfile

    liar = tmp_path / "liar.npz"
    with zipfile.ZipFile(liar, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("x.npy", _npy_bytes((10 ** 9,), body=b"\0" * 64))
    code, out, err = inspect(capsys, liar)
    assert code == 2 and "corrupt or crafted" in err and len(err.strip().splitlines()) == 1


def _odd_files(p):
    import zipfile

    torch = pytest.importorskip("torch")
    with zipfile.ZipFile(p / "text.npz", "w") as z:
        z.writestr("notes.txt", "hello")
    with zipfile.ZipFile(p / "empty.npz", "w"):
        pass
    with zipfile.ZipFile(p / "dirs.npz", "w") as z:
        z.writestr("a/", "")
    np.savez(p / "good.npz", a=np.ones(1000, np.float32))
    (p / "truncated.npz").write_bytes((p / "good.npz").read_bytes()[:300])
    (p / "notzip.npz").write_bytes(b"PK\x03\x04" + b"\xff" * 200)
    with zipfile.ZipFile(p / "objects.npz", "w") as z:
        z.writestr("o.npy", _npy_bytes((2,), dtype="|O", body=b""))
    (p / "junk.pt").write_bytes(bytes(range(256)) * 4)
    torch.save(torch.nn.Linear(4, 4), p / "module.pt")
    (p / "adir.npy").mkdir()
    (p / "short.npy").write_bytes(_npy_bytes((1000,), body=b"\0" * 16))
    (p / "pickled.npy").write_bytes(_npy_bytes((2,), dtype="|O", body=b"\x80\x04K\x01."))
    (p / "bad.safetensors").write_bytes(b"\xff" * 8 + b"{")
    return {
        "text.npz": "member notes.txt is not a .npy array", "empty.npz": "holds no tensors",
        "dirs.npz": "holds no tensors", "truncated.npz": "could not be read as npz",
        "notzip.npz": "could not be read as npz", "objects.npz": "Python objects",
        "junk.pt": "could not be read as pt", "module.pt": "pickled Python objects",
        "adir.npy": "is a directory", "short.npy": "truncated or crafted",
        "pickled.npy": "Python objects", "bad.safetensors": "could not be read as safetensors",
    }


def test_inspect_odd_and_corrupt_files_give_one_line(tmp_path, capsys):
    for name, message in _odd_files(tmp_path).items():
        code, out, err = inspect(capsys, tmp_path / name)
        assert code == 2, name
        assert message in err, (name, err)
        assert err.startswith("fp8core: error: ") and len(err.strip().splitlines()) == 1, (name, err)
        assert "\x1b" not in err and "Traceback" not in err, name


def test_inspect_reads_complex_and_nested_state_dicts(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    ckpt = {"model": {"w": torch.ones(4, 4), "b": torch.zeros(4)}, "step": 3, "c": torch.ones(2, dtype=torch.cfloat)}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    code, out, err = inspect(capsys, tmp_path / "ckpt.pt", "--json")
    rows = strict_json(out)
    assert code == 0 and rows["model.w"]["amax"] == 1.0 and rows["model.b"]["amax"] == 0.0
    assert "skipped" in rows["c"]
    code, out, err = inspect(capsys, tmp_path / "ckpt.pt")
    assert "skipped: not real-valued" in out
    torch.save({"w": -torch.ones(3)}, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    code, out, err = inspect(capsys, tmp_path / "legacy.pth", "--json")  # the pre-1.6 format: no memory map
    assert code == 0 and strict_json(out)["w"]["amax"] == 1.0


def test_inspect_plot_reports_the_file_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    np.save(tmp_path / "x.npy", np.linspace(-3, 3, 1000, dtype=np.float32))
    code, out, err = inspect(capsys, tmp_path / "x.npy", "--plot", tmp_path / "out")
    assert code == 0, err
    assert (tmp_path / "out.png").is_file() and not (tmp_path / "out").exists()
    assert f"plot written to {tmp_path / 'out.png'}" in out
    code, out, err = inspect(capsys, tmp_path / "x.npy", "--plot", tmp_path / "hist.pdf")
    assert (tmp_path / "hist.pdf").read_bytes()[:4] == b"%PDF" and f"plot written to {tmp_path / 'hist.pdf'}" in out


def test_progress_writes_no_carriage_returns_into_a_log(tmp_path):
    names = []
    for i in range(12):
        np.save(tmp_path / f"t{i}.npy", np.full(4, i, np.float32))
        names.append(str(tmp_path / f"t{i}.npy"))
    r = run("inspect", *names)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "12/12 files" in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 13


def test_version_and_help_texts():
    import fp8core
    from fp8core.cli import parser

    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"fp8core {fp8core.__version__}"
    helps = {name: sub.format_help() for name, sub in parser()._subparsers._group_actions[0].choices.items()}
    assert "training steps" in helps["demo"]
    assert "--quick" in helps["bench"] and "smoke run" in helps["bench"]
    assert "JSON" in helps["info"] and "strict JSON" in helps["inspect"]


def test_bench_percentiles_contain_the_median():
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    try:
        from bench_cpu import timeit
    finally:
        sys.path.pop(0)
    for repeat in (1, 2, 3, 7):
        med, p20, p80 = timeit(lambda: sum(range(1000)), repeat)
        assert p20 <= med <= p80, (repeat, p20, med, p80)


def test_bench_ab_compares_two_checkouts_row_by_row(tmp_path):
    """bench/bench_ab.py against this very checkout as its base: every primitive on both inputs, both timed,
    the base imported as a separate package (its ratio to itself near 1 is not asserted: timing is noisy)."""
    import json
    import os
    import subprocess

    repo = os.path.join(os.path.dirname(__file__), "..")
    out = tmp_path / "ab.json"
    r = subprocess.run([sys.executable, os.path.join(repo, "bench", "bench_ab.py"), repo, "--repeat", "5",
                        "--block", "2", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    ops = {"amax", "quantize", "quantize+amax_out", "quantize_dynamic", "dequantize", "transpose",
           "cast_transpose", "multi_amax"}
    assert {(row["op"], row["input"]) for row in rows} == {(op, i) for op in ops for i in ("numpy", "torch")}
    assert all(row["base_us"] > 0 and row["this_us"] > 0 and row["this_over_base"] > 0 for row in rows)
    assert "this/base" in r.stdout


# ---- why there is no GPU, told truthfully ----------------------------------------------------------------------

class _FakeRuntime:
    def __init__(self, driver, runtime):
        self.driverGetVersion = lambda: driver
        self.runtimeGetVersion = lambda: runtime


class _FakeCupy:
    def __init__(self, driver, runtime):
        self.cuda = type("cuda", (), {"runtime": _FakeRuntime(driver, runtime)})()


@pytest.mark.parametrize("loadable,driver,runtime,expect", [
    (False, 0, 13020, "no CUDA driver (libcuda cannot be loaded)"),
    (True, 0, 13020, "no CUDA driver"),
    (True, 12020, 13020, "the CUDA driver supports CUDA 12.2, older than this CuPy's runtime 13.2"),
    (True, 13020, 13020, None),
])
def test_the_driver_diagnosis_tells_the_cases_apart(monkeypatch, loadable, driver, runtime, expect):
    import ctypes

    from fp8core.selftest.gpu import driver_missing

    def cdll(name):
        if not loadable:
            raise OSError(f"{name}: cannot open shared object file")
        return object()

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    got = driver_missing(_FakeCupy(driver, runtime))
    assert got == expect if expect is None or "older" not in expect else got.startswith(expect)


def test_no_driver_here_is_not_called_an_insufficient_driver():
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        from conftest import GPU_REASON

        assert GPU_REASON is not None and "no CUDA driver" in GPU_REASON and "insufficient" not in GPU_REASON
    else:
        pytest.skip("this machine has a CUDA driver")
