"""An emulated CUDA device under fp8core's CUDA backend: the surface of CuPy and of CUDA's runtime and driver that
fp8core uses, over host memory, with every kernel launch run by the emulator (build.py, runtime.cpp).

:func:`install` puts the stand-ins in ``sys.modules`` as ``cupy`` and ``cupy_backends`` before fp8core is
imported, so fp8core runs unchanged: its loader hands ``cupy.RawModule`` the real cuda/ sources and options,
its launch layer computes grids from the occupancy query and packs arguments, and the stand-in driver runs
the launch on the emulator, which checks the packed layout against the kernel's parameter list. CuPy arrays
are host memory from ``malloc`` (exact sizes, so AddressSanitizer sees every byte past an end), filled with a
pattern instead of zeros, as device memory is not cleared.

Three emulated devices: 0 is sm_80 (software FP8 conversion), 1 is sm_90 (the hardware conversion
instructions, emulated as the PTX ISA documents them), 2 is sm_100 (also the family-specific E8M0 one).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import types
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import build


@dataclass
class Device:
    cc: int
    sms: int
    occupancy: int = 2                 # blocks per SM the occupancy query reports
    cooperative_limit: int | None = None  # refuse cooperative launches above this many blocks (MPS, green contexts)


DEVICES = [Device(80, 3), Device(90, 4), Device(100, 2)]
TIMEOUT_S = 30.0


@dataclass
class LaunchRecord:
    name: str
    device: int
    grid: tuple[int, int]
    block: tuple[int, int]
    cooperative: bool


@dataclass
class State:
    launches: list[LaunchRecord] = field(default_factory=list)
    capturing: bool = False
    block_window: tuple[int, int] | None = None  # run only these blocks of the next launch (huge grids)
    resident: int | None = None  # OS threads for the next launch instead of the occupancy rule's (deadlock demo)
    seed: int = 0  # thread orders: 0 the two fixed ones, else seeded random ones (launch k gets its own seed)
    seeded_launches: int = 0  # launches since the seed was set


state = State()
_local = threading.local()
_libc = ctypes.CDLL(None)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]
_FILL = 0xA5


def current() -> int:
    return getattr(_local, "device", 0)


# ---- memory and arrays --------------------------------------------------------------------------------

LAZY_BYTES = 64 << 20  # larger arrays are lazy mappings: tests of huge grids touch only a window of them


class _Block:
    """malloc'd bytes (exact size) or, for huge tensors whose pages are mostly never touched, a lazy mapping."""

    def __init__(self, nbytes: int) -> None:
        if nbytes >= LAZY_BYTES:
            self.map = mmap.mmap(-1, max(nbytes, 1))
            self.buf = (ctypes.c_char * nbytes).from_buffer(self.map)
            return
        ptr = _libc.malloc(max(nbytes, 1))
        ctypes.memset(ptr, _FILL, nbytes)
        self.buf = (ctypes.c_char * nbytes).from_address(ptr)
        weakref.finalize(self, _libc.free, ptr)




def _host_empty(shape: Any, dtype: Any) -> np.ndarray:
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if n == 0:
        return np.empty(shape, dtype)
    block = _Block(n)
    arr = np.frombuffer(block.buf, dtype=dtype).reshape(shape)
    arr.flags.writeable = True
    _owners[id(arr.base)] = block  # the ctypes buffer does not hold the _Block: keep it as long as the buffer
    weakref.finalize(arr.base, _owners.pop, id(arr.base), None)
    return arr


_owners: dict[int, _Block] = {}


class MemoryPointer:
    def __init__(self, ptr: int, device_id: int, mem: Any = None) -> None:
        self.ptr, self.device_id, self.mem = ptr, device_id, mem


def _unwrap(v: Any) -> Any:
    if isinstance(v, ndarray):
        return v._a
    if isinstance(v, (tuple, list)):
        return type(v)(_unwrap(x) for x in v)
    return v


def _wrap(v: Any, device: int | None = None) -> Any:
    if isinstance(v, np.ndarray):
        return ndarray._of(v, current() if device is None else device)
    if isinstance(v, tuple):
        return tuple(_wrap(x, device) for x in v)
    return v


class ndarray:  # noqa: N801  (CuPy's name)
    """A CuPy array on an emulated device: host memory that only kernels and explicit copies touch."""

    __array_priority__ = 100

    def __init__(self, shape: Any, dtype: Any = float, memptr: Any = None, strides: Any = None) -> None:
        if memptr is not None:
            raise NotImplementedError("the emulated device makes no arrays over foreign memory")
        self._a, self._dev = _host_empty(shape, dtype), current()

    @classmethod
    def _of(cls, a: np.ndarray, device: int) -> ndarray:
        obj = cls.__new__(cls)
        obj._a, obj._dev = a, device
        return obj

    # the attributes fp8core reads
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    strides = property(lambda self: self._a.strides)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: _wrap(self._a.T, self._dev))
    device = property(lambda self: _DeviceObj(self._dev))

    @property
    def data(self) -> MemoryPointer:
        return MemoryPointer(self._a.ctypes.data if self._a.size else 0, self._dev)

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self._dev)

    def get(self) -> np.ndarray:
        return self._a.copy()

    def set(self, host: Any) -> None:
        self._a[...] = np.asarray(host).reshape(self._a.shape)

    def copy(self) -> ndarray:
        out = ndarray._of(_host_empty(self._a.shape, self._a.dtype), self._dev)
        out._a[...] = self._a
        return out

    def fill(self, v: Any) -> None:
        self._a.fill(v)

    def __getitem__(self, k: Any) -> Any:
        return _wrap(self._a[_unwrap(k)], self._dev)

    def __setitem__(self, k: Any, v: Any) -> None:
        self._a[_unwrap(k)] = _unwrap(v)

    def __len__(self) -> int:
        return len(self._a)

    def __int__(self) -> int:
        return int(self._a)

    def __float__(self) -> float:
        return float(self._a)

    def __bool__(self) -> bool:
        return bool(self._a)

    def __repr__(self) -> str:
        return f"emulated_cupy({self._a!r}, device={self._dev})"

    def __getattr__(self, name: str) -> Any:  # view, reshape, astype, ravel, max, ... as NumPy has them
        attr = getattr(self._a, name)
        if not callable(attr):
            return _wrap(attr, self._dev)
        return lambda *a, **k: _wrap(attr(*_unwrap(a), **{n: _unwrap(v) for n, v in k.items()}), self._dev)


def _binary(name: str) -> Any:
    def op(self: ndarray, other: Any) -> Any:
        return _wrap(getattr(self._a, name)(_unwrap(other)), self._dev)
    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "and", "or", "xor", "lt", "le", "gt", "ge", "eq", "ne",
              "radd", "rsub", "rmul", "rtruediv", "rand", "ror", "rxor", "lshift", "rshift", "mod"):
    setattr(ndarray, f"__{_name}__", _binary(f"__{_name}__"))


def _inplace(name: str) -> Any:
    def op(self: ndarray, other: Any) -> ndarray:
        getattr(self._a, name)(_unwrap(other))  # in place, as CuPy's a *= 2 writes a's memory
        return self
    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "and", "or", "xor", "lshift", "rshift", "mod"):
    setattr(ndarray, f"__i{_name}__", _inplace(f"__i{_name}__"))
ndarray.__invert__ = lambda self: _wrap(~self._a, self._dev)
ndarray.__neg__ = lambda self: _wrap(-self._a, self._dev)
ndarray.__abs__ = lambda self: _wrap(abs(self._a), self._dev)


def empty(shape: Any, dtype: Any = float) -> ndarray:
    return ndarray(shape, dtype)


def zeros(shape: Any, dtype: Any = float) -> ndarray:
    a = ndarray(shape, dtype)
    a._a[...] = 0
    return a


def asarray(a: Any, dtype: Any = None) -> ndarray:
    if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    host = np.asarray(_unwrap(a), dtype=dtype)
    out = ndarray(host.shape, host.dtype)
    out._a[...] = host
    return out


def asnumpy(a: Any) -> np.ndarray:
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def _numpy_function(name: str) -> Any:
    fn = getattr(np, name)
    if not callable(fn) or isinstance(fn, type):
        return fn
    return lambda *a, **k: _wrap(fn(*_unwrap(a), **{n: _unwrap(v) for n, v in k.items()}))


# ---- devices, streams, runtime ------------------------------------------------------------------------

class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int, msg: str = "") -> None:
        super().__init__(f"cudaError {status}: {msg}")
        self.status = status


class CUDADriverError(RuntimeError):
    def __init__(self, status: int, msg: str = "") -> None:
        super().__init__(f"CUDA_ERROR {status}: {msg}")
        self.status = status


def _check_device(d: int) -> int:
    if not 0 <= d < len(DEVICES):
        raise CUDARuntimeError(101, f"invalid device ordinal {d}")
    return d


class _DeviceObj:
    def __init__(self, device: int | None = None) -> None:
        self.id = current() if device is None else _check_device(int(device))
        self._previous: list[int] = []

    @property
    def compute_capability(self) -> str:
        return str(DEVICES[self.id].cc)

    def __enter__(self) -> _DeviceObj:
        self._previous.append(current())
        _local.device = self.id
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.device = self._previous.pop()

    def use(self) -> None:
        _local.device = self.id

    def synchronize(self) -> None:
        pass  # launches run to completion before they return


class Stream:
    def __init__(self, ptr: int = 0, device: int | None = None) -> None:
        self.ptr, self.device_id = ptr, current() if device is None else device

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def get_current_stream(device: int | None = None) -> Stream:
    return Stream(0, device)


def _runtime_module() -> types.ModuleType:
    rt = types.ModuleType("cupy.cuda.runtime")
    rt.CUDARuntimeError = CUDARuntimeError
    rt.getDevice = current
    rt.setDevice = lambda d: setattr(_local, "device", _check_device(int(d)))
    rt.getDeviceCount = lambda: len(DEVICES)
    rt.getDeviceProperties = lambda d: {
        "name": f"fp8core emulated sm_{DEVICES[_check_device(d)].cc}".encode(),
        "multiProcessorCount": DEVICES[d].sms, "major": DEVICES[d].cc // 10, "minor": DEVICES[d].cc % 10,
        "totalGlobalMem": 1 << 34}
    rt.memsetAsync = lambda ptr, value, size, stream: ctypes.memset(ptr, value, size)
    rt.memcpyAsync = lambda dst, src, size, kind, stream: ctypes.memmove(dst, src, size)
    rt.streamIsCapturing = lambda stream: int(state.capturing)
    rt.driverGetVersion = lambda: 13000
    rt.runtimeGetVersion = lambda: 13000
    return rt


# ---- modules and launches -----------------------------------------------------------------------------

class _Function:
    def __init__(self, lib: ctypes.CDLL, index: int, name: str, device: int) -> None:
        self.lib, self.index, self.name, self.device = lib, index, name, device
        self.ptr = id(self)
        _functions[self.ptr] = self


_functions: dict[int, _Function] = {}


class _RawKernel:
    def __init__(self, kernel: _Function) -> None:
        self.kernel = kernel


class CompileException(Exception):
    pass


class RawModule:
    """cupy.RawModule: the source fp8core's loader passes, compiled by the host compiler for the current device."""

    def __init__(self, code: str, backend: str = "nvrtc", options: tuple = (), name_expressions: tuple = ()) -> None:
        self.code, self.options, self.names = code, tuple(options), tuple(name_expressions)
        self.lib: ctypes.CDLL | None = None
        self.device = -1

    def compile(self) -> None:
        self.device = current()
        include = [Path(o[2:]) for o in self.options if o.startswith("-I")]
        headers = {p.name: p.read_text() for d in include for p in sorted(d.glob("*.cuh"))}
        filename = next((p.name for d in include for p in sorted(d.glob("*.cu")) if p.read_text() == self.code),
                        "module.cu")
        try:
            # CuPy appends -ftz=true to every NVRTC compile (DESIGN.md): so does the stand-in
            options = tuple(o for o in self.options if not o.startswith("-I")) + ("-ftz=true",)
            path = build.build_module(self.code, headers, options, DEVICES[self.device].cc, self.names, filename)
        except RuntimeError as e:
            raise CompileException(str(e)) from None
        self.lib = ctypes.CDLL(str(path))
        self.lib.fp8emu_name.restype = ctypes.c_char_p
        self.lib.fp8emu_launch.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                           ctypes.c_void_p, ctypes.c_int, ctypes.c_double, ctypes.c_ulonglong,
                                           ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_char_p, ctypes.c_int]
        self.index = {self.lib.fp8emu_name(k).decode(): k for k in range(self.lib.fp8emu_count())}

    def get_function(self, name: str) -> _RawKernel:
        if self.lib is None:
            self.compile()
        if name not in self.index:
            raise KeyError(f"{name} is not one of the module's name expressions")
        return _RawKernel(_Function(self.lib, self.index[name], name, self.device))


def param_layout(fn: _Function) -> list[tuple[int, int]]:
    """(offset, size) of each parameter of the kernel, as its C++ signature lays them out."""
    sizes, offsets = (ctypes.c_size_t * 32)(), (ctypes.c_size_t * 32)()
    n = fn.lib.fp8emu_params(fn.index, sizes, offsets)
    return [(offsets[j], sizes[j]) for j in range(n)]


def launch_seed(seed: int, k: int) -> int:
    """The thread-order seed of the k-th launch under ``seed`` (never 0, which means the fixed orders)."""
    return ((seed * 0x9E3779B97F4A7C15 + k) & (2 ** 64 - 1)) or 1


def set_seed(seed: int) -> None:
    """Seeded random thread orders from the next launch on (0: the two fixed orders)."""
    state.seed, state.seeded_launches = seed, 0


def _launch(f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shmem: int, stream: int, params: int,
            cooperative: bool) -> None:
    fn = _functions[f]
    dev = DEVICES[fn.device]
    if current() != fn.device:
        raise CUDADriverError(201, f"{fn.name} was loaded on device {fn.device}, but device {current()} is current")
    if gz != 1 or bz != 1 or shmem != 0:
        raise CUDADriverError(1, "the emulator models 2-D grids and blocks without dynamic shared memory")
    resident = dev.occupancy * dev.sms
    if cooperative:
        limit = dev.cooperative_limit if dev.cooperative_limit is not None else resident
        if gx * gy > limit:
            raise CUDADriverError(720, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE")
        resident = gx * gy  # every block of a cooperative launch is resident
    if state.resident is not None:
        resident, state.resident = state.resident, None
    window, state.block_window = state.block_window, None
    state.launches.append(LaunchRecord(fn.name, fn.device, (gx, gy), (bx, by), cooperative))
    err = ctypes.create_string_buffer(1024)
    first, last = window if window is not None else (0, 1 << 62)
    seed = 0
    if state.seed:
        seed = launch_seed(state.seed, state.seeded_launches)
        state.seeded_launches += 1
    rc = fn.lib.fp8emu_launch(fn.index, gx, gy, bx, by, params, resident, TIMEOUT_S, first, last, seed, err,
                              len(err))
    if rc:
        raise CUDADriverError(700 if rc == 2 else 1, f"{fn.name}: {err.value.decode()}")


def _driver_module() -> types.ModuleType:
    drv = types.ModuleType("cupy_backends.cuda.api.driver")
    drv.CUDADriverError = CUDADriverError
    drv.launchKernel = lambda f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra: _launch(
        f, gx, gy, gz, bx, by, bz, shmem, stream, params, False)
    drv.launchCooperativeKernel = lambda f, gx, gy, gz, bx, by, bz, shmem, stream, params: _launch(
        f, gx, gy, gz, bx, by, bz, shmem, stream, params, True)
    drv.occupancyMaxActiveBlocksPerMultiprocessor = lambda f, threads, shmem: DEVICES[_functions[f].device].occupancy
    return drv


# ---- installing the stand-ins -------------------------------------------------------------------------

def install() -> None:
    """Register the stand-ins as ``cupy`` and ``cupy_backends`` (before anything imports fp8core)."""
    if "fp8core" in sys.modules:
        raise RuntimeError("install() must run before fp8core is imported")
    cupy = types.ModuleType("cupy")
    for name, obj in (("ndarray", ndarray), ("empty", empty), ("zeros", zeros), ("asarray", asarray),
                      ("asnumpy", asnumpy), ("RawModule", RawModule)):
        setattr(cupy, name, obj)
    ndarray.__module__ = "cupy"
    cupy.__getattr__ = _numpy_function  # isfinite, where, float32, ... over the arrays' host memory
    cuda = types.ModuleType("cupy.cuda")
    cuda.Device, cuda.Stream, cuda.ExternalStream = _DeviceObj, Stream, Stream
    cuda.get_current_stream, cuda.MemoryPointer = get_current_stream, MemoryPointer
    cuda.runtime = _runtime_module()
    cuda.nvrtc = types.ModuleType("cupy.cuda.nvrtc")
    cuda.nvrtc.getVersion = lambda: (13, 0)
    cuda.compiler = types.ModuleType("cupy.cuda.compiler")
    cuda.compiler.CompileException = CompileException
    cupy.cuda = cuda
    backends = types.ModuleType("cupy_backends")
    backends.cuda = types.ModuleType("cupy_backends.cuda")
    backends.cuda.api = types.ModuleType("cupy_backends.cuda.api")
    backends.cuda.api.driver = _driver_module()
    backends.cuda.api.runtime = cuda.runtime
    # cuBLASLt is a library of the real GPU stack: the emulator runs cuda/'s kernels only, so the GEMM reports
    # itself unavailable (as without nvmath-python) instead of reaching for a driver.
    sys.modules["nvmath"] = None
    for mod in (cupy, cuda, cuda.runtime, cuda.nvrtc, cuda.compiler, backends, backends.cuda, backends.cuda.api,
                backends.cuda.api.driver):
        sys.modules[mod.__name__] = mod
