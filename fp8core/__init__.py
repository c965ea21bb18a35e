"""fp8core: FP8 primitives (amax, scaled casts, transposes, delayed-scaling updates, GEMM) and FP4 (NVFP4, MXFP4)
for any array.

CPU arrays run on the NumPy + ml_dtypes reference backend; CUDA arrays on kernels compiled at run time.
Both follow one numerics contract (docs/numerics.md) bit for bit.
"""

from .args import as_format
from .formats import Format
from .gemm import gemm
from .ops import (amax, cast_transpose, compute_scale, dequantize, multi_amax, multi_quantize, quantize,
                  quantize_dynamic, transpose)
from .blocks import (BlockScaledTensor, MXTensor, dequantize_blockwise, dequantize_mxfp8, quantize_blockwise,
                     quantize_mxfp8, quantize_mxfp8_both, transpose_blocks)
from .fp4 import (MXFP4Tensor, NVFP4Tensor, dequantize_mxfp4, dequantize_nvfp4, quantize_mxfp4, quantize_mxfp4_both,
                  quantize_nvfp4, quantize_nvfp4_both)
from .rowwise import RowwiseTensor, dequantize_rowwise, quantize_rowwise
from .layouts import Layout, ScaledTensor
from .recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling, MXFP8BlockScaling,
                     NVFP4BlockScaling, OverrideLinearPrecision)
from .scaling import ScalingState
from .backends.cpu_threads import cpu_threads

__version__ = "0.1.0"

__all__ = ["Format", "as_format", "amax", "quantize", "quantize_dynamic", "dequantize", "transpose",
           "cast_transpose", "compute_scale", "multi_amax", "multi_quantize", "DelayedScaling",
           "Float8CurrentScaling", "ScalingState", "gemm", "__version__", "MXFP8BlockScaling", "Float8BlockScaling",
           "MXTensor", "BlockScaledTensor", "quantize_mxfp8", "quantize_mxfp8_both", "dequantize_mxfp8",
           "quantize_blockwise", "dequantize_blockwise", "transpose_blocks", "NVFP4Tensor", "MXFP4Tensor", "quantize_nvfp4",
           "quantize_nvfp4_both", "dequantize_nvfp4", "quantize_mxfp4", "quantize_mxfp4_both", "dequantize_mxfp4",
           "cpu_threads", "Layout", "ScaledTensor",
           "NVFP4BlockScaling", "RowwiseTensor", "quantize_rowwise", "dequantize_rowwise",
           "Float8RowwiseScaling", "OverrideLinearPrecision"]
