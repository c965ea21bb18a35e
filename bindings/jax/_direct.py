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

from fp8core import args, backends
from fp8core._tensor import Tensor


def quantize(outs: Sequence[Tensor], x: Tensor, scale: Tensor, fmt: Any) -> None:
    """outs: (q [x's shape, fmt], amax [1] zeroed)."""
    t = args.high_precision(x, "x")
    f = args.fmt(fmt)
    s = args.scalar(scale, t, "scale")
    backends.for_device(t.device).quantize(t, s, f, outs[1].data, out=args.backend_data(outs[0], f.dtype_name))


def cast_transpose(outs: Sequence[Tensor], x: Tensor, scale: Tensor, fmt: Any) -> None:
    """outs: (q [x's shape], q_t [last, prod(leading)], amax [1] zeroed)."""
    t = args.high_precision(x, "x")
    f = args.fmt(fmt)
    s = args.scalar(scale, t, "scale")
    t2 = args.as_2d(t, "x")
    backends.for_device(t.device).cast_transpose(t2, s, f, outs[2].data, out=(
        args.backend_data(outs[0], f.dtype_name, t2.shape), args.backend_data(outs[1], f.dtype_name)))


def quantize_dynamic(outs: Sequence[Tensor], x: Tensor, fmt: Any, margin: Any, power_of_2: Any,
                     epsilon: Any) -> None:
    """outs: (q [x's shape], scale_inv [1], amax [1])."""
    t = args.high_precision(x, "x")
    f = args.fmt(fmt)
    m, eps = args.margin(margin), args.epsilon(epsilon)
    backends.for_device(t.device).quantize_dynamic(
        t, f, m, args.flag(power_of_2, "power_of_2"), eps, None,
        out=tuple(args.backend_data(o, d) for o, d in zip(outs, (f.dtype_name, "float32", "float32"))))


def dequantize(outs: Sequence[Tensor], q: Tensor, scale_inv: Tensor, out_dtype: str, fmt: Any) -> None:
    """outs: (y [q's shape, out_dtype],)."""
    t, f = args.fp8(q, "q", fmt)
    name = args.out_dtype(out_dtype)
    s = args.scalar(scale_inv, t, "scale_inv", "q")
    backends.for_device(t.device).dequantize(t, f, s, name, out=args.backend_data(outs[0], name))


def transpose(outs: Sequence[Tensor], q: Tensor, fmt: Any) -> None:
    """outs: (q_t [last, prod(leading)],)."""
    t, f = args.fp8(q, "q", fmt)
    t = args.as_2d(t, "q")
    backends.for_device(t.device).transpose(t, out=args.backend_data(outs[0], f.dtype_name))
