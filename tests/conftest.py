import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from fp8core.cli import gpu_unavailable_reason  # noqa: E402  (after the path is set)

# tests/emulation runs in a child process with AddressSanitizer preloaded (tests/test_emulation.py).
collect_ignore = ["emulation"]

# None, or why there is no usable GPU: "cupy is not installed", "no CUDA driver (libcuda cannot be loaded)",
# "no CUDA driver", "the CUDA driver supports CUDA 12.2, older than ...", "no CUDA device".
GPU_REASON = gpu_unavailable_reason()
requires_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"GPU test: {GPU_REASON}")


def pytest_report_header(config):
    return f"fp8core GPU tests: {'enabled' if GPU_REASON is None else 'skipped (' + GPU_REASON + ')'}"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
