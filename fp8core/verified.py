"""Whether the installed CUDA kernels are ones a GPU has verified: the stamp that ``bench/gpu_run.py`` writes.

The stamp is ``bench/results/gpu-verified.json`` in a checkout; the wheel ships ``bench/`` as the package
``fp8core.bench``, so an installed fp8core finds it under ``fp8core/bench/results/``. It holds the sha256 of the
``cuda/`` sources (``fp8core._kernels.cuda_sha256``) that passed the selftest, the test suite with its GPU tests
and the sanitizers on a GPU. Until one lands, the GPU kernels count as compiled for every target and checked under
an emulator, not as verified (a selftest alone, as on the H200 on 2026-11-27, does not stamp them): :func:`status`
says so, and the README says the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["bench_dir", "stamp_path", "read_stamp", "status", "NOT_YET"]

NOT_YET = ("not verified on a GPU: no GPU has passed the selftest, the whole suite and the sanitizers with these "
           "kernels; they are compiled by NVRTC for sm_80..sm_120 and emulated against the CPU reference")


def bench_dir() -> Path:
    """The benchmarks: the installed package ``fp8core.bench``, or ``bench/`` of the checkout fp8core is imported
    from where it was never installed (no ``fp8core.bench`` mapping)."""
    try:
        import fp8core.bench as bench
    except ImportError:
        return Path(__file__).resolve().parent.parent / "bench"
    return Path(next(iter(bench.__path__)))


def stamp_path() -> Path:
    """Where the stamp is, or would be."""
    return bench_dir() / "results" / "gpu-verified.json"


def read_stamp(path: Path | None = None) -> dict[str, Any] | None:
    """The stamp's record, or None where there is none."""
    path = stamp_path() if path is None else path
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def status(path: Path | None = None) -> tuple[bool, str]:
    """(verified, in words): True only when a stamp exists and names the kernels installed here."""
    from fp8core._kernels import cuda_sha256

    sha = cuda_sha256()
    record = read_stamp(path)
    if record is None:
        return False, f"{NOT_YET} (no stamp; kernels cuda/ {sha[:12]})"
    verified = record.get("cuda_sha256")
    if verified != sha:
        return False, (f"the installed kernels (cuda/ {sha[:12]}) are NOT the GPU-verified ones (stamp "
                       f"{str(verified)[:12]}); these are compiled and emulated, not verified on a GPU")
    where = record.get("device") or "a GPU"
    return True, f"verified on {where}: the installed kernels (cuda/ {sha[:12]}) match the GPU-verified stamp"
