"""The independent FP8 oracle, now in the package (fp8core._oracle) so `fp8core selftest` uses the same one."""

from fp8core._oracle import (OUT_ROUNDING, SPECS, accumulation_tolerance, block_operand64,  # noqa: F401
                             decode, encode, gemm_reference, gemm_tolerance, quantize_bits)
