"""Where a JAX test's arrays live. On a machine with a GPU, JAX's default device is the GPU: a test whose claim
holds on the CPU (host reads, the CPU backend's GEMM bits) says so by placing its arrays there."""

import jax
import pytest

from conftest import GPU_REASON

JAX_CPU = jax.devices("cpu")[0]


def jax_gpus() -> list:
    """The GPUs JAX sees (none without a GPU plugin)."""
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def jax_gpu():
    """JAX's first GPU, or a skip that says why there is none."""
    gpus = jax_gpus()
    if GPU_REASON is not None or not gpus:
        pytest.skip(f"GPU test: {GPU_REASON or 'JAX sees no GPU'}")
    return gpus[0]


@pytest.fixture
def on_the_cpu():
    """JAX's default device the CPU for the test: the NumPy definition's GEMM bits are the CPU backend's; a GPU's
    GEMM sums in its own order (NUMERICS.md), compared with tolerances in tests/test_gpu_gemm.py."""
    with jax.default_device(JAX_CPU):
        yield
