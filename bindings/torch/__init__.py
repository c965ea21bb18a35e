"""fp8core for PyTorch: the primitives as custom ops (``torch.ops.fp8core.*``, traceable by torch.compile),
:class:`Float8Linear`, :func:`convert_to_float8` and Transformer Engine's :func:`autocast`.

The numerics are fp8core's (docs/numerics.md); CPU and CUDA tensors alike.
"""

from . import ops
from .fsdp import enable_fsdp_float8_all_gather
from .linear import Float8Linear, convert_to_float8
from .scaling import SharedScaling, autocast

__all__ = ["ops", "Float8Linear", "convert_to_float8", "autocast", "SharedScaling", "enable_fsdp_float8_all_gather"]
