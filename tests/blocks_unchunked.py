"""The CPU block paths as they were before they worked in chunks (whole-array, zero-padded to whole blocks,
fp8core 653352f): the twin the chunked paths must match bit for bit. Only public per-block helpers of
cpu_blocks are reused (the E8M0 rules and the scale rule, which chunking does not touch)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from fp8core._fpenv import ieee
from fp8core._tensor import logical_numpy_dtype
from fp8core.backends.cpu import scale_rule
from fp8core.backends.cpu_blocks import e8m0_factor, e8m0_floor, e8m0_rceil
from fp8core.blocks import FP32_BLOCK
from fp8core.formats import Format

_NAN = {"float32": (np.uint32, 0x7FFFFFFF), "bfloat16": (np.uint16, 0x7FFF), "float16": (np.uint16, 0x7FFF)}


def _padded(a: np.ndarray, br: int, bc: int) -> np.ndarray:
    rows, cols = a.shape
    R, C = -(-rows // br), -(-cols // bc)
    p = np.zeros((R * br, C * bc), a.dtype)
    p[:rows, :cols] = a
    return p.reshape(R, br, C, bc)


def _unpadded(blocks: np.ndarray, rows: int, cols: int) -> np.ndarray:
    R, br, C, bc = blocks.shape
    return blocks.reshape(R * br, C * bc)[:rows, :cols]


def block_amax_bits(x: np.ndarray, br: int, bc: int) -> np.ndarray:
    if x.dtype == np.float32:
        b = np.bitwise_and(x.view(np.uint32), np.uint32(0x7FFFFFFF))
        b[b > 0x7F800000] = 0x7FFFFFFF
        return _padded(b, br, bc).max(axis=(1, 3))
    m = _padded(np.bitwise_and(x.view(np.uint16), np.uint16(0x7FFF)), br, bc).max(axis=(1, 3))
    if x.dtype == np.float16:
        bits = m.view(np.float16).astype(np.float32).view(np.uint32)
        bits[m > 0x7C00] = 0x7FFFFFFF
        return bits
    bits = np.left_shift(m.astype(np.uint32), 16)
    bits[m > 0x7F80] = 0x7FFFFFFF
    return bits


def scaled_cast(x: np.ndarray, factor: np.ndarray, br: int, bc: int, fmt: Format) -> np.ndarray:
    rows, cols = x.shape
    blocks = _padded(x.astype(np.float32), br, bc)  # exact widening of bf16 and fp16
    with np.errstate(all="ignore"):
        np.multiply(blocks, factor[:, None, :, None], out=blocks)
    fmax = np.float32(fmt.max)
    np.clip(blocks, -fmax, fmax, out=blocks)
    q = _unpadded(blocks, rows, cols).astype(fmt.numpy_dtype)
    b = q.view(np.uint8)
    if fmt is Format.E4M3:
        b[b == 0xFF] = 0x7F
    else:
        b[np.bitwise_and(b, 0x7F) > 0x7C] = 0x7F
    return q


def scaled_widen(q: np.ndarray, factor: np.ndarray, br: int, bc: int, out_dtype: str) -> np.ndarray:
    rows, cols = q.shape
    blocks = _padded(q.astype(np.float32), br, bc)
    with np.errstate(all="ignore"):
        np.multiply(blocks, factor[:, None, :, None], out=blocks)
    y32 = _unpadded(blocks, rows, cols)
    with np.errstate(all="ignore"):
        y = y32.astype(logical_numpy_dtype(out_dtype))
    storage, nan = _NAN[out_dtype]
    y.view(storage)[np.isnan(y32)] = nan
    return y


@ieee
def quantize_mxfp8(x: np.ndarray, fmt: Format, scale_mode: str, columnwise: bool) -> tuple[np.ndarray, np.ndarray]:
    br, bc = (32, 1) if columnwise else (1, 32)
    bits = block_amax_bits(x, br, bc)
    e = e8m0_rceil(bits, fmt) if scale_mode == "rceil" else e8m0_floor(bits, fmt)
    return scaled_cast(x, e8m0_factor(e, -1), br, bc, fmt), e.view(ml_dtypes.float8_e8m0fnu)


@ieee
def dequantize_mxfp8(q: np.ndarray, scale: np.ndarray, columnwise: bool, out_dtype: str) -> np.ndarray:
    br, bc = (32, 1) if columnwise else (1, 32)
    return scaled_widen(q, e8m0_factor(scale.view(np.uint8), 1), br, bc, out_dtype)


@ieee
def quantize_blockwise(x: np.ndarray, fmt: Format, br: int, power_of_2: bool,
                       epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    amax = block_amax_bits(x, br, FP32_BLOCK).view(np.float32)
    s, s_inv, _ = scale_rule(amax.reshape(-1), np.float32(fmt.max), 0, power_of_2, epsilon)
    return scaled_cast(x, s.reshape(amax.shape), br, FP32_BLOCK, fmt), s_inv.reshape(amax.shape)


@ieee
def dequantize_blockwise(q: np.ndarray, scale_inv: np.ndarray, br: int, out_dtype: str) -> np.ndarray:
    return scaled_widen(q, scale_inv, br, FP32_BLOCK, out_dtype)
