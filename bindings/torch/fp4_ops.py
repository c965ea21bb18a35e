"""FP4 as torch custom ops (``torch.ops.fp8core.quantize_nvfp4``, ``quantize_mxfp4``, ``dequantize_nvfp4``,
``dequantize_mxfp4``, ``nvfp4_gemm``), each with a fake so that ``torch.compile(fullgraph=True)`` traces through
them: made from their declarations (fp8core.declarations) by custom_ops.py. The numerics are the core's
(fp8core.fp4).

The random state of stochastic rounding is a tensor, int64 [2] = (seed, offset), read when the op runs: a module
advances it in place each step (``advance_rng``) and a compiled graph neither bakes it in as a constant nor
recompiles for it. ``stream`` is added to the offset, so the quantizations of one step draw independent bytes
(stream 0, 1, ...). The state may live in host memory (read there, passed to the kernel by value) or on x's device
(the kernel reads it there by pointer: never read to the host, so FSDP2 or a user moving it costs no wait). The ops return plain tensor tuples; the wrappers below give
:class:`NVFP4Tensor` and :class:`MXFP4Tensor`.
"""

from __future__ import annotations

import torch

from fp8core.declarations import PRIMITIVES, check_rng
from fp8core.layouts import Layout, MXFP4Tensor, NVFP4Tensor

from .custom_ops import custom_ops
from .fake_rules import refuse_meta

Tensor = torch.Tensor
_LIB = "fp8core"

__all__ = ["quantize_nvfp4", "quantize_mxfp4", "dequantize_nvfp4", "dequantize_mxfp4", "nvfp4_gemm", "advance_rng"]

_ops = {name: custom_ops(PRIMITIVES[name])[0] for name in
        ("quantize_nvfp4", "quantize_mxfp4", "dequantize_nvfp4", "dequantize_mxfp4", "nvfp4_gemm")}


def _advance_rng(rng: Tensor, streams: int) -> tuple[Tensor, Tensor]:
    check_rng(rng)  # the metadata only: no read of the values (on a GPU, a wait for the stream)
    after = rng.clone()
    after[1:] += streams  # a device op where the state is on a device: no host copy, no read
    return rng.clone(), after


# A torch-only op (no core primitive behind it): its schema written here rather than read from annotations.
advance_rng = torch.library.custom_op(f"{_LIB}::advance_rng", _advance_rng, mutates_args=(),
                                      schema="(Tensor rng, int streams) -> (Tensor, Tensor)")
advance_rng.__doc__ = """(a copy of rng, rng with its offset advanced by ``streams``), int64 [2] each. An op, not
a clone: the compiled backward must read the copy saved at the forward, and AOTAutograd's partitioner would
recompute a clone in the backward from the buffer the forward has since advanced."""


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
    return NVFP4Tensor(*_ops["quantize_nvfp4"](x, weight_2d, hadamard, stochastic, rng, stream, columnwise), layout)


def quantize_mxfp4(x: Tensor, rounding: str = "rceil", columnwise: bool = False) -> MXFP4Tensor:
    """:func:`fp8core.quantize_mxfp4` of x [M, K] as an op: MXFP4Tensor(data uint8 [R, C/2], scale float8_e8m0fnu
    [R, C/32]); the operand [R, C] is x, or x^T with ``columnwise``."""
    return MXFP4Tensor(*_ops["quantize_mxfp4"](x, rounding, columnwise))


def dequantize_nvfp4(t: NVFP4Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """:func:`fp8core.dequantize_nvfp4` as an op: the operand [R, C] in out_dtype."""
    return _ops["dequantize_nvfp4"](t[0], t[1], t[2], t.layout.value, out_dtype)


def dequantize_mxfp4(t: MXFP4Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """:func:`fp8core.dequantize_mxfp4` as an op: the operand [R, C] in out_dtype."""
    return _ops["dequantize_mxfp4"](t[0], t[1], out_dtype)


def nvfp4_gemm(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``fp8core.gemm(a, b)`` of two NVFP4 operands (TN, blocks along K: a [M, K], b [N, K]) as an op: [M, N]."""
    return _ops["nvfp4_gemm"](a[0], a[1], a[2], b[0], b[1], b[2], a.layout.value, b.layout.value, out_dtype)
