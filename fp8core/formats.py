"""Encodings and formats.

An :class:`Encoding` is one row of the encoding table (:data:`ROWS`: E4M3, E5M2, the E8M0 block scale and FP4's
E2M1): everything fp8core knows of one element or scale encoding. Every other table of fp8core (dtype names,
kernel instantiations and the CUDA kernels' constants, DLPack and cuBLASLt type codes, the accepted spellings) is
read from the rows, so a new encoding is a new row (and, for the GPU, its conversion in cuda/).

:class:`Format` is Transformer Engine's vocabulary for a recipe's choice of encodings: ``E4M3`` or ``E5M2`` for
every tensor, or ``HYBRID`` (E4M3 forward, E5M2 backward).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["Format", "Encoding", "ROWS", "E4M3", "E5M2", "E8M0", "E2M1", "ENCODINGS", "FORMAT_NAMES",
           "HIGH_PRECISION_DTYPES", "FP8_DTYPES", "dtype_name"]

# Logical dtype names used across fp8core; storage on the GPU is uint8 (fp8) and uint16 (bf16).
HIGH_PRECISION_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, eq=False, repr=False)
class Encoding:
    """One encoding: a row of :data:`ROWS`.

    A code is an unsigned integer of ``bits`` bits: the sign (when ``signed``), then the exponent, then the mantissa.
    Every cast fp8core makes into an encoding saturates (satfinite): a finite value beyond ``max`` and +-inf become
    +-max (``max_code`` with the sign), and NaN of either sign becomes ``nan_cast``. In memory a byte holds
    ``elements_per_byte`` codes; packed two to a byte, element 2j of a row is in bits 0-3 of byte j and element 2j+1
    in bits 4-7 when ``low_nibble_first``. ml_dtypes (and so NumPy and JAX) holds one code per byte.
    """

    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float                  # largest finite value
    signed: bool                # a sign bit above the exponent (E8M0 has none)
    subnormals: bool            # exponent field 0 holds 0 and the subnormals; else it is 2^-bias (E8M0: no zero)
    has_inf: bool               # the all-ones exponent is inf (mantissa 0) or NaN, as in IEEE 754
    nan_codes: tuple[int, ...]  # every NaN code; () where there is no NaN
    nan_cast: int               # the code a NaN casts to
    elements_per_byte: int
    low_nibble_first: bool
    dtype_name: str             # ml_dtypes' name, NumPy's and JAX's too (one code per byte)
    torch_name: str             # torch's dtype (packed two to an element for E2M1: float4_e2m1fn_x2)
    dlpack_code: int            # DLPack 1.1 type code
    cuda_data_type: int         # cudaDataType, as cuBLASLt takes it (library_types.h)
    index: int | None = None    # the CUDA kernels' template parameter; None while no kernel converts it
    aliases: tuple[str, ...] = ()  # further spellings as_format accepts (besides the value and dtype_name)
    numpy_dtype: np.dtype = field(init=False)  # ml_dtypes' type

    def __post_init__(self) -> None:
        object.__setattr__(self, "numpy_dtype", np.dtype(getattr(ml_dtypes, self.dtype_name)))

    def __repr__(self) -> str:
        return f"Encoding({self.name})"

    def __reduce__(self) -> tuple:
        return _row, (self.name,)  # unpickles as the row itself: rows compare by identity

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two <= max: 8 (E4M3), 15 (E5M2); MXFP8's E8M0 scales use it."""
        return math.frexp(self.max)[1] - 1

    @cached_property
    def values(self) -> np.ndarray:
        """float64 value of every code 0 .. 2^bits - 1, from the fields alone (NaN codes NaN; read only)."""
        codes = np.arange(1 << self.bits)
        mb, top = self.mantissa_bits, (1 << self.exponent_bits) - 1
        e, m = (codes >> mb) & top, codes & ((1 << mb) - 1)
        v = (1.0 + m / 2.0 ** mb) * np.exp2(e - self.bias)
        if self.subnormals:
            v = np.where(e == 0, m * 2.0 ** (1 - self.bias - mb), v)
        if self.has_inf:
            v = np.where(e == top, np.where(m == 0, np.inf, np.nan), v)
        if self.signed:
            v = np.where((codes >> (self.bits - 1)) & 1, -v, v)
        v[list(self.nan_codes)] = np.nan
        v.flags.writeable = False
        return v

    @cached_property
    def max_code(self) -> int:
        """The code of +max: what a positive value beyond max casts to."""
        return int(np.flatnonzero(self.values == self.max)[0])

    @cached_property
    def smallest(self) -> float:
        """The smallest positive value (the smallest subnormal where there are subnormals)."""
        v = self.values
        return float(v[v > 0].min())

    @property
    def storage_dtype(self) -> np.dtype:
        """What holds the codes where the framework has no type for them (CuPy, torch for packed data): bytes."""
        return np.dtype(np.uint8)

    def storage_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The byte array's shape for codes of ``shape``: the last dimension packed ``elements_per_byte`` a byte."""
        if self.elements_per_byte == 1:
            return tuple(shape)
        if not shape or shape[-1] % self.elements_per_byte:
            raise ValueError(f"shape: {self.name} packs {self.elements_per_byte} elements a byte along the last "
                             f"dimension, which must be a multiple of {self.elements_per_byte}; got {tuple(shape)}")
        return (*shape[:-1], shape[-1] // self.elements_per_byte)

    def pack(self, codes: np.ndarray) -> np.ndarray:
        """Codes [..., C] (one a byte, any 1-byte dtype) as stored: uint8 [..., C / elements_per_byte]."""
        c = np.asarray(codes).view(np.uint8)
        if self.elements_per_byte == 1:
            return c.copy()
        self.storage_shape(c.shape)
        lo, hi = (c[..., 0::2], c[..., 1::2]) if self.low_nibble_first else (c[..., 1::2], c[..., 0::2])
        return np.bitwise_or(lo & 0xF, np.left_shift(hi & 0xF, 4, dtype=np.uint8))

    def unpack(self, data: np.ndarray) -> np.ndarray:
        """Stored bytes [..., B] as codes [..., B * elements_per_byte], one a byte (uint8)."""
        b = np.asarray(data).view(np.uint8)
        if self.elements_per_byte == 1:
            return b.copy()
        out = np.empty((*b.shape[:-1], 2 * b.shape[-1]), np.uint8)
        first, second = (b & 0xF, b >> 4) if self.low_nibble_first else (b >> 4, b & 0xF)
        out[..., 0::2], out[..., 1::2] = first, second
        return out

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.torch_name)

    @property
    def jax_dtype(self) -> Any:
        import jax.numpy as jnp

        return getattr(jnp, self.dtype_name)


E4M3 = Encoding(
    "E4M3", bits=8, exponent_bits=4, mantissa_bits=3, bias=7, max=448.0, signed=True, subnormals=True,
    has_inf=False, nan_codes=(0x7F, 0xFF), nan_cast=0x7F, elements_per_byte=1, low_nibble_first=True,
    dtype_name="float8_e4m3fn", torch_name="float8_e4m3fn", dlpack_code=10, cuda_data_type=28, index=0,
    aliases=("e4m3fn", "fp8_e4m3"))
E5M2 = Encoding(
    "E5M2", bits=8, exponent_bits=5, mantissa_bits=2, bias=15, max=57344.0, signed=True, subnormals=True,
    has_inf=True, nan_codes=(0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF), nan_cast=0x7F, elements_per_byte=1,
    low_nibble_first=True, dtype_name="float8_e5m2", torch_name="float8_e5m2", dlpack_code=12, cuda_data_type=29,
    index=1, aliases=("fp8_e5m2",))
# The MX block scale (OCP MX v1.0): a power of two 2^(e - 127), unsigned, no zero, 0xFF NaN.
E8M0 = Encoding(
    "E8M0", bits=8, exponent_bits=8, mantissa_bits=0, bias=127, max=2.0 ** 127, signed=False, subnormals=False,
    has_inf=False, nan_codes=(0xFF,), nan_cast=0xFF, elements_per_byte=1, low_nibble_first=True,
    dtype_name="float8_e8m0fnu", torch_name="float8_e8m0fnu", dlpack_code=14, cuda_data_type=30)
# FP4 (OCP MX v1.0): no inf, no NaN; NaN casts to +6 (NVIDIA's cvt.rn.satfinite.e2m1x2.f32).
E2M1 = Encoding(
    "E2M1", bits=4, exponent_bits=2, mantissa_bits=1, bias=1, max=6.0, signed=True, subnormals=True,
    has_inf=False, nan_codes=(), nan_cast=0x7, elements_per_byte=2, low_nibble_first=True,
    dtype_name="float4_e2m1fn", torch_name="float4_e2m1fn_x2", dlpack_code=17, cuda_data_type=33)

ROWS = (E4M3, E5M2, E8M0, E2M1)
_BY_NAME = {row.name: row for row in ROWS}


def _row(name: str) -> Encoding:
    return _BY_NAME[name]


class Format(enum.Enum):
    """A recipe's choice of encodings. ``E4M3`` and ``E5M2`` encode every tensor so; ``HYBRID`` encodes forward
    tensors (input, weight, output) in E4M3 and backward ones (grad_output, grad_input) in E5M2.

    A Format of one encoding has that row's attributes (``Format.E4M3.max``, ``.dtype_name``, ``.encoding``, ...);
    HYBRID has none, and reading one from it says why.
    """

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    HYBRID = "hybrid"

    @property
    def fwd(self) -> "Format":
        """The format of forward tensors (input, weight, output)."""
        return _FORMAT_OF[_CHOICES[self][0]]

    @property
    def bwd(self) -> "Format":
        """The format of backward tensors (grad_output, grad_input)."""
        return _FORMAT_OF[_CHOICES[self][1]]

    # A single encoding's row (its attributes, below) is read on every primitive call: its fields are copied into
    # the member (plain attribute reads), the rest of the row is reached through __getattr__.
    encoding: Encoding
    max: float
    dtype_name: str
    index: int
    dlpack_code: int
    numpy_dtype: np.dtype
    emax: int
    torch_dtype: Any
    jax_dtype: Any

    def __getattr__(self, name: str) -> Any:
        if name[0] == "_" or name not in _ROW_ATTRIBUTES:  # the enum machinery probes _value_ while making members
            raise AttributeError(f"'Format' object has no attribute {name!r}")
        row = ENCODINGS.get(self)
        if row is None:
            raise ValueError("fmt: HYBRID is a recipe, not an encoding; use Format.HYBRID.fwd or .bwd")
        return getattr(row, name)


# (forward, backward) encodings of each recipe choice
_CHOICES = {Format.E4M3: (E4M3, E4M3), Format.E5M2: (E5M2, E5M2), Format.HYBRID: (E4M3, E5M2)}
ENCODINGS = {f: fwd for f, (fwd, bwd) in _CHOICES.items() if fwd is bwd}  # the Formats that are one encoding
_FORMAT_OF = {row: f for f, row in ENCODINGS.items()}
_ROW_ATTRIBUTES = frozenset({"encoding", *Encoding.__dataclass_fields__, *(a for a in dir(Encoding) if a[0] != "_")})
for _fmt, _enc in ENCODINGS.items():
    _fmt.__dict__.update({k: v for k, v in vars(_enc).items() if k != "name"}, encoding=_enc)
del _fmt, _enc

FP8_DTYPES = tuple(row.dtype_name for row in ENCODINGS.values())
# Every spelling of a format as_format accepts, lower case.
FORMAT_NAMES = {name: f for f, row in ENCODINGS.items() for name in (f.value, row.dtype_name, *row.aliases)}
FORMAT_NAMES["hybrid"] = Format.HYBRID


def dtype_name(dtype: Any) -> str:
    """The logical name ('float32', 'bfloat16', 'float8_e4m3fn', ...) of a numpy, torch or jax dtype."""
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch."):]
    if text == "<class 'jax.numpy.bfloat16'>" or text.startswith("<class"):
        text = getattr(dtype, "__name__", text)
    try:
        return np.dtype(dtype).name
    except TypeError:
        return text
