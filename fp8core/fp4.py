"""FP4: NVFP4 (Transformer Engine's ``NVFP4BlockScaling``) and MXFP4 (OCP MX), E2M1 elements packed two a byte.

x (float32, bfloat16 or float16, any shape) is viewed as [M, K]; each primitive quantizes **the operand** [R, C]:
x itself, or x^T [K, M] with ``columnwise=True`` (stored transposed, as cuBLASLt's FP4 GEMM, TN only, reads it).
Blocks are consecutive elements of an operand row: 16 with an E4M3 scale (NVFP4, under an fp32 global scale from
the tensor's amax; 16x16 tiles with ``weight_2d``) or 32 with an E8M0 scale (MXFP4). ``.data`` is uint8 [R, C/2],
element 2j of a row in the low nibble of byte j. The numerics are docs/numerics.md's "FP4" section; the CPU
reference gives its bits, the CUDA kernels the same (the FP4 GEMM runs through cuBLASLt on GPUs that have its
block-scaled FP4 modes, compute capability 10.x and 12.x, and is refused by name elsewhere). Any array in, the
caller's type out.

The results are scaled tensors (:class:`fp8core.ScaledTensor`) of E2M1 data: :class:`NVFP4Tensor`
``(data, scale, global_amax)`` in layout ``1x16`` (or ``16x16`` tiles) and :class:`MXFP4Tensor` ``(data, scale)``
in ``1x32``; every function here, :func:`fp8core.gemm` and :func:`fp8core.blocks.dequantize_blocks` go by the
layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import args, backends, formats
from ._tensor import Tensor, export, export_all, wrap
from .backends.cpu_fp4 import state_seed_offset
from .layouts import Layout, MXFP4Tensor, NVFP4Tensor, ScaledTensor, resolve

__all__ = ["NVFP4Tensor", "MXFP4Tensor", "quantize_nvfp4", "quantize_nvfp4_both", "dequantize_nvfp4",
           "quantize_mxfp4", "quantize_mxfp4_both", "dequantize_mxfp4", "gemm_scale", "NVFP4_BLOCK", "MXFP4_BLOCK",
           "GemmFP4", "gemm_operands", "FP4_GEMM_K"]

Array = Any
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E4M3 = formats.E4M3.dtype_name  # NVFP4's scales: float8_e4m3fn
E8M0 = formats.E8M0.dtype_name  # MXFP4's scales: float8_e8m0fnu
# the layouts each FP4 tensor may have: MXFP4's blocks always lie along the stored rows (columnwise stores x^T)
_LAYOUTS = {NVFP4Tensor: Layout.NVFP4_1X16.family, MXFP4Tensor: (Layout.MX_ROWWISE,)}


def _operand(x: Any, function: str, block: int, columnwise: bool) -> tuple[Tensor, Any]:
    """(x as [M, K], its backend): x checked, the operand's C (K, or M when columnwise) a multiple of ``block``."""
    t = args.high_precision(x, "x")
    backend = backends.fp4_for_device(t.device, function)
    t2 = args.as_2d(t, "x")
    m, k = t2.shape
    cols = m if columnwise else k
    if cols % block:
        name, what = ("M", "down the columns of x") if columnwise else ("K", "along the rows of x")
        raise ValueError(f"x: {function}{' (columnwise)' if columnwise else ''} takes blocks of {block} {what} "
                         f"viewed as [M, K] = [{m}, {k}]; {name} = {cols} must be a multiple of {block}")
    return t2, backend


def _nvfp4_options(weight_2d: Any, hadamard: Any, rounding: Any, seed: Any, offset: Any
                   ) -> tuple[bool, bool, bool, int, int]:
    w2d = args.flag(weight_2d, "weight_2d")
    rht = args.flag(hadamard, "hadamard")
    if w2d and rht:
        raise ValueError("hadamard: weight_2d=True with hadamard=True; NVFP4 gives weights 16x16 tiles and "
                         "activations and gradients the Hadamard transform, never both")
    stochastic = args.fp4_rounding(rounding) == "stochastic"
    return w2d, rht, stochastic, args.uint64(seed, "seed"), args.uint64(offset, "offset")


# a random state in memory: (dtype, shape) -> what it holds
_RNG_STATES = {("int64", (2,)): "(seed, offset)", ("uint64", (2,)): "(seed, offset)",
               ("uint32", (4,)): "(seed lo, seed hi, offset lo, offset hi)"}


def _rng_state(obj: Any, seed: int, offset: int, x: Tensor) -> tuple[Tensor | None, int, int]:
    """(the state the backend reads where it lives, or None; seed; offset) of ``rng_state=``: on x's device it
    goes to the backend (a GPU kernel reads it by pointer: no wait for the GPU); in host memory beside a GPU x it
    is read here and passed by value (a read of host memory waits for nothing)."""
    if obj is None:
        return None, seed, offset
    if seed:
        raise ValueError(f"seed: rng_state holds the seed; leave seed at 0 with it (got {seed})")
    t = args.contiguous(wrap(obj, "rng_state"), "rng_state")
    if (t.dtype, t.shape) not in _RNG_STATES:
        held = " or ".join(f"{d} {list(s)} {w}" for (d, s), w in _RNG_STATES.items())
        raise ValueError(f"rng_state: expected {held}, got {t.dtype} {list(t.shape)}")
    if t.device == x.device:
        args.same_device(t, x, "rng_state")
        return t, 0, offset
    if t.device[0] != "cpu":
        raise ValueError(f"rng_state: is on {t.device_str()} but x is on {x.device_str()}; put it on x's device "
                         "(read there) or in host memory (read by value)")
    return None, *state_seed_offset(t.data, offset)


def _nvfp4_layout(weight_2d: bool) -> Layout:
    return Layout.NVFP4_16X16 if weight_2d else Layout.NVFP4_1X16


def quantize_nvfp4(x: Array, *, weight_2d: bool = False, hadamard: bool = False, rounding: str = "nearest",
                   seed: int = 0, offset: int = 0, rng_state: Array | None = None, global_amax: Any = None,
                   columnwise: bool = False) -> NVFP4Tensor:
    """NVFP4 quantization of the operand (x [M, K], or x^T [K, M] with ``columnwise``): 16-element blocks with
    E4M3 scales under an fp32 global scale, elements E2M1.

    weight_2d: one scale per 16x16 tile (weights). hadamard: each block replaced by its random Hadamard transform
    first (the wgrad operand of activations and gradients; not with weight_2d). rounding: "nearest" or
    "stochastic" (elements only; random bytes from Philox4x32-10 keyed by (seed, block, offset), unsigned 64-bit
    ints: the same bytes on every backend and however the work is split). rng_state: the seed and offset held in
    memory instead, int64 or uint64 [2] (seed, offset: fp8core.torch's ``fp4_rng``) or uint32 [4] (seed lo,
    seed hi, offset lo, offset hi: fp8core.jax's state), contiguous, on x's device (the GPU kernel reads it there:
    no host read, no wait) or in host memory (read by value); its seed is the seed (``seed`` stays 0) and its
    offset + ``offset`` (mod 2**64) the offset, so one state serves several streams; the same bytes as by value.
    global_amax: the tensor's amax when given (e.g. MAX-reduced across processes; inf and NaN allowed, negative
    refused), else amax(operand), taken after the transform. The operand's rows need C % 16 == 0 (K rowwise, M
    columnwise); R is free.

    Returns ``NVFP4Tensor(data uint8 [R, C/2], scale float8_e4m3fn [R, C/16] or [ceil(R/16), C/16],
    global_amax float32 [1])``, layout ``1x16`` or ``16x16`` (weight_2d), encoding E2M1.
    """
    w2d, rht, stochastic, s, o = _nvfp4_options(weight_2d, hadamard, rounding, seed, offset)
    cw = args.flag(columnwise, "columnwise")
    t2, backend = _operand(x, "quantize_nvfp4", NVFP4_BLOCK, cw)
    state, s, o = _rng_state(rng_state, s, o, t2)
    g = args.global_amax(global_amax, t2)
    data, scale, amax = backend.quantize_nvfp4(t2, w2d, rht, stochastic, s, o, state, g, cw)
    return NVFP4Tensor(*export_all(((data, "uint8"), (scale, E4M3), (amax, "float32")), t2), _nvfp4_layout(w2d))


def quantize_nvfp4_both(x: Array, *, weight_2d: bool = False, hadamard: bool = False, rounding: str = "nearest",
                        seed: int = 0, offset: int = 0, rng_state: Array | None = None, global_amax: Any = None
                        ) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """``(rowwise, columnwise)`` from one call, as NVFP4's recipe needs them: the rowwise operand (fprop, dgrad)
    never transformed, the columnwise one (wgrad) with the Hadamard transform when ``hadamard``. Each equals
    :func:`quantize_nvfp4` bit for bit with ``hadamard=False`` and ``hadamard=hadamard`` respectively, the other
    arguments the same (so the two share block numbers and offset: for independent random bytes quantize each with
    its own offset). Without the transform the global amax is taken once; with it each operand has its own (the
    columnwise one after the transform), so ``global_amax`` must then be None. x's K and M must be multiples of 16.
    """
    w2d, rht, stochastic, s, o = _nvfp4_options(weight_2d, hadamard, rounding, seed, offset)
    t2, backend = _operand(x, "quantize_nvfp4_both", NVFP4_BLOCK, False)
    _operand(x, "quantize_nvfp4_both", NVFP4_BLOCK, True)
    state, s, o = _rng_state(rng_state, s, o, t2)
    if rht and global_amax is not None:
        raise ValueError("global_amax: with hadamard=True the two operands have different amaxes (the columnwise "
                         "one after the transform); quantize each with quantize_nvfp4 and its own global_amax")
    g = args.global_amax(global_amax, t2)
    row = backend.quantize_nvfp4(t2, w2d, False, stochastic, s, o, state, g, False)
    col = backend.quantize_nvfp4(t2, w2d, rht, stochastic, s, o, state, None if rht else row[2], True)
    out = export_all(((row[0], "uint8"), (row[1], E4M3), (row[2], "float32"),
                      (col[0], "uint8"), (col[1], E4M3), (col[2], "float32")), t2)
    return NVFP4Tensor(*out[:3], _nvfp4_layout(w2d)), NVFP4Tensor(*out[3:], _nvfp4_layout(w2d))


def quantize_mxfp4(x: Array, *, rounding: str = "rceil", columnwise: bool = False) -> MXFP4Tensor:
    """MXFP4 quantization of the operand (x [M, K], or x^T [K, M] with ``columnwise``): 32-element blocks with E8M0
    scales, elements E2M1 rounded to nearest.

    rounding: the scale rule, "rceil" (NVIDIA, Transformer Engine: the block's amax lands at or below 6) or "floor"
    (OCP: may saturate). C % 32 == 0 (K rowwise, M columnwise). Returns ``MXFP4Tensor(data uint8 [R, C/2],
    scale float8_e8m0fnu [R, C/32])``, layout ``1x32`` (blocks along the stored operand's rows), encoding E2M1.
    """
    mode = args.scale_mode(rounding, "rounding")
    cw = args.flag(columnwise, "columnwise")
    t2, backend = _operand(x, "quantize_mxfp4", MXFP4_BLOCK, cw)
    data, scale = backend.quantize_mxfp4(t2, mode, cw)
    return MXFP4Tensor(*export_all(((data, "uint8"), (scale, E8M0)), t2))


def quantize_mxfp4_both(x: Array, *, rounding: str = "rceil") -> tuple[MXFP4Tensor, MXFP4Tensor]:
    """``(rowwise, columnwise)``: both MXFP4 operands of x from one call, each equal to :func:`quantize_mxfp4`."""
    mode = args.scale_mode(rounding, "rounding")
    t2, backend = _operand(x, "quantize_mxfp4_both", MXFP4_BLOCK, False)
    _operand(x, "quantize_mxfp4_both", MXFP4_BLOCK, True)
    row, col = backend.quantize_mxfp4(t2, mode, False), backend.quantize_mxfp4(t2, mode, True)
    out = export_all(((row[0], "uint8"), (row[1], E8M0), (col[0], "uint8"), (col[1], E8M0)), t2)
    return MXFP4Tensor(*out[:2]), MXFP4Tensor(*out[2:])


# ---- reading FP4 tensors back ------------------------------------------------------------------------------

def _parts(t: Any, cls: type, arg: str, function: str) -> tuple[Tensor, Tensor, Any, Layout]:
    """(data uint8 [R, C/2], scale, backend, layout) of a ``cls`` (NVFP4Tensor or MXFP4Tensor), or of a
    ScaledTensor of E2M1 data in one of its layouts, or of a plain tuple of its fields; checked."""
    if type(t) is tuple and len(t) == len(cls._fields):
        t = cls(*t)
    # a named layout is checked below, by name; an unnamed one is the kind the type or the scale's dtype means
    if not (isinstance(t, ScaledTensor) and len(t) == len(cls._fields) and t.encoding is formats.E2M1
            and (t._layout is not None or t.kind == cls._kind)):
        raise TypeError(f"{arg}: expected an {cls.__name__} ({', '.join(cls._fields)}), got {type(t).__name__}")
    family = _LAYOUTS[cls]
    if t._layout not in (None, *family):
        raise ValueError(f"{arg}: expected a {' or '.join(family)} layout, got {t._layout}")
    data = args.contiguous(wrap(t[0], f"{arg}.data"), f"{arg}.data")
    if data.dtype != "uint8":
        raise TypeError(f"{arg}.data: expected uint8 (E2M1 codes, two a byte), got {data.dtype}")
    backend = backends.fp4_for_device(data.device, function)
    data = args.as_2d(data, f"{arg}.data")
    scale_dtype = family[0].scale.dtype_name
    scale = args.contiguous(wrap(t[1], f"{arg}.scale"), f"{arg}.scale")
    args.same_device(scale, data, f"{arg}.scale", f"{arg}.data")
    if scale.dtype not in (scale_dtype, "uint8"):
        raise TypeError(f"{arg}.scale: expected {scale_dtype} (or its uint8 bytes), got {scale.dtype}")
    rows, cols = data.shape[0], 2 * data.shape[1]
    block = family[0].block[1]
    if cols % block:
        raise ValueError(f"{arg}.data: {data.shape[1]} bytes a row hold {cols} elements; {cls.__name__} rows are "
                         f"whole blocks of {block}")
    return data, scale, backend, resolve(t._layout, family, (rows, cols), scale.shape, f"{arg}.scale")


def _global_amax_tensor(t: NVFP4Tensor, data: Tensor, arg: str, data_arg: str) -> Tensor:
    """t's global amax, checked: 1 float32 element on data's device."""
    amax = args.f32_vector(t[2], data, f"{arg}.global_amax", data_arg)
    if amax.size != 1:
        raise ValueError(f"{arg}.global_amax: expected 1 element, got shape {amax.shape}")
    return amax


def _global_amax(t: NVFP4Tensor, data: Tensor, arg: str, data_arg: str) -> Any:
    """t's global amax, checked, as the backend's flat 1-element array."""
    return _global_amax_tensor(t, data, arg, data_arg).data.reshape(-1)


def dequantize_nvfp4(t: NVFP4Tensor, out_dtype: Any = "float32") -> Array:
    """``y = ROUND_TO(out_dtype, (fp32(q) * fp32(s_b)) *rn S_dec)``, S_dec from ``t.global_amax`` by the global
    scale rule; a NaN scale gives NaN (canonical). Returns [R, C] in the operand's layout (x^T for a columnwise
    tensor; the transformed values for a Hadamard one). out_dtype: float32, bfloat16 or float16."""
    data, scale, backend, _ = _parts(t, NVFP4Tensor, "t", "dequantize_nvfp4")
    amax = _global_amax(t, data, "t", "t.data")
    name = args.out_dtype(out_dtype)
    return export(backend.dequantize_nvfp4(data, scale, amax, name), name, data)


def dequantize_mxfp4(t: MXFP4Tensor, out_dtype: Any = "float32") -> Array:
    """``y = ROUND_TO(out_dtype, fp32(q) *rn 2^(e - 127))``; the NaN scale byte gives NaN (canonical). Returns
    [R, C] in the operand's layout. out_dtype: float32, bfloat16 or float16."""
    data, scale, backend, _ = _parts(t, MXFP4Tensor, "t", "dequantize_mxfp4")
    name = args.out_dtype(out_dtype)
    return export(backend.dequantize_mxfp4(data, scale, name), name, data)


def gemm_scale(t: NVFP4Tensor | MXFP4Tensor) -> Array:
    """An FP4 GEMM operand's scales as cuBLASLt reads them: uint8, flat, in 128x4 tiles of 512 bytes (zero
    padding); scale (r, c) at byte ``((r // 128) * ceil(cols / 4) + c // 4) * 512 + (r % 32) * 16 +
    (r % 128) // 32 * 4 + c % 4``, cols the scale's columns. 16x16 tiles are first expanded to the rows they cover."""
    data, scale, backend, _ = _parts(t, _class_of(t), "t", "gemm_scale")
    return export(backend.gemm_scale(scale, data.shape[0]), "uint8", data)


def _class_of(t: Any) -> type:
    """NVFP4Tensor or MXFP4Tensor: by a ScaledTensor's kind, else (a plain tuple) by its length."""
    nvfp4 = t.kind == "nvfp4" if isinstance(t, ScaledTensor) else isinstance(t, tuple) and len(t) == 3
    return NVFP4Tensor if nvfp4 else MXFP4Tensor


# ---- operands of fp8core.gemm ---------------------------------------------------------------------------

FP4_GEMM_K = 32  # K: a multiple of 32 (Transformer Engine's reference GEMM; cuBLASLt's limits unconfirmed)


class GemmFP4(NamedTuple):
    """FP4 GEMM operands, unpacked and validated for :func:`fp8core.gemm`: data [rows, K/2] and scales of each,
    their layouts, the backend, and the two global amaxes (NVFP4, whose alpha = S_dec_a *rn S_dec_b the backend
    computes where the data is) or None (MXFP4: alpha 1)."""

    a_data: Tensor
    a_scale: Tensor
    b_data: Tensor
    b_scale: Tensor
    a_layout: Layout
    b_layout: Layout
    backend: Any
    global_amaxes: tuple[Tensor, Tensor] | None


def gemm_operands(a: NVFP4Tensor | MXFP4Tensor, b: NVFP4Tensor | MXFP4Tensor) -> GemmFP4:
    """a and b of an FP4 GEMM, TN, of one kind (fp8core.blocks.gemm_operands has checked that): each with its
    blocks along K (a's data [M, K/2], b's [N, K/2]: rowwise quantizations of a [M, K] and a weight [N, K], or
    columnwise ones of the transposed tensors)."""
    cls = _class_of(a)
    da, sa, backend, la = _parts(a, cls, "a", "gemm")
    db, sb, _, lb = _parts(b, cls, "b", "gemm")
    args.same_device(db, da, "b.data", "a.data")
    amaxes = None
    if cls is NVFP4Tensor:
        amaxes = (_global_amax_tensor(a, da, "a", "a.data"), _global_amax_tensor(b, da, "b", "a.data"))
    return GemmFP4(da, sa, db, sb, la, lb, backend, amaxes)
