"""The kernel loader: NVRTC compiles ``cuda/*.cu`` per architecture; cubins are cached in memory and on disk.

The cache key covers every file under cuda/ (a header edit recompiles), the NVRTC version, the options and
the architecture. Disk entries are written atomically; an unwritable cache directory degrades to memory.
Concurrent first calls from threads compile once.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

__all__ = ["cuda_dir", "cuda_sha256", "compile_cubin", "get_function", "KERNELS", "OPTIONS", "cache_dir"]

# -ftz=true on purpose: CuPy appends it to every compile, and the kernels are written to be immune to it.
OPTIONS = ("--std=c++17", "-ftz=true", "--device-as-default-execution-space")

_T = ("float", "fp8core::bf16", "fp8core::f16")
_FMT = (0, 1)

# Every template instantiation of every file, compiled together (name_expressions).
KERNELS: dict[str, list[str]] = {
    "quantize.cu": [f"fp8core::amax_kernel<{t}>" for t in _T]
    + [f"fp8core::multi_amax_kernel<{t}>" for t in _T]
    + [f"fp8core::{k}<{t}, {f}>" for k in ("quantize_kernel", "quantize_dynamic_kernel", "multi_quantize_kernel")
       for t in _T for f in _FMT],
    "dequantize.cu": [f"fp8core::dequantize_kernel<{f}, {t}>" for f in _FMT for t in _T],
    "cast_transpose.cu": [f"fp8core::cast_transpose_kernel<{t}, {f}, true>" for t in _T for f in _FMT]
    + ["fp8core::cast_transpose_kernel<fp8core::Passthrough, 0, false>"],
    "update.cu": ["fp8core::update_kernel<true>", "fp8core::update_kernel<false>", "fp8core::compute_scale_kernel"],
    # block scaling (fp8core.blocks, backends/cuda_blocks.py)
    "block_quantize.cu": [f"fp8core::mx_quantize_kernel<{t}, {f}, {r}>" for t in _T for f in _FMT
                          for r in ("true", "false")]
    + [f"fp8core::{k}<{t}, {f}>" for k in ("quantize_1x128_kernel", "quantize_128x128_kernel") for t in _T
       for f in _FMT]
    + [f"fp8core::block_dequantize_kernel<{f}, {t}, {e}>" for f in _FMT for t in _T for e in ("true", "false")]
    + ["fp8core::mx_scale_swizzle_kernel"],
}


def cuda_dir() -> Path:
    """cuda/ inside the installed package, or beside it in a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_cuda", here.parent / "cuda"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError("fp8core's CUDA sources (cuda/*.cu, *.cuh) are not installed")


def _sources() -> list[Path]:
    root = cuda_dir()
    return sorted((p for p in root.rglob("*") if p.is_file() and p.suffix in (".cu", ".cuh")),
                  key=lambda p: p.relative_to(root).as_posix())


def cuda_sha256() -> str:
    """sha256 over every file under cuda/ in sorted path order: its path, a NUL byte, then its bytes."""
    root, h = cuda_dir(), hashlib.sha256()
    for p in _sources():
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _nvrtc() -> Any:
    from cupy.cuda import nvrtc

    return nvrtc


def compile_cubin(filename: str, arch: str) -> tuple[bytes, dict[str, str]]:
    """Compile ``cuda/filename`` for ``arch`` (e.g. "90"); returns the cubin and name expression -> symbol."""
    nvrtc = _nvrtc()
    root = cuda_dir()
    headers = [p for p in _sources() if p.suffix == ".cuh"]
    prog = nvrtc.createProgram((root / filename).read_text(), filename,
                               [p.read_bytes() for p in headers], [p.name.encode() for p in headers])
    try:
        for expr in KERNELS[filename]:
            nvrtc.addNameExpression(prog, expr)
        options = [*OPTIONS, f"-arch=sm_{arch}", f"-DFP8CORE_CUDA_SHA=0x{cuda_sha256()[:12]}"]
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"NVRTC failed on cuda/{filename} for sm_{arch}: {e}\n{log}") from None
        mapping = {expr: nvrtc.getLoweredName(prog, expr) for expr in KERNELS[filename]}
        return bytes(nvrtc.getCUBIN(prog)), mapping
    finally:
        nvrtc.destroyProgram(prog)


def cache_dir() -> Path:
    return Path(os.environ.get("FP8CORE_CACHE_DIR", Path.home() / ".cache" / "fp8core" / "kernels"))


def _key(filename: str, arch: str) -> str:
    nvrtc_version = ".".join(map(str, _nvrtc().getVersion()))
    text = json.dumps([filename, arch, cuda_sha256(), nvrtc_version, OPTIONS, KERNELS[filename]])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _read_disk(path: Path) -> tuple[bytes, dict[str, str]] | None:
    try:
        blob = path.read_bytes()
        (n,) = struct.unpack_from("<I", blob)
        return blob[4 + n:], json.loads(blob[4:4 + n])
    except (OSError, ValueError, struct.error):
        return None


def _write_disk(path: Path, cubin: bytes, mapping: dict[str, str]) -> None:
    meta = json.dumps(mapping).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<I", len(meta)) + meta + cubin)
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"fp8core: kernel cache {path.parent} is not writable ({e}); caching in memory only",
                      RuntimeWarning, stacklevel=3)


_modules: dict[tuple[str, int], tuple[Any, dict[str, str]]] = {}
_lock = threading.Lock()
_compiling: dict[tuple[str, int], threading.Lock] = {}


def _device_arch(device_id: int) -> str:
    import cupy

    return cupy.cuda.Device(device_id).compute_capability


def _load(filename: str, device_id: int) -> tuple[Any, dict[str, str]]:
    key = (filename, device_id)
    if key in _modules:
        return _modules[key]
    with _lock:
        file_lock = _compiling.setdefault(key, threading.Lock())
    with file_lock:
        if key in _modules:
            return _modules[key]
        import cupy

        arch = _device_arch(device_id)
        path = cache_dir() / f"{Path(filename).stem}-sm{arch}-{_key(filename, arch)}.bin"
        entry = _read_disk(path)
        if entry is None:
            entry = compile_cubin(filename, arch)
            _write_disk(path, *entry)
        with cupy.cuda.Device(device_id):
            module = cupy.cuda.function.Module()
            module.load(entry[0])
        _modules[key] = (module, entry[1])
        return _modules[key]


def get_function(filename: str, expr: str, device_id: int) -> Any:
    """The loaded kernel ``expr`` (a name expression of KERNELS[filename]) on ``device_id``."""
    module, mapping = _load(filename, device_id)
    return module.get_function(mapping[expr])
