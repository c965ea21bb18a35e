"""``fp8core info``: versions, the backend found, the kernel cache, the GPU-verified stamp."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import fp8core
from fp8core.extras import install_hint
from fp8core.selftest.gpu import gpu_unavailable_reason, one_line

from .common import installed_version


def gpu_report() -> dict[str, Any]:
    """The backend found: GPU name and compute capability, or why there is none."""
    why = gpu_unavailable_reason()
    if why is not None:
        return {"backend": "CPU only", "why": why}
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        props = cupy.cuda.runtime.getDeviceProperties(0)
        cc = int(cupy.cuda.Device(0).compute_capability)
    except Exception as e:
        return {"backend": "CPU only", "why": one_line(e)}
    gemm = cc >= 89
    why = "" if gemm else "needs compute capability 8.9+"
    if gemm and installed_version("nvmath") is None:
        gemm, why = False, f"nvmath-python is not installed ({install_hint('gemm')})"
    return {"backend": "cuda", "gpu": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
            "compute_capability": f"{cc // 10}.{cc % 10}", "devices": n, "fp8_gemm": gemm, "fp8_gemm_why": why}


def cmd_info(args: argparse.Namespace) -> None:
    from fp8core._kernels import cache_dir

    report: dict[str, Any] = {"fp8core": fp8core.__version__, "python": platform.python_version()}
    for name in ("numpy", "ml_dtypes", "cupy", "torch", "jax", "nvmath"):
        report[name] = installed_version(name) or "not installed"
    try:
        import cupy

        version = cupy.cuda.runtime.runtimeGetVersion()  # 1000 * major + 10 * minor: 13020 is CUDA 13.2
        report["cuda_runtime"] = f"{version // 1000}.{version % 1000 // 10}"
    except Exception:
        report["cuda_runtime"] = "unavailable"
    report.update(gpu_report())
    cache = Path(cache_dir())
    entries = len(list(cache.glob("*"))) if cache.is_dir() else 0
    report["kernel_cache"] = f"{cache} ({entries} compiled kernel files)" if cache.is_dir() else f"{cache} (empty)"
    from fp8core import verified

    report["gpu_verified"] = verified.status()[1]
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for k, v in report.items():
        print(f"{k:<20} {v}")
