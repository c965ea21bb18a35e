"""The argument rules of fp8core, in one place: the core primitives, the torch custom ops (fp8core.torch) and
the JAX functions (fp8core.jax) call these, so a bad argument gets the same error whichever door it came in by.

Each check is cheap when the argument is valid; messages are formatted only on failure, and every message
starts with the argument's name.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .formats import FP8_DTYPES, HIGH_PRECISION_DTYPES, Format, as_format, dtype_name

__all__ = ["MAX_MARGIN", "AMAX_ALGOS", "margin", "epsilon", "flag", "amax_algo", "scale_value", "scale_values",
           "fmt", "out_dtype", "array_sequence", "high_precision_name"]

MAX_MARGIN = 512
AMAX_ALGOS = ("max", "most_recent")
_HP = frozenset(HIGH_PRECISION_DTYPES)


def margin(value: Any, arg: str = "margin") -> int:
    """An int with ``|value| <= 512`` (the scale is ``fp8_max / amax / 2**margin``)."""
    if type(value) is int and -MAX_MARGIN <= value <= MAX_MARGIN:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{arg}: expected an int, got {type(value).__name__}")
    if abs(int(value)) > MAX_MARGIN:
        raise ValueError(f"{arg}: expected |{arg}| <= {MAX_MARGIN}, got {value}")
    return int(value)


def epsilon(value: Any, arg: str = "epsilon") -> float:
    """A finite float >= 0 (the amax floor)."""
    if type(value) is float and 0.0 <= value < math.inf:
        return value
    if isinstance(value, (bool, str)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{arg}: expected a float, got {type(value).__name__}")
    eps = float(value)
    if not eps >= 0.0 or eps == math.inf:
        raise ValueError(f"{arg}: expected a finite value >= 0, got {value}")
    return eps


def flag(value: Any, arg: str) -> bool:
    """A real bool (or NumPy bool): 'False', 0 and None are refused, not read by their truthiness."""
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{arg}: expected a bool, got {value!r}")


def amax_algo(value: Any, arg: str = "amax_compute_algo") -> str:
    """'max' or 'most_recent' (the batched update's built-in rules)."""
    if isinstance(value, str) and value in AMAX_ALGOS:
        return value
    raise ValueError(f"{arg}: expected one of {', '.join(repr(a) for a in AMAX_ALGOS)}, got {value!r}")


def scale_value(value: Any, arg: str) -> float:
    """A Python number usable as a scale: finite and > 0 (0, NaN, inf and negatives would poison every cast)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{arg}: expected a number, got {type(value).__name__}")
    v = float(value)
    if not 0.0 < v < math.inf:
        raise ValueError(f"{arg}: expected a finite scale > 0, got {value}")
    return v


def scale_values(values: np.ndarray, arg: str) -> None:
    """Every element of a host float32 array is a usable scale (see :func:`scale_value`)."""
    if values.size and not bool(np.all((values > 0) & (values < np.inf))):
        bad = values[~((values > 0) & (values < np.inf))].reshape(-1)[0]
        raise ValueError(f"{arg}: expected finite scales > 0, got {bad}")


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
