"""FP8 formats: the OCP E4M3 (``float8_e4m3fn``) and E5M2 encodings, and Transformer Engine's HYBRID.

Each encoding is one row of :data:`ENCODINGS`; every other table of fp8core (dtype names, kernel
instantiations, DLPack and cuBLASLt type codes, the accepted spellings) is read from it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["Format", "Encoding", "ENCODINGS", "FORMAT_NAMES", "HIGH_PRECISION_DTYPES", "FP8_DTYPES", "dtype_name"]

# Logical dtype names used across fp8core; storage on the GPU is uint8 (fp8) and uint16 (bf16).
HIGH_PRECISION_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Encoding:
    """One fp8 encoding: everything fp8core needs to know of it."""

    max: float            # largest finite value
    dtype_name: str       # ml_dtypes' (and torch's, JAX's) name
    index: int            # the CUDA kernels' template parameter
    dlpack_code: int      # DLPack 1.1 type code (8-bit float)
    cuda_data_type: int   # cudaDataType (cuBLASLt): CUDA_R_8F_E4M3 = 28, CUDA_R_8F_E5M2 = 29
    aliases: tuple[str, ...]  # further spellings as_format accepts (besides the value and dtype_name)
    numpy_dtype: np.dtype = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numpy_dtype", np.dtype(getattr(ml_dtypes, self.dtype_name)))


class Format(enum.Enum):
    """An FP8 format. ``E4M3``/``E5M2`` are encodings; ``HYBRID`` is E4M3 forward, E5M2 backward."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    HYBRID = "hybrid"

    @property
    def fwd(self) -> "Format":
        """The encoding used for forward tensors (input, weight, output)."""
        return Format.E4M3 if self is Format.HYBRID else self

    @property
    def bwd(self) -> "Format":
        """The encoding used for backward tensors (grad_output, grad_input)."""
        return Format.E5M2 if self is Format.HYBRID else self

    # An encoding's constants (its row of ENCODINGS, below) are attributes of the member, read on every
    # primitive call; HYBRID has none, and reading one from it says why.
    max: float
    dtype_name: str
    index: int
    dlpack_code: int
    numpy_dtype: np.dtype

    def __getattr__(self, name: str) -> Any:
        if name in Encoding.__dataclass_fields__ or name == "encoding":
            raise ValueError("fmt: HYBRID is a recipe, not an encoding; use Format.HYBRID.fwd or .bwd")
        raise AttributeError(name)

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two <= max: 8 (E4M3), 15 (E5M2); MXFP8's E8M0 scales use it."""
        return math.frexp(self.max)[1] - 1

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def jax_dtype(self) -> Any:
        import jax.numpy as jnp

        return getattr(jnp, self.dtype_name)


ENCODINGS = {
    Format.E4M3: Encoding(448.0, "float8_e4m3fn", 0, 10, 28, ("e4m3fn", "fp8_e4m3")),
    Format.E5M2: Encoding(57344.0, "float8_e5m2", 1, 12, 29, ("fp8_e5m2",)),
}
for _fmt, _row in ENCODINGS.items():
    _fmt.__dict__.update(vars(_row), encoding=_row)
del _fmt, _row

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
