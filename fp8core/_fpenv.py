"""The IEEE default floating-point environment around the CPU reference, whatever the calling thread set.

Programs flush subnormals behind our back: XLA:CPU runs host callbacks with flush-to-zero and
denormals-are-zero set, ``torch.set_flush_denormal(True)`` sets both in the calling thread, and threads
created from such a thread inherit them. NumPy then multiplies, compares and converts with subnormals read
and written as zero, and fp8core's results would depend on who called. :func:`ieee` runs a function in the
default environment (round to nearest, no flushing, exceptions masked) and restores the caller's afterwards.
"Exceptions masked" includes NumPy's own reporting: inside, NumPy warns of nothing (as ``np.errstate(all="ignore")``),
since NaN, inf, overflow and underflow are values the numerics contract defines, not errors.

The check is three Python float operations (well under a microsecond with the call); only a thread that is not
in the default environment pays for the switch and the restore (three libm calls, ~2-3 us). Unmasked
(trapping) exceptions are not looked for. Where libm's ``fenv`` cannot be reached (not glibc, musl or macOS),
the functions run unguarded and :data:`GUARDED` is False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any, Callable, TypeVar

import numpy as np

__all__ = ["ieee", "is_default", "set_default", "GUARDED"]

F = TypeVar("F", bound=Callable[..., Any])

_ENV_BYTES = 64  # room for fenv_t on every platform handled here (x86-64: 32 bytes, aarch64: 8, macOS: <= 16)


def _load() -> tuple[Any, Any] | None:
    if sys.platform == "win32":
        return None
    try:
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        get, put = libm.fegetenv, libm.fesetenv
    except (OSError, AttributeError):
        return None
    get.argtypes = put.argtypes = [ctypes.c_void_p]
    get.restype = put.restype = ctypes.c_int
    if sys.platform == "darwin":
        try:
            default = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.in_dll(libm, "_FE_DFL_ENV")))
        except ValueError:
            return None
    else:
        default = ctypes.c_void_p(-1)  # glibc and musl: FE_DFL_ENV is ((const fenv_t *) -1)
    return (get, put), default


_loaded = _load()
GUARDED = _loaded is not None

# NumPy >= 2 keeps its error state in a context variable: setting a prepared value costs ~0.1 us where entering
# np.errstate costs ~2 (it builds the value each time), a tenth of a small call. Private, hence the fallback.
try:
    from numpy._core._ufunc_config import _extobj_contextvar as _ERRSTATE, _make_extobj

    _IGNORE = _make_extobj(all="ignore")
except (ImportError, AttributeError, TypeError):
    _ERRSTATE = None

# The mode test is plain Python float arithmetic (C doubles obey the thread's MXCSR/FPCR as NumPy's loops do):
# three operations, ~0.1 us, where a ctypes fegetenv costs ~0.7 us. Module globals keep the compiler from
# folding them.
_SUB = 5e-324                       # the smallest subnormal double: _SUB * 1 is 0 under denormals-are-zero
_ONE = 1.0                          # (the input is read as 0) and under flush-to-zero (the result is written as 0)
_UP = 1.6653345369377348e-16        # 0.75 * 2^-52: 1 + _UP is 1 + 2^-52 only when rounding to nearest or up,
_NEXT = 1.0000000000000002          # and -1 - _UP is -(1 + 2^-52) only when rounding to nearest or down


def is_default() -> bool:
    """Whether this thread computes as IEEE 754 says by default: no flushing, round to nearest even."""
    return _SUB * _ONE != 0.0 and _ONE + _UP == _NEXT and -_ONE - _UP == -_NEXT


def set_default() -> None:
    """Put the calling thread in the default environment for good (for threads that only run fp8core)."""
    if _loaded is not None:
        _loaded[0][1](_loaded[1])


def _switched(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """fn(*args, **kwargs) in the default environment, the caller's restored afterwards (``_loaded`` is set)."""
    (get, put), default = _loaded  # type: ignore[misc]
    saved = (ctypes.c_ubyte * _ENV_BYTES)()
    get(saved)
    put(default)
    try:
        return fn(*args, **kwargs)
    finally:
        put(saved)


def ieee(fn: F) -> F:
    """``fn`` run in the IEEE default floating-point environment, NumPy's warnings off; the caller's environment
    and error state are restored afterwards."""
    if _loaded is None or _ERRSTATE is None:
        return _unguarded(fn)
    sub, one, up, nxt, mone, mnxt = _SUB, _ONE, _UP, _NEXT, -_ONE, -_NEXT  # closure cells: cheaper than globals
    errstate, ignore = _ERRSTATE, _IGNORE

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        token = errstate.set(ignore)
        try:
            if sub * one != 0.0 and one + up == nxt and mone - up == mnxt:
                return fn(*args, **kwargs)
            return _switched(fn, args, kwargs)
        finally:
            errstate.reset(token)

    return guarded  # type: ignore[return-value]


def _unguarded(fn: F) -> F:
    """The slow spelling, for a platform without a reachable fenv or a NumPy without the context variable."""
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        with np.errstate(all="ignore"):
            if _loaded is None or is_default():
                return fn(*args, **kwargs)
            return _switched(fn, args, kwargs)

    return guarded  # type: ignore[return-value]
