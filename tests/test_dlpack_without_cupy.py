"""A CUDA DLPack producer met where CuPy is not importable (fp8core[cuda12|cuda13] not installed): the import
names no stream (there is no CuPy stream to name) and fails with the general path's own error, not an
AttributeError from inside the stream lookup."""

import pytest

import fp8core
from fp8core._dlpack import CPU, CUDA, CUDA_MANAGED


class _Producer:
    """Records the stream it is asked for and refuses to export (no GPU here)."""

    def __init__(self, device_type, device):
        self.device, self.asked = (device_type, device), []

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        self.asked.append(kwargs.get("stream", "not named"))
        raise BufferError("stand-in")


@pytest.mark.parametrize("device_type", [CUDA, CUDA_MANAGED, CPU])
def test_no_cupy_no_stream_named_and_the_dlpack_error(monkeypatch, device_type):
    from fp8core.backends import cuda

    monkeypatch.setattr(cuda, "cupy", None)  # what cuda.py leaves when `import cupy` fails
    monkeypatch.setattr(cuda, "_runtime", None)
    x = _Producer(device_type, 0)
    with pytest.raises(TypeError, match="^x: could not be read through DLPack: stand-in$"):
        fp8core.amax(x)
    assert x.asked and set(x.asked) == {"not named"}
