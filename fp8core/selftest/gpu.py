"""Whether there is a GPU to check, and if not why, in words: what ``fp8core info``, ``fp8core selftest`` and the
test suite's GPU marker all say. Below both front-ends, so that the CLI imports the selftest and not the reverse."""

from __future__ import annotations

import re
import sys
from typing import Any

from fp8core.extras import install_hint

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def one_line(e: BaseException, kind: bool = True) -> str:
    """The first line of an exception's message, terminal escape codes removed, after its type when asked."""
    text = ANSI.sub("", str(e)).strip()
    first = text.splitlines()[0] if text else ""
    return (f"{type(e).__name__}: {first}" if first else type(e).__name__) if kind else first or type(e).__name__


def driver_missing(cupy: Any) -> str | None:
    """Why the CUDA driver cannot serve CuPy's runtime, told apart: no driver at all, or one too old."""
    import ctypes

    try:
        ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return "no CUDA driver (libcuda cannot be loaded)"
    driver, runtime = cupy.cuda.runtime.driverGetVersion(), cupy.cuda.runtime.runtimeGetVersion()
    if driver == 0:
        return "no CUDA driver"
    if driver < runtime:
        return (f"the CUDA driver supports CUDA {driver // 1000}.{driver % 1000 // 10}, older than this CuPy's "
                f"runtime {runtime // 1000}.{runtime % 1000 // 10}; update the driver or install the cupy for it")
    return None


def gpu_unavailable_reason() -> str | None:
    """None when CuPy sees a CUDA device; else why not, in words (no cupy, no driver, old driver, no device)."""
    try:
        import cupy
    except ImportError:
        return f"cupy is not installed ({install_hint('cuda13', 'cuda12')})"
    except Exception as e:
        return f"cupy cannot be imported ({one_line(e)})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
        return None
    except Exception as e:
        try:
            missing = driver_missing(cupy)
        except Exception:
            missing = None
        return missing or one_line(e)


def gpu_reason(device_id: int) -> str | None:
    """None, or why there is nothing to check on CUDA device ``device_id``: :func:`gpu_unavailable_reason`, or an
    ordinal beyond the devices there are."""
    why = gpu_unavailable_reason()
    if why is not None:
        return why
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
    if not 0 <= device_id < n:
        return f"--device {device_id}: there are {n} CUDA devices (0..{n - 1})"
    return None
