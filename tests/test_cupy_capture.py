"""Graphs captured with CuPy's own stream capture (``stream.begin_capture()``/``end_capture()``) against device
temporaries. CuPy's memory pool does nothing special during a capture: a temporary freed after the call goes back
to the stream's free list, the next allocation gets it, and every replay reads or writes that array. So every CUDA
path that would make one for a CuPy caller inside a capture either makes none (quantize_dynamic) or refuses by
name (a Python-number scale, block scales laid out for cuBLASLt); torch callers allocate through torch, whose
torch.cuda.graph keeps its capture's memory. The update's interval counter is not made inside any capture (its
setting would be replayed).

The CPU tests stand in for the device (allocations, launches and the capture query are recorded); the GPU tests
capture with CuPy, allocate afterwards, replay, and compare bits with an uncaptured twin.
"""

import contextlib
import ctypes
import math
import struct
import types

import numpy as np
import pytest

pytest.importorskip("cupy", reason="cupy (fp8core[cuda13]) is not installed")
import fp8core  # noqa: E402
from conftest import requires_gpu  # noqa: E402
from fp8core import _kernels, args  # noqa: E402
from fp8core._tensor import Tensor  # noqa: E402
from fp8core.backends import cuda, cuda_blocks, cuda_call  # noqa: E402
from fp8core.formats import Format  # noqa: E402

CAPTURE_ACTIVE, CAPTURE_INVALIDATED = 1, 2  # cudaStreamCaptureStatus


# ---- stand-ins for the device ------------------------------------------------------------------------------

class _Ptr:
    def __init__(self, ptr):
        self.ptr = ptr


class _Flags:
    c_contiguous = True


class FakeArray:
    """A device array as the backend reads it: shape, size, dtype, pointer, views and slices; no memory."""

    flags = _Flags()

    def __init__(self, shape, dtype, ptr):
        self.shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        self.dtype = np.dtype(dtype)
        self.size = math.prod(self.shape)
        self.ndim = len(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        self.data = _Ptr(ptr)

    def view(self, dtype):
        dtype = np.dtype(dtype)
        shape = self.shape[:-1] + (self.shape[-1] * self.dtype.itemsize // dtype.itemsize,) if self.shape else ()
        return FakeArray(shape, dtype, self.data.ptr)

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if -1 in shape:
            shape = tuple(self.size if s == -1 else s for s in shape)
        return FakeArray(shape, self.dtype, self.data.ptr)

    def __getitem__(self, key):
        start, stop, _ = key.indices(self.shape[0])
        return FakeArray((stop - start,), self.dtype, self.data.ptr + start * self.dtype.itemsize)


class FakeRuntime:
    """cupy_backends' runtime as the backend calls it; ``status`` is what cudaStreamIsCapturing answers, turned
    into CuPy's answer (a bool; RuntimeError for an invalidated capture)."""

    memcpyDeviceToDevice = 3

    def __init__(self, log):
        self.log, self.status = log, 0

    def streamIsCapturing(self, stream):
        self.log.append(("is_capturing", stream))
        if self.status == CAPTURE_INVALIDATED:
            raise RuntimeError("the stream was capturing, but an error has invalidated the capture sequence")
        return bool(self.status)

    def memsetAsync(self, ptr, value, size, stream):
        self.log.append(("memset", ptr, value, size, stream))

    def memcpyAsync(self, dst, src, size, kind, stream):
        self.log.append(("memcpy", dst, src, size, stream))


STREAM = 0x5EED


@pytest.fixture
def dev(monkeypatch):
    """The device stood in for: ``dev.log`` records allocations, launches, memsets and capture queries in order;
    ``dev.capturing(status)`` sets what the capture query answers (0: not capturing)."""
    log = []
    runtime = FakeRuntime(log)
    next_ptr = [0x10000]

    def empty(shape, dtype, like):
        a = FakeArray(shape, dtype, next_ptr[0])
        next_ptr[0] += 1 << 20
        log.append(("alloc", a.shape, a.dtype.name, like.origin))
        return a

    def launch(kernel, device, targs, work, stream, grid=None, block=None, cooperative=False, **args):
        kernel.signature.pack(args)  # the names and kinds the kernel's C++ signature takes
        log.append(("launch", kernel.name, args, stream, cooperative))

    monkeypatch.setattr(cuda, "_runtime", runtime)
    monkeypatch.setattr(cuda_call, "_runtime", runtime)
    for module in (cuda, cuda_blocks):
        monkeypatch.setattr(module, "On", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(module, "Launch", lambda t: contextlib.nullcontext((t.device[1], STREAM)))
        monkeypatch.setattr(module, "stream_of", lambda t: STREAM)
        monkeypatch.setattr(module, "empty", empty)
    monkeypatch.setattr(_kernels.Kernel, "launch", launch)
    monkeypatch.setattr(_kernels.Kernel, "max_blocks", lambda kernel, device, targs: 132 * 8)

    return types.SimpleNamespace(
        log=log,
        capturing=lambda status=CAPTURE_ACTIVE: setattr(runtime, "status", status),
        kinds=lambda: [e[0] if e[0] != "launch" else e[1] for e in log],
        allocs=lambda: [e for e in log if e[0] == "alloc"])


def gpu_tensor(shape, dtype="float32", origin="cupy", ptr=0x900000):
    storage = {"float32": np.float32, "float16": np.float16, "uint8": np.uint8, "float8_e4m3fn": np.uint8}[dtype]
    return Tensor(FakeArray(shape, storage, ptr), dtype, ("cuda", 0), origin)


def scalar_array(ptr=0xA00000):
    return gpu_tensor((1,), ptr=ptr)


# ---- the capture query --------------------------------------------------------------------------------------

@pytest.mark.parametrize("status, expected", [(0, False), (CAPTURE_ACTIVE, True)])
def test_capture_query_asks_the_launch_stream(dev, status, expected):
    dev.capturing(status)
    assert cuda_call.capture_outlives(gpu_tensor((4,)), STREAM) is expected
    assert dev.log == [("is_capturing", STREAM)]


def test_an_invalidated_capture_is_reported_before_anything_is_made(dev):
    dev.capturing(CAPTURE_INVALIDATED)
    with pytest.raises(RuntimeError, match="invalidated the capture"):
        args.new_f32([0.5], gpu_tensor((8,)), "scale")
    assert dev.kinds() == ["is_capturing"]


def test_torch_callers_are_not_asked(dev):
    """torch's temporaries come from torch's allocator, which keeps a torch.cuda.graph capture's memory: no query."""
    dev.capturing()
    assert cuda_call.capture_outlives(gpu_tensor((4,), origin="torch"), STREAM) is False
    assert dev.log == []


# ---- a Python number made into a device array (args.new_f32 -> cuda.device_f32) ---------------------------

@pytest.mark.parametrize("arg", ["scale", "scale_inv", "a_scale_inv", "b_scale_inv", "out_scale", "previous"])
def test_python_number_refused_inside_a_cupy_capture(dev, arg):
    dev.capturing()
    with pytest.raises(ValueError, match=f"^{arg}: a Python number becomes a device temporary that a graph captured "
                                         "with CuPy would read after it is freed; pass a 1-element float32 CuPy"):
        args.new_f32([0.5], gpu_tensor((8,)), arg)
    assert dev.kinds() == ["is_capturing"], "refused before anything is allocated or launched"


def test_python_number_outside_a_capture_unchanged(dev):
    out = args.new_f32([0.5], gpu_tensor((8,)), "scale")
    assert dev.kinds() == ["is_capturing", "alloc", "fill_kernel"]
    assert dev.log[2][2] == {"out": out.data.ptr, "value": int(np.float32(0.5).view(np.uint32)), "n": 1}


def test_python_number_for_a_torch_caller_inside_a_capture(dev):
    dev.capturing()
    args.new_f32([0.5], gpu_tensor((8,), origin="torch"), "scale")
    assert dev.kinds() == ["alloc", "fill_kernel"] and dev.allocs()[0][3] == "torch"


def test_a_result_made_from_host_values_is_not_refused(dev):
    """multi_amax's zeroed ``out`` is returned to the caller (the caller keeps it, as every output)."""
    dev.capturing()
    out = args.new_f32(np.zeros(3), gpu_tensor((8,)))
    assert out.shape == (3,) and dev.kinds() == ["alloc", "fill_kernel"]


def test_public_calls_name_their_argument(dev):
    dev.capturing()
    x = gpu_tensor((16,))
    with pytest.raises(ValueError, match="^scale: a Python number"):
        fp8core.quantize(x, 2.0)
    with pytest.raises(ValueError, match="^scale: a Python number"):
        fp8core.cast_transpose(gpu_tensor((4, 4)), 2.0)
    with pytest.raises(ValueError, match="^scale_inv: a Python number"):
        fp8core.dequantize(gpu_tensor((16,), "uint8"), 0.5, fmt="e4m3")
    with pytest.raises(ValueError, match="^previous: a Python number"):
        fp8core.compute_scale(gpu_tensor((3,)), "e4m3", previous=2.0)
    a = gpu_tensor((16, 32), "uint8", ptr=0xB00000)
    with pytest.raises(ValueError, match="^a_scale_inv: a Python number"):
        fp8core.gemm(a, a, 1.0, scalar_array(), a_fmt="e4m3", b_fmt="e4m3")
    with pytest.raises(ValueError, match="^b_scale_inv: a Python number"):
        fp8core.gemm(a, a, scalar_array(), 1.0, a_fmt="e4m3", b_fmt="e4m3")
    with pytest.raises(ValueError, match="^out_scale: a Python number"):
        fp8core.gemm(a, a, scalar_array(), scalar_array(0xA01000), out_dtype="e4m3", out_scale=4.0, a_fmt="e4m3",
                     b_fmt="e4m3")
    assert set(dev.kinds()) == {"is_capturing"}, "nothing allocated or launched"


# ---- quantize_dynamic: no workspace inside a CuPy capture --------------------------------------------------

@pytest.mark.parametrize("capturing", [False, True])
@pytest.mark.parametrize("given", [(False, False), (True, False), (False, True)])
def test_quantize_dynamic_whose_workspace_holds_a_result_is_one_cooperative_launch(dev, capturing, given):
    """The workspace holds the amax and/or scale_inv returned, so the caller holds it: no capture query."""
    dev.capturing(capturing)
    x = gpu_tensor((1 << 16,))
    outs = (None, scalar_array(0xC10000).data if given[0] else None, scalar_array(0xC20000).data if given[1] else None)
    q, s_inv, a = cuda.quantize_dynamic(x, Format.E4M3, 0, False, 0.0, None, out=outs)
    assert dev.kinds() == ["alloc", "alloc", "memset", "quantize_dynamic_kernel"]
    ws = dev.allocs()[1]
    assert ws[1:3] == ((4 + 32,), "uint32"), "[amax, scale_inv, barrier x2, a partial per block]"
    assert dev.log[-1][4] is True, "cooperative"
    assert (a.data.ptr, s_inv.data.ptr) == (dev.log[-1][2]["amax_out"], dev.log[-1][2]["scale_inv_out"])
    assert (s_inv is outs[1] or outs[1] is None) and (a is outs[2] or outs[2] is None)


def test_quantize_dynamic_into_given_slots_outside_a_capture_is_one_cooperative_launch(dev):
    outs = (None, scalar_array(0xC10000).data, scalar_array(0xC20000).data)
    cuda.quantize_dynamic(gpu_tensor((1 << 16,)), Format.E4M3, 0, False, 0.0, None, out=outs)
    assert dev.kinds() == ["alloc", "is_capturing", "alloc", "memset", "quantize_dynamic_kernel"]


@pytest.mark.parametrize("q_given", [False, True])
def test_quantize_dynamic_into_given_slots_inside_a_cupy_capture_makes_no_temporary(dev, q_given):
    """amax and scale_inv given: the workspace would be a pure temporary, so the two-launch path, which writes
    only results (the amax straight into its slot, no copy from a temporary)."""
    dev.capturing()
    x = gpu_tensor((1 << 16,))
    outs = (gpu_tensor((1 << 16,), "uint8", ptr=0xC00000).data if q_given else None, scalar_array(0xC10000).data,
            scalar_array(0xC20000).data)
    q, s_inv, a = cuda.quantize_dynamic(x, Format.E4M3, 0, False, 0.0, None, out=outs)
    assert (s_inv, a) == outs[1:] and (q is outs[0] or not q_given)
    assert len(dev.allocs()) == (0 if q_given else 1), "only q, when not given"
    assert [k for k in dev.kinds() if k != "alloc"] == ["is_capturing", "memset", "amax_kernel", "quantize_kernel"]
    memset, amax_launch, quantize_launch = [e for e in dev.log if e[0] in ("memset", "launch")]
    assert memset[1] == a.data.ptr and amax_launch[2]["amax_out"] == a.data.ptr
    pointers = ("x", "q", "scale", "amax_in", "amax_out", "scale_inv_out")
    assert [quantize_launch[2][k] for k in pointers] == [x.data.data.ptr, q.data.ptr, 0, a.data.ptr, 0,
                                                         s_inv.data.ptr]
    assert all(not e[4] for e in dev.log if e[0] == "launch"), "no cooperative launch"


def test_quantize_dynamic_for_a_torch_caller_inside_a_capture_keeps_its_one_launch(dev):
    dev.capturing()
    outs = (None, scalar_array(0xC10000).data, scalar_array(0xC20000).data)
    cuda.quantize_dynamic(gpu_tensor((1 << 16,), origin="torch"), Format.E4M3, 0, False, 0.0, None, out=outs)
    assert dev.kinds() == ["alloc", "alloc", "memset", "quantize_dynamic_kernel"]


def test_quantize_dynamic_with_reduce_writes_amax_into_its_slot(dev):
    """The distributed path: amax straight into the given slot, reduced there (no temporary, no copy)."""
    seen = []
    a_out = scalar_array(0xD00000).data
    cuda.quantize_dynamic(gpu_tensor((100,)), Format.E5M2, 1, False, 0.0, seen.append, out=(None, None, a_out))
    assert seen == [a_out]
    assert [k for k in dev.kinds() if k != "alloc"] == ["memset", "amax_kernel", "quantize_kernel"]
    assert [e[1:3] for e in dev.allocs()] == [((100,), "uint8"), ((1,), "float32")], "q and scale_inv only"


def test_amax_unchanged(dev):
    out = cuda.amax(gpu_tensor((5000,)))
    assert dev.kinds() == ["alloc", "memset", "amax_kernel"] and dev.log[1][1] == out.data.ptr


# ---- block scales laid out for cuBLASLt ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["1x32", "1x128", "128x128"])
def test_gemm_block_scale_layouts_refused_inside_a_cupy_capture(dev, kind):
    dev.capturing()
    scale = FakeArray((256, 4), np.uint8 if kind == "1x32" else np.float32, 0xE00000)
    with pytest.raises(ValueError, match="^a, b: a block-scaled GEMM lays its block scales out for cuBLASLt in "
                                         "device temporaries that a graph captured with CuPy would read"):
        cuda_blocks.layout_for_cublaslt(scale, kind, gpu_tensor((256, 128), "uint8"), STREAM)
    assert dev.kinds() == ["is_capturing"]


def test_gemm_block_scale_layouts_outside_a_capture_unchanged(dev):
    scale = FakeArray((256, 4), np.uint8, 0xE00000)
    out = cuda_blocks.layout_for_cublaslt(scale, "1x32", gpu_tensor((256, 128), "uint8"), STREAM)
    assert dev.kinds() == ["is_capturing", "alloc", "mx_scale_swizzle_kernel"]
    assert dev.log[-1][2] == {"s": 0xE00000, "out": out.data.ptr, "rows": 256, "kgroups": 4, "tile_rows": 1}


def test_gemm_block_scale_layouts_for_a_torch_caller_inside_a_capture(dev):
    dev.capturing()
    scale = FakeArray((256, 4), np.uint8, 0xE00000)
    cuda_blocks.layout_for_cublaslt(scale, "1x32", gpu_tensor((256, 128), "uint8", origin="torch"), STREAM)
    assert dev.kinds() == ["alloc", "mx_scale_swizzle_kernel"]


def test_gemm_scale_is_a_result_so_not_refused(dev):
    """blocks.gemm_scale's layout is returned to the caller: allowed inside a capture, not even asked."""
    dev.capturing()
    cuda_blocks.gemm_scale(Tensor(FakeArray((256, 4), np.uint8, 0xE00000), "uint8", ("cuda", 0), "cupy"), "1x32")
    assert dev.kinds() == ["alloc", "mx_scale_swizzle_kernel"]


# ---- arrays the caller keeps come from the caller's allocator ------------------------------------------------

@pytest.mark.parametrize("origin", ["torch", "cupy"])
def test_step_counter_and_scale_rule_allocate_like_the_caller(dev, origin):
    """torch callers' arrays from torch (a CuPy-pool cudaMalloc inside torch.cuda.graph's global-mode capture would
    fail it); nobody's from CuPy's pool behind the caller's back."""
    counter = cuda.step_counter(2, gpu_tensor((4, 2), origin=origin))
    assert counter.shape == (2,) and dev.allocs() == [("alloc", (2,), "int32", origin)]
    assert dev.kinds() == ["is_capturing", "alloc", "fill_kernel", "fill_kernel"]
    dev.log.clear()
    s, s_inv, ok = cuda.scale_rule(gpu_tensor((3,), origin=origin), scalar_array().data, 0, False, 0.0)
    assert [e[1:] for e in dev.allocs()] == [((3,), "bool", origin), ((3,), "float32", origin),
                                              ((3,), "float32", origin)]


@pytest.mark.parametrize("origin", ["torch", "cupy"])
def test_step_counter_is_not_made_inside_any_capture(dev, origin):
    """Its setting (two fills) would be replayed with the graph, restarting the interval at every replay."""
    dev.capturing()
    with pytest.raises(ValueError, match=r"^interval: the update's device counter .* call update\(\) once before "
                                         "capturing"):
        cuda.step_counter(2, gpu_tensor((4, 2), origin=origin))
    assert dev.kinds() == ["is_capturing"]


# ---- the cooperative quantize_dynamic refused by the driver (MPS limits, green contexts) --------------------

REAL_LAUNCH, REAL_MAX_BLOCKS = _kernels.Kernel.launch, _kernels.Kernel.max_blocks
SIGNATURES = {k.name: k.signature for k in _kernels.RECORDS}
COOPERATIVE_TOO_LARGE = 720  # CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE


class DriverError(Exception):
    """Stands in for cupy_backends' CUDADriverError (whose constructor needs libcuda)."""

    def __init__(self, status):
        super().__init__(status)
        self.status = status


class FakeDriver:
    """The driver calls of _kernels.Kernel.launch: the occupancy answer, and launches decoded from the packed
    parameter buffer into the log. Cooperative launches of more than ``resident`` blocks are refused, as under an MPS thread limit
    or in a green context with fewer SMs than the device; ``error`` refuses them with another status."""

    CUDADriverError = DriverError

    def __init__(self, log, per_sm=8, resident=1 << 30, error=COOPERATIVE_TOO_LARGE):
        self.log, self.per_sm, self.resident, self.error = log, per_sm, resident, error
        self.functions = {}

    def occupancyMaxActiveBlocksPerMultiprocessor(self, fn, threads, smem):
        return self.per_sm

    def _args(self, fn, params):
        name, sig = self.functions[fn]
        base = ctypes.c_void_p.from_address(params).value  # the first argument's address is the buffer's
        values = struct.unpack(sig.format, ctypes.string_at(base, sig.size))
        assert len(values) == len(sig.names), "no by-value struct is launched here"
        return name, dict(zip(sig.names, values))

    def launchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        name, args = self._args(fn, params)
        self.log.append(("launch", name, args, stream, False, gx))

    def launchCooperativeKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params):
        name, args = self._args(fn, params)
        if gx > self.resident:
            self.log.append(("refused", name, gx))
            raise DriverError(self.error)
        self.log.append(("launch", name, args, stream, True, gx))


SMS = 132


@pytest.fixture
def drv(dev, monkeypatch):
    """``dev`` with the real launch plans (grid sizing, argument packing, cooperative launch) over FakeDriver."""
    driver = FakeDriver(dev.log)

    class Function:
        def __init__(self, expr):
            self.ptr = 0x7000 + len(driver.functions)
            kernel = expr.split("::")[1].split("<")[0]
            driver.functions[self.ptr] = (kernel, SIGNATURES[kernel])

    monkeypatch.setattr(cuda, "_driver", driver)
    monkeypatch.setattr(_kernels, "_driver", lambda: driver)
    monkeypatch.setattr(_kernels.Kernel, "launch", REAL_LAUNCH)
    monkeypatch.setattr(_kernels.Kernel, "max_blocks", REAL_MAX_BLOCKS)
    monkeypatch.setattr(_kernels, "_plans", {})
    monkeypatch.setattr(_kernels, "_sm_counts", {0: SMS, 1: SMS})
    monkeypatch.setattr(cuda, "_no_cooperative", set())
    monkeypatch.setattr(_kernels, "get_function", lambda filename, expr, device: Function(expr))
    dev.driver = driver
    return dev


BIG = SMS * 8 * 8 * _kernels.THREADS * 2  # enough work for every block the occupancy rule allows


def _launches(log):
    return [(e[1], e[4]) for e in log if e[0] == "launch"]


def test_cooperative_grid_is_what_the_occupancy_api_allows(drv):
    drv.driver.per_sm = 3
    cuda.quantize_dynamic(gpu_tensor((BIG,)), Format.E4M3, 0, False, 0.0, None)
    (launch,) = [e for e in drv.log if e[0] == "launch"]
    assert launch[4] is True and launch[5] == 3 * SMS
    assert cuda._no_cooperative == set()


@pytest.mark.parametrize("outs", ["returned", "q_given"])
def test_refused_cooperative_launch_falls_back_to_two_launches(drv, outs):
    """The driver refuses the grid (fewer SMs than the device reports): the same call returns the two-launch
    results, written into the arrays it already holds (the workspace's amax and scale_inv), nothing allocated after
    the refusal; the device is remembered, and the next call goes straight to two launches."""
    drv.driver.resident = 500
    x = gpu_tensor((BIG,))
    q_given = gpu_tensor((BIG,), "uint8", ptr=0xC00000).data if outs == "q_given" else None
    q, s_inv, a = cuda.quantize_dynamic(x, Format.E4M3, 1, True, 0.5, None, out=(q_given, None, None))
    kinds = drv.kinds()
    assert kinds[kinds.index("refused"):] == ["refused", "memset", "amax_kernel", "quantize_kernel"]
    assert [e[1:3] for e in drv.allocs()] == ([] if q_given else [((BIG,), "uint8")]) + [((4 + 8 * SMS,), "uint32")]
    memset, amax_launch, quantize_launch = [e for e in drv.log if e[0] in ("memset", "launch")][1:]
    assert memset[1:4] == (a.data.ptr, 0, 4) and amax_launch[2] == {"x": x.data.data.ptr, "amax_out": a.data.ptr,
                                                                     "n": BIG}
    assert quantize_launch[2] == {"x": x.data.data.ptr, "q": q.data.ptr, "scale": 0, "amax_in": a.data.ptr,
                                  "amax_out": 0, "scale_inv_out": s_inv.data.ptr, "n": BIG, "fp8_max": 448.0,
                                  "margin": 1, "power_of_2": 1, "epsilon": 0.5}
    assert (q_given is None or q is q_given) and a.data.ptr + 4 == s_inv.data.ptr, "the workspace's two words"
    assert cuda._no_cooperative == {0}

    drv.log.clear()
    q2, s_inv2, a2 = cuda.quantize_dynamic(x, Format.E4M3, 1, True, 0.5, None)
    assert drv.kinds() == ["alloc", "alloc", "alloc", "memset", "amax_kernel", "quantize_kernel"]
    assert _launches(drv.log) == [("amax_kernel", False), ("quantize_kernel", False)]


def test_refusal_inside_a_cupy_capture_allocates_nothing_more(drv):
    """Inside a CuPy capture with the amax given and scale_inv returned: the workspace holds the returned scale_inv
    (the caller keeps it); the fallback after the refusal makes no temporary the graph would outlive."""
    drv.capturing()
    drv.driver.resident = 100
    q_out, a_out = gpu_tensor((BIG,), "uint8", ptr=0xC00000).data, scalar_array(0xC20000).data
    q, s_inv, a = cuda.quantize_dynamic(gpu_tensor((BIG,)), Format.E5M2, 0, False, 0.0, None,
                                        out=(q_out, None, a_out))
    assert a is a_out and q is q_out
    assert [e[1:3] for e in drv.allocs()] == [((4 + 8 * SMS,), "uint32")]
    assert drv.kinds()[-4:] == ["refused", "memset", "amax_kernel", "quantize_kernel"]
    barrier = next(e for e in drv.log if e[0] == "memset")
    assert drv.log[-1][2]["scale_inv_out"] == s_inv.data.ptr == barrier[1] - 4, \
        "scale_inv is the workspace's second word"


def test_a_refusal_is_remembered_per_device(drv):
    drv.driver.resident = 100
    x1 = Tensor(FakeArray((BIG,), np.float32, 0x900000), "float32", ("cuda", 1), "cupy")
    cuda.quantize_dynamic(x1, Format.E4M3, 0, False, 0.0, None)
    assert cuda._no_cooperative == {1}
    drv.log.clear()
    drv.driver.resident = 1 << 30
    cuda.quantize_dynamic(gpu_tensor((BIG,)), Format.E4M3, 0, False, 0.0, None)
    assert _launches(drv.log) == [("quantize_dynamic_kernel", True)]


def test_a_small_grid_is_still_cooperative_on_a_limited_device(drv):
    """Only a refusal switches a device: a grid within what is resident launches cooperatively."""
    drv.driver.resident = 100
    cuda.quantize_dynamic(gpu_tensor((100 * 8 * _kernels.THREADS,)), Format.E4M3, 0, False, 0.0, None)
    assert _launches(drv.log) == [("quantize_dynamic_kernel", True)] and cuda._no_cooperative == set()


def test_other_launch_errors_are_raised_not_hidden(drv):
    drv.driver.resident, drv.driver.error = 100, 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(DriverError):
        cuda.quantize_dynamic(gpu_tensor((BIG,)), Format.E4M3, 0, False, 0.0, None)
    assert cuda._no_cooperative == set() and _launches(drv.log) == []


# ---- on a GPU: capture with CuPy, allocate afterwards, replay, compare with an uncaptured twin ---------------

@pytest.fixture
def cp():
    import cupy

    return cupy


def _bits(a):
    a = a.get()
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@contextlib.contextmanager
def _captured(cp, stream, graphs):
    """Capture on ``stream`` (ended even when the body raises); ``(graph, first)`` goes into ``graphs``: ``first``
    is an array the graph's first node writes (so that a refused call still ends a graph that is not empty), kept
    with the graph as every array a graph touches must be."""
    first = cp.zeros(1, cp.uint32)
    cp.cuda.Device().synchronize()
    with stream:
        stream.begin_capture()
        try:
            first.fill(1)
            yield
        finally:
            graphs.append((stream.end_capture(), first))


def _crowd(cp, stream, sizes=(1, 2, 4, 36, 64, 256, 1024, 1 << 16)):
    """Arrays allocated on ``stream`` after the capture, filled with a sentinel: CuPy's pool gives them any
    block a temporary of the capture left behind, which a replay would then overwrite."""
    with stream:
        return [cp.full(n, 0x7E7E7E7E, dtype=cp.uint32) for n in sizes for _ in range(4)]


def _data(cp, n, seed):
    x = (np.random.default_rng(seed).standard_normal(n) * 30).astype(np.float32)
    x[:4] = [0.0, -0.0, 1e-40, 448.0]
    return cp.asarray(x)


@requires_gpu
def test_gpu_python_number_refused_inside_a_cupy_capture(cp):
    x = _data(cp, 4096, 0)
    fp8core.quantize(x, 2.0)  # compiled and planned outside the capture
    stream, graphs = cp.cuda.Stream(non_blocking=True), []
    with pytest.raises(ValueError, match="^scale: a Python number"):
        with _captured(cp, stream, graphs):
            fp8core.quantize(x, 2.0)
    with pytest.raises(ValueError, match="^previous: a Python number"):
        with _captured(cp, stream, graphs):
            fp8core.compute_scale(fp8core.amax(x), "e4m3", previous=2.0)


@requires_gpu
@pytest.mark.parametrize("given", [False, True], ids=["returned", "out"])
def test_gpu_captured_calls_survive_later_allocations(cp, given):
    """quantize_dynamic (results returned: its cooperative launch, whose workspace the returned amax holds; or all
    three given as out=: its two-launch path), quantize and cast_transpose with device scales, amax: captured
    with CuPy, then the capture stream allocates a crowd of sentinel arrays, then 5 replays on new data; each
    replay's results equal the same calls made eagerly (the cooperative launch), and no sentinel changed."""
    n = 3 * 4096 + 5
    x = _data(cp, n, 1)
    x2 = x[: 96 * 128].reshape(96, 128)
    scale = cp.asarray(np.array([0.75], np.float32))
    stream, graphs = cp.cuda.Stream(non_blocking=True), []
    outs = (cp.empty(n, cp.uint8), cp.empty(1, cp.float32), cp.empty(1, cp.float32)) if given else None

    def step():
        q, s_inv, a = fp8core.quantize_dynamic(x, "e4m3", out=outs)
        return [q, s_inv, a, fp8core.quantize(x, scale, "e5m2"), *fp8core.cast_transpose(x2, scale, "e4m3"),
                fp8core.amax(x)]

    with stream:
        step()  # compile and plan outside the capture
    stream.synchronize()
    with _captured(cp, stream, graphs):
        captured = step()
    graph = graphs[-1][0]
    crowd = _crowd(cp, stream)
    for replay in range(5):
        with stream:
            x[...] = _data(cp, n, 100 + replay)
            if replay == 3:
                x[7] = float("nan")  # amax NaN: no new scale, 1.0 (both quantize_dynamic paths)
            graph.launch()
            got = [_bits(r).copy() for r in captured]
            want = [_bits(r) for r in step()]
        stream.synchronize()
        for i, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(g, w, err_msg=f"result {i}, replay {replay}")
        for c in crowd:
            assert (c.get() == 0x7E7E7E7E).all(), "a replay wrote into memory allocated after the capture"


@requires_gpu
def test_gpu_block_gemm_refused_inside_a_cupy_capture(cp):
    pytest.importorskip("nvmath", reason="the GEMM needs nvmath-python")
    if int(cp.cuda.Device().compute_capability) != 90:
        pytest.skip("1x128 block GEMMs run on sm_90 only")
    from fp8core import blocks

    a = blocks.quantize_blockwise(_data(cp, 128 * 256, 2).reshape(128, 256), block="1x128")
    b = blocks.quantize_blockwise(_data(cp, 64 * 256, 3).reshape(64, 256), block="1x128")
    fmts = {"a_fmt": "e4m3", "b_fmt": "e4m3"}  # CuPy's fp8 is uint8 storage: the GEMM is told its format
    fp8core.gemm(a, b, out_dtype="bfloat16", **fmts)  # handle, plan and workspace outside the capture
    stream, graphs = cp.cuda.Stream(non_blocking=True), []
    with pytest.raises(ValueError, match="^a, b: a block-scaled GEMM"):
        with _captured(cp, stream, graphs):
            fp8core.gemm(a, b, out_dtype="bfloat16", **fmts)


@requires_gpu
def test_gpu_first_update_with_an_interval_refused_inside_a_capture(cp):
    st = fp8core.ScalingState(2, fp8core.DelayedScaling(amax_history_len=2, interval=3), device="cuda")
    stream, graphs = cp.cuda.Stream(non_blocking=True), []
    with pytest.raises(ValueError, match="^interval: the update's device counter"):
        with _captured(cp, stream, graphs):
            st.update()
    assert st.steps == 0
    with stream:
        st.update()  # made outside the capture, the counter then advances on the device in every replay
    stream.synchronize()
    assert st.steps == 1
