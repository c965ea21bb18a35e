"""The launch layer under the emulator: argument layouts against the kernels' own signatures, grids beyond one
row of 65535 blocks, the cooperative grid barrier with every block resident (and its deadlock when they are not),
and that every kernel of _kernels.KERNELS ran somewhere in this suite."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import device
import fp8core
from arrays import bits, data, upload
from fp8core import _kernels
from fp8core.backends import cuda


def test_argument_layouts_match_the_kernels(dev):
    """Each record's signature as the loader read it from the .cu (what its launch packs) against each
    instantiation's C++ parameter list as the host compiler lays it out, offset by offset."""
    for k in _kernels.RECORDS:
        for targs in k.instances:
            fn = _kernels.get_function(k.file, k.expr(targs), dev)
            assert k.signature.layout == device.param_layout(fn), k.expr(targs)


# ---- grids beyond one row: only a window of blocks around the row boundary runs, over lazily mapped memory --

def _window(first, last):
    device.state.block_window = (first, last)


def test_transpose_beyond_one_grid_row(dev, rng):
    rows, tiles = 128, 65536 + 3  # tile t covers columns [128 t, 128 t + 128): grid (32770, 2), one block idle
    q = device.empty((rows, 128 * tiles), np.uint8)
    c0 = 128 * (65535 - 2)
    region = rng.integers(0, 256, (rows, 128 * (tiles - 65533)), dtype=np.uint8)
    q[:, c0:] = device.asarray(region)
    _window(65535 - 2, 65535 + 8)  # tiles numbered past 65535 (blockIdx.y 1) and the idle block after the last
    qt = fp8core.transpose(q, fmt="e4m3")
    assert device.state.launches[-1].grid == (32770, 2)
    np.testing.assert_array_equal(qt[c0:].get(), region.T)


def test_cast_transpose_beyond_one_grid_row(dev, rng):
    rows, tiles = 128, 65536 + 1  # 128 x 128 tiles
    x = device.empty((rows, 128 * tiles), np.float32)
    c0 = 128 * (65535 - 1)
    region = data(rng, (rows, 128 * 3), np.float32)
    x[:, c0:] = device.asarray(region)
    scale = device.asarray(np.array([0.5], np.float32))  # a device array: no fill launch to take the window
    _window(65535 - 1, 65535 + 4)
    q, qt = fp8core.cast_transpose(x, scale, "e4m3")
    rq, rqt = fp8core.cast_transpose(region, 0.5, "e4m3")
    np.testing.assert_array_equal(bits(q[:, c0:]), bits(rq))
    np.testing.assert_array_equal(bits(qt[c0:]), bits(rqt))


def test_mxfp8_beyond_one_grid_row(dev, rng):
    rows, tiles = 32, 65536 + 1  # 32 x 256 tiles
    x = device.empty((rows, 256 * tiles), np.float32)
    c0 = 256 * (65535 - 1)
    region = data(rng, (rows, 256 * 3), np.float32)
    x[:, c0:] = device.asarray(region)
    _window(65535 - 1, 65535 + 4)
    got = fp8core.quantize_mxfp8_both(x, "e4m3")
    ref = fp8core.quantize_mxfp8_both(region, "e4m3")
    np.testing.assert_array_equal(bits(got[0].data[:, c0:]), bits(ref[0].data))
    np.testing.assert_array_equal(bits(got[0].scale[:, c0 // 32:]), bits(ref[0].scale))
    np.testing.assert_array_equal(bits(got[1].data[:, c0:]), bits(ref[1].data))
    np.testing.assert_array_equal(bits(got[1].scale[:, c0:]), bits(ref[1].scale))


def test_128x128_beyond_one_grid_row(dev, rng):
    rows, tiles = 128, 65536 + 1
    x = device.empty((rows, 128 * tiles), np.float16)
    c0 = 128 * (65535 - 1)
    region = data(rng, (rows, 128 * 3), np.float16)
    x[:, c0:] = device.asarray(region)
    _window(65535 - 1, 65535 + 4)
    got = fp8core.quantize_blockwise(x, "e4m3", block="128x128")
    ref = fp8core.quantize_blockwise(region, "e4m3", block="128x128")
    np.testing.assert_array_equal(bits(got.data[:, c0:]), bits(ref.data))
    np.testing.assert_array_equal(bits(got.scale_inv[:, c0 // 128:]), bits(ref.scale_inv))


# ---- the cooperative quantize_dynamic ----------------------------------------------------------------

@pytest.mark.parametrize("occupancy", [1, 2, 3])
def test_cooperative_grid_fits_what_can_be_resident(dev, occupancy, rng, monkeypatch):
    """The grid barrier runs with every block resident; the launch never asks for more blocks than the
    occupancy rule lets be resident at once (the emulated driver refuses a larger cooperative launch)."""
    monkeypatch.setattr(device.DEVICES[dev], "occupancy", occupancy)
    monkeypatch.setattr(_kernels, "_plans", {})
    x = data(rng, (300001,), np.float32)
    got = fp8core.quantize_dynamic(upload(x), "e4m3")
    ref = fp8core.quantize_dynamic(x, "e4m3")
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(bits(g), bits(r))
    launch = device.state.launches[-1]
    assert launch.cooperative and launch.name.startswith("fp8core::quantize_dynamic_kernel")
    resident = occupancy * device.DEVICES[dev].sms
    assert launch.grid[0] * launch.grid[1] == resident, "a large tensor fills what can be resident, no more"


def test_grid_barrier_hangs_when_blocks_are_not_resident(tmp_path):
    """The co-residency deadlock the occupancy rule prevents, reproduced: 8 blocks spinning on a grid barrier
    with room for only 2 at a time never finish (the emulator's watchdog ends the process, as a GPU would hang)."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import device
        device.install()
        device.TIMEOUT_S = 3.0
        import numpy as np, fp8core
        device.state.resident = 2
        x = device.asarray(np.ones(1 << 18, np.float32))
        fp8core.quantize_dynamic(x, "e4m3")
        print("finished")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=os.environ)
    assert done.returncode == 86, done.stdout + done.stderr
    assert "deadlock" in done.stderr and "finished" not in done.stdout


def test_every_kernel_emulated():
    """Every entry of _kernels.KERNELS was launched on the emulated device by some test of this suite."""
    launched = {r.name for r in device.state.launches}
    missing = [e for exprs in _kernels.KERNELS.values() for e in exprs if e not in launched]
    assert not missing, f"{len(missing)} kernel instantiations never ran under emulation: {missing}"


def test_cooperative_refusal_falls_back_to_two_launches(dev, rng, monkeypatch):
    """Under MPS limits or a green context the driver refuses the cooperative grid: the call takes the two-launch
    path, with the same bits, and keeps it on that device."""
    monkeypatch.setattr(device.DEVICES[dev], "cooperative_limit", 1)
    monkeypatch.setattr(cuda, "_no_cooperative", set())
    x = data(rng, (50001,), np.float32)
    for _ in range(2):
        before = len(device.state.launches)
        got = fp8core.quantize_dynamic(upload(x), "e5m2", margin=1)
        ref = fp8core.quantize_dynamic(x, "e5m2", margin=1)
        for g, r in zip(got, ref):
            np.testing.assert_array_equal(bits(g), bits(r))
        ran = [r.name.split("<")[0] for r in device.state.launches[before:]]
        assert ran[-2:] == ["fp8core::amax_kernel", "fp8core::quantize_kernel"], ran
    assert dev in cuda._no_cooperative
