"""Two threads meeting a device's placement for the first time at once must agree on the one Tensor.place kept
for it (fp8core compares placements by identity): otherwise arrays committed to the same device are refused as
'on cpu:0 but x is on cpu:0', in that call and, as the two caches then disagree, in later ones."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import fp8core  # noqa: E402
from fp8core import _tensor  # noqa: E402


class _Interleaved(dict):
    """The first lookup of a key runs ``other`` (the second thread, wrapping its own array) before answering
    what it read: a miss, as a thread that read just before the other stored would see."""

    def __init__(self, other):
        super().__init__()
        self.other = other

    def get(self, key, default=None):
        other, self.other = self.other, None
        if other is not None:
            missed = super().get(key, default)
            other()
            return missed
        return super().get(key, default)


def test_a_first_placement_raced_by_another_thread_is_the_same_object(monkeypatch):
    d0 = jax.devices()[0]
    x = jax.device_put(np.ones(8, np.float32), d0)
    s = jax.device_put(np.full(1, 2.0, np.float32), d0)
    assert x.sharding is not s.sharding and x.sharding == s.sharding  # equal shardings, distinct objects
    seen = {}
    monkeypatch.setattr(_tensor, "_JAX_SHARDINGS", {})
    monkeypatch.setattr(_tensor, "_JAX_PLACES", _Interleaved(lambda: seen.setdefault("s", _tensor.wrap(s))))
    tx = _tensor.wrap(x)
    assert tx.place is seen["s"].place is _tensor.wrap(s).place is not None
    q = fp8core.quantize(x, s, "e4m3")  # committed to one device: accepted, and the result stays there
    assert q.committed and q.devices() == {d0}
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), np.full(8, 2.0, np.float32))


def test_same_device_other_memory_kind_is_named_in_the_refusal():
    """A jax.Array in the device's pinned host memory and one in its device memory: refused (as jax.jit refuses
    mixing memory spaces), with a message that tells the two apart instead of 'on cpu:0 but x is on cpu:0'."""
    from jax.sharding import SingleDeviceSharding

    d0 = jax.devices()[0]
    try:
        x = jax.device_put(np.ones(8, np.float32), SingleDeviceSharding(d0, memory_kind="pinned_host"))
    except (ValueError, RuntimeError) as e:  # a backend without that memory kind
        pytest.skip(f"no pinned_host memory on {d0}: {e}")
    s = jax.device_put(np.full(1, 2.0, np.float32), d0)
    with pytest.raises(ValueError, match=rf"^scale: is on {d0} but x is on {d0} \(pinned_host memory\); put them "
                                         "on the same device$"):
        fp8core.quantize(x, s, "e4m3")
