"""fp8core's primitives as torch custom ops (namespace ``fp8core``), CPU and CUDA, each with a fake so that
``torch.compile(fullgraph=True)`` traces through them. The numerics are the core's: each op calls fp8core.

Formats are passed as strings ("e4m3", "e5m2"); scales and amax slots are 1-element float32 tensors.
An argument on the meta device beside real ones is refused as the core refuses it; with every argument on meta
an op infers shapes only (fake_rules.py says why).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

import fp8core
from fp8core import backends
from fp8core.scaling import check_update_args

from .fake_rules import gemm_shape, matrix, refuse_meta, update_args

Tensor = torch.Tensor
_LIB = "fp8core"


def follow_torch_threads(fn):
    """The op's body inside ``fp8core.cpu_threads(torch.get_num_threads())``: fp8core's CPU work (its pool, NumPy's
    BLAS) takes the threads torch takes, so ``torch.set_num_threads`` is the one setting of a torch program."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with fp8core.cpu_threads(torch.get_num_threads()):
            return fn(*args, **kwargs)
    return run


def _fp8_dtype(fmt: str) -> torch.dtype:
    return fp8core.as_format(fmt).torch_dtype


@torch.library.custom_op(f"{_LIB}::amax", mutates_args=())
@follow_torch_threads
def amax(x: Tensor) -> Tensor:
    """max |x| as float32 [1]."""
    return fp8core.amax(x)


@amax.register_fake
def _(x):
    return x.new_empty((1,), dtype=torch.float32)


# An optional argument that an op mutates trips Inductor when it is None (torch 2.13), so each op that can
# accumulate an amax is two custom ops, with and without the slot; the Python function picks one.

def quantize(x: Tensor, scale: Tensor, fmt: str, amax_out: Optional[Tensor] = None) -> Tensor:
    """SATFINITE_RTNE(fp32(x) * scale) in fmt; amax_out (float32 [1]) accumulates max |x| in place."""
    if amax_out is None:
        return torch.ops.fp8core.quantize(x, scale, fmt)
    return torch.ops.fp8core.quantize_amax(x, scale, fmt, amax_out)


@torch.library.custom_op(f"{_LIB}::quantize", mutates_args=())
@follow_torch_threads
def _quantize(x: Tensor, scale: Tensor, fmt: str) -> Tensor:
    return fp8core.quantize(x, scale, fmt)


@torch.library.custom_op(f"{_LIB}::quantize_amax", mutates_args=("amax_out",))
@follow_torch_threads
def _quantize_amax(x: Tensor, scale: Tensor, fmt: str, amax_out: Tensor) -> Tensor:
    return fp8core.quantize(x, scale, fmt, amax_out=amax_out)


@_quantize.register_fake
def _(x, scale, fmt):
    refuse_meta(("x", x), ("scale", scale))
    return torch.empty_like(x, dtype=_fp8_dtype(fmt))


@_quantize_amax.register_fake
def _(x, scale, fmt, amax_out):
    refuse_meta(("x", x), ("scale", scale), ("amax_out", amax_out))
    return torch.empty_like(x, dtype=_fp8_dtype(fmt))


@torch.library.custom_op(f"{_LIB}::quantize_dynamic", mutates_args=())
@follow_torch_threads
def quantize_dynamic(x: Tensor, fmt: str, margin: int = 0, power_of_2: bool = False,
                     epsilon: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Current scaling: (q, scale_inv [1], amax [1])."""
    return fp8core.quantize_dynamic(x, fmt, margin=margin, power_of_2=power_of_2, epsilon=epsilon)


@quantize_dynamic.register_fake
def _(x, fmt, margin=0, power_of_2=False, epsilon=0.0):
    one = x.new_empty((1,), dtype=torch.float32)
    return torch.empty_like(x, dtype=_fp8_dtype(fmt)), one, torch.empty_like(one)


@torch.library.custom_op(f"{_LIB}::dequantize", mutates_args=())
@follow_torch_threads
def dequantize(q: Tensor, scale_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    return fp8core.dequantize(q, scale_inv, out_dtype)


@dequantize.register_fake
def _(q, scale_inv, out_dtype):
    refuse_meta(("q", q), ("scale_inv", scale_inv))
    return torch.empty_like(q, dtype=out_dtype)


@torch.library.custom_op(f"{_LIB}::transpose", mutates_args=())
@follow_torch_threads
def transpose(q: Tensor) -> Tensor:
    """[prod(leading), last] -> [last, prod(leading)], bits unchanged."""
    return fp8core.transpose(q)


@transpose.register_fake
def _(q):
    rows, cols = matrix(q, "q")
    return q.new_empty((cols, rows))


def cast_transpose(x: Tensor, scale: Tensor, fmt: str, amax_out: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(quantize(x), its [last, prod(leading)] transpose) from one read of x."""
    if amax_out is None:
        return torch.ops.fp8core.cast_transpose(x, scale, fmt)
    return torch.ops.fp8core.cast_transpose_amax(x, scale, fmt, amax_out)


@torch.library.custom_op(f"{_LIB}::cast_transpose", mutates_args=())
@follow_torch_threads
def _cast_transpose(x: Tensor, scale: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    return fp8core.cast_transpose(x, scale, fmt)


@torch.library.custom_op(f"{_LIB}::cast_transpose_amax", mutates_args=("amax_out",))
@follow_torch_threads
def _cast_transpose_amax(x: Tensor, scale: Tensor, fmt: str, amax_out: Tensor) -> tuple[Tensor, Tensor]:
    return fp8core.cast_transpose(x, scale, fmt, amax_out=amax_out)


def _cast_transpose_fake(x, scale, fmt, amax_out=None):
    refuse_meta(("x", x), ("scale", scale), ("amax_out", amax_out))
    rows, cols = matrix(x, "x")
    dt = _fp8_dtype(fmt)
    return torch.empty_like(x, dtype=dt), x.new_empty((cols, rows), dtype=dt)


_cast_transpose.register_fake(_cast_transpose_fake)
_cast_transpose_amax.register_fake(_cast_transpose_fake)


@torch.library.custom_op(f"{_LIB}::compute_scale", mutates_args=())
@follow_torch_threads
def compute_scale(amax: Tensor, fmt: str, margin: int = 0, power_of_2: bool = False,
                  epsilon: float = 0.0) -> tuple[Tensor, Tensor]:
    """(scale, scale_inv) from amax by the contract's scale rule (1.0 where there is no scale)."""
    return fp8core.compute_scale(amax, fmt, margin=margin, power_of_2=power_of_2, epsilon=epsilon)


@compute_scale.register_fake
def _(amax, fmt, margin=0, power_of_2=False, epsilon=0.0):
    shape = amax.shape if amax.dim() else (1,)  # a 0-d amax gives [1] results, as the core's
    return amax.new_empty(shape), amax.new_empty(shape)


def gemm(a: Tensor, b: Tensor, a_scale_inv: Tensor, b_scale_inv: Tensor, out_dtype: torch.dtype,
         bias: Optional[Tensor] = None, out_scale: Optional[Tensor] = None, out_amax: Optional[Tensor] = None,
         use_fast_accum: bool = False) -> Tensor:
    """[M, N] = (a[M, K] · b[N, K]ᵀ) · a_scale_inv · b_scale_inv (+ bias); see fp8core.gemm."""
    if out_amax is None:
        return torch.ops.fp8core.gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, out_scale, use_fast_accum)
    return torch.ops.fp8core.gemm_amax(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, out_scale, out_amax,
                                       use_fast_accum)


@torch.library.custom_op(f"{_LIB}::gemm", mutates_args=())
@follow_torch_threads
def _gemm(a: Tensor, b: Tensor, a_scale_inv: Tensor, b_scale_inv: Tensor, out_dtype: torch.dtype,
          bias: Optional[Tensor], out_scale: Optional[Tensor], use_fast_accum: bool) -> Tensor:
    return fp8core.gemm(a, b, a_scale_inv, b_scale_inv, out_dtype=out_dtype, bias=bias, out_scale=out_scale,
                        use_fast_accum=use_fast_accum)


@torch.library.custom_op(f"{_LIB}::gemm_amax", mutates_args=("out_amax",))
@follow_torch_threads
def _gemm_amax(a: Tensor, b: Tensor, a_scale_inv: Tensor, b_scale_inv: Tensor, out_dtype: torch.dtype,
               bias: Optional[Tensor], out_scale: Optional[Tensor], out_amax: Tensor, use_fast_accum: bool) -> Tensor:
    return fp8core.gemm(a, b, a_scale_inv, b_scale_inv, out_dtype=out_dtype, bias=bias, out_scale=out_scale,
                        out_amax=out_amax, use_fast_accum=use_fast_accum)


def _gemm_fake(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, out_scale, *rest):
    out_amax = rest[0] if len(rest) == 2 else None
    refuse_meta(("a", a), ("b", b), ("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv), ("bias", bias),
                ("out_scale", out_scale), ("out_amax", out_amax))
    return a.new_empty(gemm_shape(a, b), dtype=out_dtype)


_gemm.register_fake(_gemm_fake)
_gemm_amax.register_fake(_gemm_fake)


@torch.library.custom_op(f"{_LIB}::update", mutates_args=("history", "scale", "scale_inv", "non_finite"))
@follow_torch_threads
def update(history: Tensor, scale: Tensor, scale_inv: Tensor, fp8_max: Tensor, non_finite: Tensor, margin: int,
           algo: str, power_of_2: bool, epsilon: float, update_scale: bool) -> None:
    """The batched delayed-scaling update of N tensors, in place: history [L, N], scale/scale_inv/fp8_max
    float32 [N], non_finite bool [N], all on one device; margin |m| <= 512, algo 'max' or 'most_recent',
    epsilon finite >= 0. Everything is checked (the core's checks) before the one launch on a GPU."""
    h, s, si, fm, nf, margin, algo, epsilon = check_update_args(history, scale, scale_inv, fp8_max, non_finite,
                                                                margin, algo, epsilon)
    backend = backends.for_device(h.device)
    args = (h.data, s, si, fm, margin, algo, bool(power_of_2), epsilon, bool(update_scale), nf)
    if h.is_cuda:
        with backend.launch_stream(h.caller.stream(h.device[1])):
            backend.update(*args)
    else:
        backend.update(*args)


@update.register_fake
def _(history, scale, scale_inv, fp8_max, non_finite, margin, algo, power_of_2, epsilon, update_scale):
    refuse_meta(("history", history), ("scale", scale), ("scale_inv", scale_inv), ("fp8_max", fp8_max),
                ("non_finite", non_finite))
    update_args(history, (("scale", scale, "float32"), ("scale_inv", scale_inv, "float32"),
                          ("fp8_max", fp8_max, "float32"), ("non_finite", non_finite, "bool")), margin, algo, epsilon)
    return None
