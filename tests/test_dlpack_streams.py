"""The DLPack exporter orders a consumer's stream after the producer's (an event), without a GPU: the CUDA
runtime calls are recorded by a stand-in."""

import pytest

from fp8core import _dlpack
from fp8core._dlpack import CPU, CUDA, Exporter


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
