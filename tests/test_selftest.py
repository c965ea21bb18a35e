"""`fp8core selftest`: its CPU self-consistency path, that it catches what it claims to, its coverage rule,
the no-GPU line and exit status, and the stamp."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fp8core import _kernels, selftest
from fp8core.backends import cpu


_KNOBS = (cpu.TABLE_MIN, cpu.CHUNK)
_FUNCTIONS = {m.__name__: dict(vars(m)) for m in (cpu, __import__("fp8core.backends.cpu_blocks", fromlist=["x"]))}


@pytest.fixture(scope="module")
def cpu_report():
    return selftest.run("cpu", quick=True)


def test_cpu_self_consistency_passes_and_every_check_ran(cpu_report):
    assert cpu_report.ok, cpu_report.table()
    assert not cpu_report.skipped
    for c in cpu_report.checks:
        assert c.cases > 0, c.name
    assert cpu_report.checks[-1].name.startswith("coverage")


def test_the_run_leaves_the_backend_as_it_found_it(cpu_report):
    assert (cpu.TABLE_MIN, cpu.CHUNK) == _KNOBS
    from fp8core.backends import cpu_blocks

    for mod in (cpu, cpu_blocks):  # the coverage's wrappers are gone: every function is the module's own again
        for name in selftest.coverage.primitives(mod):
            assert getattr(mod, name) is _FUNCTIONS[mod.__name__][name], f"{mod.__name__}.{name}"


def test_a_wrong_table_entry_fails_the_run(monkeypatch):
    """The dut path (16-bit quantize by table) with one wrong byte: the pattern check must name it."""
    real = cpu.quantize_table

    def broken(dtype, scale_bits, fmt):
        table = real(dtype, scale_bits, fmt).copy()
        table[0x3F80] ^= 1  # bf16 1.0 / fp16 1.875
        return table

    monkeypatch.setattr(cpu, "quantize_table", broken)
    report = selftest.run("cpu", quick=True)
    assert not report.ok
    patterns = report.checks[0]
    assert patterns.failed > 0 and "first at [16256]" in patterns.failures[0]


def test_a_backend_function_no_check_calls_fails_the_coverage(monkeypatch):
    for mod in (cpu, __import__("fp8core.backends.cuda", fromlist=["x"])):
        fn = lambda x: x  # noqa: E731
        fn.__module__, fn.__name__ = mod.__name__, "frobnicate"
        monkeypatch.setattr(mod, "frobnicate", fn, raising=False)
    assert "frobnicate" in selftest.backend_functions()
    report = selftest.run("cpu", quick=True)
    cover = report.checks[-1]
    assert cover.failed == 1 and "frobnicate was never called" in cover.failures[0]


def test_a_kernel_instantiation_no_check_launches_is_listed():
    cov = selftest.Coverage(selftest.CpuTarget())
    every = {(f, e) for f, exprs in _kernels.KERNELS.items() for e in exprs}
    cov.kernels = set(every)
    assert cov.missing_kernels() == []
    f, e = sorted(every)[3]
    cov.kernels.discard((f, e))
    assert cov.missing_kernels() == [f"{f}: {e}"]


def test_backend_functions_are_the_primitives():
    names = selftest.backend_functions()
    for name in ("amax", "quantize", "quantize_dynamic", "dequantize", "transpose", "cast_transpose",
                 "compute_scale", "scale_rule", "update", "multi_amax", "multi_quantize", "gemm"):
        assert name in names


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "fp8core", "selftest", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_without_a_gpu_one_line_and_exit_3():
    p = _cli(env={"CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == selftest.EXIT_NO_GPU == 3
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fp8core selftest: no GPU to check:")
    assert "Traceback" not in p.stderr


def test_cli_cpu_json_and_exit_0():
    p = _cli("--backend", "cpu", "--quick", "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["ok"] and report["failed"] == 0 and report["cases"] > 1000
    assert report["backend"] == "cpu"


def test_stamp_needs_the_gpu_backend(tmp_path):
    p = _cli("--backend", "cpu", "--quick", "--stamp", str(tmp_path / "s.json"))
    assert p.returncode == 2 and "--stamp" in p.stderr
    assert not (tmp_path / "s.json").exists()


def test_help_documents_the_exit_status():
    p = _cli("--help")
    assert p.returncode == 0
    for line in ("0  every check passed", "1  a check failed", "3  no usable GPU"):
        assert line in p.stdout


def test_stamp_record_fields(cpu_report):
    record = selftest.stamp_record(cpu_report)
    assert record["cuda_sha256"] == _kernels.cuda_sha256()
    assert record["passed"] == cpu_report.cases and record["failed"] == 0
    for key in ("commit", "device", "date", "versions"):
        assert key in record
    for key in ("cuda_runtime", "cupy", "torch", "jax", "nvrtc"):
        assert key in record["versions"]
    json.dumps(record)


def test_a_failing_case_reports_where(cpu_report):
    result = selftest.CheckResult("x")
    rec = selftest.Recorder(result, selftest.CpuTarget())
    x = np.array([1.0, 2.0, 3.0], np.float32)
    assert not rec.equal("label", x, np.array([1.0, 2.5, 3.0], np.float32), x)
    assert result.failed == 1 and "1 of 3 differ; first at [1] (input 0x40000000)" in result.failures[0]


def test_a_new_backend_pair_is_covered_too(tmp_path, monkeypatch):
    """cpu_X.py / cuda_X.py added beside the backends: their shared public functions must be exercised."""
    from fp8core import backends

    for name in ("cpu_fake", "cuda_fake"):
        (tmp_path / f"{name}.py").write_text("def frob(x):\n    return x\n")
    monkeypatch.setattr(backends, "__path__", [*backends.__path__, str(tmp_path)])
    try:
        assert "fake.frob" in selftest.backend_functions()
        cover = selftest.run("cpu", quick=True).checks[-1]
        assert cover.failed == 1 and "fake.frob was never called" in cover.failures[0]
    finally:
        for name in ("cpu_fake", "cuda_fake"):
            sys.modules.pop(f"fp8core.backends.{name}", None)


def test_block_primitives_are_backend_functions():
    names = selftest.backend_functions()
    for name in ("quantize_mxfp8", "quantize_mxfp8_both", "quantize_blockwise", "dequantize_blocks",
                 "transpose_scale", "gemm_scale"):
        assert f"blocks.{name}" in names


def test_a_wrong_e8m0_rounding_fails_the_mxfp8_check(monkeypatch):
    """rceil computed as floor, on both paths of the CPU backend: only the oracle written from the contract can
    tell, and the MXFP8 check must name it."""
    from fp8core.backends import cpu_blocks

    monkeypatch.setattr(cpu_blocks, "e8m0_rceil", cpu_blocks.e8m0_floor)
    report = selftest.run("cpu", quick=True)
    mx = next(c for c in report.checks if c.name.startswith("block scaling: MXFP8 rowwise"))
    assert mx.failed > 0 and any("rceil" in f and "vs oracle" in f for f in mx.failures)
    assert all(c.failed == 0 for c in report.checks if "MXFP8" not in c.name and "block gemm" not in c.name)


def test_a_wrong_swizzle_fails_the_gemm_scale_check(monkeypatch):
    from fp8core.backends import cpu_blocks

    real = cpu_blocks.gemm_scale
    monkeypatch.setattr(cpu_blocks, "gemm_scale", lambda s, kind: real(s, "1x128" if kind == "128x128" else kind))
    report = selftest.run("cpu", quick=True)
    check = next(c for c in report.checks if "scale layouts" in c.name)
    assert check.failed > 0 and "128x128" in check.failures[0]


def test_the_block_gemm_refusal_is_what_fp8core_documents():
    class Ada(selftest.CudaTarget):
        def __init__(self, cc):
            self.cc, self.name = cc, f"sm_{cc}"

    assert selftest.blocks.block_gemm_refusal(Ada(89), "mx") == "compute capability 10.0"
    assert selftest.blocks.block_gemm_refusal(Ada(89), "1x128,1x128") == "compute capability 9.0"
    assert selftest.blocks.block_gemm_refusal(Ada(100), "mx") == ""
    assert selftest.blocks.block_gemm_refusal(selftest.CpuTarget(), "mx") == ""
