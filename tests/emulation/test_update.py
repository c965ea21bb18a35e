"""The batched delayed-scaling update on the device (ScalingState(device="cuda:N")), against the same state on
the CPU: histories of length 1, 2, 65 and 1024, both algorithms, tensors that did not run, NaN and inf."""

import numpy as np
import pytest

import device
import fp8core
from arrays import bits


def _history(rng, L, n):
    h = (rng.random((L, n)) * np.exp2(rng.integers(-10, 10, (L, n)))).astype(np.float32)
    h[0, 1] = 0.0       # did not run: no new scale, history not rolled
    h[0, 2] = np.nan
    h[0, 3] = np.inf
    h[:, 4] = 1e-42     # subnormal amaxes ran
    return h


@pytest.mark.parametrize("L", [1, 2, 65, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("n", [5, 33, 100])
def test_update(dev, L, algo, n, rng):
    recipe = fp8core.DelayedScaling(amax_history_len=L, amax_compute_algo=algo, margin=1)
    gpu = fp8core.ScalingState(n, recipe, device=f"cuda:{dev}")
    cpu = fp8core.ScalingState(n, recipe)
    for step in range(3):
        h = _history(rng, L, n)
        gpu.amax_history[...] = device.asarray(h)
        cpu.amax_history[...] = h
        gpu.update()
        cpu.update()
        for name in ("amax_history", "scale", "scale_inv"):
            np.testing.assert_array_equal(bits(getattr(gpu, name)), bits(getattr(cpu, name)),
                                          err_msg=f"{name} at step {step}")


def test_update_with_interval(dev, rng):
    """interval > 1: the step counter lives on the device; scales change every third update only."""
    recipe = fp8core.DelayedScaling(amax_history_len=16, interval=3)
    gpu = fp8core.ScalingState(40, recipe, device=f"cuda:{dev}")
    cpu = fp8core.ScalingState(40, recipe)
    for step in range(7):
        h = _history(rng, 16, 40)
        gpu.amax_history[...] = device.asarray(h)
        cpu.amax_history[...] = h
        gpu.update()
        cpu.update()
        np.testing.assert_array_equal(bits(gpu.scale), bits(cpu.scale), err_msg=f"step {step}")
        np.testing.assert_array_equal(bits(gpu.amax_history), bits(cpu.amax_history), err_msg=f"step {step}")
