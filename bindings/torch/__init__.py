"""fp8core for PyTorch: the primitives as custom ops (``torch.ops.fp8core.*``, traceable by torch.compile),
:class:`Float8Linear`, :func:`convert_to_float8` and Transformer Engine's :func:`autocast`.

The numerics are fp8core's (docs/numerics.md); CPU and CUDA tensors alike.
"""

from . import ops
from . import block_ops  # noqa: F401  (block scaling: torch.ops.fp8core.quantize_mxfp8, ...)
from .linear import Float8Linear, convert_to_float8
from .scaling import SharedScaling, autocast

__all__ = ["ops", "Float8Linear", "convert_to_float8", "autocast", "SharedScaling"]
