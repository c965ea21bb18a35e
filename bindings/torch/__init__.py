"""fp8core for PyTorch: the primitives as custom ops (``torch.ops.fp8core.*``, traceable by torch.compile),
:class:`Float8Linear`, :func:`convert_to_float8`, Transformer Engine's :func:`autocast` (fp8 inside, high
precision outside), :func:`enable_fsdp_float8_all_gather` (FSDP2 gathers weights in fp8), and
:func:`record_numerics` (what the fp8 casts do to each layer's operands during training).
Transformer Engine's spelling works as written after ``import fp8core.torch as te``: :class:`Linear`
(``te.Linear(1024, 1024, params_dtype=torch.bfloat16)``, its recipe taken from the autocast), ``te.LayerNorm``,
``te.RMSNorm``, ``te.LayerNormLinear``, ``te.LayerNormMLP``, ``te.autocast(True, recipe=...)`` and its older name
``te.fp8_autocast``, ``te.fp8_model_init``/``te.quantized_model_init``, ``te.is_fp8_available()`` and
``te.recipe.DelayedScaling``/``Float8CurrentScaling``/``MXFP8BlockScaling``/``Float8BlockScaling``/
``NVFP4BlockScaling``/``Format``.
A model :func:`convert_to_float8` made runs in fp8 without a context (torchao's usage; Trainer-style loops).

The delayed-scaling state belongs to the modules and follows them through every module transform; the
invariant is written in :mod:`fp8core.torch.scaling`. The numerics are fp8core's (docs/numerics.md); CPU and
CUDA tensors alike.
"""

from . import ops
from . import block_ops  # noqa: F401  (block scaling: torch.ops.fp8core.quantize_mxfp8, ...)
from . import fp4_ops  # noqa: F401  (NVFP4: torch.ops.fp8core.quantize_nvfp4, nvfp4_gemm, advance_rng)
from .linear import Float8Conv1D, Float8Linear, convert_to_float8, enable_fsdp_float8_all_gather
from .numerics import NumericsRecord, record_numerics
from .scaling import SharedScaling, autocast, fp8_autocast
from .te import Linear
from .te_modules import LayerNorm, LayerNormLinear, LayerNormMLP, RMSNorm
from .te_support import (fp8_model_init, is_fp8_available, is_fp8_block_scaling_available, is_mxfp8_available,
                         quantized_model_init)
from fp8core import recipe  # noqa: E402  (TE's transformer_engine.common.recipe: te.recipe.DelayedScaling, ...)

__all__ = ["ops", "Float8Linear", "Float8Conv1D", "Linear", "recipe", "convert_to_float8", "autocast", "SharedScaling",
           "enable_fsdp_float8_all_gather", "record_numerics", "NumericsRecord", "fp8_autocast", "LayerNorm",
           "RMSNorm", "LayerNormLinear", "LayerNormMLP", "fp8_model_init", "quantized_model_init",
           "is_fp8_available", "is_mxfp8_available", "is_fp8_block_scaling_available"]
