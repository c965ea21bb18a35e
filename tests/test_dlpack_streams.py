"""The DLPack exporter orders a consumer's stream after the producer's (an event), and the importer names its
own stream to CUDA producers (JAX blocks the host without one), without a GPU: the CUDA runtime calls are
recorded by stand-ins."""

import sys

import pytest

import fp8core
from fp8core import _dlpack
from fp8core._dlpack import CPU, CUDA, CUDA_MANAGED, Exporter


@pytest.fixture
def waits(monkeypatch):
    calls = []
    monkeypatch.setattr(_dlpack, "_stream_wait", lambda consumer, producer, device: calls.append(
        (consumer, producer, device)))
    return calls


def _export(stream, device_type=CUDA):
    return Exporter(0x1000, (4,), "float32", device_type, 1, owner=None, stream=stream)


@pytest.mark.parametrize("consumer,expected", [(7, [(7, 5, 1)]), (1, [(0, 5, 1)]), (2, [(2, 5, 1)]),
                                               (5, []), (-1, []), (None, [])])
def test_consumer_stream_waits_for_the_producer(waits, consumer, expected):
    _export(5).__dlpack__(stream=consumer)
    assert waits == expected


def test_no_wait_without_a_known_producer_stream_or_on_the_cpu(waits):
    _export(None).__dlpack__(stream=7)
    _export(5, CPU).__dlpack__(stream=None)
    assert waits == []


def test_legacy_default_producer(waits):
    _export(0).__dlpack__(stream=1)  # both name the legacy default stream
    _export(0).__dlpack__(stream=9)
    assert waits == [(9, 0, 1)]


class _Producer:
    """A DLPack producer that records the stream it is asked for and refuses to export (no GPU here)."""

    def __init__(self, device_type, device):
        self.device, self.asked = (device_type, device), []

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        self.asked.append(kwargs.get("stream", "not named"))
        raise BufferError("stand-in")


class _JaxProducer(_Producer):
    pass


_JaxProducer.__module__ = "jaxlib.xla_extension"  # what fp8core reads to tell a JAX array


class _Stream:
    def __init__(self, ptr):
        self.ptr = ptr


@pytest.mark.parametrize("kind", [_Producer, _JaxProducer])
@pytest.mark.parametrize("device_type", [CUDA, CUDA_MANAGED])
@pytest.mark.parametrize("current,named", [(0, 1), (7, 7), (2, 2)])
def test_a_cuda_producer_is_told_the_stream_fp8core_reads_on(monkeypatch, kind, device_type, current, named):
    """Named: CuPy's current stream on the array's device (the CUDA backend launches there for non-torch arrays;
    the front-ends that launch elsewhere make that stream CuPy's current one); 0, CuPy's null stream, is named
    1, the legacy default, as DLPack wants."""
    import cupy

    devices = []
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda device: devices.append(device) or _Stream(current))
    x = kind(device_type, 3)
    with pytest.raises(TypeError, match="x: could not be read through DLPack: stand-in"):
        fp8core.amax(x)
    assert devices == [3] and x.asked and set(x.asked) == {named}


def test_a_cpu_producer_is_named_no_stream():
    x = _Producer(CPU, 0)
    with pytest.raises(TypeError, match="stand-in"):
        fp8core.amax(x)
    assert x.asked and set(x.asked) == {"not named"}


def test_a_jax_callback_buffer_on_a_gpu_is_named_no_stream(monkeypatch):
    """fp8core.jax's callbacks run on XLA's stream, where their buffers are ordered already: no stream named."""
    import cupy

    from fp8core import _tensor

    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda device: pytest.fail("a buffer was asked for a stream"))
    b = _JaxProducer(CUDA, 0)
    with pytest.raises(TypeError, match="stand-in"):
        _tensor._from_jax_buffer(b, "x")
    assert b.asked and set(b.asked) == {"not named"}


@pytest.mark.parametrize("device_type", [CUDA, CUDA_MANAGED, CPU])
def test_no_cupy_no_stream_named_and_the_dlpack_error(monkeypatch, device_type):
    """CuPy not importable (fp8core[cuda12|cuda13] not installed): no stream named (there is no CuPy stream to
    name), and the general path's own error, not an ImportError from inside the stream lookup."""
    from fp8core import _tensor

    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    monkeypatch.setattr(_tensor, "_cupy", None)
    x = _Producer(device_type, 0)
    with pytest.raises(TypeError, match="^x: could not be read through DLPack: stand-in$"):
        fp8core.amax(x)
    assert x.asked and set(x.asked) == {"not named"}
