"""FP8 formats: the OCP E4M3 (``float8_e4m3fn``) and E5M2 encodings, and Transformer Engine's HYBRID."""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["Format", "as_format", "HIGH_PRECISION_DTYPES", "FP8_DTYPES", "dtype_name"]

# Logical dtype names used across fp8core; storage on the GPU is uint8 (fp8) and uint16 (bf16).
HIGH_PRECISION_DTYPES = ("float32", "bfloat16", "float16")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


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

    def _encoding(self) -> "Format":
        if self is Format.HYBRID:
            raise ValueError("fmt: HYBRID is a recipe, not an encoding; use Format.HYBRID.fwd or .bwd")
        return self

    # The encodings' constants are read on every primitive call: each is one attribute of the member (set
    # below, after the class); HYBRID has none, and reading one from it raises _encoding's error.

    @property
    def max(self) -> float:
        """Largest finite value: 448 (E4M3), 57344 (E5M2)."""
        try:
            return self._max
        except AttributeError:
            raise self._no_encoding() from None

    @property
    def dlpack_code(self) -> int:
        """DLPack 1.1 type code: kDLFloat8_e4m3fn = 10, kDLFloat8_e5m2 = 12."""
        return 10 if self._encoding() is Format.E4M3 else 12

    @property
    def dtype_name(self) -> str:
        try:
            return self._dtype_name
        except AttributeError:
            raise self._no_encoding() from None

    @property
    def numpy_dtype(self) -> np.dtype:
        try:
            return self._numpy_dtype
        except AttributeError:
            raise self._no_encoding() from None

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def jax_dtype(self) -> Any:
        import jax.numpy as jnp

        return getattr(jnp, self.dtype_name)

    @property
    def index(self) -> int:
        """The template parameter of the CUDA kernels: 0 = E4M3, 1 = E5M2."""
        try:
            return self._index
        except AttributeError:
            raise self._no_encoding() from None

    def _no_encoding(self) -> Exception:
        try:
            self._encoding()
        except ValueError as e:
            return e
        return AttributeError(self)  # pragma: no cover - every encoding has its constants


for _fmt, _max, _name, _index in ((Format.E4M3, 448.0, "float8_e4m3fn", 0), (Format.E5M2, 57344.0, "float8_e5m2", 1)):
    _fmt._max, _fmt._dtype_name, _fmt._index = _max, _name, _index
    _fmt._numpy_dtype = np.dtype(getattr(ml_dtypes, _name))
del _fmt, _max, _name, _index


_ALIASES = {
    "e4m3": Format.E4M3, "e4m3fn": Format.E4M3, "float8_e4m3fn": Format.E4M3, "fp8_e4m3": Format.E4M3,
    "e5m2": Format.E5M2, "float8_e5m2": Format.E5M2, "fp8_e5m2": Format.E5M2,
    "hybrid": Format.HYBRID,
}


def as_format(fmt: Any, *, arg: str = "fmt", allow_hybrid: bool = False) -> Format:
    """A :class:`Format` from a Format, a string (``"e4m3"``), or an fp8 dtype of numpy, torch or jax."""
    if isinstance(fmt, Format):
        result = fmt
    elif isinstance(fmt, str) and fmt.lower() in _ALIASES:
        result = _ALIASES[fmt.lower()]
    else:
        name = dtype_name(fmt)
        if name not in FP8_DTYPES:
            raise ValueError(f"{arg}: unknown FP8 format {fmt!r}; expected Format.E4M3, Format.E5M2, "
                             "'e4m3', 'e5m2' or an fp8 dtype")
        result = _ALIASES[name]
    if allow_hybrid is not False and allow_hybrid is not True:
        from ._checks import flag  # _checks imports this module

        allow_hybrid = flag(allow_hybrid, "allow_hybrid")
    if result is Format.HYBRID and not allow_hybrid:
        raise ValueError(f"{arg}: HYBRID is a recipe, not an encoding; pass Format.HYBRID.fwd or .bwd")
    return result


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
