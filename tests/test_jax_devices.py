"""JAX arrays on a device other than the default: results follow the input's device (fp8core/_tensor.py says
the rule), on the second of two CPU devices and on the second of two GPUs.

The CPU cases live in tests/jax_two_devices.py, run here in a fresh process with two XLA:CPU devices (this
process's JAX has fixed its device count already). The committed/uncommitted rule on the one default device
is checked in this process.
"""

import os
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from conftest import requires_gpu

jax = pytest.importorskip("jax")
jnp = jax.numpy

import fp8core  # noqa: E402
import fp8core.jax as fj  # noqa: E402
from fp8core import _tensor  # noqa: E402
from fp8core._dlpack import CPU, Exporter  # noqa: E402
from jax_places import jax_gpus  # noqa: E402

HERE = os.path.dirname(__file__)


def test_second_cpu_device_cases_pass_in_a_two_device_process():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
                        os.path.join(HERE, "jax_two_devices.py")], capture_output=True, text=True, env=env,
                       timeout=600, cwd=HERE)
    tail = r.stdout[-6000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", r.stdout))
    assert counts.get("passed", 0) >= 70 and set(counts) == {"passed"}, tail


def _bits(a):
    a = np.asarray(a)
    return a.dtype.name, a.shape, a.tobytes()


@pytest.mark.parametrize("n", [64, _tensor._JAX_COPY_MAX + 64], ids=["jitted identity", "device_put"])
def test_default_device_committed_in_committed_out_and_uncommitted_stays_so(n):
    d0 = jax.devices()[0]
    v = np.resize(np.arange(65536, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)[::7], n)
    free, pinned = jnp.asarray(v), jax.device_put(v, d0)
    assert not free.committed and pinned.committed
    got = {}
    for name, x in (("free", free), ("pinned", pinned)):
        r = fp8core.quantize_dynamic(x)
        assert all(o.devices() == {d0} and o.committed is (name == "pinned") for o in r)
        got[name] = [_bits(o) for o in r]
    assert got["free"] == got["pinned"]


def test_an_imported_result_made_uncommitted_keeps_its_buffer():
    """The step a GPU result takes for an uncommitted x (DLPack's import commits), here on a CPU import."""
    v = np.resize(np.arange(65536, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)[::7], 4096)
    imported = jax.dlpack.from_dlpack(Exporter(v.ctypes.data, v.shape, "bfloat16", CPU, 0, owner=v))
    free = _tensor._jax_uncommitted(imported)
    assert imported.committed and not free.committed and free.devices() == imported.devices()
    assert free.unsafe_buffer_pointer() == imported.unsafe_buffer_pointer() and _bits(free) == _bits(v)
    assert not (free + 1).committed


def test_an_uncommitted_input_takes_the_one_shared_identity():
    """The common case pays for no placement: one jitted identity, the one it used before."""
    fp8core.amax(jnp.ones(4))
    assert _tensor.wrap(jnp.ones(4)).place is None
    put = _tensor._jax_put()
    assert _tensor._jax_put(None) is put


# ---- the second GPU ---------------------------------------------------------------------------------------

def _gpu_cases(x, s):
    return {
        "amax": lambda: fp8core.amax(x),
        "quantize": lambda: fp8core.quantize(x, s, "e4m3"),
        "quantize_dynamic": lambda: fp8core.quantize_dynamic(x, "e5m2", margin=1),
        "dequantize": lambda: fp8core.dequantize(fp8core.quantize(x, s), s, "bfloat16"),
        "transpose": lambda: fp8core.transpose(fp8core.quantize(x, s).reshape(32, -1)),
        "cast_transpose": lambda: fp8core.cast_transpose(x.reshape(32, -1), s),
        "multi_quantize": lambda: fp8core.multi_quantize([x, x[:64]], jnp.concatenate([s, s]), "e4m3"),
        "quantize_mxfp8": lambda: fp8core.quantize_mxfp8(jnp.nan_to_num(x).reshape(32, -1)),
        "fj.quantize eager": lambda: fj.quantize(x, s),
        "fj.quantize under jit": lambda: jax.jit(lambda v, w: fj.quantize(v, w))(x, s),
    }


@requires_gpu
def test_second_gpu_results_on_that_gpu_same_bits_as_the_first_and_the_cpu():
    gpus = jax_gpus()
    if len(gpus) < 2:
        pytest.skip(f"needs 2 GPUs visible to JAX, found {len(gpus)}")
    v = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)[::16].copy()  # 4096 codes
    sv = np.array([0.25], np.float32)
    got = {}
    for name, device in (("gpu1", gpus[1]), ("gpu0", gpus[0]), ("cpu", jax.devices("cpu")[0])):
        x, s = jax.device_put(v, device), jax.device_put(sv, device)
        got[name] = {}
        for op, call in _gpu_cases(x, s).items():
            leaves = jax.tree.leaves(call())
            if name == "gpu1":
                for o in leaves:
                    assert o.devices() == {device} and o.committed, (op, o.devices())
            got[name][op] = [_bits(o) for o in leaves]
    assert got["gpu1"] == got["gpu0"] == got["cpu"]


@requires_gpu
def test_second_gpu_scale_on_the_first_refused_by_name():
    gpus = jax_gpus()
    if len(gpus) < 2:
        pytest.skip(f"needs 2 GPUs visible to JAX, found {len(gpus)}")
    x = jax.device_put(jnp.ones(64, jnp.bfloat16), gpus[1])
    s = jax.device_put(jnp.ones(1, jnp.float32), gpus[0])
    with pytest.raises(ValueError, match=rf"^scale: is on {gpus[0]} but x is on {gpus[1]}; put them on the same "
                                         "device$"):
        fp8core.quantize(x, s)
