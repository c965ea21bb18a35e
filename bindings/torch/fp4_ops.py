"""NVFP4 as torch custom ops (``torch.ops.fp8core.quantize_nvfp4``, ``torch.ops.fp8core.nvfp4_gemm``), each with a
fake so that ``torch.compile(fullgraph=True)`` traces through them. The numerics are the core's (fp8core.fp4).

The random state of stochastic rounding is a tensor, int64 [2] = (seed, offset), read when the op runs: a module
advances it in place each step and a compiled graph neither bakes it in as a constant nor recompiles for it.
``stream`` is added to the offset, so the quantizations of one step draw independent bytes (stream 0, 1, ...).
The state may live in host memory (read there, passed to the kernel by value) or on x's device (the kernel reads
it there by pointer: never read to the host, so FSDP2 or a user moving it costs no wait for the GPU).
The ops return plain (data, scale, global_amax) tuples; the wrappers below give :class:`NVFP4Tensor`.
"""

# No `from __future__ import annotations`: torch.library reads the ops' annotations in the globals of the
# function it is given, follow_torch_threads' wrapper from ops.py, where `Tensor` is not a name.
import torch

import fp8core
from fp8core.layouts import Layout, NVFP4Tensor

from .fake_rules import matrix, refuse_meta
from .ops import follow_torch_threads

Tensor = torch.Tensor
_LIB = "fp8core"

__all__ = ["quantize_nvfp4", "nvfp4_gemm", "advance_rng"]


def _check_rng(rng: Tensor, x: Tensor | None = None) -> None:
    """The state's dtype and shape, and its place: host memory or x's device (its metadata only: no read)."""
    if rng.dtype != torch.int64 or tuple(rng.shape) != (2,):
        raise ValueError(f"rng: expected int64 [2] (seed, offset), got {rng.dtype} {tuple(rng.shape)}")
    if x is not None and rng.device != x.device and rng.device.type != "cpu":
        raise ValueError(f"rng: is on {rng.device} but x is on {x.device}; keep the (seed, offset) state on x's "
                         "device (read there by the kernel) or in host memory (read by value)")


@torch.library.custom_op(f"{_LIB}::quantize_nvfp4", mutates_args=())
@follow_torch_threads
def _quantize_nvfp4(x: Tensor, weight_2d: bool, hadamard: bool, stochastic: bool, rng: Tensor, stream: int,
                    columnwise: bool) -> tuple[Tensor, Tensor, Tensor]:
    _check_rng(rng, x)
    q = fp8core.quantize_nvfp4(x, weight_2d=weight_2d, hadamard=hadamard,
                               rounding="stochastic" if stochastic else "nearest",
                               rng_state=rng.contiguous() if stochastic else None, offset=stream if stochastic else 0,
                               columnwise=columnwise)
    return tuple(q)


@_quantize_nvfp4.register_fake
def _(x, weight_2d, hadamard, stochastic, rng, stream, columnwise):
    refuse_meta(("x", x), ("rng", rng))
    m, k = matrix(x, "x")
    rows, cols = (k, m) if columnwise else (m, k)
    scale_rows = -(-rows // 16) if weight_2d else rows
    return (x.new_empty((rows, cols // 2), dtype=torch.uint8),
            x.new_empty((scale_rows, cols // 16), dtype=torch.float8_e4m3fn),
            x.new_empty((1,), dtype=torch.float32))


@torch.library.custom_op(f"{_LIB}::nvfp4_gemm", mutates_args=())
@follow_torch_threads
def _nvfp4_gemm(a: Tensor, a_scale: Tensor, a_amax: Tensor, b: Tensor, b_scale: Tensor, b_amax: Tensor,
                a_layout: str, b_layout: str, out_dtype: torch.dtype) -> Tensor:
    return fp8core.gemm(NVFP4Tensor(a, a_scale, a_amax, a_layout), NVFP4Tensor(b, b_scale, b_amax, b_layout),
                        out_dtype=out_dtype)


@_nvfp4_gemm.register_fake
def _(a, a_scale, a_amax, b, b_scale, b_amax, a_layout, b_layout, out_dtype):
    refuse_meta(("a", a), ("a.scale", a_scale), ("a.global_amax", a_amax), ("b", b), ("b.scale", b_scale),
                ("b.global_amax", b_amax))
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"b: expected packed data [N, K/2] beside a's [M, K/2] = {tuple(a.shape)}, got shape "
                         f"{tuple(b.shape)}")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.custom_op(f"{_LIB}::advance_rng", mutates_args=())
def advance_rng(rng: Tensor, streams: int) -> tuple[Tensor, Tensor]:
    """(a copy of rng, rng with its offset advanced by ``streams``), int64 [2] each. An op, not a clone: the
    compiled backward must read the copy saved at the forward, and AOTAutograd's partitioner would recompute a clone
    in the backward from the buffer the forward has since advanced."""
    _check_rng(rng)  # the shape only: no read of the values (on a GPU, a wait for the stream)
    after = rng.clone()
    after[1:] += streams  # a device op where the state is on a device: no host copy, no read
    return rng.clone(), after


@advance_rng.register_fake
def _(rng, streams):
    refuse_meta(("rng", rng))
    return torch.empty_like(rng), torch.empty_like(rng)


# ---- the typed front doors --------------------------------------------------------------------------------

def quantize_nvfp4(x: Tensor, weight_2d: bool = False, hadamard: bool = False, stochastic: bool = False,
                   rng: Tensor | None = None, stream: int = 0, columnwise: bool = False) -> NVFP4Tensor:
    """:func:`fp8core.quantize_nvfp4` of x [M, K] (float32/bfloat16/float16) as an op: NVFP4Tensor(data uint8
    [R, C/2], scale float8_e4m3fn [R, C/16] or [ceil(R/16), C/16] with ``weight_2d``, global_amax float32 [1]);
    the operand [R, C] is x, or x^T with ``columnwise``. Stochastic rounding takes seed and offset + ``stream``
    from ``rng`` (int64 [2], in host memory or on x's device), read when the op runs where it lives (on a GPU by
    the kernel: no host read)."""
    if rng is None:
        rng = torch.zeros(2, dtype=torch.int64)
    layout = Layout.NVFP4_16X16 if weight_2d else Layout.NVFP4_1X16
    return NVFP4Tensor(*torch.ops.fp8core.quantize_nvfp4(x, weight_2d, hadamard, stochastic, rng, stream, columnwise),
                       layout)


def nvfp4_gemm(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``fp8core.gemm(a, b)`` of two NVFP4 operands (TN, blocks along K: a [M, K], b [N, K]) as an op: [M, N]."""
    return torch.ops.fp8core.nvfp4_gemm(a[0], a[1], a[2], b[0], b[1], b[2], a.layout.value, b.layout.value, out_dtype)
