"""Scaled tensors and their layouts (Transformer Engine's scaling modes): how a tensor's scales cover its data.

A :class:`ScaledTensor` is data with its scales in one :class:`Layout`: what the block and FP4 quantizers return
and :func:`fp8core.gemm`, the dequantizers and transpose_blocks take, each going by the layout and the data's
encoding. It unpacks as the pair ``(data, scale)``; ``MXTensor`` and ``BlockScaledTensor`` are its MXFP8 and
fp32-block spellings, ``MXFP4Tensor`` its MXFP4 one, and ``NVFP4Tensor`` the one that carries NVFP4's global amax
as a third element.
"""

from __future__ import annotations

import enum
import math
from typing import Any

from .formats import E2M1, E4M3, E8M0, Encoding, dtype_name

__all__ = ["Layout", "ScaledTensor", "MXTensor", "BlockScaledTensor", "RowwiseTensor", "NVFP4Tensor", "MXFP4Tensor",
           "resolve", "layout_of"]


class Layout(str, enum.Enum):
    """How scales cover a tensor viewed as [rows, cols]; a Layout equals its name ("1x32", "128x128", ...).

    block: (rows, cols) of data under one scale, None for one per tensor; a None inside it spans the data along
    that axis (ROWWISE's (1, None): a whole row). scale: the scales' encoding row (None:
    float32). inverse: stored as the inverse of the factor the quantization multiplied by (fp32 ``scale_inv``,
    rounded once), else as that power of two (E8M0). kind: layouts of one kind differ only in their blocks, told
    apart by the scale's shape. global_amax: an fp32 amax of the tensor goes with the scales (NVFP4's second
    level). The NVFP4 layouts hold E2M1 data (:class:`NVFP4Tensor`); MXFP4 is MX_ROWWISE over E2M1 data
    (:class:`MXFP4Tensor`).
    """

    block: tuple[int, int] | None
    scale: Encoding | None
    inverse: bool
    kind: str
    label: str
    global_amax: bool

    TENSORWISE = "tensor", None, None, True, "tensor", "one scale"
    MX_ROWWISE = "1x32", (1, 32), E8M0, False, "mx", "rowwise"
    MX_COLUMNWISE = "32x1", (32, 1), E8M0, False, "mx", "columnwise"
    BLOCK_1X128 = "1x128", (1, 128), None, True, "blocks", "1x128 blocks"
    BLOCK_128X128 = "128x128", (128, 128), None, True, "blocks", "128x128 tiles"
    NVFP4_1X16 = "1x16", (1, 16), E4M3, True, "nvfp4", "1x16 blocks", True
    NVFP4_16X16 = "16x16", (16, 16), E4M3, True, "nvfp4", "16x16 tiles", True
    # torchao's axiswise scaling: the block is a whole row (None: as long as the data is along that axis)
    ROWWISE = "rowwise", (1, None), None, True, "axiswise", "one scale per row"
    COLUMNWISE = "columnwise", (None, 1), None, True, "axiswise", "one scale per column"

    # What enum.StrEnum gives (Python 3.11+; requires-python is 3.10): str() and format() are the name itself.
    __str__ = str.__str__
    __format__ = str.__format__

    def __new__(cls, name: str, block: Any, scale: Any, inverse: bool, kind: str, label: str,
                global_amax: bool = False) -> "Layout":
        member = str.__new__(cls, name)
        member._value_ = name
        member.block, member.scale, member.inverse, member.kind = block, scale, inverse, kind
        member.label, member.global_amax = label, global_amax
        return member

    @property
    def family(self) -> tuple["Layout", ...]:
        """The layouts of this one's kind, in declaration order."""
        return _FAMILIES[self.kind]

    @property
    def transposed(self) -> "Layout | None":
        """The layout of the transpose's scales (its blocks transposed); None where that is no layout (1x128: the
        transposed data is quantized again)."""
        return _TRANSPOSED[self]

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """The scales' shape for data viewed as [rows, cols]: ``(1,)`` for one scale, else one per block."""
        if self.block is None:
            return (1,)
        br, bc = self.block
        return -(-rows // br) if br else 1, -(-cols // bc) if bc else 1

    def block_for(self, rows: int, cols: int) -> tuple[int, int]:
        """The block as (rows, cols) of data viewed as [rows, cols]: an axis the block spans (None) is the data's
        length along it (at least 1)."""
        br, bc = self.block
        return br or max(rows, 1), bc or max(cols, 1)

    @classmethod
    def parse(cls, value: Any, arg: str = "layout", allowed: tuple["Layout", ...] | None = None) -> "Layout":
        """One of ``allowed`` (default: any) from any spelling: a Layout, its name ("1x128"), or its block as a
        (rows, cols) tuple or list."""
        allowed = tuple(cls) if allowed is None else allowed
        try:
            found = _SPELLINGS.get(tuple(value) if isinstance(value, (tuple, list)) else value)
        except TypeError:  # unhashable: no spelling
            found = None
        if found in allowed:
            return found
        raise ValueError(f"{arg}: expected {' or '.join(repr(a.value) for a in allowed)}, got {value!r}")


_FAMILIES = {kind: tuple(a for a in Layout if a.kind == kind) for kind in dict.fromkeys(a.kind for a in Layout)}
_SPELLINGS = {**{a.value: a for a in Layout}, **{a.block: a for a in Layout if a.block}}
_TRANSPOSED = {a: next((b for b in _FAMILIES[a.kind] if b.block == (a.block and a.block[::-1])), None) for a in Layout}


def resolve(layout: Layout | None, family: tuple[Layout, ...], shape: tuple[int, int], scale_shape: tuple[int, ...],
            arg: str) -> Layout:
    """The layout of scales of ``scale_shape`` over data viewed as ``shape``: ``layout`` where the tensor names
    one (its shape checked), else the first of ``family`` whose shape it has. Layouts of a kind share a shape
    only where they mean the same blocks (MX's for at most one row and one column, 1x128's and 128x128's for one
    row)."""
    scale_shape = tuple(scale_shape)
    candidates = family if layout is None else (layout,)
    for candidate in candidates:
        if candidate.scale_shape(*shape) == scale_shape:
            return candidate
    expected = " or ".join(f"{c.scale_shape(*shape)} ({c.label})" for c in candidates)
    raise ValueError(f"{arg}: expected shape {expected} for data viewed as {tuple(shape)}, got {scale_shape}")


def layout_of(t: "ScaledTensor", arg: str = "t") -> Layout:
    """``t.layout`` from shapes and dtypes alone (so also while torch.compile or jax.jit traces): the layout t
    names, else the one of its kind its scale's shape means; a scale of another shape is an error naming ``arg``.
    Data packed several elements a byte (E2M1) is viewed as the elements it holds: uint8 [R, C/2] as [R, C]."""
    shape = tuple(t[0].shape)
    per_byte = t.encoding.elements_per_byte if t.encoding is not None else 1
    rows_cols = (math.prod(shape[:-1]), shape[-1] * per_byte) if shape else (1, 1)
    return resolve(t._layout, _FAMILIES[t.kind], rows_cols, tuple(t[1].shape), f"{arg}.{t._fields[1]}")


class ScaledTensor(tuple):
    """Data and its scales in one :class:`Layout`; unpacks as ``(data, scale)``, pickles with its layout.

    data: fp8 (E4M3 or E5M2), any shape, viewed as [rows, cols]; or E2M1 codes packed two a byte, uint8
    [rows, cols/2] (FP4). scale: in the layout's encoding and :meth:`Layout.scale_shape`. layout: a Layout or its
    name; None reads it from the scale (E8M0 or uint8: MX, 2-D float32: fp32 blocks, else one scale) and its
    shape. encoding: the data's row, as named (the quantizers do; uint8 storage (CuPy) and E2M1 need it), else
    None. A tuple with ``_fields``, so ``jax.jit`` carries it as a tuple of its fields (rebuilt without its layout,
    read back from the shapes, and with its class's default encoding) and torch.compile traces it; ``_replace``
    as a NamedTuple's, keeping the layout and encoding.
    """

    _fields: tuple[str, ...] = ("data", "scale")
    _kind: str | None = None  # the kind its pair-only constructor means; None: read from the scale's dtype

    def __new__(cls, data: Any, scale: Any, layout: Layout | str | None = None,
                encoding: Encoding | None = None) -> "ScaledTensor":
        return cls._new((data, scale), layout, encoding)

    @classmethod
    def _new(cls, parts: tuple, layout: Layout | str | None, encoding: Encoding | None) -> "ScaledTensor":
        self = super().__new__(cls, parts)
        self._layout = layout if layout is None or type(layout) is Layout else Layout.parse(layout)
        self.encoding = encoding
        return self

    def __getnewargs__(self) -> tuple:
        return *self, self._layout, self.encoding

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}={value!r}" for name, value in zip(self._fields, self))
        return f"{type(self).__name__}({parts}, layout={self._layout!r})"

    def _replace(self, **parts: Any) -> "ScaledTensor":
        """A copy with the named fields replaced (``t._replace(scale=s)``), its layout and encoding kept."""
        unknown = set(parts) - set(self._fields)
        if unknown:
            raise ValueError(f"_replace: {type(self).__name__} has fields {', '.join(self._fields)}; got "
                             f"{', '.join(sorted(unknown))}")
        return type(self)(*(parts.get(name, value) for name, value in zip(self._fields, self)), self._layout,
                          self.encoding)

    @property
    def data(self) -> Any:
        return self[0]

    @property
    def scale(self) -> Any:
        return self[1]

    @property
    def kind(self) -> str:
        """The layout's kind: the named layout's, else the constructor's, else by the scale's dtype."""
        if self._layout is not None or self._kind is not None:
            return self._layout.kind if self._layout is not None else self._kind
        if dtype_name(self[1].dtype) in (E8M0.dtype_name, "uint8"):
            return "mx"
        return "blocks" if len(self[1].shape) == 2 else "tensor"

    @property
    def layout(self) -> Layout:
        """The named layout, else the one of this kind that the scale's shape means (ValueError if none)."""
        return layout_of(self)


class MXTensor(ScaledTensor):
    """``MXTensor(data, scale)``: fp8 data and E8M0 scale bytes (``float8_e8m0fnu``; uint8 for CuPy),
    ``[rows, ceil(cols/32)]`` for blocks of 32 along a row (``1x32``), ``[ceil(rows/32), cols]`` along a column
    (``32x1``). Element ``data[r, c]`` is ``q * 2^(e - 127)`` with e its block's byte."""

    _kind = "mx"


class BlockScaledTensor(ScaledTensor):
    """FP8 data and one fp32 scale inverse per 1x128 block (``[rows, ceil(cols/128)]``) or per 128x128 tile
    (``[ceil(rows/128), ceil(cols/128)]``): ``BlockScaledTensor(data, scale_inv)``. Element ``data[r, c]`` is
    ``q * scale_inv[its block]``."""

    _fields = ("data", "scale_inv")
    _kind = "blocks"
    scale_inv = ScaledTensor.scale


class RowwiseTensor(ScaledTensor):
    """FP8 data and one fp32 scale inverse per row (``[rows, 1]``, layout ``rowwise``) or per column
    (``[1, cols]``, ``columnwise``) of its 2-D view: torchao's axiswise scaling, ``RowwiseTensor(data,
    scale_inv)``. Element ``data[r, c]`` is ``q * scale_inv[r, 0]`` (``scale_inv[0, c]``). Built from the pair
    alone, the scale's shape tells the two apart (for one row and one column they mean the same)."""

    _fields = ("data", "scale_inv")
    _kind = "axiswise"
    scale_inv = ScaledTensor.scale


class NVFP4Tensor(ScaledTensor):
    """NVFP4 data, its E4M3 block scales and the global amax its fp32 global scale comes from:
    ``NVFP4Tensor(data, scale, global_amax)``, unpacking as those three.

    data: uint8 [R, C/2], E2M1 codes of the operand [R, C] (x [M, K], or x^T when columnwise), two a byte.
    scale: float8_e4m3fn [R, C/16] (layout ``1x16``) or [ceil(R/16), C/16] (``16x16`` tiles). global_amax:
    float32 [1]. Element (r, c) is ``(q * s_b) * S_dec`` with ``S_dec = 1 / (2688 / global_amax)`` (1 where the
    amax is 0, inf or NaN).
    """

    _fields = ("data", "scale", "global_amax")
    _kind = "nvfp4"

    def __new__(cls, data: Any, scale: Any, global_amax: Any, layout: Layout | str | None = None,
                encoding: Encoding | None = E2M1) -> "NVFP4Tensor":
        return cls._new((data, scale, global_amax), layout, encoding)

    @property
    def global_amax(self) -> Any:
        return self[2]


class MXFP4Tensor(ScaledTensor):
    """``MXFP4Tensor(data, scale)``: E2M1 codes, uint8 [R, C/2] two a byte, and E8M0 scales float8_e8m0fnu
    [R, C/32], one per 32 elements of a row (layout ``1x32``; a columnwise quantization stores the operand x^T,
    so its blocks lie along rows too). Element (r, c) is ``q * 2^(e - 127)``."""

    _kind = "mx"

    def __new__(cls, data: Any, scale: Any, layout: Layout | str | None = Layout.MX_ROWWISE,
                encoding: Encoding | None = E2M1) -> "MXFP4Tensor":
        return cls._new((data, scale), layout, encoding)
