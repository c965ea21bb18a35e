"""The kernels of cuda/, one :class:`Kernel` record each, and their loader.

A record holds everything about one kernel but its parameters: its file, its template instantiations (the loader
compiles them together as name expressions) and its grid rule. The parameters are the kernel's C++ signature in
its .cu file, read on the record's first use (fp8core._signatures); a launch names its arguments:
``QUANTIZE.launch(device, (x.dtype, fmt.index), x.size, stream, x=..., q=..., n=x.size, ...)``, and a missing,
unknown or misspelt name, or a value the parameter's C++ type cannot hold, raises naming the kernel and the
parameter before anything reaches the driver.

The loader: ``cupy.RawModule`` compiles each ``cuda/*.cu`` with NVRTC for the device it runs on. CuPy keys its disk
cache on the source text and the options, not on included headers, so the options carry ``-DFP8CORE_CUDA_SHA=``
(a hash of the module's own sources: its .cu and the headers it includes): a header edit recompiles the modules
that include it, and only those. Modules are held per (file, device); concurrent first calls from threads compile
once.

``compile_cubin`` compiles without a GPU for any architecture (the CI's NVRTC and SASS tests), with the same
source and options. It calls NVRTC itself and sizes the cubin with nvrtcGetCUBINSize: CuPy's
``nvrtc.getCUBIN`` returns it one byte short, which is harmless to a module load but not to cuobjdump.

Conversion path: sm_89+ converts to and from fp8 in hardware; sm_80/86 get the software conversion of
common.cuh (same bits). ``FP8CORE_FORCE_SOFT_FP8=1`` in the environment when a module is first compiled in a
process takes the software path on every GPU, to test it against the hardware one.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import re
import threading
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from . import _signatures
from ._caches import cached, memo
from .formats import ROWS

# CuPy's RawModule appends -ftz=true and --device-as-default-execution-space to every compile; compile_cubin
# passes them too so that it compiles what runs. The kernels are written to be immune to -ftz.
OPTIONS = ("--std=c++17", "-ftz=true", "--device-as-default-execution-space")
_RAWMODULE_OPTIONS = ("--std=c++17",)

THREADS = 256  # threads per block of every kernel but update_kernel's
MIN_COMPUTE_CAPABILITY = 80  # every kernel (the FP8 GEMM needs 89, see backends/cublaslt.py)
_MAX_GRID = 65535


def soft_fp8() -> bool:
    """Whether ``FP8CORE_FORCE_SOFT_FP8`` asks for the software conversion (read when a module is compiled)."""
    return os.environ.get("FP8CORE_FORCE_SOFT_FP8", "") not in ("", "0")


def _stride(per_thread: int) -> Any:
    """A grid-stride loop over ``work`` items, ``per_thread`` a thread: no more blocks than run at once, no more
    than there is work."""
    return lambda max_blocks, work: max(1, min(max_blocks, -(-work // (per_thread * THREADS))))


def _each(per_block: int) -> Any:
    """One block per ``per_block`` items."""
    return lambda max_blocks, work: -(-work // per_block)


def _tiles(rows: int, cols: int) -> Any:
    """One block per rows x cols tile of a ``(rows, cols)`` work, numbered over (x, y) within their limits: as few
    rows of blocks as hold the n tiles, each as short as they allow, so that fewer than gy blocks (under
    n / 65535 + 1) are idle (a full first row, min(n, 65535) x ceil(n / 65535), idled up to 65534)."""
    def grid(max_blocks: int, work: tuple[int, int]) -> tuple[int, int]:
        n = -(-work[0] // rows) * -(-work[1] // cols)
        gy = max(1, -(-n // _MAX_GRID))
        return max(1, -(-n // gy)), gy
    return grid


def _cxx(arg: Any) -> str:
    """A template argument: a dtype name as its C++ type, a bool as true/false, an int as itself."""
    if isinstance(arg, bool):
        return "true" if arg else "false"
    return _CXX_TYPES.get(arg, str(arg)) if isinstance(arg, str) else str(arg)


_CXX_TYPES = {"float32": "float", "bfloat16": "fp8core::bf16", "float16": "fp8core::f16"}


class _Plan:
    """An instantiation loaded on one device: its function and the most blocks of it that run at once."""

    __slots__ = ("function", "fn", "max_blocks", "driver")

    def __init__(self, function: Any, sm_count: int) -> None:
        self.function = function  # keeps the module loaded
        self.fn = function.ptr
        self.driver = driver = _driver()
        self.max_blocks = sm_count * max(1, driver.occupancyMaxActiveBlocksPerMultiprocessor(self.fn, THREADS, 0))


def _driver() -> Any:
    from cupy_backends.cuda.api import driver

    return driver


_plans: dict[tuple[Any, int, tuple], _Plan] = memo("kernels.plans", {})
_sm_counts: dict[int, int] = memo("kernels.sm_counts", {})  # the devices checked, and their SM counts


def _sm_count(device: int) -> int:
    n = _sm_counts.get(device)
    if n is None:
        import cupy

        cc = int(cupy.cuda.Device(device).compute_capability)
        if cc < MIN_COMPUTE_CAPABILITY:
            raise RuntimeError(f"fp8core's CUDA kernels need compute capability 8.0 or newer (Ampere, Ada, Hopper, "
                               f"Blackwell); cuda:{device} is {cc // 10}.{cc % 10}")
        n = _sm_counts[device] = cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
    return n


class Kernel:
    """One kernel: ``file`` under cuda/, C++ ``name`` in namespace fp8core, the template arguments of each
    instantiation, and its ``grid`` rule (max_blocks, work) -> grid. Its parameters: :attr:`signature`."""

    __slots__ = ("file", "name", "instances", "rule", "_signature")

    def __init__(self, file: str, name: str, instances: Any = ((),), grid: Any = _stride(8)) -> None:
        self.file, self.name, self.rule = file, name, grid
        self.instances = [tuple(t) for t in instances]
        self._signature: _signatures.Signature | None = None

    @property
    def signature(self) -> _signatures.Signature:
        """The kernel's parameters as its C++ signature declares them (names, types, layout), read once."""
        if self._signature is None:
            # Threads racing here read equal signatures; whichever is stored last is kept.
            self._signature = _signatures.read(cuda_dir(), self.file, self.name)
        return self._signature

    def constant(self, name: str) -> int:
        """A namespace-scope integer ``constexpr`` of the kernel's file (or its headers), e.g. MULTI_CHUNK."""
        try:
            return self.signature.constants[name]
        except KeyError:
            raise ValueError(f"cuda/{self.file}: no integer constexpr named {name}") from None

    def expr(self, targs: tuple = ()) -> str:
        """The name expression of one instantiation."""
        return f"fp8core::{self.name}<{', '.join(map(_cxx, targs))}>" if targs else f"fp8core::{self.name}"

    def _plan(self, device: int, targs: tuple) -> _Plan:
        """Call inside the device guard."""
        key = (self, device, targs)
        plan = _plans.get(key)
        if plan is None:
            sm_count = _sm_count(device)  # refuses a device older than the kernels before compiling for it
            # Built outside any lock (get_function compiles once per file and device under its own lock); a thread
            # that races here builds an equal plan over the same function, and the first one stored is kept.
            plan = _plans.setdefault(key, _Plan(get_function(self.file, self.expr(targs), device), sm_count))
        return plan

    def grid(self, device: int, targs: tuple, work: Any) -> Any:
        """The grid a launch over ``work`` gets by this kernel's rule."""
        return self.rule(self.max_blocks(device, targs), work)

    def max_blocks(self, device: int, targs: tuple) -> int:
        return self._plan(device, targs).max_blocks

    def launch(self, device: int, targs: tuple, work: Any, stream: int, /, **args: Any) -> None:
        """Launch instantiation ``targs`` on ``stream`` (a raw handle) with ``args``, one keyword per parameter of
        the C++ signature (pointers as ints, 0 for null; a by-value struct as a mapping of its fields), the grid by
        the rule over ``work``. Launch options, also by keyword (names no kernel parameter may take): ``grid``
        (instead of the rule's), ``block`` (threads, or (x, y); default THREADS), ``cooperative`` (default False).
        Call inside the device guard."""
        # Positional-only parameters and one **args: CPython then binds the keywords without comparing each with
        # the named parameters (measured: that doubles the call's cost), and options are taken out only if given.
        sig = self._signature or self.signature
        grid, block, cooperative = None, THREADS, False
        if len(args) > len(sig.names):
            grid, block = args.pop("grid", None), args.pop("block", THREADS)
            cooperative = args.pop("cooperative", False)
        params = sig.pack(args)  # refused by name before any device is asked
        plan = self._plan(device, targs)
        if grid is None:
            grid = self.rule(plan.max_blocks, work)
        gx, gy = (grid, 1) if isinstance(grid, int) else grid
        bx, by = (block, 1) if isinstance(block, int) else block
        if cooperative:
            plan.driver.launchCooperativeKernel(plan.fn, gx, gy, 1, bx, by, 1, 0, stream, params)
        else:
            plan.driver.launchKernel(plan.fn, gx, gy, 1, bx, by, 1, 0, stream, params, 0)


# Template arguments: dtype names, format indices.
_T = ("float32", "bfloat16", "float16")
_FMT = tuple(row.index for row in ROWS if row.index is not None)  # every encoding the kernels convert
_T_FMT = list(itertools.product(_T, _FMT))

AMAX = Kernel("quantize.cu", "amax_kernel", itertools.product(_T))
MULTI_AMAX = Kernel("quantize.cu", "multi_amax_kernel", itertools.product(_T))
QUANTIZE = Kernel("quantize.cu", "quantize_kernel", _T_FMT)
QUANTIZE_DYNAMIC = Kernel("quantize.cu", "quantize_dynamic_kernel", _T_FMT)
MULTI_QUANTIZE = Kernel("quantize.cu", "multi_quantize_kernel", _T_FMT)
DEQUANTIZE = Kernel("dequantize.cu", "dequantize_kernel", itertools.product(_FMT, _T))
CAST_TRANSPOSE = Kernel("cast_transpose.cu", "cast_transpose_kernel",
                        [(t, f, True) for t, f in _T_FMT] + [("fp8core::Passthrough", 0, False)], _tiles(128, 128))
UPDATE = Kernel("update.cu", "update_kernel", [(True,), (False,)], _each(32))
COMPUTE_SCALE = Kernel("update.cu", "compute_scale_kernel", grid=_each(THREADS))
FILL = Kernel("update.cu", "fill_kernel", grid=_stride(1))
# block scaling (fp8core.blocks, backends/cuda_blocks.py)
MX_QUANTIZE = Kernel("block_quantize.cu", "mx_quantize_kernel", itertools.product(_T, _FMT, (True, False)),
                     _tiles(32, 256))
QUANTIZE_1X128 = Kernel("block_quantize.cu", "quantize_1x128_kernel", _T_FMT, _stride(1))
QUANTIZE_128X128 = Kernel("block_quantize.cu", "quantize_128x128_kernel", _T_FMT, _tiles(128, 128))
QUANTIZE_AXISWISE = Kernel("block_quantize.cu", "quantize_axiswise_kernel", _T_FMT, _stride(1))
BLOCK_DEQUANTIZE = Kernel("block_quantize.cu", "block_dequantize_kernel", itertools.product(_FMT, _T, (True, False)))
# the scale layout of cuBLASLt's block-scaled GEMMs, MXFP8's and FP4's (tile_rows 16: NVFP4's 16x16 weight tiles)
MX_SCALE_SWIZZLE = Kernel("block_quantize.cu", "mx_scale_swizzle_kernel", grid=_stride(1))
# FP4 (fp8core.fp4, backends/cuda_fp4.py): one thread per block of the operand, grid-stride
NVFP4_QUANTIZE = Kernel("fp4_quantize.cu", "nvfp4_quantize_kernel", itertools.product(_T), _stride(1))
MXFP4_QUANTIZE = Kernel("fp4_quantize.cu", "mxfp4_quantize_kernel", itertools.product(_T, (True, False)), _stride(1))
FP4_DEQUANTIZE = Kernel("fp4_quantize.cu", "fp4_dequantize_kernel", itertools.product(_T, (True, False)), _stride(1))
NVFP4_GEMM_ALPHA = Kernel("fp4_gemm.cu", "nvfp4_gemm_alpha_kernel", grid=_stride(1))  # one thread: alpha, beta

RECORDS = tuple(k for k in list(globals().values()) if isinstance(k, Kernel))  # every record above, in order
# Every instantiation of every file, compiled together (name_expressions); selftest's coverage reads it.
KERNELS: dict[str, list[str]] = {}
for _k in RECORDS:
    KERNELS.setdefault(_k.file, []).extend(_k.expr(t) for t in _k.instances)
del _k


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


def included(code: str, headers: Mapping[str, str]) -> list[str]:
    """The names of ``headers`` (name -> text) that ``code`` reaches through ``#include "name"``, directly or through
    another header, in the order first reached. A name not in ``headers`` (a system header) is not followed."""
    found: list[str] = []
    pending = [code]
    while pending:
        for name in _INCLUDE.findall(pending.pop()):
            if name in headers and name not in found:
                found.append(name)
                pending.append(headers[name])
    return found


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def module_sources(filename: str) -> list[Path]:
    """The files one module is compiled from: ``cuda/filename`` and the headers it includes."""
    root = cuda_dir()
    headers = {p.relative_to(root).as_posix(): p for p in _sources() if p.suffix == ".cuh"}
    reached = included((root / filename).read_text(), {n: p.read_text() for n, p in headers.items()})
    return [root / filename, *(headers[n] for n in reached)]


def module_sha256(filename: str) -> str:
    """sha256 over the files of one module (module_sources), as cuda_sha256 hashes all of cuda/."""
    root, h = cuda_dir(), hashlib.sha256()
    for p in module_sources(filename):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def module_options(soft_fp8: bool, filename: str | None = None) -> tuple[str, ...]:
    """The -D options of a compile: the sources' hash (CuPy's cache key: of ``filename``'s module, so that an edit
    of one kernel file recompiles that module alone; of all of cuda/ without one), the encodings' constants
    (FP8CORE_ENCODINGS and FP8CORE_FP4_ENCODINGS, both declared by common.cuh's one FP8CORE_ENCODING macro, from
    the rows of fp8core.formats) and the forced software path."""
    sha = module_sha256(filename) if filename is not None else cuda_sha256()
    return (f"-DFP8CORE_CUDA_SHA=0x{sha[:16]}", _encodings_option(), _fp4_encodings_option()) + (
        ("-DFP8CORE_FORCE_SOFT_FP8=1",) if soft_fp8 else ())


def _encodings_option() -> str:
    rows = "".join(f"FP8CORE_ENCODING({r.name},{r.index},{r.exponent_bits},{r.mantissa_bits},{r.bias},{r.max_code},"
                   f"{int(r.has_inf)},{int(bool(r.nan_codes))},{r.nan_cast})" for r in ROWS if r.index is not None)
    return f"-DFP8CORE_ENCODINGS={rows}"


# The packed (two a byte) element encodings, E2M1: no instantiation of the FP8 kernels takes them (their rows have
# no index); common.cuh declares them from their own define, with template indices of their own.
FP4_INDEX = {r.name: 16 + i for i, r in enumerate(r for r in ROWS if r.elements_per_byte == 2)}


def _fp4_encodings_option() -> str:
    rows = "".join(f"FP8CORE_ENCODING({r.name},{FP4_INDEX[r.name]},{r.exponent_bits},{r.mantissa_bits},{r.bias},"
                   f"{r.max_code},{int(r.has_inf)},{int(bool(r.nan_codes))},{r.nan_cast})"
                   for r in ROWS if r.name in FP4_INDEX)
    return f"-DFP8CORE_FP4_ENCODINGS={rows}"


# Files with instructions that exist only on family-specific targets (block_quantize.cu: the hardware E8M0
# conversion; fp4_quantize.cu: E8M0 and E2M1, cvt.rn.satfinite.e2m1x2.f32, which NVRTC 13 takes for sm_100a/f,
# sm_103f, sm_110f, sm_120f, sm_121f and refuses for sm_90 and the generic sm_100), and the devices that get one:
# sm_XXXf is a superset of the sm_XXX CuPy appends, and NVRTC given both compiles for the family target. The forced
# software path never takes it.
FAMILY_FILES = frozenset({"block_quantize.cu", "fp4_quantize.cu"})
FAMILY_ARCHS = (100, 103, 110, 120, 121)
# The first NVRTC that takes each family target: the "f" targets came with CUDA 12.9 (12.8 answers "invalid value
# for --gpu-architecture"), and sm_110 was sm_101 before CUDA 13.0. The cuda12 extra allows NVRTC 12.4+, so an
# older NVRTC compiles the generic target, where block_quantize.cu takes its software E8M0 path (same bits).
FAMILY_MIN_NVRTC = {100: (12, 9), 103: (12, 9), 110: (13, 0), 120: (12, 9), 121: (12, 9)}


@cached("kernels.nvrtc_version", maxsize=1)
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


_compiled: dict[tuple[str, str, bool, str], tuple[bytes, dict[str, str]]] = memo("kernels.cubins", {})


def compile_cubin(filename: str, arch: str, soft_fp8: bool = False) -> tuple[bytes, dict[str, str]]:
    """Compile ``cuda/filename`` for ``arch`` (e.g. "90"), no GPU needed; the cubin and name expression -> symbol.

    Kept in memory per (file, arch, path, the module's sources' hash) for the tests that read the same cubins."""
    key = (filename, arch, soft_fp8, module_sha256(filename))
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
        options = [*OPTIONS, f"-arch=sm_{arch}", *module_options(soft_fp8, filename)]
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


_modules: dict[tuple[str, int], Any] = {}
_functions: dict[tuple[str, str, int], Any] = {}
_lock = threading.Lock()
_compiling: dict[tuple[str, int], threading.Lock] = {}


def _module(filename: str, device_id: int) -> Any:
    key = (filename, device_id)
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
            soft = soft_fp8()
            module = cupy.RawModule(
                code=(cuda_dir() / filename).read_text(), backend="nvrtc",
                options=(*_RAWMODULE_OPTIONS, f"-I{cuda_dir()}", *module_options(soft, filename),
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
    key = (filename, expr, device_id)
    fn = _functions.get(key)
    if fn is None:
        import cupy

        module = _module(filename, device_id)
        with cupy.cuda.Device(device_id):
            # RawModule.get_function gives a RawKernel; its .kernel is the Function loaded on this device.
            fn = module.get_function(expr).kernel
        _functions[key] = fn
    return fn
