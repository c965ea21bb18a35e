"""The kernel loader: ``cupy.RawModule`` compiles each ``cuda/*.cu`` with NVRTC for the device it runs on.

CuPy keys its disk cache on the source text and the options, not on included headers, so the options carry
``-DFP8CORE_CUDA_SHA=`` (a hash of every file under cuda/): a header edit recompiles. Modules are held per
(file, device, conversion path); concurrent first calls from threads compile once.

``compile_cubin`` compiles without a GPU for any architecture (the CI's NVRTC and SASS tests), with the same
source and options. It calls NVRTC itself and sizes the cubin with nvrtcGetCUBINSize: CuPy's
``nvrtc.getCUBIN`` returns it one byte short, which is harmless to a module load but not to cuobjdump.

Conversion path: sm_89+ converts to and from fp8 in hardware; sm_80/86 get the software conversion of
common.cuh (same bits). ``FP8CORE_FORCE_SOFT_FP8=1`` in the environment at import (or ``FORCE_SOFT_FP8 = True``
before the first launch) takes the software path on every GPU, to test it against the hardware one.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["cuda_dir", "cuda_sha256", "compile_cubin", "get_function", "KERNELS", "OPTIONS", "cache_dir",
           "FORCE_SOFT_FP8", "module_options", "arch_options", "FAMILY_ARCHS", "nvrtc_version"]

# CuPy's RawModule appends -ftz=true and --device-as-default-execution-space to every compile; compile_cubin
# passes them too so that it compiles what runs. The kernels are written to be immune to -ftz.
OPTIONS = ("--std=c++17", "-ftz=true", "--device-as-default-execution-space")
_RAWMODULE_OPTIONS = ("--std=c++17",)

FORCE_SOFT_FP8 = os.environ.get("FP8CORE_FORCE_SOFT_FP8", "") not in ("", "0")

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
    "update.cu": ["fp8core::update_kernel<true>", "fp8core::update_kernel<false>", "fp8core::compute_scale_kernel",
                  "fp8core::fill_kernel"],
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


def module_options(soft_fp8: bool) -> tuple[str, ...]:
    """The -D options of every compile: the cuda/ hash (CuPy's cache key) and the forced software path."""
    return (f"-DFP8CORE_CUDA_SHA=0x{cuda_sha256()[:16]}",) + (("-DFP8CORE_FORCE_SOFT_FP8=1",) if soft_fp8 else ())


# Files with instructions that exist only on family-specific targets (block_quantize.cu: the hardware E8M0
# conversion), and the devices that get one: sm_XXXf is a superset of the sm_XXX CuPy appends, and NVRTC given
# both compiles for the family target. The forced software path never takes it.
FAMILY_FILES = frozenset({"block_quantize.cu"})
FAMILY_ARCHS = (100, 103, 110, 120, 121)
# The first NVRTC that takes each family target: the "f" targets came with CUDA 12.9 (12.8 answers "invalid value
# for --gpu-architecture"), and sm_110 was sm_101 before CUDA 13.0. The cuda12 extra allows NVRTC 12.4+, so an
# older NVRTC compiles the generic target, where block_quantize.cu takes its software E8M0 path (same bits).
FAMILY_MIN_NVRTC = {100: (12, 9), 103: (12, 9), 110: (13, 0), 120: (12, 9), 121: (12, 9)}


@lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC CuPy loaded, read once per process."""
    major, minor = _nvrtc().getVersion()
    return int(major), int(minor)


def arch_options(filename: str, compute_capability: int, soft_fp8: bool) -> tuple[str, ...]:
    """The extra -arch option a device of ``compute_capability`` compiles ``filename`` with (or none): the family
    target where this NVRTC has it."""
    if (filename in FAMILY_FILES and compute_capability in FAMILY_ARCHS and not soft_fp8
            and nvrtc_version() >= FAMILY_MIN_NVRTC[compute_capability]):
        return (f"-arch=sm_{compute_capability}f",)
    return ()


def _nvrtc() -> Any:
    from cupy.cuda import nvrtc

    return nvrtc


@lru_cache(maxsize=1)
def _libnvrtc() -> ctypes.CDLL:
    """The libnvrtc CuPy loaded (for nvrtcGetCUBINSize, which CuPy does not wrap)."""
    _nvrtc().getVersion()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libnvrtc.so" in path or "libnvrtc64" in path:
                return ctypes.CDLL(path)
    return ctypes.CDLL("libnvrtc.so")


def _cubin(prog: int) -> bytes:
    lib = _libnvrtc()
    size = ctypes.c_size_t()
    if lib.nvrtcGetCUBINSize(ctypes.c_void_p(prog), ctypes.byref(size)) != 0:
        raise RuntimeError("nvrtcGetCUBINSize failed")
    buf = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetCUBIN(ctypes.c_void_p(prog), buf) != 0:
        raise RuntimeError("nvrtcGetCUBIN failed")
    return buf.raw


_compiled: dict[tuple[str, str, bool, str], tuple[bytes, dict[str, str]]] = {}


def compile_cubin(filename: str, arch: str, soft_fp8: bool = False) -> tuple[bytes, dict[str, str]]:
    """Compile ``cuda/filename`` for ``arch`` (e.g. "90"), no GPU needed; the cubin and name expression -> symbol.

    Kept in memory per (file, arch, path, cuda/ hash) for the tests that read the same cubins."""
    key = (filename, arch, soft_fp8, cuda_sha256())
    if key not in _compiled:
        _compiled[key] = _compile_cubin(filename, arch, soft_fp8)
    return _compiled[key]


def _compile_cubin(filename: str, arch: str, soft_fp8: bool) -> tuple[bytes, dict[str, str]]:
    nvrtc = _nvrtc()
    root = cuda_dir()
    headers = [p for p in _sources() if p.suffix == ".cuh"]
    prog = nvrtc.createProgram((root / filename).read_text(), filename,
                               [p.read_bytes() for p in headers], [p.name.encode() for p in headers])
    try:
        for expr in KERNELS[filename]:
            nvrtc.addNameExpression(prog, expr)
        options = [*OPTIONS, f"-arch=sm_{arch}", *module_options(soft_fp8)]
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"NVRTC failed on cuda/{filename} for sm_{arch}: {e}\n{log}") from None
        mapping = {expr: nvrtc.getLoweredName(prog, expr) for expr in KERNELS[filename]}
        return _cubin(prog), mapping
    finally:
        nvrtc.destroyProgram(prog)


def cache_dir() -> Path:
    """CuPy's kernel cache, where the compiled modules live."""
    return Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))


_modules: dict[tuple[str, int, bool], Any] = {}
_functions: dict[tuple[str, str, int, bool], Any] = {}
_lock = threading.Lock()
_compiling: dict[tuple[str, int, bool], threading.Lock] = {}


def _module(filename: str, device_id: int, soft: bool) -> Any:
    key = (filename, device_id, soft)
    module = _modules.get(key)
    if module is not None:
        return module
    with _lock:
        file_lock = _compiling.setdefault(key, threading.Lock())
    with file_lock:
        module = _modules.get(key)
        if module is None:
            import cupy

            cc = int(cupy.cuda.Device(device_id).compute_capability)
            module = cupy.RawModule(
                code=(cuda_dir() / filename).read_text(), backend="nvrtc",
                options=(*_RAWMODULE_OPTIONS, f"-I{cuda_dir()}", *module_options(soft),
                         *arch_options(filename, cc, soft)),
                name_expressions=KERNELS[filename])
            with cupy.cuda.Device(device_id):
                try:
                    module.compile()  # for this device's architecture, into CuPy's disk cache
                except cupy.cuda.compiler.CompileException as e:
                    raise RuntimeError(f"NVRTC failed on cuda/{filename} for cuda:{device_id}: {e}") from None
            _modules[key] = module
        return module


def get_function(filename: str, expr: str, device_id: int) -> Any:
    """The loaded kernel ``expr`` (a name expression of KERNELS[filename]) on ``device_id`` (a cupy Function)."""
    soft = FORCE_SOFT_FP8
    key = (filename, expr, device_id, soft)
    fn = _functions.get(key)
    if fn is None:
        import cupy

        module = _module(filename, device_id, soft)
        with cupy.cuda.Device(device_id):
            # RawModule.get_function gives a RawKernel; its .kernel is the Function loaded on this device.
            fn = module.get_function(expr).kernel
        _functions[key] = fn
    return fn
