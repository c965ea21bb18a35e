import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _gpu_reason() -> str | None:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
        return None
    except Exception as e:  # no cupy, no driver, no device
        return f"no usable GPU ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


GPU_REASON = _gpu_reason()
requires_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"GPU test: {GPU_REASON}")


def pytest_report_header(config):
    return f"fp8core GPU tests: {'enabled' if GPU_REASON is None else 'skipped (' + GPU_REASON + ')'}"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
