"""The FP8 GEMM: ``D[M, N] = (a[M, K] · b[N, K]ᵀ) · a_scale_inv · b_scale_inv (+ bias)``, per docs/numerics.md.

One validation for both backends, so code that runs on the CPU emulation runs on cuBLASLt: the limits are
cuBLASLt's FP8 limits (K and N multiples of 16, no E5M2 x E5M2, E5M2 output only from an E5M2 operand,
16-byte aligned operands) and they are enforced everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import args, backends, fp4
from ._tensor import Tensor, export, wrap
from .args import MULTIPLE, as_format, check_bias, check_shapes
from .blocks import gemm_operands, gemm_scales
from .declarations import PRIMITIVES
from .declare import Spec
from .formats import E2M1, ENCODINGS, FP8_DTYPES, HIGH_PRECISION_DTYPES, Encoding, Format, dtype_name
from .layouts import Layout, ScaledTensor

__all__ = ["gemm", "GemmSpec", "ALIGNMENT", "MULTIPLE", "check_shapes", "check_bias"]

Array = Any
ALIGNMENT = 16  # bytes: cuBLASLt's requirement for FP8 operands and outputs


_GEMM = PRIMITIVES["gemm"].results  # the output's shape and dtype, as the front-ends read them


@dataclass(frozen=True)
class GemmSpec:
    """Everything but the pointers: the key of the GPU plan cache."""

    m: int
    n: int
    k: int
    a_fmt: Format | Encoding  # Format.E4M3/E5M2, or formats.E2M1 for FP4
    b_fmt: Format | Encoding
    out_dtype: str          # logical name: float32, bfloat16, float16, float8_e4m3fn, float8_e5m2
    bias_dtype: str | None
    fast_accum: bool
    a_block: Layout | None = None  # scaled operands: Layout.MX_ROWWISE, BLOCK_1X128, BLOCK_128X128 or ROWWISE, and
    b_block: Layout | None = None  # with E2M1 (FP4) formats NVFP4_1X16, NVFP4_16X16 or MX_ROWWISE (MXFP4)

    @property
    def out_fmt(self) -> Format | None:
        return as_format(self.out_dtype) if self.out_dtype in FP8_DTYPES else None


def _parse_out_dtype(out_dtype: Any) -> str:
    if isinstance(out_dtype, Format):
        return as_format(out_dtype, arg="out_dtype").dtype_name
    name = out_dtype if isinstance(out_dtype, str) else dtype_name(out_dtype)
    if name in HIGH_PRECISION_DTYPES:
        return name
    try:
        return as_format(name, arg="out_dtype").dtype_name
    except ValueError:
        raise ValueError(f"out_dtype: expected float32, bfloat16, float16, or an fp8 format "
                         f"({', '.join(f.name for f in ENCODINGS)}), got {out_dtype!r}") from None


def _aligned(t: Tensor, arg: str) -> None:
    data = t.data
    ptr = data.ctypes.data if hasattr(data, "ctypes") else data.data.ptr
    if t.size and ptr % ALIGNMENT:
        raise ValueError(f"{arg}: its data pointer must be {ALIGNMENT}-byte aligned (cuBLASLt's FP8 limit), "
                         f"got an address {ptr % ALIGNMENT} bytes past a boundary; pass a fresh contiguous copy")


def _operand(obj: Any, arg: str, fmt: Any, dims: str) -> tuple[Tensor, Format]:
    t, f = args.fp8(obj, arg, fmt)
    if len(t.shape) != 2:
        raise ValueError(f"{arg}: expected a 2-D {dims} array, got shape {t.shape}")
    _aligned(t, arg)
    return t, f


def _bias(bias: Any, ta: Tensor, n: int, out_name: str) -> Tensor | None:
    if bias is None:
        return None
    t = args.contiguous(wrap(bias, "bias"), "bias")
    args.same_device(t, ta, "bias", "a")
    check_bias(t.dtype, t.shape, n, out_name)
    _aligned(t, "bias")  # cuBLASLt 13.1 refused a bias 2 bytes off (CUBLAS_STATUS_INVALID_VALUE, H200)
    return t


def _out(obj: Any, ta: Tensor, spec: Spec) -> Tensor:
    t = args.contiguous(wrap(obj, "out"), "out")
    args.same_device(t, ta, "out", "a")
    storage_ok = ta.is_cuda and spec.dtype in FP8_DTYPES and t.dtype == "uint8"
    if t.dtype != spec.dtype and not storage_ok:
        raise TypeError(f"out: expected {spec.dtype}, got {t.dtype}")
    if t.shape != spec.shape:
        raise ValueError(f"out: expected shape {spec.shape}, got {t.shape}")
    if t.readonly:
        raise ValueError("out: is read-only")
    _aligned(t, "out")
    return t


def gemm(a: Array, b: Array, a_scale_inv: Array | float | None = None, b_scale_inv: Array | float | None = None, *,
         out_dtype: Any = "bfloat16", bias: Array | None = None, out_scale: Array | float | None = None,
         out_amax: Array | None = None, use_fast_accum: bool = False, out: Array | None = None,
         a_fmt: Format | str | None = None, b_fmt: Format | str | None = None) -> Array:
    """FP8 matrix multiply with per-tensor scales; the result comes back in the caller's array type.

    a: fp8 [M, K], b: fp8 [N, K] (laid out like a Linear weight), both row-major and 16-byte aligned;
    pairs E4M3xE4M3, E4M3xE5M2, E5M2xE4M3. K and N must be positive multiples of 16 (M may be 0).
    a_scale_inv, b_scale_inv: 1-element float32 on a's device (or Python floats).
    out_dtype: float32, bfloat16, float16, or an fp8 format (E5M2 only when an operand is E5M2); an fp8
    output needs ``out_scale`` and is ``quantize(D, out_scale)``; ``out_amax`` (1-element float32) becomes
    ``max(out_amax, amax(D))`` with D taken before the cast. bias: [N], bfloat16 (float16 for float16 output;
    either for fp8 output), 16-byte aligned. use_fast_accum: Hopper's fast fp8 accumulation (no effect on the CPU).
    out: an optional preallocated [M, N] result, sharing no memory with the other arguments. a_fmt/b_fmt name
    the format of uint8 storage (CuPy).

    Scaled operands (:class:`fp8core.ScaledTensor`) carry their scales, so a_scale_inv and b_scale_inv stay
    None; the GEMM goes by their layouts and element encodings (both of one kind): rowwise MXFP8 x MXFP8
    (``Layout.MX_ROWWISE``, 1x32 E8M0 blocks along K, K a multiple of 32; cuBLASLt on sm_100+), 1x128 and/or
    128x128 fp32 blocks (not both 128x128; K a multiple of 128, M of 8; cuBLASLt >= 12.9 on sm_90 only; no
    use_fast_accum), or one fp32 scale per row of a [M, K] and of b [N, K] (``Layout.ROWWISE``,
    :func:`fp8core.quantize_rowwise`; D scaled by their outer product; cuBLASLt >= 12.9 on sm_90 only), whose output
    is float32, bfloat16 or float16; one scale each (``Layout.TENSORWISE``), the
    per-tensor GEMM above; or FP4 (E2M1, :mod:`fp8core.fp4`): NVFP4 x NVFP4 (1x16 blocks or 16x16 tiles) or
    MXFP4 x MXFP4 (1x32), TN with blocks along K, K a multiple of 32, out_dtype float32, bfloat16 or float16 and
    bias only (cuBLASLt on compute capability 10.x and 12.x, with NVFP4's alpha computed on the device).
    """
    fast_accum = args.flag(use_fast_accum, "use_fast_accum")
    scaled = None
    if isinstance(a, ScaledTensor) or isinstance(b, ScaledTensor):
        gemm_operands(a, b, a_scale_inv, b_scale_inv)
        if a.encoding is E2M1:  # NVFP4 or MXFP4: packed data, its own GEMM
            return _fp4(a, b, out_dtype, bias, out_scale, out_amax, fast_accum, out)
        if a.kind == "tensor":  # one scale each: the per-tensor GEMM with the scales they carry
            a, b, a_scale_inv, b_scale_inv = a[0], b[0], a[1], b[1]
        else:
            scaled, a, b = (a, b), a[0], b[0]
    elif a_scale_inv is None or b_scale_inv is None:
        raise TypeError(f"{'a_scale_inv' if a_scale_inv is None else 'b_scale_inv'}: required for fp8 operands "
                        "with per-tensor scales")
    ta, fa = _operand(a, "a", a_fmt, "[M, K]")
    tb, fb = _operand(b, "b", b_fmt, "[N, K]")
    args.same_device(tb, ta, "b", "a")
    m, k, n = check_shapes(ta.shape, tb.shape, fa, fb)
    out_name = _parse_out_dtype(out_dtype)
    if out_name == "float8_e5m2" and Format.E5M2 not in (fa, fb):
        raise ValueError("out_dtype: E5M2 output needs an E5M2 operand (cuBLASLt); use E4M3 for E4M3 x E4M3")
    a_layout = b_layout = None
    if scaled is not None:
        sa, sb, a_layout, b_layout = gemm_scales(*scaled, ta, tb, k, out_name)
        sa, sb = sa.data, sb.data
        if fast_accum and a_layout.kind == "blocks":
            # torch._scaled_mm refuses it and Transformer Engine's Float8BlockScaling always splits the
            # accumulator: the block scales are applied where each K-block's partial sum is promoted to fp32.
            raise ValueError("use_fast_accum: a 1x128/128x128 block GEMM accumulates in fp32 at every 128-wide "
                             "K-block (cuBLASLt has no fast accumulation for it); pass use_fast_accum=False")
    else:
        sa = args.scalar(a_scale_inv, ta, "a_scale_inv", "a")
        sb = args.scalar(b_scale_inv, ta, "b_scale_inv", "a")
    fp8_out = out_name in FP8_DTYPES
    if fp8_out and out_scale is None:
        raise ValueError(f"out_scale: an fp8 output ({out_name}) needs its scale")
    if not fp8_out and (out_scale is not None or out_amax is not None):
        raise ValueError(f"{'out_scale' if out_scale is not None else 'out_amax'}: only for an fp8 out_dtype, "
                         f"got out_dtype {out_name}")
    so = args.scalar(out_scale, ta, "out_scale", "a") if fp8_out else None
    am = args.f32_slots(out_amax, ta, "out_amax", "a") if out_amax is not None else None
    tbias = _bias(bias, ta, n, out_name)
    (result,) = _GEMM((ta.shape, fa.dtype_name), (tb.shape, fb.dtype_name), None, None, out_name)
    backend = backends.for_device(ta.device)
    if out is None:
        dst = args.result(backend, result, ta)
    else:
        to = _out(out, ta, result)
        # the CPU's column spans write out while others still read b (and cuBLASLt reads and writes at once)
        args.no_overlap([("out", to)], [("a", ta), ("b", tb), ("bias", tbias), ("a_scale_inv", sa),
                                         ("b_scale_inv", sb), ("out_scale", so), ("out_amax", am)])
        dst = to.data
    spec = GemmSpec(m, n, k, fa, fb, out_name, tbias.dtype if tbias is not None else None, fast_accum,
                    a_layout, b_layout)
    d = backend.gemm(spec, ta, tb, sa, sb, tbias, so, am, dst)
    return out if out is not None else export(d, out_name, ta)


def _fp4(a: ScaledTensor, b: ScaledTensor, out_dtype: Any, bias: Any, out_scale: Any, out_amax: Any,
         fast_accum: bool, out: Any) -> Array:
    """The FP4 GEMM (fp8core.fp4's operands, both NVFP4 or both MXFP4): D = alpha * sum over K-blocks of
    s_a * s_b * (q_a . q_b) (+ bias), written as float32, bfloat16 or float16; what it does not take is refused
    by name."""
    for arg, value in (("out_scale", out_scale), ("out_amax", out_amax), ("out", out)):
        if value is not None:
            raise ValueError(f"{arg}: an FP4 GEMM takes its scales from its operands and writes float32, bfloat16 "
                             f"or float16 to a new array; pass no {arg}")
    if fast_accum:
        raise ValueError("use_fast_accum: the FP4 GEMM has no fast accumulation; pass use_fast_accum=False")
    ops = fp4.gemm_operands(a, b)
    ta, tb = ops.a_data, ops.b_data
    _aligned(ta, "a")  # cuBLASLt's, as for FP8: refused on every backend alike
    _aligned(tb, "b")
    m, k, n = check_shapes((ta.shape[0], 2 * ta.shape[1]), (tb.shape[0], 2 * tb.shape[1]))
    if k % fp4.FP4_GEMM_K:
        raise ValueError(f"a: K = {k}; the FP4 GEMM needs K to be a multiple of {fp4.FP4_GEMM_K}")
    out_name = args.out_dtype(out_dtype)
    tbias = _bias(bias, ta, n, out_name)
    spec = GemmSpec(m, n, k, E2M1, E2M1, out_name, tbias.dtype if tbias is not None else None, False, ops.a_layout,
                    ops.b_layout)
    d = ops.backend.gemm(spec, ta, ops.a_scale, tb, ops.b_scale, ops.global_amaxes, tbias)
    return export(d, out_name, ta)
