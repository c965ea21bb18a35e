"""Backends: ``cpu`` (NumPy + ml_dtypes, the reference) and ``cuda`` (the kernels of cuda/, launched through
fp8core._kernels' records), with ``cpu_blocks``/``cuda_blocks`` for block scaling and ``cpu_fp4``/``cuda_fp4`` for FP4
(NVFP4, MXFP4).

Both modules of a pair implement :class:`Backend` (:class:`BlockBackend`) with the same signatures, over
:class:`fp8core._views.Tensor` views of the caller's arrays; the API layer picks one by the input's device. Arrays
a backend takes and returns besides Tensors are its own: NumPy arrays in the logical dtype on the CPU, CuPy
arrays in storage dtype on a GPU. Results come from the tensor's caller's allocator, launches go on its stream.
The CUDA backend adds ``allocate`` (that allocator under the device guard, for the results the core allocates
from their declared shapes: fp8core.args.result, which on the CPU calls the caller's allocator itself),
``device_f32`` (host values as a device array on the caller's stream) and ``step_counter`` (the update's
device-side interval counter), which the CPU has no need of.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Protocol

from .._views import Tensor
from ..formats import Encoding
from ..layouts import Layout

__all__ = ["Backend", "BlockBackend", "FP4Backend", "blocks_for_device", "for_device", "fp4_for_device"]


class Backend(Protocol):
    """The primitives of docs/numerics.md. ``amax_out`` slots accumulate (max with what they hold); ``out=``
    arrays are written instead of new ones."""

    name: str
    xp: ModuleType  # numpy or cupy

    def amax(self, x: Tensor) -> Any: ...
    def multi_amax(self, xs: list[Tensor], out: Any) -> None: ...
    def quantize(self, x: Tensor, scale: Any, fmt: Encoding, amax_out: Any | None, *, out: Any | None = None
                 ) -> Any: ...
    def quantize_dynamic(self, x: Tensor, fmt: Encoding, margin: int, power_of_2: bool, epsilon: float,
                         reduce: Callable | None, *, out: tuple = (None, None, None)) -> tuple[Any, Any, Any]: ...
    def multi_quantize(self, xs: list[Tensor], scales: list[Any], fmts: list[Encoding], amax_outs: list[Any | None],
                       *, outs: list[Any | None] | None = None) -> list[Any]: ...
    def dequantize(self, q: Tensor, fmt: Encoding, scale_inv: Any, out_dtype: str, *, out: Any | None = None
                   ) -> Any: ...
    def transpose(self, q: Tensor, *, out: Any | None = None) -> Any: ...
    def cast_transpose(self, x: Tensor, scale: Any, fmt: Encoding, amax_out: Any | None, *,
                       out: tuple = (None, None)) -> tuple[Any, Any]: ...
    def scale_rule(self, amax: Any, fp8_max: Any, margin: int, power_of_2: bool, epsilon: float
                   ) -> tuple[Any, Any, Any]: ...
    def compute_scale(self, amax: Any, fp8_max: float, margin: int, power_of_2: bool, epsilon: float,
                      previous: Any | None) -> tuple[Any, Any]: ...
    def update(self, history: Any, scale: Any, scale_inv: Any, fp8_max: Any, margin: int, algo: str,
               power_of_2: bool, epsilon: float, update_scale: bool, flags: Any | None, step: Any | None = None,
               interval: int = 1) -> None: ...
    def gemm(self, spec: Any, a: Tensor, b: Tensor, a_scale_inv: Any, b_scale_inv: Any, bias: Tensor | None,
             out_scale: Any | None, out_amax: Any | None, out: Any | None) -> Any: ...


class BlockBackend(Protocol):
    """Block scaling (fp8core.blocks), by :class:`fp8core.layouts.Layout`: MX's 1x32 E8M0 scales along rows or
    columns, 1x128 and 128x128 float32 scale inverses. The quantizers write ``out``, allocated by the core from
    the declarations (E8M0 scales as uint8 storage on a GPU)."""

    def quantize_mxfp8(self, x: Tensor, fmt: Encoding, scale_mode: str, layout: Layout, out: tuple[Any, Any]
                       ) -> tuple[Any, Any]: ...
    def quantize_mxfp8_both(self, x: Tensor, fmt: Encoding, scale_mode: str, out: tuple[Any, ...]
                            ) -> tuple[Any, ...]: ...
    def quantize_blockwise(self, x: Tensor, fmt: Encoding, layout: Layout, power_of_2: bool, epsilon: float,
                           out: tuple[Any, Any]) -> tuple[Any, Any]: ...
    def dequantize_blocks(self, q: Tensor, scale: Tensor, fmt: Encoding, layout: Layout, out_dtype: str) -> Any: ...
    def transpose_scale(self, scale: Tensor) -> Any: ...
    def gemm_scale(self, scale: Tensor, layout: Layout) -> Any: ...


class FP4Backend(Protocol):
    """FP4 (fp8core.fp4): NVFP4 and MXFP4 on the operand [R, C] (x, or x^T when columnwise), E2M1 packed."""

    def quantize_nvfp4(self, x: Tensor, weight_2d: bool, hadamard: bool, stochastic: bool, seed: int, offset: int,
                       rng_state: Tensor | None, global_amax: Any | None, columnwise: bool) -> tuple[Any, Any, Any]: ...
    def dequantize_nvfp4(self, data: Tensor, scale: Tensor, global_amax: Any, out_dtype: str) -> Any: ...
    def quantize_mxfp4(self, x: Tensor, mode: str, columnwise: bool) -> tuple[Any, Any]: ...
    def dequantize_mxfp4(self, data: Tensor, scale: Tensor, out_dtype: str) -> Any: ...
    def gemm_scale(self, scale: Tensor, rows: int) -> Any: ...
    def gemm_alpha(self, amax_a: Tensor, amax_b: Tensor) -> Any: ...
    def gemm(self, spec: Any, a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor,
             global_amaxes: tuple[Tensor, Tensor] | None, bias: Tensor | None) -> Any: ...


def for_device(device: tuple) -> Any:
    """The :class:`Backend` module for ``device`` (("cpu", 0) or ("cuda", ordinal))."""
    if device[0] == "cpu":
        from . import cpu

        return cpu
    from . import cuda

    return cuda


def blocks_for_device(device: tuple) -> Any:
    """The :class:`BlockBackend` module for ``device``: block scaling's kernels are modules of their own."""
    if device[0] == "cpu":
        from . import cpu_blocks

        return cpu_blocks
    from . import cuda_blocks

    return cuda_blocks


def fp4_for_device(device: tuple, function: str) -> Any:
    """The :class:`FP4Backend` module for ``device``; ``function``: the public name called (every one has both
    backends; what a GPU lacks for the FP4 GEMM is refused by cuda_fp4.gemm, naming its compute capability)."""
    if device[0] == "cpu":
        from . import cpu_fp4

        return cpu_fp4
    from . import cuda_fp4

    return cuda_fp4
