"""What a user of the wheel gets: the benchmarks and the GPU-verified stamp inside the package, the license; and
the CLI's words: the CUDA runtime as major.minor, one reason for 'no GPU', tables that fit 100 columns."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import GPU_REASON

ROOT = Path(__file__).resolve().parent.parent


def _build_backend_installed() -> bool:
    """Whether this interpreter has what pyproject.toml's [build-system] requires (then the wheel is built with it,
    as an isolated build would be, without fetching it: a GPU machine may have no network)."""
    try:
        import tomllib
        from importlib.metadata import PackageNotFoundError, version

        from packaging.requirements import Requirement
    except ImportError:  # Python 3.10 (no tomllib), or no packaging: the isolated build
        return False
    for spec in tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]:
        req = Requirement(spec)
        try:
            if not req.specifier.contains(version(req.name), prereleases=True):
                return False
        except PackageNotFoundError:
            return False
    return True


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    isolation = ["--no-build-isolation"] if _build_backend_installed() else []
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(out),
                        str(ROOT)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (found,) = out.glob("fp8core-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """The wheel unpacked into a folder of its own, as pip installs it (no source checkout beside it)."""
    target = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                        str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return target


def in_installed(target, code):
    """Run ``code`` with fp8core imported from ``target`` only (-P: not from the working directory)."""
    env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300,
                       env=env, cwd=target.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_the_wheel_carries_license_benchmarks_and_no_measured_runs(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    for script in ("bench_cpu.py", "bench_gpu.py", "bench_gemm.py", "bench_mlp.py"):
        assert f"fp8core/bench/{script}" in names  # what `fp8core bench` runs
    assert {n for n in names if "/results/" in n} <= {"fp8core/bench/results/gpu-verified.json"}
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata and "Classifier: Development Status" in metadata
    assert "](docs/" not in metadata  # the long description has no links relative to the repository


def test_stamp_and_benchmarks_are_found_in_the_installed_package(installed):
    results = installed / "fp8core" / "bench" / "results"
    code = ("from fp8core import verified; import json; "
            "print(json.dumps([str(verified.bench_dir()), str(verified.stamp_path()), *verified.status()]))")
    bench, stamp, ok, words = json.loads(in_installed(installed, code))
    assert Path(bench) == installed / "fp8core" / "bench" and (Path(bench) / "bench_cpu.py").is_file()
    assert Path(stamp) == results / "gpu-verified.json"
    assert not ok and words.startswith("not verified on a GPU") and "no stamp" in words
    sha = in_installed(installed, "from fp8core._kernels import cuda_sha256; print(cuda_sha256())").strip()
    results.mkdir(parents=True, exist_ok=True)
    try:
        (results / "gpu-verified.json").write_text(json.dumps({"cuda_sha256": "0" * 64, "device": "Test GPU"}))
        _, _, ok, words = json.loads(in_installed(installed, code))
        assert not ok and "NOT the GPU-verified ones" in words
        (results / "gpu-verified.json").write_text(json.dumps({"cuda_sha256": sha, "device": "Test GPU"}))
        _, _, ok, words = json.loads(in_installed(installed, code))
        assert ok and words.startswith("verified on Test GPU")
        info = json.loads(in_installed(installed, "from fp8core.cli import main; main(['info', '--json'])"))
        assert info["gpu_verified"] == words
    finally:
        (results / "gpu-verified.json").unlink()


def test_info_prints_the_cuda_runtime_as_major_minor(monkeypatch, capsys):
    cupy = pytest.importorskip("cupy")
    from fp8core.cli import main

    monkeypatch.setattr(cupy.cuda.runtime, "runtimeGetVersion", lambda: 13020)
    assert main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cuda_runtime"] == "13.2"


@pytest.mark.skipif(GPU_REASON is None, reason="needs a machine without a GPU")
def test_selftest_without_a_gpu_gives_infos_reason(capsys):
    from fp8core.cli import gpu_unavailable_reason, main

    with pytest.raises(SystemExit) as e:
        main(["selftest"])
    assert e.value.code == 3
    err = capsys.readouterr().err
    assert f"no GPU to check: {gpu_unavailable_reason()}." in err
    assert "InsufficientDriver" not in err and "insufficient" not in err


def test_selftest_table_fits_100_columns():
    from fp8core.selftest import CheckResult, Report

    long = "block gemm: MXFP8 and 1x128/128x128 against the emulation and float64, tolerance growing with K"
    checks = [CheckResult("quantize: float32 bit patterns", 12, 0, "", 0.5),
              CheckResult(long, 48, 1, "", 1.4, failures=[f"case {i}: " + "x" * 150 for i in range(2)]),
              CheckResult("gemm", 0, 0, "nvmath-python is not installed " + "(a long reason) " * 8, 0.0)]
    report = Report("cpu (table and chunked paths vs direct, unchunked paths and the oracle)", "cpu", True, checks,
                    12.5)
    text = report.table()
    assert max(len(line) for line in text.splitlines()) <= 100
    flat = " ".join(text.split())
    assert long in flat  # the wrapped name reads whole
    assert "FAILED" in text and "skipped" in text and "FAIL: 59 of 60 cases passed" in flat


def test_bench_cpu_pins_and_prints_torchs_threads_and_marks_missing_peers():
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_cpu.py"), "--sizes-kib", "64", "--sizes-mib",
                        "--dtypes", "bfloat16", "--torch-threads", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any("torch eager runs with 1 intra-op threads" in line for line in lines)
    meta = json.loads(lines[0].split(" ", 4)[-1])
    assert meta["torch_threads"] == 1
    table = lines[lines.index(next(line for line in lines if line.startswith("op "))):]
    assert len({len(line) for line in table}) == 1, "rows of unequal width"
    dynamic = next(line for line in table if line.startswith("quantize_dynamic "))
    assert dynamic.rstrip().endswith("—") and "nan" not in r.stdout  # ml_dtypes has no quantize_dynamic


def test_bench_help_describes_the_command():
    r = subprocess.run([sys.executable, "-m", "fp8core", "bench", "--help"], capture_output=True, text=True,
                       timeout=120)
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "against torch eager (its intra-op threads pinned and printed)" in text
    assert "--torch-threads N" in text
