"""``fp8core selftest``: fp8core on the GPU at hand against the CPU reference, compared by bits, as a table.

Users run it on a new GPU, driver or CUDA version, like a framework's environment check. Every primitive of
the backend and every kernel instantiation of ``fp8core._kernels.KERNELS`` must be exercised: one that no
check reaches is itself a failure, so a new kernel or backend function cannot go untested silently.

``--backend cpu`` runs the same checks with the CPU backend as the device under test (CI has no GPU): the
table and chunked paths against the direct, unchunked ones, and both against the independent per-element
oracle of ``fp8core._oracle``.

Exit status: 0 every check passed; 1 a check failed (or ``--stamp`` was refused); 2 a usage error;
3 no usable GPU (one line says why; nothing was checked).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import subprocess
import sys
import threading
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

import ml_dtypes
import numpy as np

import fp8core
from fp8core import Format, _oracle
from fp8core._tensor import Tensor, logical_numpy_dtype, storage_dtype
from fp8core.extras import install_hint
from fp8core.formats import dtype_name

__all__ = ["run", "main", "configure_parser", "stamp_record", "versions", "commit_of_checkout", "EXIT_PASS",
           "EXIT_FAIL", "EXIT_USAGE", "EXIT_NO_GPU"]

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3
TABLE_COLUMNS = 100  # the widest line of the table: a terminal's or a log's
EPILOG = """exit status:
  0  every check passed
  1  a check failed, or --stamp was refused (something failed or was skipped)
  2  usage error
  3  no usable GPU (use --backend cpu for the CPU self-consistency check)"""

FORMATS = (Format.E4M3, Format.E5M2)
HIGH = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# Functions of a backend module that are plumbing, not primitives.
_NOT_PRIMITIVES = {"launch_stream", "scale_value", "pow2_floor", "roll"}


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
        return a.view(_UINT[a.dtype.itemsize]).reshape(-1)

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
        self.gpu, self.cc = gpu, int(cc)
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
    from .backends import cpu, cpu_blocks

    saved = cpu._TABLE_MIN, cpu._CHUNK, cpu_blocks.TABLE_MIN
    cpu._TABLE_MIN, cpu._CHUNK, cpu_blocks.TABLE_MIN = table_min, chunk, table_min
    try:
        yield
    finally:
        cpu._TABLE_MIN, cpu._CHUNK, cpu_blocks.TABLE_MIN = saved


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
                where = f" (input 0x{int(src.view(_UINT[src.dtype.itemsize])[i]):x})"
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

def _patterns(dtype: np.dtype) -> np.ndarray:
    return np.arange(65536, dtype=np.uint16).view(dtype)


def _data(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype, specials: bool = True) -> np.ndarray:
    """Normal values over many binades, with NaN, ±inf, ±0, subnormals and huge values at the front."""
    x = (rng.standard_normal(shape) * 2.0 ** rng.uniform(-12, 12, shape)).astype(np.float32)
    flat = x.reshape(-1)
    if specials and flat.size >= 10:
        flat[:10] = [np.nan, -np.inf, np.inf, -0.0, 1e-40, -1e-42, 1e30, 448.0, -57344.0, 2.0 ** -133]
    return x.astype(dtype)


def _f32(v: Any) -> np.ndarray:
    return np.array(v, np.float32).reshape(-1)


# Scales: ordinary, odd, tiny (products go subnormal), fp32-subnormal, huge (everything saturates), FLT_MAX.
SCALES = (1.0, 3.0, 0.7, 2.0 ** -20, 2.0 ** -140, 2.0 ** 20, 3.0e38)
QUICK_SCALES = (1.0, 3.0, 2.0 ** -140, 3.0e38)
ODD_SHAPES = ((1,), (7,), (33,), (31, 33), (4097,), (3, 5, 7), (1, 65537), (257, 129))
EMPTY_SHAPES = ((0,), (0, 8), (8, 0))
_ORACLE_MAX = 1 << 17  # elements: the per-element oracle is slow; larger inputs compare with the reference only


def _name(x: Any) -> str:
    return np.dtype(x).name


# ---- the checks --------------------------------------------------------------------------------------------

@check("quantize: all 65,536 bf16 and fp16 patterns", covers=("quantize",))
def _all_patterns(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    for dtype in (BF16, F16):
        x = _patterns(dtype)
        xd = t.put(x)
        for fmt in FORMATS:
            for scale in (QUICK_SCALES if quick else SCALES):
                label = f"{_name(dtype)} -> {fmt.name}, scale {scale:g}"
                with t.ref():
                    slot_ref = _f32([0.0])
                    ref = fp8core.quantize(x, scale, fmt, amax_out=slot_ref)
                r.equal(f"{label} vs oracle", _oracle.quantize_bits(x.astype(np.float32), scale, fmt.value),
                        ref, x)
                slot = t.put(_f32([0.0]))
                with t.dut():
                    got = fp8core.quantize(xd, t.put(_f32([scale])), fmt, amax_out=slot)
                r.equal(label, ref, got, x)
                r.equal(f"{label} fused amax", slot_ref, slot)


@check("quantize: float32 bit patterns", covers=("quantize",))
def _f32_patterns(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    n = 1 << (16 if quick else 20)
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    specials = [0x0, 0x80000000, 0x1, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF, 0x7F7FFFFF,
                0x43E00000, 0x43E80000, 0x43F00000, 0x3B000000, 0x3A800000, 0x47600000, 0x47700000]
    bits[:len(specials)] = specials
    x = bits.view(np.float32)
    xd = t.put(x)
    for fmt in FORMATS:
        for scale in (1.0, 2.0 ** -20, 2.0 ** 20):
            with t.ref():
                ref = fp8core.quantize(x, scale, fmt)
            r.equal(f"float32 -> {fmt.name}, scale {scale:g} vs oracle",
                    _oracle.quantize_bits(x, scale, fmt.value), ref, x)
            with t.dut():
                got = fp8core.quantize(xd, scale, fmt)
            r.equal(f"float32 -> {fmt.name}, scale {scale:g}", ref, got, x)


@check("amax and quantize: odd shapes, misaligned views, empty tensors", covers=("amax", "quantize"))
def _shapes(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    shapes = ODD_SHAPES[:5] if quick else ODD_SHAPES
    for dtype in HIGH:
        for shape in shapes + EMPTY_SHAPES:
            for offset in (0, 1, 3):
                x = _data(rng, shape, dtype)
                xd = t.put(x, offset)
                label = f"{_name(dtype)} {shape} +{offset}"
                with t.ref():
                    a_ref = fp8core.amax(x)
                with t.dut():
                    r.equal(f"amax {label}", a_ref, fp8core.amax(xd))
                for fmt in FORMATS:
                    with t.ref():
                        slot_ref = _f32([0.5])  # accumulates: max(0.5, amax)
                        ref = fp8core.quantize(x, 0.75, fmt, amax_out=slot_ref)
                    slot = t.put(_f32([0.5]))
                    with t.dut():
                        got = fp8core.quantize(xd, t.put(_f32([0.75])), fmt, amax_out=slot)
                    r.equal(f"quantize {label} -> {fmt.name}", ref, got, x)
                    r.equal(f"quantize {label} -> {fmt.name} fused amax", slot_ref, slot)
    n = 1 << (18 if quick else 22)  # large enough for the table path and many blocks
    for dtype in HIGH:
        x = _data(rng, (n,), dtype)
        with t.ref():
            ref, a_ref = fp8core.quantize(x, 2.0, Format.E4M3), fp8core.amax(x)
        xd = t.put(x, 1)
        with t.dut():
            r.equal(f"quantize {_name(dtype)} ({n},) +1", ref, fp8core.quantize(xd, 2.0, Format.E4M3), x)
            r.equal(f"amax {_name(dtype)} ({n},) +1", a_ref, fp8core.amax(xd))
    for dtype in HIGH:  # amax of all-NaN-free data whose max is a subnormal, and of -0 only
        for values in ([1e-45, -1e-44, 0.0], [-0.0, -0.0]):
            x = np.array(values, np.float32).astype(dtype)
            with t.ref():
                a_ref = fp8core.amax(x)
            with t.dut():
                r.equal(f"amax {_name(dtype)} {values}", a_ref, fp8core.amax(t.put(x)))


def _dequantize_oracle(codes: np.ndarray, fmt: Format, scale_inv: float, out: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        y = (_oracle.decode(fmt.value)[codes].astype(np.float32) * np.float32(scale_inv)).astype(np.float32)
        o = y.astype(logical_numpy_dtype(out))
    o.view(_UINT[o.dtype.itemsize])[np.isnan(y)] = 0x7FFFFFFF if out == "float32" else 0x7FFF
    return o


@check("dequantize: every code to every output dtype", covers=("dequantize",))
def _dequantize(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    codes = np.arange(256, dtype=np.uint8)
    for fmt in FORMATS:
        q = codes.view(fmt.numpy_dtype)
        for out in ("float32", "bfloat16", "float16"):
            for scale_inv in (1.0, 3.0, 2.0 ** -10, 2.0 ** -130, 2.0 ** 100):
                label = f"{fmt.name} -> {out}, scale_inv {scale_inv:g}"
                with t.ref():
                    ref = fp8core.dequantize(q, scale_inv, out)
                r.equal(f"{label} vs oracle", _dequantize_oracle(codes, fmt, scale_inv, out), ref, codes)
                with t.dut():
                    r.equal(label, ref, fp8core.dequantize(t.put(q), t.put(_f32([scale_inv])), out), codes)
        for shape in ((7,), (31, 33), (4097,)) + EMPTY_SHAPES:
            for offset in (0, 1):
                q = rng.integers(0, 256, shape, dtype=np.uint8).view(fmt.numpy_dtype)
                with t.ref():
                    ref = fp8core.dequantize(q, 0.5, "bfloat16")
                with t.dut():
                    r.equal(f"{fmt.name} {shape} +{offset} -> bfloat16", ref,
                            fp8core.dequantize(t.put(q, offset), 0.5, "bfloat16"))


@check("transpose and cast_transpose: odd shapes, misaligned, empty", covers=("transpose", "cast_transpose"))
def _transposes(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    shapes = ((1, 1), (1, 65), (63, 65), (64, 64), (129, 257), (4097, 3), (0, 8), (8, 0))
    if not quick:
        shapes += ((1000, 1000), (2049, 1537))
    for shape in shapes:
        for fmt in FORMATS:
            q = rng.integers(0, 256, shape, dtype=np.uint8).view(fmt.numpy_dtype)
            with t.ref():
                ref = fp8core.transpose(q)
            r.truth(f"transpose {shape} is .T", np.array_equal(ref.view(np.uint8), q.view(np.uint8).T))
            with t.dut():
                r.equal(f"transpose {fmt.name} {shape}", ref, fp8core.transpose(t.put(q, 1)))
        for dtype in HIGH:
            for fmt in FORMATS:
                x = _data(rng, shape, dtype)
                label = f"cast_transpose {_name(dtype)} {shape} -> {fmt.name}"
                with t.ref():
                    slot_ref = _f32([0.0])
                    q_ref, qt_ref = fp8core.cast_transpose(x, 0.75, fmt, amax_out=slot_ref)
                if x.size <= _ORACLE_MAX:
                    r.equal(f"{label} vs oracle", _oracle.quantize_bits(x.astype(np.float32), 0.75, fmt.value),
                            q_ref, x)
                r.truth(f"{label}: q_t is q.T", np.array_equal(qt_ref.view(np.uint8), q_ref.view(np.uint8).T))
                slot = t.put(_f32([0.0]))
                with t.dut():
                    q, qt = fp8core.cast_transpose(t.put(x, 1), t.put(_f32([0.75])), fmt, amax_out=slot)
                r.equal(label, q_ref, q, x)
                r.equal(f"{label} (q_t)", qt_ref, qt)
                r.equal(f"{label} fused amax", slot_ref, slot)


@check("quantize_dynamic: current scaling, both algorithms of the grid", covers=("quantize_dynamic",))
def _dynamic(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    sizes = (0, 1, 37, 4099, 1 << 17) + (() if quick else (1 << 22, (1 << 22) + 5))
    options = ((0, False, 0.0), (2, True, 0.0), (-3, False, 1e3))
    for dtype in HIGH:
        for n in sizes:
            for fmt in FORMATS:
                for margin, pow2, eps in options[:1] if n > _ORACLE_MAX else options:
                    x = _data(rng, (n,), dtype, specials=False)
                    if n > 9:
                        x[n // 2] = -1e4 if dtype != F16 else -6e4
                    label = f"{_name(dtype)} ({n},) {fmt.name} margin {margin} pow2 {pow2} eps {eps:g}"
                    with t.ref():
                        q_ref, si_ref, a_ref = fp8core.quantize_dynamic(x, fmt, margin=margin, power_of_2=pow2,
                                                                        epsilon=eps)
                    amax = np.abs(x.astype(np.float32)).max() if n else np.float32(0)
                    s, s_inv, _ = _oracle.scale_rule(amax, fmt.max, margin, pow2, eps)
                    r.equal(f"{label} scale_inv vs oracle", _f32([s_inv]), si_ref)
                    if n <= _ORACLE_MAX:
                        r.equal(f"{label} vs oracle", _oracle.quantize_bits(x.astype(np.float32), s, fmt.value),
                                q_ref, x)
                    with t.dut():
                        q, si, a = fp8core.quantize_dynamic(t.put(x), fmt, margin=margin, power_of_2=pow2,
                                                            epsilon=eps)
                    r.equal(label, q_ref, q, x)
                    r.equal(f"{label} scale_inv", si_ref, si)
                    r.equal(f"{label} amax", a_ref, a)
    for dtype in HIGH:  # no scale (all zeros, a NaN, an inf) gives scale 1; a reduce hook doubles amax
        for fill in (0.0, np.nan, np.inf):
            x = _data(rng, (4099,), dtype, specials=False)
            if fill == 0.0:
                x[:] = 0
            else:
                x[7] = fill
            with t.ref():
                ref = fp8core.quantize_dynamic(x, Format.E4M3)
            with t.dut():
                got = fp8core.quantize_dynamic(t.put(x), Format.E4M3)
            for part, e, g in zip(("q", "scale_inv", "amax"), ref, got):
                r.equal(f"{_name(dtype)} with {fill} ({part})", e, g)

        def double(a: Any) -> None:
            a *= 2

        x = _data(rng, (4099,), dtype, specials=False)
        with t.ref():
            ref = fp8core.quantize_dynamic(x, Format.E5M2, margin=1, reduce=double)
        with t.dut():
            got = fp8core.quantize_dynamic(t.put(x), Format.E5M2, margin=1, reduce=double)
        for part, e, g in zip(("q", "scale_inv", "amax"), ref, got):
            r.equal(f"{_name(dtype)} with reduce ({part})", e, g)


_AMAX_VALUES = np.array([0.0, -0.0, 1e-45, 1e-40, 2.0 ** -126, 1e-6, 0.5, 1.0, 3.0, 448.0, 57344.0, 1e30, 3e38,
                         np.inf, np.nan], np.float32)


@check("compute_scale: the scale rule on special amax values", covers=("compute_scale",))
def _compute_scale(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    a = _AMAX_VALUES
    for fmt in FORMATS:
        for margin, pow2, eps in ((0, False, 0.0), (1, True, 0.0), (-130, False, 0.0), (130, True, 0.0),
                                  (0, False, 1e-3)):
            for previous in (None, 2.0, "vector"):
                prev = _f32(np.arange(1, a.size + 1)) if previous == "vector" else previous
                label = f"{fmt.name} margin {margin} pow2 {pow2} eps {eps:g} previous {previous}"
                with t.ref():
                    s_ref, si_ref = fp8core.compute_scale(a, fmt, margin=margin, power_of_2=pow2, epsilon=eps,
                                                          previous=prev)
                rule = [_oracle.scale_rule(v, fmt.max, margin, pow2, eps) for v in a]
                p = np.broadcast_to(np.float32(1) if prev is None else _f32(prev), a.shape)
                with np.errstate(divide="ignore"):
                    s_or = _f32([s if ok or previous is None else p[i] for i, (s, _, ok) in enumerate(rule)])
                    si_or = _f32([si if ok or previous is None else 1 / p[i] for i, (_, si, ok) in enumerate(rule)])
                r.equal(f"{label} vs oracle (scale)", s_or, s_ref, a)
                r.equal(f"{label} vs oracle (scale_inv)", si_or, si_ref, a)
                pd = t.put(prev) if isinstance(prev, np.ndarray) else prev
                with t.dut():
                    s, si = fp8core.compute_scale(t.put(a), fmt, margin=margin, power_of_2=pow2, epsilon=eps,
                                                  previous=pd)
                r.equal(f"{label} (scale)", s_ref, s, a)
                r.equal(f"{label} (scale_inv)", si_ref, si, a)


def _history(rng: np.random.Generator, L: int, n: int) -> np.ndarray:
    H = rng.uniform(0, 100, size=(L, n)).astype(np.float32)
    H[:, ::11] *= np.float32(1e-39)  # subnormal amaxes
    H[0, ::7] = 0  # did not run this step
    H[0, 3], H[0, 5], H[0, 6] = np.nan, np.inf, 1e-45
    if L > 2:
        H[L // 2, 9] = np.nan  # a NaN deep in the history: "max" keeps the previous scale while it lasts
    return H


@check("batched update: both algorithms, did-not-run, NaN, interval, callable", covers=("update", "scale_rule"))
def _update(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    n = 300 if quick else 1000
    formats = [Format.E4M3, Format.E5M2] * (n // 2)
    for algo in ("max", "most_recent"):
        for L in ((1, 2, 31) if quick else (1, 2, 31, 1024)):
            for interval, margin, pow2 in ((1, 0, False), (2, 1, True)):
                recipe = fp8core.DelayedScaling(amax_history_len=L, amax_compute_algo=algo, interval=interval,
                                                margin=margin, power_of_2=pow2)
                H = _history(rng, L, n)
                ref = fp8core.ScalingState(n, recipe, formats)
                dut = fp8core.ScalingState(n, recipe, formats, device=t.state_device())
                ref.amax_history[...] = H
                dut.amax_history[...] = fp8core.backends.for_device(dut.device).xp.asarray(H)
                H_or, s_or, si_or = H.copy(), _f32(np.ones(n)), _f32(np.ones(n))
                maxes = _f32([f.max for f in formats])
                for step in range(3):
                    flags_or = _oracle.update(H_or, s_or, si_or, maxes, margin, algo, pow2, 0.0,
                                              step % interval == 0)
                    with t.ref():
                        ref.update()
                    with t.dut():
                        dut.update()
                    label = f"{algo} L={L} interval {interval} margin {margin} pow2 {pow2} step {step}"
                    r.equal(f"{label} vs oracle", np.concatenate([H_or.reshape(-1), s_or, si_or]), ref.buffer)
                    r.equal(f"{label} flags vs oracle", flags_or, ref.non_finite)
                    r.equal(label, ref.buffer, dut.buffer)
                    r.equal(f"{label} flags", ref.non_finite, dut.non_finite)
                    fresh = rng.uniform(0, 10, n).astype(np.float32)
                    fresh[::5] = 0
                    ref.amax_history[0] = fresh
                    dut.amax_history[0] = fp8core.backends.for_device(dut.device).xp.asarray(fresh)
                    H_or[0] = fresh
    recipe = fp8core.DelayedScaling(amax_history_len=8, amax_compute_algo=lambda h: h.max(axis=0) / 2)
    ref = fp8core.ScalingState(n, recipe)
    dut = fp8core.ScalingState(n, recipe, device=t.state_device())
    H = _history(rng, 8, n)
    ref.amax_history[...] = H
    dut.amax_history[...] = fp8core.backends.for_device(dut.device).xp.asarray(H)
    for step in range(2):
        with t.ref():
            ref.update()
        with t.dut():
            dut.update()
        r.equal(f"callable amax_compute_algo step {step}", ref.buffer, dut.buffer)


@check("multi_amax and multi_quantize: mixed dtypes, formats, empty members", covers=("multi_amax",
                                                                                      "multi_quantize"))
def _multi(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    sizes = (5, 0, 4096, 100003, 1, 65537) + (() if quick else (1 << 21,))
    for mixed in (False, True):
        dtypes = [HIGH[i % 3] if mixed else BF16 for i in range(len(sizes))]
        fmts = [FORMATS[i % 2] if mixed else Format.E4M3 for i in range(len(sizes))]
        xs = [_data(rng, (n,), d) for n, d in zip(sizes, dtypes)]
        xds = [t.put(x, i % 2) for i, x in enumerate(xs)]
        label = f"{len(xs)} tensors{' of mixed dtypes and formats' if mixed else ''}"
        start = _f32(np.linspace(0, 100, len(xs)))  # out accumulates: max(out, amax)
        with t.ref():
            out_ref = start.copy()
            fp8core.multi_amax(xs, out_ref)
            singles = np.concatenate([fp8core.amax(x) for x in xs])
        r.truth(f"multi_amax {label} is max(out, amax) of each",
                np.array_equal(out_ref.view(np.uint32), np.maximum(start.view(np.uint32), singles.view(np.uint32))))
        out = t.put(start)
        with t.dut():
            fp8core.multi_amax(xds, out)
        r.equal(f"multi_amax {label}", out_ref, out)
        scales = _f32(2.0 ** rng.integers(-8, 8, len(xs)))
        with t.ref():
            amax_ref = _f32(np.zeros(len(xs)))
            qs_ref = fp8core.multi_quantize(xs, scales, fmts, amax_out=amax_ref)
            singles = [fp8core.quantize(x, float(s), f) for x, s, f in zip(xs, scales, fmts)]
        for i, (a, b) in enumerate(zip(qs_ref, singles)):
            r.equal(f"multi_quantize {label}: tensor {i} is quantize()", b, a)
        amax_out = t.put(_f32(np.zeros(len(xs))))
        with t.dut():
            qs = fp8core.multi_quantize(xds, t.put(scales), fmts, amax_out=amax_out)
        for i, (e, g) in enumerate(zip(qs_ref, qs)):
            r.equal(f"multi_quantize {label}: tensor {i} ({sizes[i]} {_name(dtypes[i])} -> {fmts[i].name})", e, g,
                    xs[i])
        r.equal(f"multi_quantize {label} amax_out", amax_ref, amax_out)


def _gemm_unavailable(t: Target) -> str:
    if not isinstance(t, CudaTarget):
        return ""
    if t.cc < 89:
        return f"the FP8 GEMM needs compute capability 8.9+, this GPU is {t.cc // 10}.{t.cc % 10}"
    try:
        import nvmath.bindings.cublasLt  # noqa: F401
    except ImportError:
        return f"nvmath-python is not installed ({install_hint('gemm')})"
    return ""


def _codes(rng: np.random.Generator, shape: tuple[int, int], fmt: Format) -> np.ndarray:
    x = (rng.standard_normal(shape) * 2.0 ** rng.uniform(-4, 4, shape)).astype(np.float32)
    return _oracle.encode(x, fmt.value)


@check("gemm: against the CPU emulation and float64, tolerance growing with K", needs=_gemm_unavailable,
       covers=("gemm",))
def _gemm(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    pairs = ((Format.E4M3, Format.E4M3), (Format.E4M3, Format.E5M2), (Format.E5M2, Format.E4M3))
    shapes = ((1, 16, 16), (7, 32, 64), (130, 48, 1024)) + (() if quick else ((64, 128, 8192), (0, 16, 32)))
    fast_modes = (False, True) if isinstance(t, CudaTarget) else (False,)
    for m, n, k in shapes:
        for fa, fb in pairs:
            outs = ["float32", "bfloat16", "float16", "float8_e4m3fn"] + (["float8_e5m2"] if Format.E5M2 in (fa, fb)
                                                                          else [])
            ac, bc = _codes(rng, (m, k), fa), _codes(rng, (n, k), fb)
            a, b = ac.view(fa.numpy_dtype), bc.view(fb.numpy_dtype)
            sa, sb = 0.5, 0.25
            exact = _oracle.gemm_reference(ac, fa.value, bc, fb.value, sa, sb)
            for out in outs:
                fp8_out = out.startswith("float8")
                out_scale = 4.0 if fp8_out else None
                bias_dtype = "bfloat16" if out != "float16" else "float16"
                bias = (rng.standard_normal(n) * 4).astype(logical_numpy_dtype(bias_dtype)) if m % 2 else None
                ref64 = exact if bias is None else exact + bias.astype(np.float64)
                fmax = Format.E4M3.max if out == "float8_e4m3fn" else Format.E5M2.max
                want = np.clip(ref64 * out_scale, -fmax, fmax) if fp8_out else ref64
                label = f"{m}x{n}x{k} {fa.name}x{fb.name} -> {out}{' +bias' if bias is not None else ''}"
                with t.ref():
                    amax_ref = _f32([0.0]) if fp8_out else None
                    emu = fp8core.gemm(a, b, sa, sb, out_dtype=out, bias=bias, out_scale=out_scale,
                                       out_amax=amax_ref)
                emu64 = emu.astype(np.float64)
                for fast in fast_modes:
                    eps = _oracle.FAST_ACCUM_EPS if fast else 2.0 ** -23
                    atol, rtol = _oracle.gemm_tolerance(ac, fa.value, bc, fb.value, sa * sb, out,
                                                        out_scale or 1.0, accumulation_eps=eps)
                    if not fast:
                        r.close(f"{label}: emulation vs float64", want, emu64, atol, rtol)
                    label_fast = label + (" fast accum" if fast else "")
                    amax_d = t.put(_f32([0.0])) if fp8_out else None
                    bias_d = t.put(bias) if bias is not None else None
                    with t.dut():
                        got = fp8core.gemm(t.put(a), t.put(b), t.put(_f32([sa])), t.put(_f32([sb])),
                                           out_dtype=out, bias=bias_d, use_fast_accum=fast,
                                           out_scale=None if out_scale is None else t.put(_f32([out_scale])),
                                           out_amax=amax_d)
                    got64 = t.bits(got).view(logical_numpy_dtype(out)).astype(np.float64).reshape(want.shape)
                    r.close(f"{label_fast}: vs float64", want, got64, atol, rtol)
                    r.close(f"{label_fast}: vs the emulation", emu64, got64, 2 * atol, 2 * rtol)
                    if fp8_out and m:
                        got_amax = t.bits(amax_d).view(np.float32).astype(np.float64)
                        r.close(f"{label_fast}: out_amax", amax_ref.astype(np.float64), got_amax,
                                2 * atol.max() + 2.0 ** -22 * np.abs(ref64).max(), 0.0)


# ---- block scaling (fp8core.blocks): every primitive by bits, the oracle written from the contract ----------

E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
_EMAX = {Format.E4M3: 8, Format.E5M2: 15}
_MX, _FP32_BLOCK = 32, 128
BLOCK_SHAPES = ((1, 1), (3, 31), (31, 33), (33, 65), (64, 128), (130, 257), (2, 3, 40), (0, 32), (32, 0))
QUICK_BLOCK_SHAPES = ((1, 1), (3, 31), (33, 65), (130, 257), (2, 3, 40), (0, 32))


def _oracle_max(quick: bool) -> int:
    """Elements up to which an input is also checked against the oracle (a Python loop over blocks)."""
    return 1 << 12 if quick else 1 << 14


def _blocks_backend(t: Target) -> Any:
    """The block backend module under test, looked up at each call (the coverage wraps its attributes)."""
    import importlib

    return importlib.import_module(f"fp8core.backends.{t.backend_name}_blocks")


def _rows_cols(x: np.ndarray) -> np.ndarray:
    """x as the 2-D [rows, cols] fp32 view the block primitives work on (leading dims folded)."""
    return np.asarray(x, np.float32).reshape(int(np.prod(x.shape[:-1], dtype=np.int64)), x.shape[-1])


def _blocks_of(rows: int, cols: int, br: int, bc: int) -> Iterator[tuple[int, int, tuple[slice, slice]]]:
    for i in range(-(-rows // br)):
        for j in range(-(-cols // bc)):
            yield i, j, (slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))


def _block_amax(block: np.ndarray) -> float:
    a = np.abs(block)
    return float("nan") if np.isnan(a).any() else float(a.max())


def e8m0_oracle(amax: float, fmt: Format, mode: str) -> int:
    """The scale byte of one block by docs/numerics.md, in Python floats: "rceil" rounds the exponent of
    v = fp32(amax) *rn fp32(1/fp8_max) up, "floor" is OCP's floor(log2(amax)) - emax; 0..254, NaN 0xFF."""
    import math

    a = np.float32(amax)
    if np.isnan(a):
        return 0xFF
    if mode == "rceil":
        v = float(a * np.float32(1.0 / fmt.max))
        if v == 0:
            return 0
        if math.isinf(v):
            return 254
        m, ex = math.frexp(v)  # v = m 2^ex, m in [0.5, 1): log2 v rounded up is ex, or ex - 1 when m is 0.5
        e = (ex - 1 if m == 0.5 else ex) + 127
    else:
        if a == 0:
            return 0
        if np.isinf(a):
            return 254
        e = math.frexp(float(a))[1] - 1 - _EMAX[fmt] + 127
    return min(max(e, 0), 254)


def _pow2(e: int, sign: int) -> float:
    import math

    return math.nan if e == 0xFF else math.ldexp(1.0, sign * (e - 127))


def mx_oracle(x: np.ndarray, fmt: Format, mode: str, columnwise: bool) -> tuple[np.ndarray, np.ndarray]:
    """(codes [rows, cols], scale bytes) of MXFP8 by the contract, block by block."""
    f = _rows_cols(x)
    br, bc = (_MX, 1) if columnwise else (1, _MX)
    rows, cols = f.shape
    q = np.zeros(f.shape, np.uint8)
    e = np.zeros((-(-rows // br), -(-cols // bc)), np.uint8)
    for i, j, sl in _blocks_of(rows, cols, br, bc):
        e[i, j] = e8m0_oracle(_block_amax(f[sl]), fmt, mode)
        q[sl] = _oracle.quantize_bits(f[sl], _pow2(int(e[i, j]), -1), fmt.value)
    return q, e


def blockwise_oracle(x: np.ndarray, fmt: Format, br: int, power_of_2: bool, epsilon: float
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scale_inv) of 1x128 / 128x128 blocks: the per-tensor scale rule on each block's amax."""
    f = _rows_cols(x)
    rows, cols = f.shape
    q = np.zeros(f.shape, np.uint8)
    s_inv = np.zeros((-(-rows // br), -(-cols // _FP32_BLOCK)), np.float32)
    for i, j, sl in _blocks_of(rows, cols, br, _FP32_BLOCK):
        s, s_inv[i, j], _ = _oracle.scale_rule(_block_amax(f[sl]), fmt.max, 0, power_of_2, epsilon)
        q[sl] = _oracle.quantize_bits(f[sl], s, fmt.value)
    return q, s_inv


def block_dequantize_oracle(codes: np.ndarray, factors: np.ndarray, br: int, bc: int, fmt: Format,
                            out: str) -> np.ndarray:
    """ROUND_TO(out, fp32(q) *rn factor[block]) per block; factors fp32 (2^(e-127) for E8M0, NaN for 0xFF)."""
    rows, cols = codes.shape
    y = np.zeros(codes.shape, logical_numpy_dtype(out))
    for i, j, sl in _blocks_of(rows, cols, br, bc):
        y[sl] = _dequantize_oracle(codes[sl], fmt, float(factors[i, j]), out)
    return y


def _amax_case_rows(fmt: Format) -> np.ndarray:
    """One row per E8M0 rounding case (exact powers of two, one ulp either side, v subnormal and the 2^-127
    boundary, the top binade, inf, NaN, 0), each row's block amax at columns 5 and 40, a smaller value beside."""
    v127 = np.float32(2.0 ** -127) / np.float32(1.0 / fmt.max)
    cases = [0.0, 1e-45, 1e-40, 2.0 ** -126, float(v127), float(np.nextafter(v127, np.float32(1))),
             float(np.nextafter(v127, np.float32(0))), 0.75, 1.0, float(np.nextafter(np.float32(1), np.float32(2))),
             fmt.max, float(np.nextafter(np.float32(fmt.max), np.float32(0))), 2.0 ** 100, 3.0e38,
             float(np.float32(3.4028235e38)), np.inf, np.nan]
    x = np.zeros((len(cases), 64), np.float32)
    x[:, 5] = cases
    x[:, 40] = cases
    with np.errstate(all="ignore"):
        x[:, 41] = -np.float32(cases) / np.float32(3)
    return x


def _block_inputs(rng: np.random.Generator, quick: bool) -> Iterator[tuple[str, np.ndarray]]:
    shapes = QUICK_BLOCK_SHAPES if quick else BLOCK_SHAPES + ((1000, 1024),)
    for dtype in HIGH:
        for shape in shapes:
            yield f"{_name(dtype)} {shape}", _data(rng, shape, dtype)


def _put_pair(t: Target, pair: Any, offset: int = 0) -> Any:
    return type(pair)(t.put(np.asarray(pair[0]), offset), t.put(np.asarray(pair[1])))


@check("block scaling: MXFP8 rowwise, columnwise and both, rceil and floor",
       covers=("blocks.quantize_mxfp8", "blocks.quantize_mxfp8_both"))
def _mxfp8(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from . import blocks

    cases = [(f"{fmt.name} rounding cases{' (transposed)' if tr else ''}", _amax_case_rows(fmt).T.copy() if tr
              else _amax_case_rows(fmt), (fmt,)) for fmt in FORMATS for tr in (False, True)]
    cases += [(label, x, FORMATS) for label, x in _block_inputs(rng, quick)]
    for label, x, fmts in cases:
        for offset in (0, 1):  # +1: a misaligned view takes the kernels' scalar paths
            xd = t.put(x, offset)
            for fmt in fmts:
                for mode in ("rceil", "floor"):
                    name = f"{label} +{offset} {fmt.name} {mode}"
                    with t.ref():
                        refs = [blocks.quantize_mxfp8(x, fmt, scale_mode=mode, columnwise=c) for c in (False, True)]
                        both_ref = blocks.quantize_mxfp8_both(x, fmt, scale_mode=mode)
                    if offset == 0 and x.size <= _oracle_max(quick):
                        for c, ref in zip((False, True), refs):
                            q_or, e_or = mx_oracle(x, fmt, mode, c)
                            part = "columnwise" if c else "rowwise"
                            r.equal(f"{name} {part} vs oracle (data)", q_or, ref.data, x)
                            r.equal(f"{name} {part} vs oracle (scale)", e_or, ref.scale)
                    for ref, both in zip(refs, both_ref):
                        r.truth(f"{name}: both is rowwise and columnwise", np.array_equal(
                            t.bits(ref.data), t.bits(both.data)) and np.array_equal(t.bits(ref.scale),
                                                                                    t.bits(both.scale)))
                    with t.dut():
                        got = [blocks.quantize_mxfp8(xd, fmt, scale_mode=mode, columnwise=c) for c in (False, True)]
                        got_both = blocks.quantize_mxfp8_both(xd, fmt, scale_mode=mode)
                    for part, ref, g, gb in zip(("rowwise", "columnwise"), refs, got, got_both):
                        r.equal(f"{name} {part} (data)", ref.data, g.data, x)
                        r.equal(f"{name} {part} (scale)", ref.scale, g.scale)
                        r.equal(f"{name} both, {part} (data)", ref.data, gb.data, x)
                        r.equal(f"{name} both, {part} (scale)", ref.scale, gb.scale)


@check("block scaling: MXFP8 dequantize, every code and scale byte, to every output dtype",
       covers=("blocks.dequantize_mxfp8",))
def _mxfp8_dequantize(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from . import blocks

    for shape in ((64, 256), (33, 65), (1, 1), (0, 32)) + (() if quick else ((1000, 1024),)):
        for fmt in FORMATS:
            codes = rng.integers(0, 256, shape, dtype=np.uint8)
            codes.reshape(-1)[:256] = np.arange(min(256, codes.size))
            for columnwise in (False, True):
                s_shape = (-(-shape[0] // _MX), shape[1]) if columnwise else (shape[0], -(-shape[1] // _MX))
                e = rng.integers(0, 256, s_shape, dtype=np.uint8)
                e.reshape(-1)[:4] = [0, 1, 254, 0xFF][:e.size]  # 2^-127 (products go subnormal), 2^127, NaN
                t_cpu = blocks.MXTensor(codes.view(fmt.numpy_dtype), e.view(E8M0))
                for out in ("float32", "bfloat16", "float16"):
                    name = f"{shape} {fmt.name} {'columnwise' if columnwise else 'rowwise'} -> {out}"
                    with t.ref():
                        ref = blocks.dequantize_mxfp8(t_cpu, out)
                    if codes.size <= _oracle_max(quick):
                        factors = np.array([[_pow2(int(v), 1) for v in row] for row in e], np.float32)
                        br, bc = (_MX, 1) if columnwise else (1, _MX)
                        r.equal(f"{name} vs oracle", block_dequantize_oracle(codes, factors, br, bc, fmt, out), ref,
                                codes)
                    with t.dut():
                        got = blocks.dequantize_mxfp8(_put_pair(t, t_cpu, 1 if out == "float32" else 0), out)
                    r.equal(name, ref, got, codes)


@check("block scaling: 1x128 and 128x128 blocks with fp32 scales", covers=("blocks.quantize_blockwise",))
def _blockwise(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from . import blocks

    for label, x in _block_inputs(rng, quick):
        for offset in (0, 1):
            xd = t.put(x, offset)
            for block, br in (("1x128", 1), ("128x128", 128)):
                for fmt in FORMATS:
                    for pow2, eps in ((True, 0.0), (False, 0.0), (False, 1e-30)):
                        name = f"{label} +{offset} {block} {fmt.name} pow2 {pow2} eps {eps:g}"
                        with t.ref():
                            ref = blocks.quantize_blockwise(x, fmt, block=block, power_of_2=pow2, epsilon=eps)
                        if offset == 0 and x.size <= _oracle_max(quick):
                            q_or, s_or = blockwise_oracle(x, fmt, br, pow2, eps)
                            r.equal(f"{name} vs oracle (data)", q_or, ref.data, x)
                            r.equal(f"{name} vs oracle (scale_inv)", s_or, ref.scale_inv)
                        with t.dut():
                            got = blocks.quantize_blockwise(xd, fmt, block=block, power_of_2=pow2, epsilon=eps)
                        r.equal(f"{name} (data)", ref.data, got.data, x)
                        r.equal(f"{name} (scale_inv)", ref.scale_inv, got.scale_inv)


@check("block scaling: 1x128 and 128x128 dequantize, to every output dtype", covers=("blocks.dequantize_blockwise",))
def _blockwise_dequantize(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from . import blocks

    for shape in ((64, 256), (130, 257), (1, 1), (0, 128)) + (() if quick else ((1000, 1024),)):
        for fmt in FORMATS:
            codes = rng.integers(0, 256, shape, dtype=np.uint8)
            codes.reshape(-1)[:256] = np.arange(min(256, codes.size))
            for br in (1, 128):
                s_shape = (-(-shape[0] // br), -(-shape[1] // _FP32_BLOCK))
                s_inv = (2.0 ** rng.uniform(-20, 20, s_shape)).astype(np.float32)
                s_inv.reshape(-1)[:5] = [2.0 ** -140, 3.0e38, np.inf, np.nan, 0.0][:s_inv.size]
                t_cpu = blocks.BlockScaledTensor(codes.view(fmt.numpy_dtype), s_inv)
                for out in ("float32", "bfloat16", "float16"):
                    name = f"{shape} {fmt.name} {'1x128' if br == 1 else '128x128'} -> {out}"
                    with t.ref():
                        ref = blocks.dequantize_blockwise(t_cpu, out)
                    if codes.size <= _oracle_max(quick):
                        r.equal(f"{name} vs oracle",
                                block_dequantize_oracle(codes, s_inv, br, _FP32_BLOCK, fmt, out), ref, codes)
                    with t.dut():
                        got = blocks.dequantize_blockwise(_put_pair(t, t_cpu, 1 if out == "float32" else 0), out)
                    r.equal(name, ref, got, codes)


@check("block scaling: transpose_blocks (MXFP8 both ways, 128x128 tiles)",
       covers=("blocks.transpose_scale", "transpose"))
def _transpose_blocks(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from . import blocks

    for shape in ((1, 1), (1, 65), (37, 70), (64, 96), (300, 257), (0, 32)) + (() if quick else ((1000, 1024),)):
        x = _data(rng, shape, np.float32)
        with t.ref():
            pairs = [blocks.quantize_mxfp8(x, columnwise=c) for c in (False, True)]
            pairs.append(blocks.quantize_blockwise(x, block="128x128"))
            refs = [blocks.transpose_blocks(p) for p in pairs]
            direct = [blocks.quantize_mxfp8(np.ascontiguousarray(x.T), columnwise=c) for c in (True, False)]
            direct.append(blocks.quantize_blockwise(np.ascontiguousarray(x.T), block="128x128"))
        for label, ref, want in zip(("MXFP8 rowwise", "MXFP8 columnwise", "128x128"), refs, direct):
            r.equal(f"{shape} {label}: the transpose's quantization (data)", want[0], ref[0])
            r.equal(f"{shape} {label}: the transpose's quantization (scales)", want[1], ref[1])
        for label, pair, ref in zip(("MXFP8 rowwise", "MXFP8 columnwise", "128x128"), pairs, refs):
            with t.dut():
                got = blocks.transpose_blocks(_put_pair(t, pair))
            r.equal(f"{shape} {label} (data)", ref[0], got[0])
            r.equal(f"{shape} {label} (scales)", ref[1], got[1])


def gemm_scale_oracle(scale: np.ndarray, kind: str) -> np.ndarray:
    """cuBLASLt's scale layouts element by element: "1x32" 128x4 tiles of 512 bytes (byte
    (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4 of tile (r // 128, c // 4)), "1x128" [KB, rows], "128x128" rows
    padded to 4 floats."""
    rows, kgroups = scale.shape
    if kind == "1x32":
        tiles_c = -(-kgroups // 4)
        out = np.zeros(-(-rows // 128) * 128 * tiles_c * 4, np.uint8)
        for rr in range(rows):
            for c in range(kgroups):
                out[((rr // 128) * tiles_c + c // 4) * 512 + (rr % 32) * 16 + (rr % 128) // 32 * 4 + c % 4] = \
                    scale.view(np.uint8)[rr, c]
        return out
    if kind == "1x128":
        return scale.T.copy()
    out = np.zeros((rows, -(-kgroups // 4) * 4), np.float32)
    out[:, :kgroups] = scale
    return out


@check("block scaling: the scale layouts of the block-scaled GEMM (MXFP8 swizzle, 1x128, 128x128)",
       covers=("blocks.gemm_scale",))
def _gemm_scales(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from ._tensor import wrap

    for shape in ((1, 1), (128, 4), (130, 6), (256, 32), (300, 7), (0, 4)):
        for kind in ("1x32", "1x128", "128x128"):
            if kind == "1x32":
                s = rng.integers(0, 256, shape, dtype=np.uint8).view(E8M0)
            else:
                s = (2.0 ** rng.uniform(-30, 30, shape)).astype(np.float32)
            name = f"{kind} scales {shape}"
            with t.ref():
                ref = _blocks_backend(CpuTarget()).gemm_scale(wrap(s), kind)
            r.equal(f"{name} vs oracle", gemm_scale_oracle(s, kind), ref)
            with t.dut():
                got = _blocks_backend(t).gemm_scale(wrap(t.put(s)), kind)
            r.equal(name, ref, got)


def _block_gemm_refusal(t: Target, scheme: str) -> str:
    """Why this GPU refuses the scheme, as fp8core documents it ("" where it runs it)."""
    if not isinstance(t, CudaTarget):
        return ""
    if scheme == "mx":
        return "" if t.cc >= 100 else "compute capability 10.0"
    if t.cc != 90:  # cuBLASLt's 1x128/128x128 scale modes exist on Hopper only
        return "compute capability 9.0"
    from .backends import cublaslt

    return "" if int(cublaslt._lt().get_version()) >= cublaslt._MIN_BLOCK_VERSION else "cuBLAS 12.9"


def _dequantized64(pair: Any, scheme_block: str, fmt: Format) -> np.ndarray:
    """A CPU block-scaled operand as exact float64 values (codes decoded, times their block's factor)."""
    codes = np.asarray(pair[0]).view(np.uint8)
    v = _oracle.decode(fmt.value)[codes]
    if scheme_block == "1x32":
        f = np.array([[_pow2(int(e), 1) for e in row] for row in np.asarray(pair[1]).view(np.uint8)])
        return v * np.repeat(f, _MX, axis=1)[:, :codes.shape[1]]
    f = np.asarray(pair[1], np.float64)
    rows = np.repeat(f, _FP32_BLOCK if scheme_block == "128x128" else 1, axis=0)[:codes.shape[0]]
    return v * np.repeat(rows, _FP32_BLOCK, axis=1)[:, :codes.shape[1]]


@check("block gemm: MXFP8 and 1x128/128x128 against the emulation and float64, tolerance growing with K",
       needs=_gemm_unavailable)
def _block_gemm(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from . import blocks

    schemes = (("mx", "1x32", "1x32"), ("1x128,1x128", "1x128", "1x128"), ("1x128,128x128", "1x128", "128x128"),
               ("128x128,1x128", "128x128", "1x128"))
    shapes = ((16, 16, 128), (130, 48, 256)) + (() if quick else ((256, 512, 4096),))
    for scheme, a_block, b_block in schemes:
        refusal = _block_gemm_refusal(t, scheme)
        for m, n, k in shapes:
            x = (rng.standard_normal((m, k)) * 2.0 ** rng.uniform(-6, 6, (m, k))).astype(np.float32)
            w = (rng.standard_normal((n, k)) * 2.0 ** rng.uniform(-6, 6, (n, 1))).astype(np.float32)
            fa, fb = Format.E4M3, (Format.E5M2 if m % 2 else Format.E4M3)
            with t.ref():
                if scheme == "mx":
                    a, b = blocks.quantize_mxfp8(x, fa), blocks.quantize_mxfp8(w, fb)
                else:
                    a = blocks.quantize_blockwise(x, fa, block=a_block, power_of_2=False)
                    b = blocks.quantize_blockwise(w, fb, block=b_block, power_of_2=False)
            a64, b64 = _dequantized64(a, a_block, fa), _dequantized64(b, b_block, fb)
            exact = a64 @ b64.T
            absprod = np.abs(a64) @ np.abs(b64).T
            for out in ("float32", "bfloat16"):
                label = f"{scheme} {m}x{n}x{k} {fa.name}x{fb.name} -> {out}"
                rtol, step = _oracle.OUT_ROUNDING[out]
                atol = k * 2.0 ** -23 * absprod + step
                with t.ref():
                    emu = fp8core.gemm(a, b, out_dtype=out)
                emu64 = np.asarray(emu).astype(np.float64)
                r.close(f"{label}: emulation vs float64", exact, emu64, atol, rtol)
                if refusal:
                    try:
                        with t.dut():
                            fp8core.gemm(_put_pair(t, a), _put_pair(t, b), out_dtype=out)
                        r.truth(f"{label}: refused on {t.name}", False, f"ran; fp8core says it needs {refusal}")
                    except ValueError as e:
                        r.truth(f"{label}: refused on {t.name} (needs {refusal})", refusal in str(e), str(e))
                    continue
                with t.dut():
                    got = fp8core.gemm(_put_pair(t, a), _put_pair(t, b), out_dtype=out)
                got64 = t.bits(got).view(logical_numpy_dtype(out)).astype(np.float64).reshape(exact.shape)
                r.close(f"{label}: vs float64", exact, got64, atol, rtol)
                r.close(f"{label}: vs the emulation", emu64, got64, 2 * atol, 2 * rtol)


# ---- coverage: every backend function and every kernel instantiation must have run -------------------------

def backend_pairs() -> list[tuple[str, Any, Any]]:
    """(prefix, CPU module, CUDA module) of every backend pair: cpu/cuda, and cpu_X/cuda_X for any X added."""
    import importlib
    import pkgutil

    from . import backends

    names = {m.name for m in pkgutil.iter_modules(backends.__path__)}
    pairs = [("", "cpu", "cuda")] + [(f"{n[5:]}.", f"cpu_{n[5:]}", n) for n in sorted(names)
                                     if n.startswith("cuda_") and f"cpu_{n[5:]}" in names]
    return [(prefix, importlib.import_module(f"{backends.__name__}.{c}"),
             importlib.import_module(f"{backends.__name__}.{g}")) for prefix, c, g in pairs]


def _public(mod: Any) -> set[str]:
    import inspect

    return {n for n, f in vars(mod).items() if inspect.isfunction(f) and f.__module__ == mod.__name__
            and not n.startswith("_")} - _NOT_PRIMITIVES


def backend_functions() -> list[str]:
    """The primitives every backend implements: public functions defined in both modules of a backend pair
    (``name`` for cpu/cuda, ``X.name`` for cpu_X/cuda_X)."""
    return sorted(prefix + n for prefix, c, g in backend_pairs() for n in _public(c) & _public(g))


class _Coverage:
    """Records which backend functions (outermost calls under dut() only) and which kernels the checks reached.

    The functions are wrapped where callers look them up (module attributes), and ``get_function`` wherever a
    backend module holds it, so a kernel launched through any backend is seen.
    """

    def __init__(self, target: Target) -> None:
        self.cuda = target.backend_name == "cuda"
        self.target = target
        self.functions: set[str] = set()
        self.kernels: set[tuple[str, str]] = set()
        self._depth = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0 and self.target.in_dut:
                self.functions.add(name)
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth
        return recorded

    def _patch(self, module: Any, attr: str, value: Any) -> None:
        self._saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, value)

    def __enter__(self) -> "_Coverage":
        from . import _kernels

        for prefix, cpu_mod, cuda_mod in backend_pairs():
            module = cuda_mod if self.cuda else cpu_mod
            for name in _public(cpu_mod) & _public(cuda_mod):
                self._patch(module, name, self._wrap(prefix + name, getattr(module, name)))
        if self.cuda:
            get_function = _kernels.get_function

            def recorded(filename: str, expr: str, device_id: int) -> Any:
                self.kernels.add((filename, expr))
                return get_function(filename, expr, device_id)

            holders = [_kernels] + [m for _, _, m in backend_pairs() if getattr(m, "get_function", None) is get_function]
            for holder in holders:
                self._patch(holder, "get_function", recorded)
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, attr, value in reversed(self._saved):
            setattr(module, attr, value)
        self._saved.clear()

    def missing_kernels(self) -> list[str]:
        from ._kernels import KERNELS

        return [f"{f}: {e}" for f, exprs in KERNELS.items() for e in exprs if (f, e) not in self.kernels]


# ---- running and reporting ---------------------------------------------------------------------------------

def _gpu_reason(device_id: int) -> str | None:
    """None, or why there is nothing to check, in the words ``fp8core info`` uses (no cupy, no driver...)."""
    from .cli import gpu_unavailable_reason

    why = gpu_unavailable_reason()
    if why is not None:
        return why
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
    if not 0 <= device_id < n:
        return f"--device {device_id}: there are {n} CUDA devices (0..{n - 1})"
    return None


@dataclass
class Report:
    target: str
    backend: str
    quick: bool
    checks: list[CheckResult]
    seconds: float
    device_id: int = 0

    @property
    def cases(self) -> int:
        return sum(c.cases for c in self.checks)

    @property
    def failed(self) -> int:
        return sum(c.failed for c in self.checks)

    @property
    def skipped(self) -> list[CheckResult]:
        return [c for c in self.checks if c.skipped]

    @property
    def ok(self) -> bool:
        return self.failed == 0

    def verdict(self) -> str:
        head = "PASS" if self.ok else "FAIL"
        text = f"{head}: {self.cases - self.failed} of {self.cases} cases passed on {self.target} " \
               f"in {self.seconds:.1f} s"
        if self.skipped:
            text += f"; {len(self.skipped)} check(s) skipped"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target, "backend": self.backend, "quick": self.quick, "cases": self.cases,
                "passed": self.cases - self.failed, "failed": self.failed, "skipped": len(self.skipped),
                "ok": self.ok, "seconds": round(self.seconds, 2), "verdict": self.verdict(),
                "checks": [c.as_dict() for c in self.checks]}

    def table(self, columns: int = TABLE_COLUMNS) -> str:
        """The report for a terminal, every line at most ``columns`` wide: long check names and reasons wrap."""
        figures = 2 + 6 + 1 + 6 + 1 + 8 + 2 + len("skipped")  # the columns right of the name
        width = max(20, min(max(len(c.name) for c in self.checks), columns - figures))
        wrap = functools.partial(textwrap.wrap, width=columns, subsequent_indent="    ", break_on_hyphens=False)
        lines = wrap(f"fp8core {fp8core.__version__} selftest on {self.target}") + [""]
        lines.append(f"{'check':<{width}}  {'cases':>6} {'failed':>6} {'seconds':>8}  result")
        lines.append("-" * len(lines[-1]))
        for c in self.checks:
            result = "skipped" if c.skipped else ("ok" if not c.failed else "FAILED")
            name = textwrap.wrap(c.name, width=width, subsequent_indent="  ", break_on_hyphens=False)
            lines.append(f"{name[0]:<{width}}  {c.cases:>6} {c.failed:>6} {c.seconds:>8.2f}  {result}")
            lines += name[1:]
            if c.skipped:
                lines += wrap(f"  skipped: {c.skipped}")
        for c in self.checks:
            for f in c.failures:
                lines += wrap(f"  {c.name}: {f}")
        lines += [""] + wrap(self.verdict())
        return "\n".join(lines)


def run(backend: str = "cuda", quick: bool = False, device_id: int = 0, seed: int = 0,
        progress: Callable[[str], None] | None = None) -> Report:
    """Run every check on ``backend`` ("cuda" or "cpu") and return the report. Raises RuntimeError when
    ``backend`` is "cuda" and no usable GPU is found (the message says why)."""
    if backend == "cuda":
        reason = _gpu_reason(device_id)
        if reason:
            raise RuntimeError(reason)
        target: Target = CudaTarget(device_id)
    elif backend == "cpu":
        target = CpuTarget()
    else:
        raise ValueError(f"backend: expected 'cuda' or 'cpu', got {backend!r}")
    rng = np.random.default_rng(seed)
    results: list[CheckResult] = []
    start = time.perf_counter()
    ctx = target.cp.cuda.Device(device_id) if isinstance(target, CudaTarget) else contextlib.nullcontext()
    with _Coverage(target) as cov, ctx:
        skipped_covers: set[str] = set()
        for c in CHECKS:
            res = CheckResult(c.name)
            results.append(res)
            if progress:
                progress(c.name)
            res.skipped = c.needs(target) if c.needs else ""
            if res.skipped:
                skipped_covers.update(c.covers)
                continue
            t0 = time.perf_counter()
            rec = Recorder(res, target)
            try:
                with np.errstate(all="ignore"):
                    c.fn(target, rec, quick, rng)
                target.sync()
            except Exception as e:  # a crash is a failed case, reported in one line with where it happened
                frame = traceback.extract_tb(e.__traceback__)[-1]
                rec.truth("raised", False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                                           f"({Path(frame.filename).name}:{frame.lineno})")
            res.seconds = time.perf_counter() - t0
    cover = CheckResult("coverage: every backend function and kernel instantiation ran")
    missing = [f for f in backend_functions() if f not in cov.functions and f not in skipped_covers]
    for f in missing:
        cover.cases += 1
        cover.failed += 1
        cover.failures.append(f"backend function {f} was never called by any check")
    cover.cases += len(backend_functions()) - len(missing)
    if cov.cuda:
        from ._kernels import KERNELS

        lost = cov.missing_kernels()
        cover.cases += sum(len(v) for v in KERNELS.values())
        cover.failed += len(lost)
        cover.failures += [f"kernel {k} was never launched by any check" for k in lost][:8]
    results.append(cover)
    return Report(target.name, target.backend_name, quick, results, time.perf_counter() - start, device_id)


def commit_of_checkout() -> str | None:
    root = Path(fp8core.__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, Any]:
    """Versions of what the kernels ran on, without importing the frameworks."""
    v: dict[str, Any] = {"fp8core": fp8core.__version__, "python": sys.version.split()[0],
                         "numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__,
                         "cupy": _dist_version("cupy-cuda13x", "cupy-cuda12x", "cupy"),
                         "torch": _dist_version("torch"), "jax": _dist_version("jax"),
                         "jaxlib": _dist_version("jaxlib"), "nvmath-python": _dist_version("nvmath-python"),
                         "torchao": _dist_version("torchao")}
    try:
        import cupy

        v["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        v["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
        v["nvrtc"] = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
    except Exception:
        v["cuda_runtime"] = v["cuda_driver"] = v["nvrtc"] = None
    return v


def stamp_record(report: Report) -> dict[str, Any]:
    """The GPU-verified stamp (shared/GPU.md) for a report that passed on a GPU."""
    from ._kernels import cuda_sha256

    return {"cuda_sha256": cuda_sha256(), "commit": commit_of_checkout(), "device": report.target,
            "passed": report.cases - report.failed, "failed": report.failed, "versions": versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "by": "fp8core selftest" + (" --quick" if report.quick else "")}


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0].replace("``", "")
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--quick", action="store_true", help="fewer scales and sizes (seconds instead of a minute)")
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    p.add_argument("--stamp", metavar="FILE", help="write the GPU-verified stamp JSON to FILE, only when every "
                   "check ran and passed on a GPU")
    p.add_argument("--device", type=int, default=0, metavar="N", help="CUDA device ordinal (default 0)")
    p.add_argument("--backend", choices=["cuda", "cpu"], default="cuda",
                   help="cuda (default): the GPU against the CPU reference; cpu: the CPU backend's own paths "
                        "against each other and the oracle")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    """Run the command for parsed ``args``; returns the exit status."""
    if args.stamp and args.backend != "cuda":
        print("fp8core selftest: error: --stamp records a GPU verification; it needs --backend cuda",
              file=sys.stderr)
        return EXIT_USAGE
    def progress(name: str) -> None:
        if not args.json and sys.stderr.isatty():
            sys.stderr.write(f"\r\033[K{name}")
            sys.stderr.flush()
    try:
        report = run(args.backend, args.quick, args.device, args.seed, progress)
    except RuntimeError as e:
        print(f"fp8core selftest: no GPU to check: {e}. Nothing was checked; "
              "`fp8core selftest --backend cpu` checks the CPU backend.", file=sys.stderr)
        if args.json:  # a script reading stdout gets a verdict, not an empty string
            print(json.dumps({"target": None, "backend": args.backend, "quick": args.quick, "cases": 0, "passed": 0,
                              "failed": 0, "skipped": 0, "ok": False, "verdict": f"NO GPU: nothing was checked ({e})",
                              "checks": []}, indent=1, allow_nan=False), flush=True)
        return EXIT_NO_GPU
    if sys.stderr.isatty() and not args.json:
        sys.stderr.write("\r\033[K")
    print(json.dumps(report.as_dict(), indent=1) if args.json else report.table(), flush=True)
    if not report.ok:
        if args.stamp:
            print(f"fp8core selftest: stamp not written: {report.failed} case(s) failed", file=sys.stderr)
        return EXIT_FAIL
    if args.stamp:
        if report.skipped:
            print(f"fp8core selftest: stamp not written: {len(report.skipped)} check(s) skipped "
                  f"({'; '.join(c.skipped for c in report.skipped)})", file=sys.stderr)
            return EXIT_FAIL
        try:
            Path(args.stamp).parent.mkdir(parents=True, exist_ok=True)
            Path(args.stamp).write_text(json.dumps(stamp_record(report), indent=1) + "\n")
        except OSError as e:
            print(f"fp8core selftest: error: --stamp {args.stamp}: {e.strerror or e}", file=sys.stderr)
            return EXIT_USAGE
        if not args.json:
            print(f"stamp written to {args.stamp}")
    return EXIT_PASS
