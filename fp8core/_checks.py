"""The argument rules of fp8core, in one place: the core primitives, the torch custom ops (fp8core.torch) and
the JAX functions (fp8core.jax) call these, so a bad argument gets the same error whichever door it came in by.

Each check is cheap when the argument is valid; messages are formatted only on failure, and every message
starts with the argument's name.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from .formats import FP8_DTYPES, HIGH_PRECISION_DTYPES, Format, as_format, dtype_name

__all__ = ["MAX_MARGIN", "MAX_HISTORY_LEN", "MAX_TENSORS", "AMAX_ALGOS", "F32_EPSILON_MAX", "margin", "epsilon",
           "flag", "real", "amax_algo", "scale_value", "scale_values", "scale_mask", "negative_amax_mask", "f32_text",
           "fmt", "out_dtype", "array_sequence", "high_precision_name"]

MAX_MARGIN = 512
# A delayed-scaling state's dimensions: the update kernel takes the history length as a 32-bit int, and a count
# of tensors beyond it is no real model (2**31 tensors of 1 KiB history each would be 2 TiB of state).
MAX_HISTORY_LEN = MAX_TENSORS = 2**31 - 1
AMAX_ALGOS = ("max", "most_recent")
_HP = frozenset(HIGH_PRECISION_DTYPES)
# The largest double that rounds (to nearest) to a finite float32: 2**128 - 2**103, exclusive. Above it an
# epsilon becomes inf in float32 and every amax is floored to inf (no scale at all, silently).
_F32_ROUNDS_TO_INF = 3.4028235677973366e38
F32_EPSILON_MAX = 3.4028234663852886e38  # float32's largest finite value, as the messages state the bound
_INF_BITS = 0x7F800000
_ABS_BITS = 0x7FFFFFFF
_SIGN_BIT = 0x80000000


def margin(value: Any, arg: str = "margin") -> int:
    """An int with ``|value| <= 512`` (the scale is ``fp8_max / amax / 2**margin``)."""
    if type(value) is int and -MAX_MARGIN <= value <= MAX_MARGIN:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{arg}: expected an int, got {type(value).__name__}")
    if abs(int(value)) > MAX_MARGIN:
        raise ValueError(f"{arg}: expected |{arg}| <= {MAX_MARGIN}, got {value}")
    return int(value)


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


def amax_algo(value: Any, arg: str = "amax_compute_algo") -> str:
    """'max' or 'most_recent' (the batched update's built-in rules)."""
    if isinstance(value, str) and value in AMAX_ALGOS:
        return value
    raise ValueError(f"{arg}: expected one of {', '.join(repr(a) for a in AMAX_ALGOS)}, got {value!r}")


def scale_value(value: Any, arg: str) -> float:
    """A Python number usable as a scale: finite and > 0 (0, NaN, inf and negatives would poison every cast)."""
    v = real(value, arg)
    if not 0.0 < v < math.inf:
        raise ValueError(f"{arg}: expected a finite scale > 0, got {value}")
    return v


# Value checks of float32 arrays read their bits: a comparison would read a subnormal as 0 in a thread that
# flushes (torch.set_flush_denormal, XLA:CPU's callbacks) and on a GPU (CuPy compiles with -ftz=true), and the
# contract says such modes never change a result, a refusal included.

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


def fmt(value: Any, arg: str = "fmt") -> Format:
    """An fp8 encoding (Format.E4M3, Format.E5M2, 'e4m3', 'e5m2', an fp8 dtype); HYBRID is a recipe, refused."""
    return as_format(value, arg=arg)


def out_dtype(value: Any, arg: str = "out_dtype") -> str:
    """float32, bfloat16 or float16 (a name, or a NumPy, torch or JAX dtype)."""
    name = value if isinstance(value, str) else dtype_name(value)
    if name not in _HP:
        raise ValueError(f"{arg}: expected float32, bfloat16 or float16, got {value!r}")
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
