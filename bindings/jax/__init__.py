"""fp8core for JAX: the primitives callable inside ``jax.jit`` on CPU and GPU, through
``jax.experimental.buffer_callback`` (XLA's buffers and, on a GPU, XLA's stream; no host copy).

JAX arrays are immutable, so where the core accumulates into an amax slot these functions return the amax
instead; scales and amaxes are float32 [1] arrays. Under ``vmap`` the callbacks run once per batch element
(``vmap_method="sequential"``). Across devices, reduce amaxes with :func:`reduce_amax` inside ``shard_map``.

Placement is XLA's, eager calls included (each is a cached ``jax.jit``): the callback runs on the device the
computation runs on and writes XLA's buffers there, so results land where XLA puts them (x's device for a
committed x, or where ``in_shardings``/``out_shardings`` say), and XLA refuses arguments committed to two
devices with its own error.
"""

import importlib
from typing import Any

from . import blocks  # noqa: F401  (block scaling, fp8core.jax.blocks: MXFP8 and 1x128/128x128 under jit)
from .dense import dense, init_state, next_state
from .primitives import (amax, cast_transpose, compute_scale, dequantize, gemm, numbers_static, quantize,
                         quantize_dynamic, reduce_amax, transpose, update)

__all__ = ["amax", "quantize", "quantize_dynamic", "dequantize", "transpose", "cast_transpose", "gemm",
           "compute_scale", "update", "reduce_amax", "dense", "init_state", "next_state"]


def __getattr__(name: str) -> Any:
    if name in ("Fp8DotGeneral", "Fp8Einsum", "fp8_dot_general"):  # flax is an optional extra: imported on first use
        from . import linen

        return getattr(linen, name)
    if name == "combine_calls":
        from . import tying

        return tying.combine_calls
    if name == "nnx":  # fp8core.jax.nnx, for flax NNX (``from . import nnx`` would ask this function again)
        return importlib.import_module(".nnx", __name__)
    if name in ("from_flax_fp8_state", "to_flax_fp8_state"):
        from . import convert

        return getattr(convert, name)
    raise AttributeError(f"module 'fp8core.jax' has no attribute {name!r}")
