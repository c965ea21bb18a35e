"""The fp8core command, run as a subprocess on files the tests make."""

import json
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
    (lambda p: (p / "bad.npy").write_bytes(b"not numpy") and p / "bad.npy", "could not be read as npy"),
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


def test_bench_quick_prints_the_table():
    r = run("bench", "--quick", timeout=600)
    assert r.returncode == 0, r.stderr
    assert "GB/s" in r.stdout
