"""Backends: ``cpu`` (NumPy + ml_dtypes, the reference) and ``cuda`` (CuPy RawModule kernels).

Both implement the same functions over :class:`fp8core._tensor.Tensor` views; the API layer picks one
by the input's device.
"""

from __future__ import annotations

from types import ModuleType

__all__ = ["for_device"]


def for_device(device: tuple) -> ModuleType:
    if device[0] == "cpu":
        from . import cpu

        return cpu
    from . import cuda

    return cuda
