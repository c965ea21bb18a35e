"""fp8core's own GPU selftest (every kernel against the CPU reference) on each emulated device."""

from fp8core import _kernels, selftest


def test_selftest_passes(dev, monkeypatch):
    # As in a fresh process: the selftest sees the kernels it reaches when their plans are made.
    monkeypatch.setattr(_kernels, "_plans", {})
    report = selftest.run("cuda", quick=True, device_id=dev)
    assert report.ok, report.table()
