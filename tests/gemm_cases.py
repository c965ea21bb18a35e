"""Operands and cases shared by the CPU (test_gemm.py) and GPU (test_gpu_gemm.py) GEMM tests."""

import ml_dtypes
import numpy as np

import fp8core

PAIRS = [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")]
OUTS = ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]
# E5M2 output only from an E5M2 operand (cuBLASLt's table; test_errors checks the refusal)
CASES = [(a, b, o) for a, b in PAIRS for o in OUTS if o != "float8_e5m2" or "e5m2" in (a, b)]
NP = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def fp8_codes(rng, shape, fmt, spread=4.0):
    """Random finite fp8 operands spanning several binades (no NaN, no inf)."""
    x = (rng.standard_normal(shape) * 2.0 ** rng.uniform(-spread, spread, shape)).astype(np.float32)
    q = fp8core.quantize(x, 1.0, fmt)
    return q.view(np.uint8)


def as_fp8(codes, fmt):
    return codes.view(NP[fmt])
