"""GPU kernels against the CPU reference, bit for bit. Skipped, with the reason, where there is no GPU."""

import ml_dtypes
import numpy as np
import pytest

import fp8core
from conftest import requires_gpu
from fp8core import Format

pytestmark = requires_gpu
FORMATS = [Format.E4M3, Format.E5M2]
SHAPES = [(1,), (7,), (31, 33), (4097, 1), (1, 65537), (256, 512), (0,), (0, 8)]
DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


def to_gpu(cp, x):
    """numpy (ml_dtypes allowed) -> cupy storage array; fp8core reads uint16 as bf16 only through torch/DLPack,
    so bf16 travels to the device inside a torch tensor."""
    import torch

    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16).cuda()
    return cp.asarray(x)


def host_bits(a):
    import torch

    if isinstance(a, torch.Tensor):
        a = a.cpu()
        return a.view(torch.uint8 if a.element_size() == 1 else torch.int16 if a.element_size() == 2
                      else torch.int32).numpy().view(np.uint8 if a.element_size() == 1 else np.uint16
                                                      if a.element_size() == 2 else np.uint32)
    return a.get().view(np.uint8 if a.dtype.itemsize == 1 else np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def data(shape, dtype, rng):
    x = (rng.standard_normal(shape) * 50).astype(np.float32)
    flat = x.reshape(-1)
    if flat.size > 8:
        flat[:8] = [np.nan, -np.inf, np.inf, -0.0, 1e-40, -1e-42, 1e30, 448.0]
    return x.astype(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_all_16bit_patterns(cp, fmt, dtype):
    x = np.arange(65536, dtype=np.uint16).view(dtype)
    for scale in [1.0, 3.0, 2.0 ** -20, 2.0 ** 20]:
        ref = fp8core.quantize(x, scale, fmt).view(np.uint8)
        np.testing.assert_array_equal(host_bits(fp8core.quantize(to_gpu(cp, x), scale, fmt)), ref)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_amax_cast_transpose(cp, shape, dtype, fmt, rng):
    x = data(shape, dtype, rng)
    g = to_gpu(cp, x)
    slot_ref = np.zeros(1, np.float32)
    ref = fp8core.quantize(x, 0.75, fmt, amax_out=slot_ref)
    slot = cp.zeros(1, cp.float32)
    scale = cp.asarray(np.array([0.75], np.float32))
    np.testing.assert_array_equal(host_bits(fp8core.quantize(g, scale, fmt, amax_out=slot)), ref.view(np.uint8))
    assert slot.get().view(np.uint32)[0] == slot_ref.view(np.uint32)[0]
    np.testing.assert_array_equal(host_bits(fp8core.amax(g)), fp8core.amax(x).view(np.uint32))
    if len(shape) == 2:
        q_ref, qt_ref = fp8core.cast_transpose(x, 0.75, fmt)
        slot = cp.zeros(1, cp.float32)
        q, qt = fp8core.cast_transpose(g, scale, fmt, amax_out=slot)
        np.testing.assert_array_equal(host_bits(q), q_ref.view(np.uint8))
        np.testing.assert_array_equal(host_bits(qt), qt_ref.view(np.uint8))
        np.testing.assert_array_equal(host_bits(fp8core.transpose(q, fmt=fmt)), qt_ref.view(np.uint8))
        assert slot.get().view(np.uint32)[0] == slot_ref.view(np.uint32)[0]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out", ["float32", "bfloat16", "float16"])
def test_dequantize_all_codes(cp, fmt, out):
    codes = np.tile(np.arange(256, dtype=np.uint8), 9)[:2049]
    for s in [1.0, 2.0 ** -30, 3.3, 0.0]:
        ref = fp8core.dequantize(codes.view(fmt.numpy_dtype), s, out)
        got = fp8core.dequantize(cp.asarray(codes), s, out, fmt=fmt)
        np.testing.assert_array_equal(host_bits(got), ref.view(np.uint32 if out == "float32" else np.uint16))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [1, 1000, 1 << 20, 3 << 22])
def test_quantize_dynamic(cp, dtype, n, rng):
    x = data((n,), dtype, rng)
    x.reshape(-1)[0] = 1.0 if n > 1 else x.reshape(-1)[0]  # keep a finite amax
    q_ref, si_ref, a_ref = fp8core.quantize_dynamic(x, "e4m3", margin=1, power_of_2=False)
    q, si, a = fp8core.quantize_dynamic(to_gpu(cp, x), "e4m3", margin=1)
    np.testing.assert_array_equal(host_bits(q), q_ref.view(np.uint8))
    assert host_bits(si)[0] == si_ref.view(np.uint32)[0] and host_bits(a)[0] == a_ref.view(np.uint32)[0]


def test_misaligned_views(cp, rng):
    base = data((4099,), np.float32, rng)
    g = cp.asarray(base)
    for off in range(1, 5):
        ref = fp8core.quantize(base[off:off + 4000], 2.0, "e5m2")
        np.testing.assert_array_equal(host_bits(fp8core.quantize(g[off:off + 4000], 2.0, "e5m2")), ref.view(np.uint8))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("L", [1, 2, 31, 1024])
def test_update_matches_cpu(cp, algo, L, rng):
    n = 1000
    recipe = fp8core.DelayedScaling(amax_history_len=L, amax_compute_algo=algo, margin=1, power_of_2=True)
    cpu = fp8core.ScalingState(n, recipe)
    gpu = fp8core.ScalingState(n, recipe, device="cuda")
    H = rng.uniform(0, 100, size=(L, n)).astype(np.float32)
    H[0, ::7] = 0
    H[0, 3], H[0, 5] = np.nan, np.inf
    cpu.amax_history[...] = H
    gpu.amax_history[...] = cp.asarray(H)
    for _ in range(3):
        cpu.update()
        gpu.update()
    np.testing.assert_array_equal(gpu.buffer.get().view(np.uint32), cpu.buffer.view(np.uint32))
    np.testing.assert_array_equal(gpu.non_finite.get(), cpu.non_finite)


def test_multi_tensor(cp, rng):
    xs = [data((n,), np.float32, rng) for n in (5, 4096, 100000)]
    xs[0][:] = [1, 2, 3, 4, 5]
    out = cp.zeros(3, cp.float32)
    fp8core.multi_amax([cp.asarray(x) for x in xs], out)
    np.testing.assert_array_equal(out.get().view(np.uint32), np.concatenate([fp8core.amax(x) for x in xs]).view(np.uint32))
    scales = np.array([1.0, 0.5, 4.0], np.float32)
    qs = fp8core.multi_quantize([cp.asarray(x) for x in xs], cp.asarray(scales), "e4m3")
    for q, x, s in zip(qs, xs, scales):
        np.testing.assert_array_equal(host_bits(q), fp8core.quantize(x, float(s), "e4m3").view(np.uint8))


def test_cuda_graph_of_quantize_and_update(cp, rng):
    st = fp8core.ScalingState(2, fp8core.DelayedScaling(amax_history_len=4), device="cuda")
    x = cp.asarray(data((4096,), np.float32, rng))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        st.quantize(x, 0)  # compile and warm outside the capture
        st.update()
        stream.begin_capture()
        q = st.quantize(x, 0)
        st.update()
        graph = stream.end_capture()
    stream.synchronize()
    eager = fp8core.ScalingState(2, fp8core.DelayedScaling(amax_history_len=4), device="cuda")
    eager.load_state_dict(st.state_dict())
    with stream:
        graph.launch()
        eager_q = eager.quantize(x, 0)
        eager.update()
    stream.synchronize()
    np.testing.assert_array_equal(host_bits(q), host_bits(eager_q))


def test_over_2_31_elements(cp):
    n = (1 << 31) + 77
    free = cp.cuda.Device().mem_info[0]
    if free < n * 4:
        pytest.skip(f"GPU test: needs {n * 4 / 2**30:.1f} GiB free, has {free / 2**30:.1f}")
    x = cp.full(n, 2.0, dtype=cp.float16)
    x[-1] = -300.0
    slot = cp.zeros(1, cp.float32)
    q = fp8core.quantize(x, 1.0, "e4m3", amax_out=slot)
    assert int(q[-1]) == int(fp8core.quantize(np.array([-300.0], np.float16), 1.0, "e4m3").view(np.uint8)[0])
    assert int(q[n // 2]) == 0x40 and float(slot.get()[0]) == 300.0
