"""Checks of block scaling (fp8core.blocks): every primitive by bits against an oracle written from the contract,
the block-scaled GEMM's scale layouts, and the block-scaled GEMM."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

import fp8core
from fp8core import Format, _oracle, formats
from fp8core._views import logical_numpy_dtype

from .conversions import dequantize_oracle
from .gemm import gemm_unavailable
from .harness import FORMATS, HIGH, CpuTarget, CudaTarget, Recorder, Target, check, name_of, sample

SCALE = formats.E8M0  # MXFP8's scale encoding
E8M0 = SCALE.numpy_dtype
_MX, _FP32_BLOCK = 32, 128
BLOCK_SHAPES = ((1, 1), (3, 31), (31, 33), (33, 65), (64, 128), (130, 257), (2, 3, 40), (0, 32), (32, 0))
QUICK_BLOCK_SHAPES = ((1, 1), (3, 31), (33, 65), (130, 257), (2, 3, 40), (0, 32))


def _oracle_max(quick: bool) -> int:
    """Elements up to which an input is also checked against the oracle (a Python loop over blocks)."""
    return 1 << 12 if quick else 1 << 14


def _blocks_backend(t: Target) -> Any:
    """The block backend module under test, looked up at each call (the coverage wraps its attributes)."""
    import importlib

    return importlib.import_module(f"fp8core.backends.{t.backend_name}_blocks")


def _rows_cols(x: np.ndarray) -> np.ndarray:
    """x as the 2-D [rows, cols] fp32 view the block primitives work on (leading dims folded)."""
    return np.asarray(x, np.float32).reshape(int(np.prod(x.shape[:-1], dtype=np.int64)), x.shape[-1])


def _blocks_of(rows: int, cols: int, br: int, bc: int) -> Iterator[tuple[int, int, tuple[slice, slice]]]:
    for i in range(-(-rows // br)):
        for j in range(-(-cols // bc)):
            yield i, j, (slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))


def _block_amax(block: np.ndarray) -> float:
    a = np.abs(block)
    return float("nan") if np.isnan(a).any() else float(a.max())


def e8m0_oracle(amax: float, fmt: Format, mode: str) -> int:
    """The scale byte of one block by docs/numerics.md, in Python floats: "rceil" rounds the exponent of
    v = fp32(amax) *rn fp32(1/fp8_max) up, "floor" is OCP's floor(log2(amax)) - emax; 0..254, NaN 0xFF."""
    import math

    a = np.float32(amax)
    if np.isnan(a):
        return SCALE.nan_cast
    if mode == "rceil":
        v = float(a * np.float32(1.0 / fmt.max))
        if v == 0:
            return 0
        if math.isinf(v):
            return SCALE.max_code
        m, ex = math.frexp(v)  # v = m 2^ex, m in [0.5, 1): log2 v rounded up is ex, or ex - 1 when m is 0.5
        e = (ex - 1 if m == 0.5 else ex) + SCALE.bias
    else:
        if a == 0:
            return 0
        if np.isinf(a):
            return SCALE.max_code
        e = math.frexp(float(a))[1] - 1 - fmt.emax + SCALE.bias
    return min(max(e, 0), SCALE.max_code)


def _pow2(e: int, sign: int) -> float:
    import math

    return math.nan if e == SCALE.nan_cast else math.ldexp(1.0, sign * (e - SCALE.bias))


def block_oracle(x: np.ndarray, fmt: Format, layout: Any, rule: Any) -> tuple[np.ndarray, np.ndarray]:
    """(codes [rows, cols], stored scales) by the contract, block by block: ``rule(amax)`` gives the block's
    stored scale (E8M0 byte, fp32 scale_inv) and the factor its elements are cast with."""
    f = _rows_cols(x)
    q = np.zeros(f.shape, np.uint8)
    stored = np.zeros(layout.scale_shape(*f.shape), np.uint8 if layout.scale is SCALE else np.float32)
    for i, j, sl in _blocks_of(*f.shape, *layout.block_for(*f.shape)):
        stored[i, j], factor = rule(_block_amax(f[sl]))
        q[sl] = _oracle.quantize_bits(f[sl], factor, fmt.value)
    return q, stored


def block_dequantize_oracle(codes: np.ndarray, factors: np.ndarray, br: int, bc: int, fmt: Format,
                            out: str) -> np.ndarray:
    """ROUND_TO(out, fp32(q) *rn factor[block]) per block; factors fp32 (2^(e-127) for E8M0, NaN for 0xFF)."""
    rows, cols = codes.shape
    y = np.zeros(codes.shape, logical_numpy_dtype(out))
    for i, j, sl in _blocks_of(rows, cols, br, bc):
        y[sl] = dequantize_oracle(codes[sl], fmt, float(factors[i, j]), out)
    return y


def _amax_case_rows(fmt: Format) -> np.ndarray:
    """One row per E8M0 rounding case (exact powers of two, one ulp either side, v subnormal and the 2^-127
    boundary, the top binade, inf, NaN, 0), each row's block amax at columns 5 and 40, a smaller value beside."""
    v127 = np.float32(2.0 ** -127) / np.float32(1.0 / fmt.max)
    cases = [0.0, 1e-45, 1e-40, 2.0 ** -126, float(v127), float(np.nextafter(v127, np.float32(1))),
             float(np.nextafter(v127, np.float32(0))), 0.75, 1.0, float(np.nextafter(np.float32(1), np.float32(2))),
             fmt.max, float(np.nextafter(np.float32(fmt.max), np.float32(0))), 2.0 ** 100, 3.0e38,
             float(np.float32(3.4028235e38)), np.inf, np.nan]
    x = np.zeros((len(cases), 64), np.float32)
    x[:, 5] = cases
    x[:, 40] = cases
    with np.errstate(all="ignore"):
        x[:, 41] = -np.float32(cases) / np.float32(3)
    return x


def _block_inputs(rng: np.random.Generator, quick: bool) -> Iterator[tuple[str, np.ndarray]]:
    shapes = QUICK_BLOCK_SHAPES if quick else BLOCK_SHAPES + ((1000, 1024),)
    for dtype in HIGH:
        for shape in shapes:
            yield f"{name_of(dtype)} {shape}", sample(rng, shape, dtype)


def _put_pair(t: Target, pair: Any, offset: int = 0) -> Any:
    return type(pair)(t.put(np.asarray(pair[0]), offset), t.put(np.asarray(pair[1])), pair.layout)


@check("block scaling: MXFP8 rowwise, columnwise and both, rceil and floor",
       covers=("blocks.quantize_mxfp8", "blocks.quantize_mxfp8_both"))
def _mxfp8(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from fp8core import blocks

    cases = [(f"{fmt.name} rounding cases{' (transposed)' if tr else ''}", _amax_case_rows(fmt).T.copy() if tr
              else _amax_case_rows(fmt), (fmt,)) for fmt in FORMATS for tr in (False, True)]
    cases += [(label, x, FORMATS) for label, x in _block_inputs(rng, quick)]
    for label, x, fmts in cases:
        for offset in (0, 1):  # +1: a misaligned view takes the kernels' scalar paths
            xd = t.put(x, offset)
            for fmt in fmts:
                for mode in ("rceil", "floor"):
                    name = f"{label} +{offset} {fmt.name} {mode}"
                    with t.ref():
                        refs = [blocks.quantize_mxfp8(x, fmt, scale_mode=mode, columnwise=c) for c in (False, True)]
                        both_ref = blocks.quantize_mxfp8_both(x, fmt, scale_mode=mode)
                    if offset == 0 and x.size <= _oracle_max(quick):
                        for layout, ref in zip((fp8core.Layout.MX_ROWWISE, fp8core.Layout.MX_COLUMNWISE), refs):
                            q_or, e_or = block_oracle(x, fmt, layout, lambda a: (e := e8m0_oracle(a, fmt, mode),
                                                                                 _pow2(e, -1)))
                            part = layout.label
                            r.equal(f"{name} {part} vs oracle (data)", q_or, ref.data, x)
                            r.equal(f"{name} {part} vs oracle (scale)", e_or, ref.scale)
                    for ref, both in zip(refs, both_ref):
                        r.truth(f"{name}: both is rowwise and columnwise", np.array_equal(
                            t.bits(ref.data), t.bits(both.data)) and np.array_equal(t.bits(ref.scale),
                                                                                    t.bits(both.scale)))
                    with t.dut():
                        got = [blocks.quantize_mxfp8(xd, fmt, scale_mode=mode, columnwise=c) for c in (False, True)]
                        got_both = blocks.quantize_mxfp8_both(xd, fmt, scale_mode=mode)
                    for part, ref, g, gb in zip(("rowwise", "columnwise"), refs, got, got_both):
                        r.equal(f"{name} {part} (data)", ref.data, g.data, x)
                        r.equal(f"{name} {part} (scale)", ref.scale, g.scale)
                        r.equal(f"{name} both, {part} (data)", ref.data, gb.data, x)
                        r.equal(f"{name} both, {part} (scale)", ref.scale, gb.scale)


@check("block scaling: dequantize by layout (MXFP8 rowwise and columnwise, every code and scale byte; 1x128 and "
       "128x128), to every output dtype", covers=("blocks.dequantize_blocks",))
def _dequantize_blocks(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from fp8core import blocks

    L = fp8core.Layout
    for layout in (L.MX_ROWWISE, L.MX_COLUMNWISE, L.BLOCK_1X128, L.BLOCK_128X128):
        mx = layout.kind == "mx"
        shapes = ((64, 256), (33, 65) if mx else (130, 257), (1, 1), (0, 32 if mx else 128))
        for shape in shapes + (() if quick else ((1000, 1024),)):
            for fmt in FORMATS:
                codes = rng.integers(0, 256, shape, dtype=np.uint8)
                codes.reshape(-1)[:256] = np.arange(min(256, codes.size))
                if mx:
                    e = rng.integers(0, 256, layout.scale_shape(*shape), dtype=np.uint8)
                    # 2^-127 (products go subnormal), 2^-126, 2^127, NaN
                    e.reshape(-1)[:4] = [0, 1, SCALE.max_code, SCALE.nan_cast][:e.size]
                    scale, factors = e.view(E8M0), np.array([[_pow2(int(v), 1) for v in row] for row in e], np.float32)
                else:
                    scale = factors = (2.0 ** rng.uniform(-20, 20, layout.scale_shape(*shape))).astype(np.float32)
                    scale.reshape(-1)[:5] = [2.0 ** -140, 3.0e38, np.inf, np.nan, 0.0][:scale.size]
                t_cpu = fp8core.ScaledTensor(codes.view(fmt.numpy_dtype), scale, layout)
                for out in ("float32", "bfloat16", "float16"):
                    name = f"{shape} {fmt.name} {layout.value} -> {out}"
                    with t.ref():
                        ref = blocks.dequantize_blocks(t_cpu, out)
                    if codes.size <= _oracle_max(quick):
                        r.equal(f"{name} vs oracle", block_dequantize_oracle(codes, factors, *layout.block, fmt, out),
                                ref, codes)
                    with t.dut():
                        got = blocks.dequantize_blocks(_put_pair(t, t_cpu, 1 if out == "float32" else 0), out)
                    r.equal(name, ref, got, codes)


def _fp32_scaled(t: Target, r: Recorder, quick: bool, rng: np.random.Generator, quantize: Any, layouts: Any,
                 options: tuple[tuple[bool, float], ...]) -> None:
    """quantize(x, fmt, layout_arg, power_of_2, epsilon) for each (layout_arg, layout) of ``layouts``: the
    reference against the oracle and the target against the reference."""
    for label, x in _block_inputs(rng, quick):
        for offset in (0, 1):
            xd = t.put(x, offset)
            for arg, layout in layouts:
                for fmt in FORMATS:
                    for pow2, eps in options:
                        name = f"{label} +{offset} {layout} {fmt.name} pow2 {pow2} eps {eps:g}"
                        with t.ref():
                            ref = quantize(x, fmt, arg, pow2, eps)
                        if offset == 0 and x.size <= _oracle_max(quick):
                            rule = lambda amax: _oracle.scale_rule(amax, fmt.max, 0, pow2, eps)[1::-1]  # noqa: E731
                            q_or, s_or = block_oracle(x, fmt, layout, rule)
                            if x.size == 0:  # rows or columns of no elements: amax 0, scale 1
                                s_or = np.ones(s_or.shape, np.float32)
                            r.equal(f"{name} vs oracle (data)", q_or, ref.data, x)
                            r.equal(f"{name} vs oracle (scale_inv)", s_or, ref.scale_inv)
                        with t.dut():
                            got = quantize(xd, fmt, arg, pow2, eps)
                        r.equal(f"{name} (data)", ref.data, got.data, x)
                        r.equal(f"{name} (scale_inv)", ref.scale_inv, got.scale_inv)


@check("block scaling: 1x128 and 128x128 blocks with fp32 scales", covers=("blocks.quantize_blockwise",))
def _blockwise(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from fp8core import blocks

    _fp32_scaled(t, r, quick, rng, lambda x, fmt, block, pow2, eps: blocks.quantize_blockwise(
        x, fmt, block=block, power_of_2=pow2, epsilon=eps),
        [(b, b) for b in (fp8core.Layout.BLOCK_1X128, fp8core.Layout.BLOCK_128X128)],
        ((True, 0.0), (False, 0.0), (False, 1e-30)))


@check("rowwise scaling: one fp32 scale per row and per column", covers=("blocks.quantize_blockwise",))
def _rowwise(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    _fp32_scaled(t, r, quick, rng, lambda x, fmt, axis, pow2, eps: fp8core.quantize_rowwise(
        x, fmt, axis=axis, power_of_2=pow2, epsilon=eps),
        ((-1, fp8core.Layout.ROWWISE), (0, fp8core.Layout.COLUMNWISE)), ((True, 0.0), (False, 1e-30)))


@check("block scaling: transpose_blocks (MXFP8 both ways, 128x128 tiles)",
       covers=("blocks.transpose_scale", "transpose"))
def _transpose_blocks(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from fp8core import blocks

    for shape in ((1, 1), (1, 65), (37, 70), (64, 96), (300, 257), (0, 32)) + (() if quick else ((1000, 1024),)):
        x = sample(rng, shape, np.float32)
        with t.ref():
            pairs = [blocks.quantize_mxfp8(x, columnwise=c) for c in (False, True)]
            pairs.append(blocks.quantize_blockwise(x, block="128x128"))
            refs = [blocks.transpose_blocks(p) for p in pairs]
            direct = [blocks.quantize_mxfp8(np.ascontiguousarray(x.T), columnwise=c) for c in (True, False)]
            direct.append(blocks.quantize_blockwise(np.ascontiguousarray(x.T), block="128x128"))
        for label, ref, want in zip(("MXFP8 rowwise", "MXFP8 columnwise", "128x128"), refs, direct):
            r.equal(f"{shape} {label}: the transpose's quantization (data)", want[0], ref[0])
            r.equal(f"{shape} {label}: the transpose's quantization (scales)", want[1], ref[1])
        for label, pair, ref in zip(("MXFP8 rowwise", "MXFP8 columnwise", "128x128"), pairs, refs):
            with t.dut():
                got = blocks.transpose_blocks(_put_pair(t, pair))
            r.equal(f"{shape} {label} (data)", ref[0], got[0])
            r.equal(f"{shape} {label} (scales)", ref[1], got[1])


def gemm_scale_oracle(scale: np.ndarray, kind: str) -> np.ndarray:
    """cuBLASLt's scale layouts element by element: "1x32" 128x4 tiles of 512 bytes (byte
    (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4 of tile (r // 128, c // 4)), "1x128" [KB, rows], "128x128" rows
    padded to 4 floats."""
    rows, kgroups = scale.shape
    if kind == "1x32":
        tiles_c = -(-kgroups // 4)
        out = np.zeros(-(-rows // 128) * 128 * tiles_c * 4, np.uint8)
        for rr in range(rows):
            for c in range(kgroups):
                out[((rr // 128) * tiles_c + c // 4) * 512 + (rr % 32) * 16 + (rr % 128) // 32 * 4 + c % 4] = \
                    scale.view(np.uint8)[rr, c]
        return out
    if kind == "1x128":
        return scale.T.copy()
    out = np.zeros((rows, -(-kgroups // 4) * 4), np.float32)
    out[:, :kgroups] = scale
    return out


@check("block scaling: the scale layouts of the block-scaled GEMM (MXFP8 swizzle, 1x128, 128x128)",
       covers=("blocks.gemm_scale",))
def _gemm_scales(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from fp8core._tensor import wrap

    for shape in ((1, 1), (128, 4), (130, 6), (256, 32), (300, 7), (0, 4)):
        for kind in ("1x32", "1x128", "128x128"):
            if kind == "1x32":
                s = rng.integers(0, 256, shape, dtype=np.uint8).view(E8M0)
            else:
                s = (2.0 ** rng.uniform(-30, 30, shape)).astype(np.float32)
            name = f"{kind} scales {shape}"
            with t.ref():
                ref = _blocks_backend(CpuTarget()).gemm_scale(wrap(s), kind)
            r.equal(f"{name} vs oracle", gemm_scale_oracle(s, kind), ref)
            with t.dut():
                got = _blocks_backend(t).gemm_scale(wrap(t.put(s)), kind)
            r.equal(name, ref, got)


def block_gemm_refusal(t: Target, scheme: str) -> str:
    """Why this GPU refuses the scheme, as fp8core documents it ("" where it runs it)."""
    if not isinstance(t, CudaTarget):
        return ""
    if scheme == "mx":
        return "" if t.cc >= 100 else "compute capability 10.0"
    if t.cc != 90:  # cuBLASLt's 1x128/128x128 and outer-vector scale modes exist on Hopper only
        return "compute capability 9.0"
    from fp8core.backends import cublaslt

    return "" if int(cublaslt.lt_bindings().get_version()) >= cublaslt.MIN_BLOCK_VERSION else "cuBLAS 12.9"


@check("block gemm: MXFP8, 1x128/128x128 and rowwise against the emulation and float64, tolerance growing with K",
       needs=gemm_unavailable)
def _block_gemm(t: Target, r: Recorder, quick: bool, rng: np.random.Generator) -> None:
    from fp8core import blocks

    schemes = (("mx", "1x32", "1x32"), ("1x128,1x128", "1x128", "1x128"), ("1x128,128x128", "1x128", "128x128"),
               ("128x128,1x128", "128x128", "1x128"), ("rowwise", "rowwise", "rowwise"))
    shapes = ((16, 16, 128), (136, 48, 256)) + (() if quick else ((256, 512, 4096),))
    for scheme, a_block, b_block in schemes:
        refusal = block_gemm_refusal(t, scheme)
        for m, n, k in shapes:
            x = (rng.standard_normal((m, k)) * 2.0 ** rng.uniform(-6, 6, (m, k))).astype(np.float32)
            w = (rng.standard_normal((n, k)) * 2.0 ** rng.uniform(-6, 6, (n, 1))).astype(np.float32)
            fa, fb = Format.E4M3, (Format.E5M2 if m % 2 else Format.E4M3)
            with t.ref():
                if scheme == "mx":
                    a, b = blocks.quantize_mxfp8(x, fa), blocks.quantize_mxfp8(w, fb)
                elif scheme == "rowwise":
                    a, b = fp8core.quantize_rowwise(x, fa, power_of_2=False), fp8core.quantize_rowwise(w, fb)
                else:
                    a = blocks.quantize_blockwise(x, fa, block=a_block, power_of_2=False)
                    b = blocks.quantize_blockwise(w, fb, block=b_block, power_of_2=False)
            a64, b64 = _oracle.block_operand64(a), _oracle.block_operand64(b)
            exact = a64 @ b64.T
            absprod = np.abs(a64) @ np.abs(b64).T
            for out in ("float32", "bfloat16"):
                label = f"{scheme} {m}x{n}x{k} {fa.name}x{fb.name} -> {out}"
                with t.ref():
                    emu = fp8core.gemm(a, b, out_dtype=out)
                emu64 = np.asarray(emu).astype(np.float64)
                r.close(f"{label}: emulation vs float64", exact, emu64,
                        *_oracle.accumulation_tolerance(absprod, k, out))
                atol, rtol = _oracle.accumulation_tolerance(absprod, k, out, tensor_core=isinstance(t, CudaTarget))
                if refusal:
                    try:
                        with t.dut():
                            fp8core.gemm(_put_pair(t, a), _put_pair(t, b), out_dtype=out)
                        r.truth(f"{label}: refused on {t.name}", False, f"ran; fp8core says it needs {refusal}")
                    except ValueError as e:
                        r.truth(f"{label}: refused on {t.name} (needs {refusal})", refusal in str(e), str(e))
                    continue
                with t.dut():
                    got = fp8core.gemm(_put_pair(t, a), _put_pair(t, b), out_dtype=out)
                got64 = t.bits(got).view(logical_numpy_dtype(out)).astype(np.float64).reshape(exact.shape)
                r.close(f"{label}: vs float64", exact, got64, atol, rtol)
                r.close(f"{label}: vs the emulation", emu64, got64, 2 * atol, 2 * rtol)
