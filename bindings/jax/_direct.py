"""The core primitives' bodies for the callbacks of fp8core.jax, whose outputs are XLA's own buffers.

fp8core.quantize(..., out=) checks every ``out`` it is given: wrapped, contiguous, on x's device, of the right
dtype and shape, writable, and overlapping no input nor other output (~40 us a call on the CPU, most of a small
call's Python). XLA's output buffers pass all of that by construction: fp8core.jax declares their shapes and
dtypes, XLA allocates them on the callback's device, and without declared input/output aliases no two buffers
share memory. These functions check the inputs with the core's own functions, in the core's order (the same
errors), and hand XLA's buffers straight to the backend. ``fp8core.jax.TRUSTED_OUTS = False`` sends every call
through the public primitives instead (tests/test_jax_fastpaths.py compares the two).
"""

from __future__ import annotations

from typing import Any, Sequence

from fp8core import _checks, ops
from fp8core._tensor import Tensor


def quantize(outs: Sequence[Tensor], x: Tensor, scale: Tensor, fmt: Any) -> None:
    """outs: (q [x's shape, fmt], amax [1] zeroed)."""
    t = ops._high_precision(x, "x")
    f = ops._format(fmt)
    s = ops._scalar(scale, t, "scale")
    ops._backend(t).quantize(t, s, f, outs[1].data, out=ops._backend_data(outs[0], f.dtype_name))


def cast_transpose(outs: Sequence[Tensor], x: Tensor, scale: Tensor, fmt: Any) -> None:
    """outs: (q [x's shape], q_t [last, prod(leading)], amax [1] zeroed)."""
    t = ops._high_precision(x, "x")
    f = ops._format(fmt)
    s = ops._scalar(scale, t, "scale")
    t2 = ops._as_2d(t, "x")
    ops._backend(t).cast_transpose(t2, s, f, outs[2].data, out=(
        ops._backend_data(outs[0], f.dtype_name, t2.shape), ops._backend_data(outs[1], f.dtype_name)))


def quantize_dynamic(outs: Sequence[Tensor], x: Tensor, fmt: Any, margin: Any, power_of_2: Any,
                     epsilon: Any) -> None:
    """outs: (q [x's shape], scale_inv [1], amax [1])."""
    t = ops._high_precision(x, "x")
    f = ops._format(fmt)
    m, eps = ops._margin(margin), ops._epsilon(epsilon)
    ops._backend(t).quantize_dynamic(
        t, f, m, _checks.flag(power_of_2, "power_of_2"), eps, None,
        out=tuple(ops._backend_data(o, d) for o, d in zip(outs, (f.dtype_name, "float32", "float32"))))


def dequantize(outs: Sequence[Tensor], q: Tensor, scale_inv: Tensor, out_dtype: str, fmt: Any) -> None:
    """outs: (y [q's shape, out_dtype],)."""
    t, f = ops._fp8(q, "q", fmt)
    name = ops._out_dtype(out_dtype)
    s = ops._scalar(scale_inv, t, "scale_inv", "q")
    ops._backend(t).dequantize(t, f, s, name, out=ops._backend_data(outs[0], name))


def transpose(outs: Sequence[Tensor], q: Tensor, fmt: Any) -> None:
    """outs: (q_t [last, prod(leading)],)."""
    t, f = ops._fp8(q, "q", fmt)
    t = ops._as_2d(t, "q")
    ops._backend(t).transpose(t, out=ops._backend_data(outs[0], f.dtype_name))
