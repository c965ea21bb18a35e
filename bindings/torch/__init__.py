"""fp8core for PyTorch: the primitives as custom ops (``torch.ops.fp8core.*``, traceable by torch.compile),
:class:`Float8Linear`, :func:`convert_to_float8`, Transformer Engine's :func:`autocast` (fp8 inside, high
precision outside), and :func:`enable_fsdp_float8_all_gather` (FSDP2 gathers weights in fp8).

The delayed-scaling state belongs to the modules and follows them through every module transform; the
invariant is written in :mod:`fp8core.torch.scaling`. The numerics are fp8core's (docs/numerics.md); CPU and
CUDA tensors alike.
"""

from . import ops
from . import block_ops  # noqa: F401  (block scaling: torch.ops.fp8core.quantize_mxfp8, ...)
from .fsdp import enable_fsdp_float8_all_gather
from .linear import Float8Linear, convert_to_float8
from .scaling import SharedScaling, autocast

__all__ = ["ops", "Float8Linear", "convert_to_float8", "autocast", "SharedScaling", "enable_fsdp_float8_all_gather"]
