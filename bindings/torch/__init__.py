"""fp8core for PyTorch: the primitives as custom ops (``torch.ops.fp8core.*``, traceable by torch.compile),
:class:`Float8Linear`, :func:`convert_to_float8`, Transformer Engine's :func:`autocast` (fp8 inside, high
precision outside), :func:`enable_fsdp_float8_all_gather` (FSDP2 gathers weights in fp8), and
:func:`record_numerics` (what the fp8 casts do to each layer's operands during training).
Transformer Engine's spelling works as written after ``import fp8core.torch as te``: :class:`Linear`
(``te.Linear(1024, 1024, params_dtype=torch.bfloat16)``, its recipe taken from the autocast), ``te.autocast`` and
``te.recipe.DelayedScaling``/``Float8CurrentScaling``/``MXFP8BlockScaling``/``Float8BlockScaling``/``Format``.

The delayed-scaling state belongs to the modules and follows them through every module transform; the
invariant is written in :mod:`fp8core.torch.scaling`. The numerics are fp8core's (docs/numerics.md); CPU and
CUDA tensors alike.
"""

from . import ops
from . import block_ops  # noqa: F401  (block scaling: torch.ops.fp8core.quantize_mxfp8, ...)
from .linear import Float8Linear, convert_to_float8, enable_fsdp_float8_all_gather
from .numerics import NumericsRecord, record_numerics
from .scaling import SharedScaling, autocast
from .te import Linear
from fp8core import recipe  # noqa: E402  (TE's transformer_engine.common.recipe: te.recipe.DelayedScaling, ...)

__all__ = ["ops", "Float8Linear", "Linear", "recipe", "convert_to_float8", "autocast", "SharedScaling",
           "enable_fsdp_float8_all_gather", "record_numerics", "NumericsRecord"]
