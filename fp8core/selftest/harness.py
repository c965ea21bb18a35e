"""What every check is written against: the device under test (``Target``), the recorder of cases, the
registry of checks, and the inputs they share."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import ml_dtypes
import numpy as np

from fp8core._views import Tensor, storage_dtype
from fp8core.formats import ENCODINGS, dtype_name

FORMATS = tuple(ENCODINGS)  # every fp8 format
BF16, F16 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
HIGH = (np.dtype(np.float32), BF16, F16)
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
ORACLE_MAX = 1 << 17  # elements: the per-element oracle is slow; larger inputs compare with the reference only


# ---- the device under test ---------------------------------------------------------------------------------

class Target:
    """Where the checked calls run. ``put`` places a host array (logical dtype) there, ``offset`` elements
    past an aligned start (a misaligned view); ``bits`` brings any result back as flat unsigned bits;
    ``dut()``/``ref()`` wrap the calls under test and the reference calls."""

    name = ""
    backend_name = ""
    in_dut = False  # the coverage counts calls made under dut() only

    @contextlib.contextmanager
    def dut(self) -> Iterator[None]:
        self.in_dut = True
        try:
            with self._dut_paths():
                yield
        finally:
            self.in_dut = False

    def _dut_paths(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def put(self, x: np.ndarray, offset: int = 0) -> Any:
        raise NotImplementedError

    def bits(self, a: Any) -> np.ndarray:
        if isinstance(a, Tensor):
            a = a.data
        if not isinstance(a, np.ndarray):
            a = a.get()
        a = np.ascontiguousarray(a)
        return a.view(UINT[a.dtype.itemsize]).reshape(-1)

    def ref(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def sync(self) -> None:
        pass

    def state_device(self) -> str:
        raise NotImplementedError


class CudaTarget(Target):
    backend_name = "cuda"

    def __init__(self, device_id: int) -> None:
        import cupy

        self.cp, self.id = cupy, device_id
        props = cupy.cuda.runtime.getDeviceProperties(device_id)
        gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        cc = cupy.cuda.Device(device_id).compute_capability
        self.cc = int(cc)
        self.name = f"cuda:{device_id} ({gpu}, sm_{cc})"

    def put(self, x: np.ndarray, offset: int = 0) -> Any:
        name = dtype_name(x.dtype)
        host = np.ascontiguousarray(x).view(storage_dtype(name))
        with self.cp.cuda.Device(self.id):
            base = self.cp.empty(x.size + offset, dtype=host.dtype)
            base[offset:] = self.cp.asarray(host.reshape(-1))
            arr = base[offset:].reshape(x.shape)
        # bf16 and fp8 have no CuPy dtype: a Tensor names the logical dtype of the storage array
        return Tensor(arr, name, ("cuda", self.id), "cupy") if storage_dtype(name) != x.dtype else arr

    def sync(self) -> None:
        self.cp.cuda.Device(self.id).synchronize()

    def state_device(self) -> str:
        return f"cuda:{self.id}"


@contextlib.contextmanager
def _cpu_paths(table_min: int, chunk: int) -> Iterator[None]:
    from fp8core.backends import cpu, cpu_blocks

    saved = cpu.TABLE_MIN, cpu.CHUNK, cpu_blocks.TABLE_MIN
    cpu.TABLE_MIN, cpu.CHUNK, cpu_blocks.TABLE_MIN = table_min, chunk, table_min
    try:
        yield
    finally:
        cpu.TABLE_MIN, cpu.CHUNK, cpu_blocks.TABLE_MIN = saved


class CpuTarget(Target):
    """The CPU backend under test: 16-bit quantize always by table, in odd-sized chunks over the thread pool;
    the reference runs the direct, unchunked path."""

    backend_name = "cpu"
    name = "cpu (table and chunked paths vs direct, unchunked paths and the oracle)"

    def put(self, x: np.ndarray, offset: int = 0) -> Any:
        base = np.empty(x.size + offset, dtype=x.dtype)
        base[offset:] = x.reshape(-1)
        return base[offset:].reshape(x.shape)

    def _dut_paths(self) -> contextlib.AbstractContextManager:
        return _cpu_paths(1, 4099)

    def ref(self) -> contextlib.AbstractContextManager:
        return _cpu_paths(1 << 62, 1 << 62)

    def state_device(self) -> str:
        return "cpu"


# ---- recording ---------------------------------------------------------------------------------------------

@dataclass
class CheckResult:
    name: str
    cases: int = 0
    failed: int = 0
    skipped: str = ""
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "cases": self.cases, "failed": self.failed, "skipped": self.skipped,
                "seconds": round(self.seconds, 3), "failures": self.failures}


class Recorder:
    def __init__(self, result: CheckResult, target: Target) -> None:
        self.result, self.target = result, target

    def _fail(self, text: str) -> None:
        self.result.failed += 1
        if len(self.result.failures) < 8:
            self.result.failures.append(text)

    def equal(self, label: str, expected: Any, got: Any, inputs: np.ndarray | None = None) -> bool:
        """One case: ``got`` (on the target or host) has exactly the bits of ``expected``."""
        self.result.cases += 1
        e = self.target.bits(expected)
        g = self.target.bits(got)
        if e.shape != g.shape or e.dtype != g.dtype:
            self._fail(f"{label}: got {g.size} {g.dtype} values, expected {e.size} {e.dtype}")
            return False
        bad = np.flatnonzero(e != g)
        if bad.size:
            i = int(bad[0])
            where = ""
            if inputs is not None and inputs.size == e.size:
                src = np.ascontiguousarray(inputs).reshape(-1)
                where = f" (input 0x{int(src.view(UINT[src.dtype.itemsize])[i]):x})"
            self._fail(f"{label}: {bad.size} of {e.size} differ; first at [{i}]{where}: "
                       f"expected 0x{int(e[i]):x}, got 0x{int(g[i]):x}")
            return False
        return True

    def close(self, label: str, ref: np.ndarray, got: np.ndarray, atol: Any, rtol: float) -> bool:
        """One case: ``|got - ref| <= atol + rtol |ref|`` elementwise (float64)."""
        self.result.cases += 1
        err = np.abs(got - ref)
        bad = ~(err <= atol + rtol * np.abs(ref))
        if bad.any():
            i = int(np.flatnonzero(bad.reshape(-1))[0])
            self._fail(f"{label}: {int(bad.sum())} of {ref.size} out of tolerance; first at [{i}]: expected "
                       f"{ref.reshape(-1)[i]!r}, got {got.reshape(-1)[i]!r}")
            return False
        return True

    def truth(self, label: str, ok: bool, detail: str = "") -> bool:
        self.result.cases += 1
        if not ok:
            self._fail(f"{label}: {detail}")
        return ok


@dataclass
class Check:
    name: str
    fn: Callable[[Target, Recorder, bool, np.random.Generator], None]
    needs: Callable[[Target], str] | None = None  # a reason to skip, or ""
    covers: tuple[str, ...] = ()


CHECKS: list[Check] = []


def check(name: str, needs: Callable[[Target], str] | None = None, covers: tuple[str, ...] = ()) -> Callable:
    def register(fn: Callable) -> Callable:
        CHECKS.append(Check(name, fn, needs, covers))
        return fn
    return register


# ---- inputs ------------------------------------------------------------------------------------------------

def sample(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype, specials: bool = True) -> np.ndarray:
    """Normal values over many binades, with NaN, ±inf, ±0, subnormals and huge values at the front."""
    x = (rng.standard_normal(shape) * 2.0 ** rng.uniform(-12, 12, shape)).astype(np.float32)
    flat = x.reshape(-1)
    if specials and flat.size >= 10:
        flat[:10] = [np.nan, -np.inf, np.inf, -0.0, 1e-40, -1e-42, 1e30, 448.0, -57344.0, 2.0 ** -133]
    return x.astype(dtype)


def f32(v: Any) -> np.ndarray:
    return np.array(v, np.float32).reshape(-1)


def name_of(x: Any) -> str:
    return np.dtype(x).name
