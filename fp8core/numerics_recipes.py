"""The recipes a numerics study compares (``fp8core inspect --recipes``, ``fp8core.torch.record_numerics``'s
``recipes=``), by name, each a :class:`fp8core.numerics_stats.Recipe`: per-tensor current scaling in E4M3 and
E5M2, torchao's rowwise scaling (one power-of-2 scale per row), MXFP8 (rceil and floor scales), 1x128 and
128x128 blocks, NVFP4 (plain, and the Hadamard-transformed wgrad operand) and MXFP4.

The quantization is the library's (its public functions, whole tensor at a time).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from fp8core.backends.cpu_fp4 import hadamard16
from fp8core.blocks import dequantize_blocks, quantize_blockwise, quantize_mxfp8
from fp8core.formats import E2M1, E8M0, Format
from fp8core.fp4 import (MXFP4_BLOCK, NVFP4_BLOCK, MXFP4Tensor, NVFP4Tensor, dequantize_mxfp4, dequantize_nvfp4,
                         quantize_mxfp4, quantize_nvfp4)
from fp8core.layouts import Layout, ScaledTensor
from fp8core.numerics_blocks import e4m3_scales, e8m0_scales, fp32_scales
from fp8core.numerics_stats import Recipe
from fp8core.ops import amax, dequantize, quantize_dynamic
from fp8core.rowwise import RowwiseTensor, dequantize_rowwise, quantize_rowwise

__all__ = ["RECIPES", "BLOCK_RULE", "select", "layer_recipe", "rowwise_recipe"]


def _current(fmt: Format) -> Recipe:
    def part(q: Any, r0: int, r1: int, c0: int, c1: int) -> tuple[np.ndarray, np.ndarray]:
        data, scale_inv = q
        piece = np.ascontiguousarray(data[r0:r1, c0:c1])  # some columns of several rows: a strided view
        return piece, dequantize(piece, scale_inv)

    return Recipe(fmt.value, f"Float8CurrentScaling, Format.{fmt.name}: one scale per tensor from its amax", fmt,
                  lambda x: quantize_dynamic(x, fmt)[:2], part, scale_inv=lambda q: float(q[1][0]))


def rowwise_recipe(power_of_2: bool = True, epsilon: float = 1e-12, name: str = "rowwise") -> Recipe:
    """One fp32 scale per row, E4M3 (Float8RowwiseScaling's cast of every operand along its GEMM's K; its
    defaults: power-of-2 scales, torchao's amax floor 1e-12)."""
    # Measured as one scale per tensor is (no block statistics): a row's scale covers a row of any length, so any
    # part of the tensor is its rows' codes times their scales.
    def part(t: RowwiseTensor, r0: int, r1: int, c0: int, c1: int) -> tuple[np.ndarray, np.ndarray]:
        piece = np.ascontiguousarray(t.data[r0:r1, c0:c1])
        return piece, dequantize_rowwise(RowwiseTensor(piece, np.ascontiguousarray(t.scale_inv[r0:r1]),
                                                       Layout.ROWWISE))

    return Recipe(name, f"Float8RowwiseScaling (torchao's rowwise), E4M3: a{' power-of-2' if power_of_2 else 'n'} "
                  "fp32 scale per row (along the last dimension)", Format.E4M3,
                  lambda x: quantize_rowwise(x, Format.E4M3, power_of_2=power_of_2, epsilon=epsilon), part)


def _blocked(name: str, doc: str, layout: Layout, quantize: Any, fmt: Format = Format.E4M3) -> Recipe:
    br, bc = layout.block

    def part(t: ScaledTensor, r0: int, r1: int, c0: int, c1: int) -> tuple[np.ndarray, np.ndarray]:
        piece = ScaledTensor(np.ascontiguousarray(t.data[r0:r1, c0:c1]),
                             np.ascontiguousarray(t.scale[r0 // br:-(-r1 // br), c0 // bc:-(-c1 // bc)]), layout)
        return piece.data, dequantize_blocks(piece)

    scales = e8m0_scales if layout.scale is E8M0 else fp32_scales
    return Recipe(name, doc, fmt, quantize, part, row_step=br, block=layout.block,
                  block_scales=lambda t: scales(t.scale))


def _mxfp8(mode: str) -> Recipe:
    return _blocked(f"mxfp8_{mode}", f"MXFP8BlockScaling, E4M3, scale_mode {mode}: an E8M0 scale per 1x32 block",
                    Layout.MX_ROWWISE, lambda x: quantize_mxfp8(x, Format.E4M3, scale_mode=mode))


def _blockwise(layout: Layout) -> Recipe:
    return _blocked(f"block_{layout.value}", f"Float8BlockScaling, E4M3: a power-of-2 fp32 scale per {layout.value} "
                    "block", layout, lambda x: quantize_blockwise(x, Format.E4M3, block=layout))


def _whole_blocks(x: np.ndarray, block: int) -> np.ndarray:
    """x [R, C] with zero columns up to a multiple of ``block`` (FP4 rows hold whole blocks; zeros change no
    block's amax, no global amax)."""
    pad = -x.shape[1] % block
    return np.pad(x, ((0, 0), (0, pad))) if pad else x


_LONG = 1 << 18  # elements of a row past which FP4 quantizes a tensor in strips of columns


def _in_strips(x: np.ndarray, block: int, quantize: Callable[[np.ndarray], Any]) -> tuple[np.ndarray, np.ndarray]:
    """(data, scale) of x [R, C] (C a multiple of ``block``) quantized whole, or in strips of _LONG columns where
    its rows are longer: the backend works a row at a time at least, so a long row's temporaries would be many
    times the tensor. The same bytes: blocks do not span strips, and NVFP4's global amax is passed in."""
    if x.shape[1] <= _LONG:
        t = quantize(x)
        return t.data, t.scale
    data = np.empty((x.shape[0], x.shape[1] // 2), np.uint8)
    scale = None
    for c0 in range(0, x.shape[1], _LONG):
        t = quantize(np.ascontiguousarray(x[:, c0:c0 + _LONG]))
        if scale is None:
            scale = np.empty((x.shape[0], x.shape[1] // block), np.asarray(t.scale).dtype)
        data[:, c0 // 2:(c0 + _LONG) // 2] = t.data
        scale[:, c0 // block:(c0 + _LONG) // block] = t.scale
    return data, scale


def _fp4_part(t: Any, r0: int, r1: int, c0: int, c1: int, block: int) -> tuple[Any, np.ndarray]:
    """(data bytes, scales) of the whole blocks under columns c0:c1 of rows r0:r1 (c0 a multiple of block)."""
    b1 = -(-c1 // block)
    return (np.ascontiguousarray(t.data[r0:r1, c0 // 2:b1 * block // 2]),
            np.ascontiguousarray(t.scale[r0:r1, c0 // block:b1]))


_STRIP = 1 << 22  # elements of x per step of nvfp4_rht's operand (its transformed strip: 8 MiB of bf16)
_TILE = 256  # rows and columns of a tile of its transpose


def _nvfp4(hadamard: bool) -> Recipe:
    def quantize(x: np.ndarray) -> NVFP4Tensor:
        x = _whole_blocks(x, NVFP4_BLOCK)
        g = amax(x)  # the global amax, taken once for every strip
        return NVFP4Tensor(*_in_strips(x, NVFP4_BLOCK, lambda s: quantize_nvfp4(s, global_amax=g)), g)

    def part(t: NVFP4Tensor, r0: int, r1: int, c0: int, c1: int) -> tuple[np.ndarray, np.ndarray]:
        data, scale = _fp4_part(t, r0, r1, c0, c1, NVFP4_BLOCK)
        y = dequantize_nvfp4(NVFP4Tensor(data, scale, t.global_amax))
        return E2M1.unpack(data)[:, :c1 - c0], y[:, :c1 - c0]

    if not hadamard:
        return Recipe("nvfp4", "NVFP4BlockScaling, E2M1: an E4M3 scale per 1x16 block under an fp32 global scale",
                      E2M1, quantize, part, block=(1, NVFP4_BLOCK), block_scales=_nvfp4_scales)

    def operand(x: np.ndarray) -> np.ndarray | None:
        if x.shape[0] == 1:  # a 1-D (one-row) tensor: no tokens to run blocks down
            return None
        x = np.pad(x, ((0, -x.shape[0] % NVFP4_BLOCK), (0, 0)))
        out = np.empty((x.shape[1], x.shape[0]), x.dtype)
        # in strips of x's columns, so that the transform's float32 temporaries stay near _STRIP elements; each
        # strip transposed in square tiles (a whole strip's .T read it a column at a time: 8.5 against 2.2 ns an
        # element on 4096x4096 bf16)
        step = max(1, _STRIP // max(x.shape[0], 1))
        with np.errstate(all="ignore"):  # the transform's own rule for inf and NaN
            for k0 in range(0, x.shape[1], step):
                t = hadamard16(x[:, k0:k0 + step], True)
                for r0 in range(0, t.shape[0], _TILE):
                    for c0 in range(0, t.shape[1], _TILE):
                        out[k0 + c0:k0 + c0 + _TILE, r0:r0 + _TILE] = t[r0:r0 + _TILE, c0:c0 + _TILE].T
        return out

    return Recipe("nvfp4_rht", "NVFP4BlockScaling's wgrad operand: x^T (blocks of 16 rows of x, zero-padded), "
                  "each block's random Hadamard transform, then NVFP4 as nvfp4; measured against the transformed "
                  "values (the transform is orthonormal and cancels in the GEMM)", E2M1, quantize, part,
                  block=(1, NVFP4_BLOCK), operand=operand, block_scales=_nvfp4_scales,
                  not_applicable="a 1-D or one-row tensor has no tokens for the wgrad operand's blocks")


def _nvfp4_tiles() -> Recipe:
    """NVFP4BlockScaling's weights: an E4M3 scale per 16x16 tile (rows zero-padded to 16: no tile's amax moves)."""
    def quantize(x: np.ndarray) -> NVFP4Tensor:
        return quantize_nvfp4(_whole_blocks(x, NVFP4_BLOCK), weight_2d=True)

    def part(t: NVFP4Tensor, r0: int, r1: int, c0: int, c1: int) -> tuple[np.ndarray, np.ndarray]:
        b1 = -(-c1 // NVFP4_BLOCK)
        data = np.ascontiguousarray(t.data[r0:r1, c0 // 2:b1 * NVFP4_BLOCK // 2])
        scale = np.ascontiguousarray(t.scale[r0 // NVFP4_BLOCK:-(-r1 // NVFP4_BLOCK), c0 // NVFP4_BLOCK:b1])
        y = dequantize_nvfp4(NVFP4Tensor(data, scale, t.global_amax, Layout.NVFP4_16X16))
        return E2M1.unpack(data)[:, :c1 - c0], y[:, :c1 - c0]

    return Recipe("nvfp4_16x16", "NVFP4BlockScaling's weights, E2M1: an E4M3 scale per 16x16 tile under an fp32 "
                  "global scale", E2M1, quantize, part, row_step=NVFP4_BLOCK, block=(NVFP4_BLOCK, NVFP4_BLOCK),
                  block_scales=_nvfp4_scales)


def layer_recipe(recipe: Any, operand: str) -> Recipe:
    """The cast a layer under a block recipe (MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling) makes of
    ``operand`` ("input", "weight", "grad_output") for its forward or dgrad GEMM, blocks along the last dimension,
    as a study recipe named for the layer's recipe: the format the recipe gives the operand (HYBRID's E5M2
    grad_output), its scale rule and block shape. NVFP4's stochastic rounding of gradients is measured rounded to
    nearest (the random bytes are the layer's; the statistics of the nearest rounding bound its error in
    expectation) and its wgrad operand's Hadamard transform is the ``nvfp4_rht`` recipe's to compare."""
    from fp8core.recipe import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

    slot = ("input", "weight", "grad_output").index(operand)
    name = type(recipe).__name__
    if isinstance(recipe, NVFP4BlockScaling):
        if operand == "weight" and not recipe.disable_2d_quantization:
            return _nvfp4_tiles()
        return RECIPES["nvfp4"]
    fmt = recipe.fp8_format.bwd if operand == "grad_output" else recipe.fp8_format.fwd
    if isinstance(recipe, MXFP8BlockScaling):
        mode = recipe.scale_mode
        return _blocked(name, f"MXFP8BlockScaling, {fmt.name}, scale_mode {mode}: an E8M0 scale per 1x32 block",
                        Layout.MX_ROWWISE, lambda x: quantize_mxfp8(x, fmt, scale_mode=mode), fmt)
    if isinstance(recipe, Float8BlockScaling):
        layout = recipe.layouts[slot]
        p2, eps = recipe.power_of_2, recipe.epsilon
        return _blocked(name, f"Float8BlockScaling, {fmt.name}: an fp32 scale per {layout.value} block", layout,
                        lambda x: quantize_blockwise(x, fmt, block=layout, power_of_2=p2, epsilon=eps), fmt)
    raise TypeError(f"recipe: expected MXFP8BlockScaling, Float8BlockScaling or NVFP4BlockScaling, got {name}")


def _nvfp4_scales(t: NVFP4Tensor) -> Any:
    return e4m3_scales(t.scale, np.asarray(t.global_amax))


def _mxfp4() -> Recipe:
    def part(t: MXFP4Tensor, r0: int, r1: int, c0: int, c1: int) -> tuple[np.ndarray, np.ndarray]:
        data, scale = _fp4_part(t, r0, r1, c0, c1, MXFP4_BLOCK)
        return E2M1.unpack(data)[:, :c1 - c0], dequantize_mxfp4(MXFP4Tensor(data, scale))[:, :c1 - c0]

    return Recipe("mxfp4", "MXFP4 (OCP MX), E2M1: an E8M0 scale per 1x32 block, rceil", E2M1,
                  lambda x: MXFP4Tensor(*_in_strips(_whole_blocks(x, MXFP4_BLOCK), MXFP4_BLOCK, quantize_mxfp4)),
                  part, block=(1, MXFP4_BLOCK),
                  block_scales=lambda t: e8m0_scales(t.scale))


# A tie in SQNR goes to the recipe listed first: one scale per tensor before any block recipe, which has
# scales to keep per block.
RECIPES: dict[str, Recipe] = {r.name: r for r in (
    _current(Format.E4M3), _current(Format.E5M2), rowwise_recipe(), _mxfp8("rceil"), _mxfp8("floor"),
    _blockwise(Layout.BLOCK_1X128), _blockwise(Layout.BLOCK_128X128), _nvfp4(False), _nvfp4(True), _mxfp4())}

BLOCK_RULE = ("block recipes run along the last dimension (a tensor is viewed as [rows, last dim]; 1-D is one "
              "row); a partial block at an edge is zero-padded in effect (its scale comes from its own elements); "
              "a scalar has no blocks: n/a; nvfp4_rht measures x^T, its blocks down 16 rows of x (rows zero-padded "
              "to 16), the transformed values, and is n/a for a 1-D or one-row tensor")


def select(names: str | Sequence[str], arg: str = "recipes") -> list[Recipe]:
    """``"all"``, or names from :data:`RECIPES` (a sequence, or one string of comma-separated names), in the
    order given, repeats dropped. ValueError naming ``arg`` for an unknown or empty name."""
    if isinstance(names, str):
        if names.strip() == "all":
            return list(RECIPES.values())
        names = [n.strip() for n in names.split(",")]
    elif not isinstance(names, (list, tuple)):
        raise TypeError(f"{arg}: expected 'all', a comma-separated string or a list of recipe names, got "
                        f"{type(names).__name__}")
    valid = ", ".join(RECIPES)
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"{arg}: expected recipe names (str), got {type(n).__name__}")
        if n not in RECIPES:
            what = "an empty name" if not n else f"unknown recipe {n!r}"
            raise ValueError(f"{arg}: {what}; expected 'all' or a comma-separated list of {valid}")
    return [RECIPES[n] for n in dict.fromkeys(names)]
