"""The CPU reference backend: docs/numerics.md in NumPy + ml_dtypes, vectorized, in cache-sized chunks on all cores.

Arrays here are NumPy arrays in their logical dtype (ml_dtypes for fp8 and bf16).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from collections import OrderedDict, deque
from typing import Any, Callable

import numpy as np

from .._caches import cached, memo
from .._fpenv import ieee, set_default
from .._views import ALLOCATING, Tensor, logical_numpy_dtype
from .cpu_threads import blas_on_one_thread, thread_budget
from ..formats import E8M0, Encoding
from ..layouts import Layout

xp = np
name = "cpu"

CHUNK = 1 << 16  # elements per task at most: the fp32 temporaries stay in L2
_MIN_SHARE = 1 << 14  # elements per task at least once the pool is in: a cast task makes ~10 NumPy calls
_THREADS = max(1, min(os.cpu_count() or 1, 8))
# From this many elements a call hands chunks to the pool (map_chunks); below, the calling thread runs it alone. Per kind
# of work, as its cost per element differs: "cast" is the fp32 quantize (a multiply, 4 integer passes, a lookup),
# "lookup" one table lookup per element (bf16/fp16 quantize by the per-scale table, dequantize). amax never uses
# the pool: its two reductions run at memory speed on one core. Where the pool pays:
# bench/bench_cpu.py --crossover (bench/results/cpu-2core-2026-11-25-pool-crossover.md).
_POOL_MIN = {"cast": 1 << 18, "lookup": 1 << 17}
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_slot_lock = threading.Lock()  # see _accumulate

F32_NAN_BITS = np.uint32(0x7FFFFFFF)
FLT_MAX = np.float32(3.4028235e38)


def _forget_pool() -> None:
    """In a forked child: the parent's worker threads do not exist here, and an executor that believes it has
    idle workers would queue work that nobody runs (a hang). The child makes its own pool when it needs one.
    The locks are new too: the child inherits them as they were, maybe held by a thread now gone."""
    global _pool, _pool_lock, _slot_lock
    _pool = None
    _pool_lock = threading.Lock()
    _slot_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_THREADS - 1, thread_name_prefix="fp8core", initializer=set_default)
        return _pool


def _drain(fn: Callable[[int, int], Any], tasks: Any, results: list[Any], failed: list[tuple[int, BaseException]]
           ) -> None:
    # tasks: one list iterator shared by all threads (its next() is atomic under the GIL). A failed span empties
    # it, so no thread starts another, and is kept with its index for map_spans to raise.
    for i, a, b in tasks:
        try:
            results[i] = fn(a, b)
        except BaseException as e:  # KeyboardInterrupt in the caller's span included: nothing new starts
            failed.append((i, e))
            deque(tasks, maxlen=0)
            return


def map_chunks(n: int, fn: Callable[[int, int], Any], kind: str = "lookup") -> list[Any]:
    """``fn(start, stop)`` over cache-sized chunks of ``range(n)``, results in chunk order.

    From ``_POOL_MIN[kind]`` elements up the chunks go to the pool (:func:`map_spans`).
    """
    threads = pool_threads()
    if n < _POOL_MIN[kind] or threads == 1:
        return [fn(a, min(a + CHUNK, n)) for a in range(0, n, CHUNK)]
    return map_spans(n, min(CHUNK, max(_MIN_SHARE, -(-n // (2 * threads)))), fn)


def pool_threads() -> int:
    """The threads a call on this thread may use: fp8core's pool's size, or fewer inside cpu_threads(n)
    (cpu_threads.py)."""
    budget = thread_budget()
    return _THREADS if budget is None else min(_THREADS, budget)


def map_spans(n: int, size: int, fn: Callable[[int, int], Any]) -> list[Any]:
    """``fn(start, stop)`` over spans of ``size`` of ``range(n)`` on the pool, results in span order.

    The calling thread and the pool's threads take spans from one queue as each gets to it: the caller starts at
    once and never waits for a thread to wake, only for spans already begun. A pool task that has not started
    when the queue runs dry is cancelled, not waited for.
    """
    starts = range(0, n, size)
    results: list[Any] = [None] * len(starts)
    tasks = iter([(i, a, min(a + size, n)) for i, a in enumerate(starts)])
    threads = pool_threads()
    if threads == 1 or len(starts) < 2:
        return [fn(a, b) for _, a, b in tasks]
    pool = _pool or _get_pool()
    failed: list[tuple[int, BaseException]] = []
    futures = [pool.submit(_drain, fn, tasks, results, failed) for _ in range(min(threads - 1, len(starts) - 1))]
    try:
        _drain(fn, tasks, results, failed)
    finally:
        # A span still running writes into the caller's arrays (and reads its scratch): every one begun is waited
        # for before anything is raised
        deque(tasks, maxlen=0)
        wait([f for f in futures if not f.cancel()])
    if failed:
        # what one thread would have raised: the first failing span in order, an interrupt before any error
        raise min(failed, key=lambda f: (isinstance(f[1], Exception), f[0]))[1]
    return results


def _flat(t: Tensor) -> np.ndarray:
    return t.data.reshape(-1)


# ---- amax -------------------------------------------------------------------------------------------------

_F32 = np.dtype(np.float32)
_F16_NUM = np.dtype(np.float16).num
_SMALL = 4096  # elements: below this one masked reduction beats two plain ones
_LOW15_16 = np.array(0x7FFF, np.uint16)
_LOW31 = np.array(0x7FFFFFFF, np.uint32)


def _f16_abs_to_f32() -> np.ndarray:
    """fp32 bit pattern of each |fp16| pattern 0..0x7FFF (NaN canonical): fp16 widens exactly."""
    global _F16_BITS
    if _F16_BITS is None:
        bits = np.arange(0x8000, dtype=np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
        bits[0x7C01:] = F32_NAN_BITS
        _F16_BITS = bits
    return _F16_BITS


_F16_BITS: np.ndarray | None = None


def _amax_bits(x: np.ndarray) -> int:
    """fp32 bit pattern of max|x| for a flat array, NaN canonicalised.

    |x| patterns compare as unsigned integers (NaN above inf). Small arrays: one reduction of the patterns
    with the sign masked off. Larger ones: the largest positive pattern is the signed max, the largest negative
    magnitude is the unsigned max less the sign bit: two read-only reductions, no temporary.
    """
    n = x.size
    if n == 0:
        return 0
    if x.itemsize == 2:
        if n < _SMALL:
            m = _top(np.bitwise_and(x.view(np.uint16), _LOW15_16))
        else:
            m = max(_top(x.view(np.int16)), _top(x.view(np.uint16)) - 0x8000, 0)
        if x.dtype.num == _F16_NUM:
            return int((_F16_BITS if _F16_BITS is not None else _f16_abs_to_f32())[m])
        return 0x7FFFFFFF if m > 0x7F80 else m << 16  # bfloat16
    if n < _SMALL:
        m = _top(np.bitwise_and(x.view(np.uint32), _LOW31))
    else:
        m = max(_top(x.view(np.int32)), _top(x.view(np.uint32)) - 0x80000000, 0)
    return 0x7FFFFFFF if m > 0x7F800000 else m


# Elements: below this an integer array's max is read at its argmax, a plain call where max is a ufunc reduction
# with a fixed set-up cost; on millions of elements max streams faster (bench_cpu.py's amax rows).
_ARGMAX_MAX = 1 << 21


def _top(v: np.ndarray) -> int:
    """The largest element of a non-empty flat integer array."""
    return int(v[v.argmax()]) if v.size < _ARGMAX_MAX else int(v.max())


def _bits_to_f32(bits: Any) -> np.float32:
    return np.array([bits], np.uint32).view(np.float32)[0]


def _accumulate(amax_out: np.ndarray, bits: Any) -> None:
    """amax_out = max(amax_out, value), compared as SIGNED int32 bit patterns, like the GPU's atomicMax.

    A slot holding -0.0 or any negative value (sign bit set) ranks below every amax and takes it; NaN
    (0x7FFFFFFF) ranks above inf. The lock makes the read-modify-write atomic among fp8core's callers, as the
    GPU's atomicMax is: threads accumulating into one slot never lose the max.
    """
    view = amax_out.view(np.int32)  # 1-element, 1-D
    with _slot_lock:
        if bits > view[0]:
            view[0] = bits


def _amax(x: Tensor) -> np.ndarray:
    # On the calling thread, whole: reductions make no temporaries, so chunks only add calls, and a second
    # thread does not pay (the two reductions run at memory speed; see _POOL_MIN)
    return np.array([_amax_bits(_flat(x))], np.uint32).view(np.float32)


amax = ieee(_amax)


@ieee
def multi_amax(xs: list[Tensor], out: np.ndarray) -> None:
    for i, x in enumerate(xs):
        _accumulate(out[i:i + 1], _amax_bits(_flat(x)))


# ---- quantize ---------------------------------------------------------------------------------------------

def to_f32(x: np.ndarray) -> np.ndarray:
    if x.itemsize == 4:  # float32
        return x.copy()
    if x.dtype.num == _F16_NUM:
        return x.astype(np.float32)
    return np.left_shift(x.view(np.uint16), 16, dtype=np.uint32).view(np.float32)  # bf16: exact widening


def canonical_nan_fp8(bits: np.ndarray, fmt: Encoding) -> None:
    """Every NaN code of ``bits`` (uint8 codes, in place) becomes the one the contract writes: ml_dtypes keeps a NaN's
    sign. A NaN's magnitude is above +max's code, and above +inf's where there is one."""
    above = fmt.max_code + 1 if fmt.has_inf else fmt.max_code
    bits[np.bitwise_and(bits, (1 << (fmt.bits - 1)) - 1) > above] = fmt.nan_cast


# SATFINITE_RTNE of an fp32 value into fp8 depends only on its top 16 bits (sign, exponent, 7 mantissa bits:
# the rounding bit is among them for an encoding of at most 6 mantissa bits, subnormal results included) and on
# whether any of the low 16 bits is set (they only make the result "above a tie"; above fmax they only mean "above
# fmax"; under an all-ones exponent, NaN rather than inf). So the cast is one lookup in a 2^17-entry table indexed by
# (top 16 bits, low 16 bits != 0), built once per format by clip + ml_dtypes (the definition) over those 2^17
# representatives: a lookup costs a fraction of ml_dtypes' own cast.
_CAST: dict[Encoding, np.ndarray] = memo("cpu.cast_tables", {})


def _cast_table(fmt: Encoding) -> np.ndarray:
    table = _CAST.get(fmt)
    if table is None:
        table = _CAST[fmt] = _build_cast_table(fmt)
    return table


@ieee
def _build_cast_table(fmt: Encoding) -> np.ndarray:
    idx = np.arange(1 << 17, dtype=np.uint32)
    f = np.bitwise_or(np.left_shift(np.right_shift(idx, 1), 16), np.bitwise_and(idx, 1)).view(np.float32)
    fmax = np.float32(fmt.max)
    clipped = np.clip(f, -fmax, fmax)  # saturates finite values and +-inf; NaN passes through
    with np.errstate(invalid="ignore"):  # NaN casts to NaN
        table = clipped.astype(fmt.numpy_dtype).view(np.uint8)  # ml_dtypes: round-to-nearest-even
    table[np.isnan(clipped)] = fmt.nan_cast
    return table


# 0-d operands: NumPy converts a Python int or a NumPy scalar on every call, a 0-d array it takes as it is.
_LOW15 = np.array(0x7FFF, np.uint32)
_FIFTEEN = np.array(15, np.uint32)
_SIXTEEN = np.array(16, np.uint32)


def _cast_f32(f: np.ndarray, fmt: Encoding, out: np.ndarray | None = None) -> np.ndarray:
    """out (uint8 fp8 codes, allocated when None) = SATFINITE_RTNE(f) for a flat fp32 array."""
    bits = f.view(np.uint32)
    low = np.bitwise_and(bits, _LOW15)
    np.add(low, _LOW15, out=low)  # bit 15 set iff any of bits 14..0 was
    np.bitwise_or(low, bits, out=low)
    np.right_shift(low, _FIFTEEN, out=low)  # (top 16 bits << 1) | (low 16 bits != 0)
    table = _CAST.get(fmt)
    return (table if table is not None else _cast_table(fmt)).take(low, out=out, mode="clip")


def satfinite_cast(f: np.ndarray, fmt: Encoding) -> np.ndarray:
    """SATFINITE_RTNE(f) into fmt's codes (uint8, f's shape; NaN canonical) for fp32 f, by the cast table: the
    quantize cast without a scale."""
    return _cast_f32(np.ascontiguousarray(f, np.float32).reshape(-1), fmt).reshape(np.shape(f))


def _scaled_f32(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """fp32(x) * scale as a new flat fp32 array, scale a 0-d float32 array. NumPy's warnings must be off (the
    product may overflow or be inf * 0): @ieee callers have them off; the pool's threads use
    _quantize_chunk_pooled."""
    if x.itemsize == 4:  # float32
        return np.multiply(x, scale)
    if x.dtype.num == _F16_NUM or x.size <= _SMALL:
        # exact widening; for bf16, ml_dtypes' cast is the cheaper call on few elements, slower on many
        f = x.astype(np.float32)
    else:  # bf16: exact widening
        f = np.left_shift(x.view(np.uint16), _SIXTEEN, dtype=np.uint32).view(np.float32)
    return np.multiply(f, scale, out=f)


def _quantize_chunk(x: np.ndarray, scale: np.ndarray, fmt: Encoding, out: np.ndarray, want_amax: bool = True
                    ) -> int:
    """out (uint8 codes) = SATFINITE_RTNE(fp32(x) * scale) (see _scaled_f32); returns the chunk's amax bits
    (of x, before scaling) when asked."""
    _cast_f32(_scaled_f32(x, scale), fmt, out)
    return _amax_bits(x) if want_amax else 0


def _quantize_chunk_pooled(x: np.ndarray, scale: np.float32, fmt: Encoding, out: np.ndarray, want_amax: bool
                           ) -> int:
    with np.errstate(all="ignore"):  # per chunk: the pool's threads do not see the caller's errstate
        return _quantize_chunk(x, scale, fmt, out, want_amax)


@cached("cpu.quantize_tables", maxsize=32)
@ieee
def quantize_table(dtype: str, scale_bits: int, fmt: Encoding) -> np.ndarray:
    """quantize() of all 65,536 patterns of a 16-bit input type: each result depends only on its pattern,
    so a large bf16/fp16 tensor is one table lookup per element, made by the same code as the direct path."""
    patterns = np.arange(65536, dtype=np.uint16).view(logical_numpy_dtype(dtype))
    table = np.empty(65536, dtype=np.uint8)
    _quantize_chunk(patterns, np.array(scale_bits, np.uint32).view(np.float32), fmt, table, False)
    return table


TABLE_MIN = 1 << 16  # building the table is the direct path over 65,536 patterns: from here it never loses
# From TABLE_MIN >> 4 elements a table is built for a scale seen before (delayed scaling keeps a scale for
# many calls; a scale used once, as current scaling's are, never pays for a table it will not reuse).
_SEEN_MIN = TABLE_MIN >> 4
_seen: OrderedDict = memo("cpu.seen_scales", OrderedDict())
_SEEN_MAX = 16


def _table_for(dtype: str, scale: np.float32, fmt: Encoding, n: int) -> np.ndarray | None:
    if n >= TABLE_MIN:
        return quantize_table(dtype, int(scale.view(np.uint32)), fmt)
    if n < _SEEN_MIN:
        return None
    key = (dtype, int(scale.view(np.uint32)), fmt)
    try:
        _seen.move_to_end(key)
    except KeyError:
        _seen[key] = None
        while len(_seen) > _SEEN_MAX:
            try:
                _seen.popitem(last=False)
            except KeyError:  # another thread emptied it
                break
        return None
    return quantize_table(*key)


def _quantize(x: Tensor, scale: Any, fmt: Encoding, amax_out: np.ndarray | None, *, out: np.ndarray | None = None
              ) -> np.ndarray:
    s = _scale_0d(scale)
    data = x.data
    flat = data if data.ndim == 1 else data.reshape(-1)
    n = flat.size
    want = amax_out is not None
    table = _table_for(x.dtype, s, fmt, n) if flat.itemsize == 2 and n >= _SEEN_MIN else None
    if out is None and table is None and x.origin not in ALLOCATING and 0 < n <= CHUNK and n < _POOL_MIN["cast"]:
        # A small call's cost is its NumPy calls: the lookup allocates the result (torch callers get torch's)
        q = _cast_f32(_scaled_f32(flat, s), fmt).view(fmt.numpy_dtype)
        if want:
            _accumulate(amax_out, _amax_bits(flat))
        return q if data.ndim == 1 else q.reshape(data.shape)
    q = x.caller.empty(data.shape, fmt.numpy_dtype, x.device) if out is None else out
    qflat = (q if q.ndim == 1 else q.reshape(-1)).view(np.uint8)
    # Above one chunk, amax is one pass over the whole array after all chunks: a reduction between two chunks'
    # lookups evicts what the next lookup reads.
    if table is not None:
        codes = flat.view(np.uint16)
        if n <= CHUNK and n < _POOL_MIN["lookup"]:
            table.take(codes, out=qflat, mode="clip")
        else:
            map_chunks(n, lambda a, b: table.take(codes[a:b], out=qflat[a:b], mode="clip"))
        bits = _amax_bits(flat) if want else 0
    elif n <= CHUNK and n < _POOL_MIN["cast"]:  # _quantize_chunk's work, one frame fewer on a small call's path
        if n:
            _cast_f32(_scaled_f32(flat, s), fmt, qflat)
        bits = _amax_bits(flat) if want and n else 0
    else:
        map_chunks(n, lambda a, b: _quantize_chunk_pooled(flat[a:b], s, fmt, qflat[a:b], False), "cast")
        bits = _amax_bits(flat) if want else 0
    if want:
        _accumulate(amax_out, bits)
    return q


quantize = ieee(_quantize)  # the backend's quantize: _quantize in the IEEE environment, no frame between


def scale_value(scale: Any) -> np.float32:
    return np.float32(np.asarray(scale).reshape(-1)[0])


def _scale_0d(scale: Any) -> np.ndarray:
    """The scale as a 0-d float32 array (the cheapest ufunc operand)."""
    if type(scale) is np.ndarray and scale.dtype is _F32 and scale.size == 1:
        return scale.reshape(())
    return np.array(scale_value(scale))


@ieee
def quantize_dynamic(x: Tensor, fmt: Encoding, margin: int, power_of_2: bool, epsilon: float,
                     reduce: Callable | None, *, out: tuple = (None, None, None)
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q_out, s_inv_out, a_out = out
    a = _amax(x)
    if a_out is not None:
        a_out[...] = a
        a = a_out
    if reduce is not None:
        reduce(a)
    scale, scale_inv, _ = _scale_rule(a, np.float32(fmt.max), margin, power_of_2, epsilon)
    if s_inv_out is not None:
        s_inv_out[...] = scale_inv
        scale_inv = s_inv_out
    return _quantize(x, scale, fmt, None, out=q_out), scale_inv, a


@ieee
def multi_quantize(xs: list[Tensor], scales: list[np.ndarray], fmts: list[Encoding],
                   amax_outs: list[np.ndarray | None], *, outs: list[np.ndarray | None] | None = None
                   ) -> list[np.ndarray]:
    outs = outs if outs is not None else [None] * len(xs)
    return [_quantize(x, s, f, a, out=o) for x, s, f, a, o in zip(xs, scales, fmts, amax_outs, outs)]


# ---- dequantize -------------------------------------------------------------------------------------------

CANONICAL_NAN = {"float32": (np.uint32, 0x7FFFFFFF), "bfloat16": (np.uint16, 0x7FFF),
                  "float16": (np.uint16, 0x7FFF)}


@cached("cpu.dequantize_tables", maxsize=64)
@ieee
def _dequant_table(fmt: Encoding, scale_inv_bits: int, out_dtype: str) -> np.ndarray:
    """All 256 results: each output depends only on its input byte, so the table is the definition."""
    codes = np.arange(256, dtype=np.uint8).view(fmt.numpy_dtype)
    with np.errstate(all="ignore"):
        y = codes.astype(np.float32) * _bits_to_f32(scale_inv_bits)
        out = y.astype(logical_numpy_dtype(out_dtype))  # RTNE
    storage, nan = CANONICAL_NAN[out_dtype]
    out.view(storage)[np.isnan(y)] = nan
    return out


@ieee
def dequantize(q: Tensor, fmt: Encoding, scale_inv: Any, out_dtype: str, *,
               out: np.ndarray | None = None) -> np.ndarray:
    table = _dequant_table(fmt, int(_scale_0d(scale_inv).view(np.uint32)), out_dtype)
    data = q.data
    codes = (data if data.ndim == 1 else data.reshape(-1)).view(np.uint8)
    if out is None and q.origin not in ALLOCATING and codes.size <= CHUNK:  # the lookup allocates (see _quantize)
        y = table.take(codes, mode="clip")
        return y if data.ndim == 1 else y.reshape(data.shape)
    y = q.caller.empty(data.shape, table.dtype, q.device) if out is None else out
    yflat = y.reshape(-1)
    if codes.size <= CHUNK:
        table.take(codes, out=yflat, mode="clip")
    else:
        map_chunks(codes.size, lambda a, b: table.take(codes[a:b], out=yflat[a:b], mode="clip"))
    return y


# ---- transpose --------------------------------------------------------------------------------------------

def _strip_rows(cols: int) -> int:
    """Source rows per strip of the transpose, each strip copied column by column: 32, or more where rows are
    short, so that a strip moves at least 16 KiB (a strip's Python step costs more than copying a few hundred
    bytes: 4096x64 took 1.6-2x as long in strips of 32 rows). bench/results/cpu-2core-2026-11-26-gemm-transpose.txt."""
    return max(32, 16384 // max(cols, 1) // 32 * 32)


# From this many elements the transpose's strips go to the pool: 2048x2048 and above took 0.43-0.7 of their time
# on one thread (1000x3000: 0.8-0.85); at 1024x1024 and below the pool lost 1.25-2.9x (waking a thread, the GIL
# between strips). bench/results/cpu-2core-2026-11-26-gemm-transpose.txt.
_TRANSPOSE_POOL_MIN = 1 << 22


def transpose(q: Tensor, *, out: np.ndarray | None = None) -> np.ndarray:
    rows, cols = q.shape
    # Small ones: one allocating copy (the strips pay once the array outgrows the cache)
    if out is None and q.origin not in ALLOCATING and rows * cols <= _SMALL:
        return q.data.T.copy()
    out = q.caller.empty((cols, rows), q.data.dtype, q.device) if out is None else out
    src = q.data.view(np.uint8)
    dst = out.view(np.uint8)
    if rows * cols <= _SMALL:
        np.copyto(dst, src.T)
        return out
    strip = _strip_rows(cols)

    def strips(r0: int, r1: int) -> None:  # r0, r1: multiples of strip, or rows (slices stop there)
        for r in range(r0, r1, strip):
            dst[:, r:r + strip] = src[r:r + strip].T

    if rows * cols < _TRANSPOSE_POOL_MIN:
        strips(0, rows)
    else:  # spans of whole strips: disjoint columns of out
        map_spans(rows, -(-rows // (2 * pool_threads() * strip)) * strip, strips)
    return out


@ieee
def cast_transpose(x: Tensor, scale: Any, fmt: Encoding, amax_out: np.ndarray | None, *,
                   out: tuple = (None, None)) -> tuple[np.ndarray, np.ndarray]:
    q = _quantize(x, scale, fmt, amax_out, out=out[0])
    return q, transpose(Tensor(q, fmt.dtype_name, x.device, x.origin), out=out[1])


# ---- the scale rule and the batched delayed-scaling update -------------------------------------------------

def pow2_floor(s: np.ndarray) -> np.ndarray:
    """2^floor(log2(s)) for s >= 0, exact: the highest set bit of the fp32 pattern, subnormals included."""
    bits = s.view(np.uint32)
    exp = np.bitwise_and(bits, np.uint32(0x7F800000))
    mant = np.bitwise_and(bits, np.uint32(0x007FFFFF))
    sub = np.zeros_like(bits)
    nz = mant != 0
    sub[nz] = np.left_shift(np.uint32(1), (np.frexp(mant[nz].astype(np.float64))[1] - 1).astype(np.uint32))
    out = np.where(exp != 0, np.bitwise_and(bits, np.uint32(0xFF800000)), sub).astype(np.uint32)
    return out.view(np.float32)


_ONE = np.array(1, np.float32)  # 0-d constants: the cheapest ufunc operands
_FLT_MAX = np.array(FLT_MAX, np.float32)


def _scale_rule(amax: np.ndarray, fp8_max: Any, margin: int, power_of_2: bool,
                epsilon: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scale, scale_inv, ok) elementwise; where ``ok`` is False there is no new scale (scale = 1 there).
    fp8_max: a float32 scalar or array broadcasting against amax."""
    amax = np.asarray(amax, np.float32).reshape(-1)
    eps = np.array(epsilon, np.float32)
    with np.errstate(all="ignore"):
        a = np.where(amax < eps, eps, amax)
        ok = np.isfinite(a)
        ok &= a != 0
        s = np.divide(fp8_max, np.where(ok, a, _ONE), dtype=np.float32)
        if margin:  # ldexp by 0 is the identity
            s = np.ldexp(s, np.int32(-margin))
        s = np.where(np.isinf(s), _FLT_MAX, s)
        if power_of_2:
            s = pow2_floor(s)
        s = np.where(ok, s, _ONE)
        s_inv = np.divide(_ONE, s)
    return s, s_inv, ok


scale_rule = ieee(_scale_rule)


@ieee
def compute_scale(amax: np.ndarray, fp8_max: float, margin: int, power_of_2: bool, epsilon: float,
                  previous: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    s, s_inv, ok = _scale_rule(amax, np.float32(fp8_max), margin, power_of_2, epsilon)
    if previous is not None:
        prev = np.broadcast_to(np.asarray(previous, np.float32).reshape(-1), s.shape)
        with np.errstate(divide="ignore"):
            s, s_inv = np.where(ok, s, prev), np.where(ok, s_inv, np.float32(1) / prev)
    return s.astype(np.float32, copy=False).reshape(amax.shape), s_inv.astype(np.float32, copy=False).reshape(amax.shape)


@ieee
def update(history: np.ndarray, scale: np.ndarray, scale_inv: np.ndarray, fp8_max: np.ndarray, margin: int,
           algo: str, power_of_2: bool, epsilon: float, update_scale: bool, flags: np.ndarray | None,
           step: np.ndarray | None = None, interval: int = 1) -> None:
    """The batched delayed-scaling update of docs/numerics.md, in place, all N columns at once. ``step`` (int32
    [steps % interval, 0]), when given, decides update_scale and advances, as the CUDA backend's counter does."""
    if step is not None:
        update_scale = int(step[0]) == 0
        step[0] = (int(step[0]) + 1) % interval
    L = history.shape[0]
    cur = history[0].copy()
    ran = (cur.view(np.uint32) & np.uint32(0x7FFFFFFF)) != 0  # on the bits: a subnormal or NaN amax did run
    if flags is not None:
        flags[...] = ~np.isfinite(cur)
    if not ran.any():
        return
    with np.errstate(invalid="ignore"):
        a = history.max(axis=0) if algo == "max" else cur
    if update_scale:
        s, s_inv, ok = _scale_rule(a, fp8_max, margin, power_of_2, epsilon)
        take = ran & ok
        scale[take] = s[take]
        scale_inv[take] = s_inv[take]
    roll(history, ran, cur, L)


def roll(history: Any, ran: Any, cur: Any, L: int) -> None:
    """[cur, h1, ..., h_{L-1}] -> [0, h2, ..., h_{L-1}, cur] in the columns that ran (NumPy or CuPy)."""
    if L > 1:
        if bool(ran.all()):
            history[1:L - 1] = history[2:L].copy()
            history[L - 1] = cur
        else:
            cols = ran.nonzero()[0]
            history[1:L - 1, cols] = history[2:L, cols]
            history[L - 1, cols] = cur[cols]
    history[0][ran] = 0


# ---- gemm -------------------------------------------------------------------------------------------------

def _block_factors(scale: np.ndarray, layout: Layout, rows: int) -> np.ndarray:
    """float64 factor of every operand row for every K-block, [rows, KB]: E8M0 bytes as 2^(e-127) (the NaN byte
    NaN), fp32 scale inverses as they are; a 128x128 tile's factor spread over its 128 rows."""
    if layout.scale is E8M0:
        f = E8M0.values.take(np.asarray(scale).view(np.uint8))
    else:
        f = np.asarray(scale, np.float32).astype(np.float64)
    return np.repeat(f, layout.block_for(rows, 1)[0], axis=0)[:rows]


@cached("cpu.widen_tables")
@ieee
def _widen_table(fmt: Encoding) -> np.ndarray:
    """The float64 value of each of the 256 codes, made by ml_dtypes' cast (its bits, NaN's too); read only:
    every GEMM of every thread reads this one cached array."""
    table = np.arange(256, dtype=np.uint8).view(fmt.numpy_dtype).astype(np.float64)
    table.flags.writeable = False
    return table


def _widen(data: np.ndarray, fmt: Encoding, out: np.ndarray) -> np.ndarray:
    """An fp8 operand (its codes in any 1-byte dtype) as float64 into ``out`` (of data's shape), exactly: one
    lookup per element in a 2 KiB table that stays in L1. A flax training step took 1.23-1.35x as long with
    ml_dtypes' astype, and longer with a 1 MiB table of code pairs, which the matmul evicts
    (bench/results/cpu-2core-2026-11-25-flax-train.txt). ``mode="clip"``: with the default "raise", ``take``
    writes through a temporary copy of ``out`` (7x slower at 64K elements)."""
    return _widen_table(fmt).take(np.asarray(data).view(np.uint8), out=out, mode="clip")


# The GEMM's float64 temporaries (widened operands, the product) come from a scratch buffer per thread, reused
# from call to call. Freshly allocated, they are page-faulted in again whenever glibc has handed the freed
# blocks back to the OS, which depends on the sizes and order of what the program allocates and frees: a
# variant allocating them took 2x as long at 64x256x256 and 256x256x64 called in a loop (0.49 against 0.25 ms),
# 1.2-1.45x at 64x1024x1024 and 256x1024x1024 called in turn (1200-1800 page faults per call against 50);
# bench/results/cpu-2core-2026-11-26-gemm-transpose.txt. The buffers hold no caller's memory, only what the last
# GEMM on the thread needed, at most _SCRATCH_MAX bytes per thread and kind (a thread calling gemm keeps up to
# 16 MiB until it ends, a pool thread 8 MiB: enough for the GEMMs of a width-1024 layer at 256 tokens, split in
# two); a larger need gets fresh memory for that call alone.
_SCRATCH_MAX = 1 << 23


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.kinds: dict[str, np.ndarray] = {}


_scratch_buffers = _Scratch()


def _scratch(kind: str, *specs: tuple[tuple[int, ...], Any]) -> list[np.ndarray]:
    """Arrays of the given (shape, dtype), contents undefined, carved from this thread's buffer of ``kind``
    (each starting a multiple of 64 bytes in): two kinds may be in use at once, one kind by one caller at a
    time. ``kind`` "operand": the GEMM's widened ``a``; "span": a span of its columns (see :func:`gemm`)."""
    sizes = [math.prod(shape) * np.dtype(dt).itemsize for shape, dt in specs]
    total = sum(-(-size // 64) * 64 for size in sizes)
    buf = _scratch_buffers.kinds.get(kind)
    if buf is None or buf.size < total:
        buf = np.empty(total, np.uint8)
        if total <= _SCRATCH_MAX:
            _scratch_buffers.kinds[kind] = buf
    views, at = [], 0
    for (shape, dt), size in zip(specs, sizes):
        views.append(buf[at:at + size].view(dt).reshape(shape))
        at += -(-size // 64) * 64
    return views


def _blas_on_one_thread() -> bool:
    """Whether the environment runs NumPy's BLAS on one thread, as its libraries read it when they load:
    OPENBLAS_NUM_THREADS, MKL_NUM_THREADS or VECLIB_MAXIMUM_THREADS set to 1 (each where set), else
    OMP_NUM_THREADS=1, which OpenBLAS and MKL follow when their own is unset."""
    own = [v for v in map(os.environ.get, ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS"))
           if v]
    return all(v.strip() == "1" for v in own) if own else os.environ.get("OMP_NUM_THREADS", "").strip() == "1"


# From this many multiply-adds a GEMM's N columns are split between the calling thread and the pool, one span
# per thread, where BLAS runs on one thread (the README's advice for JAX on the CPU): on 2 cores, 64x512x512 and
# up then took 0.57-0.83 of one span's time, 256x256x256 the same; below, waking the pool's thread and handing
# the GIL back and forth cost more than the half it takes over saves (64x256x256 split: 1.4-1.6x as long). With
# BLAS's own threads (OpenBLAS's default) the split took 1.0-1.25x one span's time, two teams of threads on the
# same cores, so there the GEMM stays one span and BLAS's threads do the sharing. Either way the same code runs
# and the same bits come out; only the span count differs. bench/results/cpu-2core-2026-11-26-gemm-transpose.txt.
# fp8core reads BLAS's environment once. Inside cpu_threads(n) (a torch program: torch's thread count) BLAS is
# held to one thread for the GEMM, so the one-thread threshold holds there whatever the environment says.
_GEMM_SPLIT_MIN = 1 << 24
_GEMM_POOL_MIN = _GEMM_SPLIT_MIN if _blas_on_one_thread() else 1 << 62


@ieee
def gemm(spec: Any, a: Tensor, b: Tensor, a_scale_inv: Any, b_scale_inv: Any, bias: Tensor | None,
         out_scale: Any | None, out_amax: np.ndarray | None, out: np.ndarray | None) -> np.ndarray:
    """The emulation: fp8 operands widened exactly, products summed and scaled in float64, the result (+ bias)
    rounded once to fp32, then cast to the output like :func:`quantize` and NumPy's RTNE casts do. E4M3 x E4M3
    products are multiples of 2^-18 below 2^17.6, so float64 sums them exactly for K up to 2^17: their bits then
    depend neither on BLAS's order of summation nor on how the columns are split into spans (see _GEMM_POOL_MIN:
    each output element is computed whole within one span). With an E5M2 operand the products' range spans
    up to 2^49.6 units of the smallest, and a sum of such extremes can round, in BLAS's order.
    Block-scaled: D[m, n] = sum_kb fa[m, kb] * fb[n, kb] * (sum_{k in kb} a[m, k] * b[n, k]); the roundings
    beyond the K-block sums' are the factors' products and the sum over K-blocks, far inside the GPU's tolerance.
    """
    m, n, k = spec.m, spec.n, spec.k
    fp8_out = spec.out_fmt is not None
    dtype = spec.out_fmt.numpy_dtype if fp8_out else logical_numpy_dtype(spec.out_dtype)
    dst = np.empty((m, n), dtype) if out is None else out.view(dtype)
    a64 = _widen(a.data, spec.a_fmt.encoding, *_scratch("operand", ((m, k), np.float64)))
    if spec.a_block is None:
        sa, sb = np.float64(scale_value(a_scale_inv)), np.float64(scale_value(b_scale_inv))
    else:
        fa = _block_factors(a_scale_inv, Layout(spec.a_block), m)
        fb = _block_factors(b_scale_inv, Layout(spec.b_block), n)
    bias64 = None if bias is None else bias.data.astype(np.float64)

    def columns(n0: int, n1: int) -> int:
        """dst[:, n0:n1]; the amax bits of its fp32 values where an fp8 output's amax is asked for."""
        b64, d, d32 = _scratch("span", ((n1 - n0, k), np.float64), ((m, n1 - n0), np.float64),
                               ((m, n1 - n0), np.float32))
        with np.errstate(all="ignore"):  # here too: the pool's threads do not see the caller's errstate
            _widen(b.data[n0:n1], spec.b_fmt.encoding, b64)
            if spec.a_block is None:
                np.matmul(a64, b64.T, out=d)
                d *= sa  # in place: (d * sa) * sb, the same roundings
                d *= sb
            else:
                bk = Layout(spec.a_block).block_for(m, k)[1]  # a rowwise operand: all of K is one block
                d.fill(0)
                for kb in range(-(-k // bk)):
                    ks = slice(kb * bk, (kb + 1) * bk)
                    d += (a64[:, ks] @ b64[:, ks].T) * fa[:, kb:kb + 1] * fb[n0:n1, kb]
            if bias64 is not None:
                d += bias64[n0:n1]
            np.copyto(d32, d)  # rounded once to fp32
            if not fp8_out:
                dst[:, n0:n1] = d32  # NumPy's / ml_dtypes' RTNE cast
                return 0
            codes = _quantize(Tensor(d32, "float32", a.device, "numpy"), out_scale, spec.out_fmt.encoding, None)
            dst[:, n0:n1] = codes.view(dtype)
            return _amax_bits(d32.reshape(-1)) if out_amax is not None else 0

    budget = thread_budget()
    with blas_on_one_thread() if budget is not None else contextlib.nullcontext():
        threads = pool_threads()
        if m * n * k >= (_GEMM_POOL_MIN if budget is None else _GEMM_SPLIT_MIN) and threads > 1:
            bits = map_spans(n, -(-n // (16 * threads)) * 16, columns)
        else:
            bits = [columns(0, n)]
    if out_amax is not None:  # N >= 16: one span at least
        _accumulate(out_amax, max(bits))
    return dst if out is None else out
