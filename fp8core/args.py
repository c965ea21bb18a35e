"""The argument rules of fp8core, each stated once with its error text: the core primitives, the torch custom
ops (fp8core.torch) and the JAX functions (fp8core.jax) call these, so a bad argument gets the same error
whichever door it came in by.

Each check is cheap when the argument is valid (the cheap test first); messages are formatted only on failure,
and every message starts with the argument's name.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Callable, Sequence

import numpy as np

from ._fpenv import ieee
from ._tensor import Tensor, logical_numpy_dtype, storage_dtype, wrap
from .formats import (E2M1, ENCODINGS, FORMAT_NAMES, FP8_DTYPES, HIGH_PRECISION_DTYPES, ROWS, Encoding, Format,
                      dtype_name)
from .layouts import Layout, ScaledTensor

MAX_MARGIN = 512
# A delayed-scaling state's dimensions: the update kernel takes the history length as a 32-bit int, and a count
# of tensors beyond it is no real model (2**31 tensors of 1 KiB history each would be 2 TiB of state).
MAX_HISTORY_LEN = MAX_TENSORS = 2**31 - 1
AMAX_ALGOS = ("max", "most_recent")  # the batched update's built-in rules
SCALE_MODES = ("rceil", "floor")  # MXFP8's E8M0 scale rules
FP4_ROUNDINGS = ("nearest", "stochastic")  # NVFP4's element rounding
MX_BLOCK = 32  # MXFP8's block: 32 elements along a row or a column
FP32_BLOCK = 128  # DeepSeek-V3's blocks: 1x128 and 128x128
NVFP4_BLOCK = 16  # NVFP4's block: 16 elements along an operand row, under one E4M3 scale
MXFP4_BLOCK = 32  # MXFP4's block: 32 elements along an operand row, under one E8M0 scale
_AXES = {-1: Layout.ROWWISE, 1: Layout.ROWWISE, 0: Layout.COLUMNWISE, -2: Layout.COLUMNWISE}
_E8M0 = Layout.MX_ROWWISE.scale.dtype_name  # MX scales: float8_e8m0fnu
_BY_DTYPE = {row.dtype_name: row for row in ROWS}  # an encoding by its dtype, for errors
MULTIPLE = 16  # K and N: cuBLASLt's FP8 GEMM takes positive multiples of it
# cuBLASLt's FP8 table: the bias type each output takes (fp8 outputs take the type of C, bf16 or fp16).
_BIAS_DTYPES = {"float32": ("bfloat16",), "bfloat16": ("bfloat16",), "float16": ("float16",),
                **{name: ("bfloat16", "float16") for name in FP8_DTYPES}}
_HP = frozenset(HIGH_PRECISION_DTYPES)
_FP8_TEXT = ", ".join(FP8_DTYPES)
_FORMATS_TEXT = ", ".join([f"Format.{f.name}" for f in ENCODINGS] + [repr(f.value) for f in ENCODINGS])
# The largest double that rounds (to nearest) to a finite float32: 2**128 - 2**103, exclusive. Above it an
# epsilon becomes inf in float32 and every amax is floored to inf (no scale at all, silently).
_F32_ROUNDS_TO_INF = 3.4028235677973366e38
F32_EPSILON_MAX = 3.4028234663852886e38  # float32's largest finite value, as the messages state the bound
_F32_MIN_NORMAL = 1.1754943508222875e-38
_F32 = np.dtype(np.float32)  # NumPy's one native float32 dtype object (a byte-swapped one is another object)
_INF_BITS = 0x7F800000
_ABS_BITS = 0x7FFFFFFF
_SIGN_BIT = 0x80000000


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints: the count of blocks of b that cover a."""
    return -(-a // b)


# ---- Python values ----------------------------------------------------------------------------------------

def margin(value: Any, arg: str = "margin") -> int:
    """An int with ``|value| <= 512`` (the scale is ``fp8_max / amax / 2**margin``)."""
    if type(value) is int and -MAX_MARGIN <= value <= MAX_MARGIN:
        return value
    return integer(value, arg, high=MAX_MARGIN)


def integer(value: Any, arg: str, low: int | None = None, high: int | None = None) -> int:
    """A true integer (not a bool, not a float, not a string) within [low, high] (``|value| <= high`` without
    ``low``), as a Python int: the rule of the recipes' int fields."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{arg}: expected an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if low is not None and v < low:
        raise ValueError(f"{arg}: expected an int >= {low}, got {v}")
    if high is not None and abs(v) > high:
        bound = f"an int in [{low}, {high}]" if low is not None else f"|{arg}| <= {high}"
        raise ValueError(f"{arg}: expected {bound}, got {v}")
    return v


def real(value: Any, arg: str, what: str = "a number") -> float:
    """A real number (Python or NumPy; not a bool, not a string) as a Python float. An int beyond the double
    range is refused naming ``arg`` (Python's own message names no argument)."""
    if isinstance(value, (bool, np.bool_, str)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{arg}: expected {what}, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{arg}: expected a number, got an int too large for a float ("
                         f"{int(value).bit_length()} bits)") from None


def epsilon(value: Any, arg: str = "epsilon") -> float:
    """The amax floor: a real number >= 0 that is finite in float32 (where it is applied). A larger one would
    become inf there and floor every amax to inf: no scale at all, silently."""
    if type(value) is float and 0.0 <= value < _F32_ROUNDS_TO_INF:
        return value
    eps = real(value, arg, "a float")
    if not 0.0 <= eps < _F32_ROUNDS_TO_INF:
        raise ValueError(f"{arg}: expected a finite float32 value >= 0 (at most {F32_EPSILON_MAX:.8g}), "
                         f"got {value!r}")
    return eps


def flag(value: Any, arg: str) -> bool:
    """The one rule for every boolean argument and recipe field: True or False (a NumPy bool too). Anything else
    is refused naming ``arg``: 'False', 0, 1 and None are not read by their truthiness."""
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{arg}: expected a bool (True or False), got {type(value).__name__} {value!r}")


def amax_algo(value: Any, arg: str = "algo") -> str:
    """'max' or 'most_recent': the batched update's built-in rules (a recipe may also hold a callable)."""
    if not isinstance(value, str) or value not in AMAX_ALGOS:
        raise ValueError(f"{arg}: expected one of {AMAX_ALGOS}, got {value!r}")
    return value


def gemm_recipe_format(recipe: Any, arg: str = "recipe") -> None:
    """A recipe that feeds fp8 GEMMs (a Linear, fp8core.jax.dense) has a GEMM for its formats' pairs."""
    if recipe.fp8_format is Format.E5M2:
        raise ValueError(f"{arg}: fp8_format E5M2 would make E5M2 x E5M2 GEMMs, which have no FP8 kernel; "
                         "use Format.HYBRID (E4M3 forward, E5M2 backward) or Format.E4M3")


def scale_mode(mode: Any, arg: str = "scale_mode") -> str:
    """'rceil' or 'floor': how an MX block's E8M0 scale is rounded (MXFP8's scale_mode, MXFP4's rounding)."""
    if not isinstance(mode, str) or mode not in SCALE_MODES:
        raise ValueError(f"{arg}: expected 'rceil' (NVIDIA, Transformer Engine) or 'floor' (OCP), got {mode!r}")
    return mode


def fp4_rounding(value: Any, arg: str = "rounding") -> str:
    """'nearest' or 'stochastic': how NVFP4's elements are rounded to E2M1 (its scales always to nearest)."""
    if not isinstance(value, str) or value not in FP4_ROUNDINGS:
        raise ValueError(f"{arg}: expected 'nearest' or 'stochastic', got {value!r}")
    return value


def uint64(value: Any, arg: str) -> int:
    """An unsigned 64-bit integer (a random seed or offset) as a Python int: anything else is a ValueError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or not 0 <= int(value) < 1 << 64:
        raise ValueError(f"{arg}: expected an unsigned 64-bit integer (0 <= {arg} < 2**64), got "
                         f"{type(value).__name__} {value!r}")
    return int(value)


def block(value: Any, arg: str = "block") -> Layout:
    """An fp32-scaled block layout: "1x128" (or (1, 128), Layout.BLOCK_1X128) or "128x128"."""
    return Layout.parse(value, arg, Layout.BLOCK_1X128.family)


def scale_value(value: Any, arg: str) -> float:
    """A Python number usable as a scale: finite and > 0 (0, NaN, inf and negatives would poison every cast)."""
    v = real(value, arg)
    if not 0.0 < v < math.inf:
        raise ValueError(f"{arg}: expected a finite scale > 0, got {value}")
    return v


def as_format(fmt: Any, *, arg: str = "fmt", allow_hybrid: bool = False) -> Format:
    """A :class:`Format` from a Format, a string (``"e4m3"``), or an fp8 dtype of numpy, torch or jax."""
    if isinstance(fmt, Format):
        result = fmt
    elif isinstance(fmt, str) and fmt.lower() in FORMAT_NAMES:
        result = FORMAT_NAMES[fmt.lower()]
    else:
        name = dtype_name(fmt)
        if name not in FP8_DTYPES:
            raise ValueError(f"{arg}: unknown FP8 format {fmt!r}; expected {_FORMATS_TEXT} or an fp8 dtype")
        result = FORMAT_NAMES[name]
    if not flag(allow_hybrid, "allow_hybrid") and result is Format.HYBRID:
        raise ValueError(f"{arg}: HYBRID is a recipe, not an encoding; pass Format.HYBRID.fwd or .bwd")
    return result


# Format lookups without as_format's parsing: every spelling seen once is remembered.
_FORMATS: dict[Any, Format] = {f: f for f in ENCODINGS}


def fmt(value: Any, arg: str = "fmt") -> Format:
    """An fp8 encoding (Format.E4M3, Format.E5M2, 'e4m3', 'e5m2', an fp8 dtype); HYBRID is a recipe, refused."""
    try:
        f = _FORMATS.get(value)
    except TypeError:  # unhashable: as_format names the problem
        return as_format(value, arg=arg)
    if f is None:
        f = as_format(value, arg=arg)
        if isinstance(value, str) or type(value).__module__.split(".")[0] in ("torch", "numpy", "jax", "ml_dtypes"):
            _FORMATS[value] = f
    return f


_ROWS: dict[Any, Encoding] = dict(ENCODINGS)  # encoding's lookups: the spellings fmt remembers, and the Formats


def encoding(value: Any, arg: str = "fmt") -> Encoding:
    """The encoding row of an fp8 format (what :func:`fmt` accepts): what the backends take."""
    try:
        return _ROWS[value]
    except (KeyError, TypeError):
        pass
    row = fmt(value, arg).encoding
    if value in _FORMATS:
        _ROWS[value] = row
    return row


_OUT_DTYPES: dict[Any, str] = {}


def out_dtype(value: Any, arg: str = "out_dtype") -> str:
    """float32, bfloat16 or float16 (a name, or a NumPy, torch or JAX dtype), as its name."""
    try:
        name = _OUT_DTYPES.get(value)
    except TypeError:  # unhashable
        name = None
    if name is not None:
        return name
    name = value if isinstance(value, str) else dtype_name(value)
    if name not in _HP:
        raise ValueError(f"{arg}: expected float32, bfloat16 or float16, got {value!r}")
    try:
        _OUT_DTYPES[value] = name
    except TypeError:
        pass
    return name


def array_sequence(xs: Any, arg: str = "xs") -> list[Any]:
    """A list or tuple of arrays. A single array is refused: its rows would silently become tensors."""
    if isinstance(xs, (list, tuple)):
        if not xs:
            raise ValueError(f"{arg}: expected at least one tensor")
        return list(xs)
    if hasattr(xs, "shape") or hasattr(xs, "__dlpack__") or hasattr(xs, "__array_interface__"):
        raise TypeError(f"{arg}: expected a list or tuple of arrays, got a single array of shape "
                        f"{tuple(xs.shape) if hasattr(xs, 'shape') else '?'}; pass [x] for one tensor")
    raise TypeError(f"{arg}: expected a list or tuple of arrays, got {type(xs).__name__}")


def high_precision_name(name: str, arg: str) -> None:
    """``name`` (a logical dtype name) is float32, bfloat16 or float16."""
    if name in _HP:
        return
    if name in FP8_DTYPES:
        raise TypeError(f"{arg}: expected float32, bfloat16 or float16 data, got fp8 ({name}); dequantize it first")
    raise TypeError(f"{arg}: expected float32, bfloat16 or float16 data, got {name}")


def fp8_name(name: str, arg: str) -> None:
    """``name`` (a logical dtype name) is an fp8 encoding's."""
    if name not in FP8_DTYPES:
        hint = "; quantize it first" if name in _HP else ""
        raise TypeError(f"{arg}: expected fp8 data ({_FP8_TEXT}), got {name}{hint}")


# ---- float32 values, by their bits ------------------------------------------------------------------------
# A comparison would read a subnormal as 0 in a thread that flushes (torch.set_flush_denormal, XLA:CPU's
# callbacks) and on a GPU (CuPy compiles with -ftz=true), and the contract says such modes never change a
# result, a refusal included.

def scale_mask(values: Any, xp: Any = np) -> Any:
    """Where a float32 array holds a usable scale: finite and > 0 (+0 < bits < +inf), by its bits."""
    bits = values.view(xp.uint32)
    return (bits != 0) & (bits < _INF_BITS)


def negative_amax_mask(values: Any, xp: Any = np) -> Any:
    """Where a float32 array holds a negative amax (-0.0 and negative subnormals included, NaN not: the history
    records non-finite amaxes), by its bits."""
    bits = values.view(xp.uint32)
    return (bits >= _SIGN_BIT) & ((bits & _ABS_BITS) <= _INF_BITS)


def f32_text(value: Any) -> str:
    """A float32 element for a message, from its bits (a subnormal read as a float in a flushing thread would
    print 0.0)."""
    v = np.asarray(value, np.float32).reshape(-1)[:1]
    mag = int(v.view(np.uint32)[0]) & _ABS_BITS
    if 0 < mag < 0x00800000:  # subnormal: NumPy's shortest-digits formatter works on the bits
        return np.format_float_scientific(v[0], unique=True, trim="-")
    return repr(float(v[0]))  # a normal float32 (or 0, inf, NaN) widens to a double exactly in any mode


def scale_values(values: np.ndarray, arg: str) -> None:
    """Every element of a host float32 array is a usable scale (see :func:`scale_value`), by its bits."""
    if values.size:
        ok = scale_mask(values.reshape(-1))
        if not bool(ok.all()):
            raise ValueError(f"{arg}: expected finite scales > 0, got {f32_text(values.reshape(-1)[~ok][0])}")


@ieee  # a Python float's fp32 rounding must not flush a subnormal (FTZ set by the caller)
def host_f32(values: Any) -> np.ndarray:
    """Python numbers as a flat host float32 array (rounded to nearest; beyond float32's range: inf)."""
    with np.errstate(over="ignore"):
        return np.asarray(values, dtype=np.float32).reshape(-1)


def new_f32(values: Any, like: Tensor, arg: str | None = None) -> Any:
    """Python numbers as a float32 array on like's device (on the caller's stream). ``arg``: the argument
    whose number this is (a device temporary: refused inside a CuPy capture)."""
    host = host_f32(values)
    if not like.is_cuda:
        return host
    from . import backends

    return backends.for_device(like.device).device_f32(host, like, arg)


# ---- arrays -----------------------------------------------------------------------------------------------

def contiguous(t: Tensor, arg: str) -> Tensor:
    """t, whose array is row-major and starts at an address aligned to its elements (every array argument and
    out= slot of the primitives passes here). A GPU's 2-, 4- and 8-byte loads and stores fault at any other
    address, so a view at an odd byte offset is refused by name before a launch; on the CPU too, where NumPy
    would cope: one rule and one error on both backends."""
    data = t.data
    if type(data) is np.ndarray:
        flags = data.flags  # one flags object for both tests: NumPy makes a new one at each access
        if flags.c_contiguous and flags.aligned:
            return t
        row_major, aligned = flags.c_contiguous, flags.aligned
    else:  # CuPy (its flags know no alignment); dtype.alignment is NumPy's rule for the same dtype
        row_major, aligned = data.flags.c_contiguous, not data.data.ptr % data.dtype.alignment
    if not row_major and data.size > 1:
        raise ValueError(f"{arg}: expected a contiguous (row-major) array, got strides {data.strides} for "
                         f"shape {data.shape}; make it contiguous first")
    if not aligned and data.size:
        _misaligned(data, t.dtype, arg)
    return t


def _misaligned(data: Any, dtype: str, arg: str) -> None:
    size = data.dtype.alignment
    where = (data.__array_interface__["data"][0] if isinstance(data, np.ndarray) else data.data.ptr) % size
    raise ValueError(f"{arg}: its data pointer must be aligned to its {size}-byte {dtype} elements (a GPU's loads "
                     f"fault otherwise; refused on every backend), got an address {where} byte"
                     f"{'s' if where > 1 else ''} past a {size}-byte boundary; pass a fresh copy")


def same_device(t: Tensor, x: Tensor, arg: str, xarg: str = "x") -> None:
    # JAX arrays committed to two devices are refused (an uncommitted one goes anywhere): _tensor says why
    if t.device != x.device or (t.place is not x.place and t.place is not None and x.place is not None):
        raise ValueError(f"{arg}: is on {t.device_str()} but {xarg} is on {x.device_str()}; "
                         "put them on the same device")


def high_precision(obj: Any, arg: str) -> Tensor:
    """float32, bfloat16 or float16 data, contiguous."""
    t = contiguous(wrap(obj, arg), arg)
    if t.dtype not in _HP:
        high_precision_name(t.dtype, arg)
    return t


def fp8(obj: Any, arg: str, named: Any) -> tuple[Tensor, Format]:
    """fp8 data: a native fp8 dtype, or uint8 storage (CuPy) with ``named`` (the call's fmt=) its format."""
    t = contiguous(wrap(obj, arg), arg)
    if t.dtype == "uint8":
        if named is None:
            raise TypeError(f"{arg}: uint8 data is fp8 storage only with fmt= naming its format")
        return t, fmt(named)
    fp8_name(t.dtype, arg)
    found = fmt(t.dtype)
    if named is not None and fmt(named) is not found:
        raise ValueError(f"fmt: {fmt(named).name} does not match {arg}'s dtype {t.dtype}")
    return t, found


def as_2d(t: Tensor, arg: str) -> Tensor:
    """The [prod(leading), last] view of t (at least 1-D)."""
    shape = t.data.shape
    if len(shape) == 0:
        raise ValueError(f"{arg}: expected at least 1 dimension, got a scalar")
    if len(shape) == 2:
        return t
    rows = math.prod(shape[:-1])
    return Tensor(t.data.reshape(rows, shape[-1]), t.dtype, t.device, t.origin, t.readonly, t.place)


def float32_name(name: str, arg: str) -> None:
    """``name`` (a dtype name) is float32."""
    if name != "float32":
        raise TypeError(f"{arg}: expected float32, got {name}")


def one_element(shape: tuple[int, ...], arg: str) -> None:
    """An array of ``shape`` holds one element (a scale, an amax slot)."""
    if math.prod(shape) != 1:
        raise ValueError(f"{arg}: expected 1 element, got shape {tuple(shape)}")


def f32_vector(obj: Any, x: Tensor, arg: str, xarg: str = "x") -> Tensor:
    """float32 data, contiguous, on x's device."""
    t = contiguous(wrap(obj, arg), arg)
    if t.dtype != "float32":
        float32_name(t.dtype, arg)
    if t.device != x.device or t.place is not x.place:
        same_device(t, x, arg, xarg)
    return t


def scalar(obj: Any, x: Tensor, arg: str, xarg: str = "x") -> Any:
    """A 1-element float32 array on x's device, flat (a Python number becomes one)."""
    tp = type(obj)
    if tp is float or tp is int or (isinstance(obj, (float, int)) and not isinstance(obj, bool)):
        # fp32 normals (and 0) convert the same in any floating-point mode; the rest go through the guard
        if (_F32_MIN_NORMAL <= abs(obj) <= F32_EPSILON_MAX or obj == 0) and x.device[0] == "cpu":
            return np.array([obj], np.float32)
        return new_f32([real(obj, arg)], x, arg)
    if tp is np.ndarray and obj.dtype is _F32 and obj.size == 1 and x.device[0] == "cpu" and obj.flags.aligned:
        return obj if obj.ndim == 1 else obj.reshape(-1)  # a native fp32 element: nothing the checks would refuse
    data = f32_vector(obj, x, arg, xarg).data
    if data.size != 1:
        one_element(data.shape, arg)
    return data if data.ndim == 1 else data.reshape(-1)


def f32_slots(obj: Any, x: Tensor, arg: str, xarg: str = "x", n: int | None = None, hint: str = "") -> Any:
    """Writable float32 on x's device, flat, that a call accumulates into: 1 element (``n`` None) or ``n``.
    ``hint``: said after 'is read-only'."""
    t = f32_vector(obj, x, arg, xarg)
    if n is None and t.size != 1:
        raise ValueError(f"{arg}: expected 1 element, got shape {t.shape}")
    if n is not None and t.size != n:
        raise ValueError(f"{arg}: expected {n} elements, got {t.size}")
    if t.readonly:
        raise ValueError(f"{arg}: is read-only{hint}")
    return t.data if t.data.ndim == 1 else t.data.reshape(-1)


def global_amax(obj: Any, x: Tensor, arg: str = "global_amax") -> Any:
    """None, or a given amax as 1 float32 element on x's device: a number is rounded to fp32 once; inf and NaN
    are amaxes too (a MAX all-reduce passes them on); a negative one (-0.0 included) is refused, by its bits."""
    if obj is None:
        return None
    a = scalar(obj, x, arg)
    if isinstance(a, np.ndarray) and bool(negative_amax_mask(a).any()):
        raise ValueError(f"{arg}: expected an amax >= 0 (inf and NaN are amaxes too), got {f32_text(a)}")
    return a


def amax_slot(obj: Any, x: Tensor) -> Any:
    """``amax_out=`` of a quantize: None, or 1 writable float32 element on x's device."""
    if obj is None:
        return None
    if type(obj) is np.ndarray and obj.dtype is _F32 and obj.size == 1 and x.device[0] == "cpu":
        flags = obj.flags
        if flags.writeable and flags.aligned:
            return obj if obj.ndim == 1 else obj.reshape(-1)  # nothing the checks would refuse
    return f32_slots(obj, x, "amax_out", hint=" (JAX arrays are immutable: fp8core.jax returns amax instead)")


# ---- reduce=: a MAX all-reduce of amaxes, run by the caller's function --------------------------------------

def reduce_hook(reduce: Any) -> Callable[[Any], None] | None:
    """A backend's hook: ``reduce`` run by :func:`reduce_amaxes`'s rule on the 1-element amax."""
    if reduce is None:
        return None
    if not callable(reduce):
        raise TypeError(f"reduce: expected a callable or None, got {type(reduce).__name__}")
    return lambda a: reduce_amaxes(reduce, a, a)


def reduce_amaxes(reduce: Callable[[Any], Any], given: Any, data: Any) -> None:
    """The one rule of every ``reduce`` hook (``quantize_dynamic``, ``ScalingState.update``).

    ``reduce(given)`` MAX-reduces the float32 amaxes ``given`` [n] across a group, either in place (returning
    None, ``given`` itself, or an async handle with ``wait()``, which is waited on: torch.distributed.all_reduce)
    or by returning the reduced amaxes (n float32 values on their device: a functional all-reduce), which are
    then copied into ``given``. ``data`` is ``given``'s memory as a backend array (NumPy or CuPy), flat.

    The reduced amaxes are checked where they lie in host memory (a GPU array is not read back: that would
    synchronise): a negative amax (-0.0 too: a MAX of amaxes >= +0 never gives one) is refused naming
    ``reduce``, and ``given`` is put back as it was, so a refused reduce leaves nothing written.
    """
    n = data.size
    saved = data.copy() if isinstance(data, np.ndarray) else None
    result = reduce(given)
    if result is not None and result is not given:
        if callable(getattr(result, "wait", None)):
            result.wait()
        else:
            try:
                got = contiguous(wrap(result, "reduce's result"), "reduce's result")
            except TypeError as e:
                raise TypeError(f"reduce: returned {type(result).__name__}; expected None (reduced in place) or "
                                f"the reduced amaxes as an array of {n} float32 values") from e
            if got.dtype != "float32" or got.size != n:
                raise ValueError(f"reduce: returned {got.size} {got.dtype} values; expected None (reduced in "
                                 f"place) or the reduced amaxes as {n} float32 values")
            same_device(got, wrap(data, "amax"), "reduce's result", "the amaxes")
            data[...] = got.data.reshape(-1)  # float32 to float32: a copy of bits in any mode
    if saved is not None:
        neg = negative_amax_mask(data)
        if bool(neg.any()):
            i = int(np.flatnonzero(neg)[0])
            value = f32_text(data[i])
            data[...] = saved
            raise ValueError(f"reduce: gave a negative amax ({value}) for tensor {i}; amaxes are >= +0 (a MAX "
                             f"all-reduce of amaxes keeps them so); nothing was written")


# ---- out=: the caller's memory for the results (NumPy's convention); checked in full before any write -----

def outs(out: Any, n: int) -> tuple[Any, ...]:
    """``out`` as n entries (None: allocate that one); one array is accepted where there is one result."""
    if out is None:
        return (None,) * n
    if not isinstance(out, tuple):
        out = (out,)
    if len(out) != n:
        raise ValueError(f"out: expected {'an array or ' if n == 1 else ''}a tuple of {n} arrays (None for any "
                         f"to allocate), got a tuple of {len(out)}")
    return out


def out_slot(obj: Any, arg: str, shape: tuple, dtype: str, x: Tensor, xarg: str = "x") -> Tensor:
    """One output slot: contiguous, writable, on x's device, ``shape``, and ``dtype`` or its storage dtype
    (uint8 for fp8, uint16 for bfloat16: the format is already named by the call)."""
    t = contiguous(wrap(obj, arg), arg)
    same_device(t, x, arg, xarg)
    if t.dtype != dtype and t.dtype != _storage_name(dtype):
        storage = _storage_name(dtype)
        also = f" (or {storage} storage)" if storage != dtype else ""
        raise TypeError(f"{arg}: expected {dtype}{also}, got {t.dtype}")
    if t.shape != tuple(shape):
        raise ValueError(f"{arg}: expected shape {tuple(shape)}, got {t.shape}")
    if t.readonly:
        raise ValueError(f"{arg}: is read-only")
    return t


_storage_name = functools.cache(lambda dtype: storage_dtype(dtype).name)  # np.dtype(...).name: microseconds


def _overlap(a: Any, b: Any) -> bool:
    """Whether two arrays' memory ranges meet (every argument is contiguous by now)."""
    if isinstance(a, np.ndarray):
        return np.may_share_memory(a, b)  # the bounds only, without a pointer read (.ctypes costs more)
    if not a.size or not b.size:
        return False
    pa, pb = a.data.ptr, b.data.ptr
    return pa < pb + b.nbytes and pb < pa + a.nbytes


def no_overlap(outputs: Sequence[tuple[str, Tensor | None]], inputs: Sequence[tuple[str, Any]]) -> None:
    """No output may share memory with an input or another output: a kernel would read what it wrote."""
    named = [(a, t.data) for a, t in outputs if t is not None]
    others = [(a, d.data if isinstance(d, Tensor) else d) for a, d in inputs if d is not None]
    for i, (arg, data) in enumerate(named):
        for other, odata in named[i + 1:] + others:
            if _overlap(data, odata):
                raise ValueError(f"{arg}: overlaps {other} in memory; pass a separate array")


@functools.cache
def array_dtype(dtype: str, cuda: bool) -> np.dtype:
    """The dtype of a backend's array of logical ``dtype``: itself on the CPU, its storage dtype on a GPU."""
    return storage_dtype(dtype) if cuda else logical_numpy_dtype(dtype)


def result(backend: Any, spec: Any, like: Tensor) -> Any:
    """A new array for a result of ``spec`` (a declared output: shape and dtype name) from like's caller's
    allocator, as ``backend`` takes arrays."""
    if like.device[0] == "cpu":  # no device guard to take: the caller's allocator straight away (a small call's cost)
        dt = _LOGICAL.get(spec.dtype) or array_dtype(spec.dtype, False)
        caller = like.caller
        return caller.empty(spec.shape, dt, like.device) if caller.allocates else np.empty(spec.shape, dt)
    return backend.allocate(spec.shape, array_dtype(spec.dtype, True), like)


_LOGICAL: dict[str, np.dtype] = {name: np.dtype(name) for name in (*HIGH_PRECISION_DTYPES, *FP8_DTYPES)}


def backend_data(t: Tensor | None, dtype: str, shape: tuple | None = None) -> Any:
    """An out slot as its backend takes arrays: logical dtype on the CPU, storage dtype on a GPU."""
    if t is None:
        return None
    data = t.data.view(array_dtype(dtype, t.is_cuda))
    return data if shape is None else data.reshape(shape)


# ---- rules on shapes and dtype names alone: the core, its declarations (fp8core.declarations) and the front-ends
# that check while tracing state them once, here ------------------------------------------------------------

def check_shapes(a_shape: tuple[int, ...], b_shape: tuple[int, ...], fa: Format | None = None,
                 fb: Format | None = None) -> tuple[int, int, int]:
    """(M, K, N) of ``a [M, K] · b [N, K]ᵀ`` by cuBLASLt's FP8 limits, from shapes (and the operands' formats,
    when known) alone."""
    for arg, shape, dims in (("a", a_shape, "[M, K]"), ("b", b_shape, "[N, K]")):
        if len(shape) != 2:
            raise ValueError(f"{arg}: expected a 2-D {dims} array, got shape {tuple(shape)}")
    (m, k), (n, kb) = a_shape, b_shape
    if kb != k:
        raise ValueError(f"b: expected [N, K] with K = {k} to match a [M, K] = {tuple(a_shape)}, got shape "
                         f"{tuple(b_shape)}")
    if k == 0 or k % MULTIPLE:
        raise ValueError(f"a: K = {k}; cuBLASLt's FP8 GEMM needs K to be a positive multiple of {MULTIPLE}")
    if n == 0 or n % MULTIPLE:
        raise ValueError(f"b: N = {n}; cuBLASLt's FP8 GEMM needs N to be a positive multiple of {MULTIPLE}")
    if fa is Format.E5M2 and fb is Format.E5M2:
        raise ValueError("a, b: E5M2 x E5M2 has no FP8 GEMM (cuBLASLt); use E4M3 for one operand")
    return m, k, n


def fp4_operand(mk: tuple[int, int], function: str, block: int, columnwise: bool) -> tuple[int, int]:
    """[R, C] of an FP4 operand of x viewed as [M, K] = ``mk`` (x itself, or x^T with ``columnwise``), its rows a
    whole number of ``block``-element blocks."""
    m, k = mk
    cols = m if columnwise else k
    if cols % block:
        name, what = ("M", "down the columns of x") if columnwise else ("K", "along the rows of x")
        raise ValueError(f"x: {function}{' (columnwise)' if columnwise else ''} takes blocks of {block} {what} "
                         f"viewed as [M, K] = [{m}, {k}]; {name} = {cols} must be a multiple of {block}")
    return (k, m) if columnwise else (m, k)


def check_bias(dtype: str, shape: tuple[int, ...], n: int, out_name: str) -> None:
    """The bias rule by dtype name and shape: [N], of the type cuBLASLt pairs with the output."""
    allowed = _BIAS_DTYPES[out_name]
    if dtype not in allowed:
        raise TypeError(f"bias: for out_dtype {out_name} expected {' or '.join(allowed)}, got {dtype}")
    if tuple(shape) != (n,):
        raise ValueError(f"bias: expected shape ({n},) (N), got {tuple(shape)}")


def check_update_shapes(history: tuple[str, tuple[int, ...]], vectors: Sequence[tuple[str, str, tuple[int, ...],
                        str]], history_arg: str = "history") -> int:
    """The batched update's dtype and shape rules, from dtype names and shapes alone: history float32 [L, N], L and
    N >= 1; each (arg, dtype, shape, expected dtype) of ``vectors`` [N]. Returns N."""
    dtype, shape = history
    if dtype != "float32":
        raise TypeError(f"{history_arg}: expected float32, got {dtype}")
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"{history_arg}: expected shape [L, N] with L, N >= 1, got {tuple(shape)}")
    n = shape[1]
    for arg, dtype, shape, want in vectors:
        if dtype != want:
            raise TypeError(f"{arg}: expected {want}, got {dtype}")
        if tuple(shape) != (n,):
            raise ValueError(f"{arg}: expected shape ({n},) to match {history_arg} [L, {n}], got {tuple(shape)}")
    return n


def scale_dtypes(kind: str) -> tuple[str, ...]:
    """The dtypes a scale of a layout kind may have: its encoding's, and uint8 storage of E8M0 (CuPy)."""
    return (_E8M0, "uint8") if kind == "mx" else ("float32",)


def axis_layout(axis: Any) -> Layout:
    """The layout of :func:`quantize_rowwise`'s ``axis``: ROWWISE for -1 or 1, COLUMNWISE for 0 or -2."""
    if isinstance(axis, bool) or not isinstance(axis, int) or axis not in _AXES:
        raise ValueError(f"axis: expected -1 or 1 (one scale per row, amax over the columns) or 0 (one scale per "
                         f"column, amax over the rows) of x viewed as [rows, cols], got {axis!r}")
    return _AXES[axis]


def transposed_layout(layout: Layout, rows: int) -> Layout:
    """The layout of the transpose's scales, for data of ``rows`` rows (viewed 2-D); 1x128 blocks have none but
    in a single row, where they are a 128x128 tile's."""
    if layout.transposed is None and rows > 1:
        raise ValueError(f"t: {layout.value} blocks lie along rows and have no transpose; quantize the transposed "
                         "tensor instead")
    return layout.transposed or Layout.BLOCK_128X128


def gemm_operands(a: Any, b: Any, a_scale_inv: Any, b_scale_inv: Any) -> None:
    """Scaled GEMM operands: both ScaledTensors of one kind (MX, fp32 blocks, one scale, NVFP4) and element
    width (FP4's E2M1 or fp8), no separate scales."""
    for arg, obj in (("a", a), ("b", b)):
        if not isinstance(obj, ScaledTensor):
            raise TypeError(f"{arg}: with a block-scaled operand, expected a ScaledTensor (MXTensor, "
                            f"BlockScaledTensor, NVFP4Tensor, MXFP4Tensor), got {type(obj).__name__}; quantize both "
                            "operands with the same scheme")
    if a.kind != b.kind or (a.encoding is E2M1) != (b.encoding is E2M1):
        raise ValueError(f"b: a is {type(a).__name__} but b is {type(b).__name__} ({_described(a)} and "
                         f"{_described(b)}); a scaled GEMM takes two operands of one scheme: MXFP8, fp32 blocks, "
                         "one scale per row, one scale each, NVFP4 or MXFP4")
    for arg, value in (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv)):
        if value is not None:
            raise ValueError(f"{arg}: block-scaled operands carry their own scales; pass no {arg}")


def _described(t: ScaledTensor) -> str:
    """t's layout and element encoding, for an error ("1x16 E2M1")."""
    try:
        layout = t.layout.value
    except ValueError:  # a scale no layout fits: its own error comes once the operands match
        layout = t.kind
    row = t.encoding or _BY_DTYPE.get(dtype_name(t[0].dtype))
    return f"{layout} {row.name if row else dtype_name(t[0].dtype)}"


def gemm_layouts(a_layout: Layout, b_layout: Layout, m: int, n: int, k: int) -> None:
    """The scaled ``a [M, K] · b [N, K]ᵀ`` by cuBLASLt's limits, from layouts and shapes alone: the one
    statement of the rule, for the core and the front-ends that check it while tracing."""
    if a_layout.kind == "axiswise":
        for arg, layout, rows in (("a.scale_inv", a_layout, m), ("b.scale_inv", b_layout, n)):
            if layout != Layout.ROWWISE:
                raise ValueError(f"{arg}: the GEMM takes one scale per row of a [M, K] and of b [N, K] (rowwise, "
                                 f"along K): expected shape {Layout.ROWWISE.scale_shape(rows, k)}, got "
                                 f"{layout.scale_shape(rows, k)} ({layout.label}); transpose_blocks a columnwise "
                                 "operand first")
        return
    if a_layout.kind == "mx":
        if k % MX_BLOCK:
            raise ValueError(f"a: K = {k}; an MXFP8 GEMM needs K to be a multiple of 32 (whole 1x32 blocks)")
        for arg, layout, rows in (("a.scale", a_layout, m), ("b.scale", b_layout, n)):
            if layout != Layout.MX_ROWWISE:
                raise ValueError(f"{arg}: the GEMM takes rowwise MXFP8 (blocks along K): expected shape "
                                 f"{Layout.MX_ROWWISE.scale_shape(rows, k)}, got {layout.scale_shape(rows, k)}")
        return
    if k % FP32_BLOCK:
        raise ValueError(f"a: K = {k}; a 1x128/128x128 block GEMM needs K to be a multiple of 128 (whole blocks)")
    if a_layout == b_layout == Layout.BLOCK_128X128:
        raise ValueError("a, b: cuBLASLt has no 128x128 x 128x128 GEMM; quantize a (activations, gradients) in "
                         "1x128 blocks")
    # cuBLASLt 13.1 on an H200 found no algorithm for M = 1 and M = 130 (run of 2026-11-26) and ran M = 8, 20, 136;
    # Transformer Engine asks a multiple of 8 too ("Caller must pad"). N is a multiple of 16 for every FP8 GEMM.
    if m % 8:
        raise ValueError(f"a: M = {m}; a 1x128/128x128 block GEMM needs M to be a multiple of 8 (as Transformer "
                         "Engine asks; cuBLASLt found no algorithm for M = 1 or 130), on both backends: pad a's rows "
                         "with zeros")
