"""The CUDA launch layer's host-side logic, without a GPU: grid shares, argument layouts, capability errors and the
cuBLASLt plan cache's bound."""

import inspect

import pytest

pytest.importorskip("cupy", reason="cupy (fp8core[cuda13]) is not installed")
from fp8core import _kernels  # noqa: E402
from fp8core import backends  # noqa: E402
from fp8core.backends import cpu, cpu_blocks, cublaslt, cuda, cuda_blocks, cuda_call  # noqa: E402


@pytest.mark.parametrize("sizes", [[5, 4096, 100000], [0, 0, 7], [1 << 30, 16, 16, 0], [1] * 64, [0]])
def test_multi_blocks_by_elements(sizes):
    first = cuda._multi_blocks(sizes, 1056)
    blocks = [b - a for a, b in zip(first, first[1:])]
    assert first[0] == 0 and len(first) == len(sizes) + 1
    assert all(b >= 1 for b in blocks), "every tensor gets a block (an empty one still merges its amax 0)"
    assert all(b <= max(1, -(-n // (8 * _kernels.THREADS))) for b, n in zip(blocks, sizes)), "no idle blocks"
    big = max(range(len(sizes)), key=lambda i: sizes[i])
    if sizes[big] >= 1 << 30:
        assert blocks[big] >= 1000, "a large tensor among small ones gets the GPU's share of blocks"
    assert first[-1] < 2 ** 31 - 1


def test_multi_format_is_the_struct():
    for k in (_kernels.MULTI_AMAX, _kernels.MULTI_QUANTIZE):
        assert k.signature.size == 2824 <= 4096 and k.signature.layout == [(0, 2824)]


def test_argument_layouts_are_naturally_aligned():
    for k in _kernels.RECORDS:
        for offset, size in k.signature.layout:
            assert offset % min(size, 8) == 0, k.name


def test_records_are_the_loaders_table():
    """KERNELS (what the loader compiles, what selftest covers) is every record's instantiations, each once."""
    exprs = [k.expr(t) for k in _kernels.RECORDS for t in k.instances]
    assert sorted(exprs) == sorted(e for es in _kernels.KERNELS.values() for e in es)
    assert len(set(exprs)) == 100  # 84 FP8 (6 of quantize_axiswise_kernel; the scale swizzle serves FP4 too), fp4_quantize.cu's 15, fp4_gemm.cu's alpha
    assert _kernels.QUANTIZE.expr(("bfloat16", 1)) == "fp8core::quantize_kernel<fp8core::bf16, 1>"
    assert _kernels.CAST_TRANSPOSE.expr(("float32", 0, True)) == "fp8core::cast_transpose_kernel<float, 0, true>"
    assert _kernels.FILL.expr() == "fp8core::fill_kernel"


@pytest.mark.parametrize("kernel, tile", [(_kernels.CAST_TRANSPOSE, 128), (_kernels.QUANTIZE_128X128, 128)])
def test_tiles_stay_within_grid_limits(kernel, tile):
    assert kernel.rule(1056, (tile, tile)) == (1, 1)
    assert kernel.rule(1056, (tile + 1, 1)) == (2, 1)
    gx, gy = kernel.rule(1056, (1 << 20, 1 << 16))
    assert gx <= 65535 and gy <= 65535 and gx * gy >= (1 << 20) * (1 << 16) // tile ** 2
    assert kernel.rule(1056, (0, 5)) == (1, 1)


@pytest.mark.parametrize("n", [1, 2, 65534, 65535, 65536, 65537, 2 * 65535 + 1, 3 * 65535 - 1, 1000003, 2 ** 31 - 1,
                               65535 * 65535])
def test_tiles_leave_no_row_of_idle_blocks(n):
    """Fewer idle blocks than rows of the grid (a first row filled to 65535 idled up to 65534 at the end)."""
    gx, gy = _kernels.CAST_TRANSPOSE.rule(1056, (128, 128 * n))
    assert gx <= 65535 and gy <= 65535 and 0 <= gx * gy - n < gy, (gx, gy)


def test_grid_stride_rules():
    assert _kernels.QUANTIZE.rule(1056, 0) == 1 and _kernels.QUANTIZE.rule(1056, 2049) == 2
    assert _kernels.QUANTIZE.rule(1056, 1 << 40) == 1056, "no more blocks than run at once"
    assert _kernels.FILL.rule(1056, 257) == 2 and _kernels.COMPUTE_SCALE.rule(8, 1 << 20) == 4096


@pytest.mark.parametrize("protocol, modules, least", [(backends.Backend, (cpu, cuda), 7),
                                                      (backends.BlockBackend, (cpu_blocks, cuda_blocks), 6)])
def test_backends_implement_one_interface(protocol, modules, least):
    """Every function of the interface, in both backends, with its parameters (names, kinds, defaults)."""
    def params(fn, drop_self=False):
        ps = list(inspect.signature(fn).parameters.values())[drop_self:]
        return [(p.name, p.kind, p.default) for p in ps]

    names = [n for n, f in vars(protocol).items() if inspect.isfunction(f) and not n.startswith("_")]
    assert len(names) >= least  # block scaling: one dequantize for every layout
    for name in names:
        want = params(getattr(protocol, name), drop_self=True)
        for module in modules:
            assert params(getattr(module, name)) == want, f"{module.__name__}.{name}"


def test_kernels_refuse_older_gpus_before_compiling(monkeypatch):
    import cupy

    monkeypatch.setattr(_kernels, "_sm_counts", {})
    monkeypatch.setattr(_kernels, "_plans", {})
    monkeypatch.setattr(cupy.cuda, "Device", lambda device: type("D", (), {"compute_capability": "75"})())
    monkeypatch.setattr(_kernels, "get_function", lambda *a: pytest.fail("compiled for an unsupported device"))
    with pytest.raises(RuntimeError, match=r"compute capability 8.0 or newer .*cuda:2 is 7.5"):
        _kernels.QUANTIZE.launch(2, ("float32", 0), 16, 0, x=0, q=0, scale=0, amax_in=0, amax_out=0, scale_inv_out=0,
                                 n=16, fp8_max=448.0, margin=0, power_of_2=0, epsilon=0.0)
    assert _kernels._sm_counts == {}, "a refused device is asked again (and refused again) next time"


@pytest.mark.parametrize("env, soft", [(None, False), ("0", False), ("1", True)])
def test_the_soft_fp8_knob_is_read_when_a_module_is_compiled(monkeypatch, env, soft):
    """FP8CORE_FORCE_SOFT_FP8 (the one knob) decides the conversion path of the modules compiled after it is set."""
    import cupy

    made = []

    class RawModule:
        def __init__(self, code, backend, options, name_expressions):
            made.append(options)

        def compile(self):
            pass

    if env is None:
        monkeypatch.delenv("FP8CORE_FORCE_SOFT_FP8", raising=False)
    else:
        monkeypatch.setenv("FP8CORE_FORCE_SOFT_FP8", env)
    monkeypatch.setattr(_kernels, "_modules", {})
    monkeypatch.setattr(_kernels, "nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(cupy, "RawModule", RawModule)
    monkeypatch.setattr(cupy.cuda, "Device", lambda device=None: type("D", (), {
        "compute_capability": "100", "__enter__": lambda self: None, "__exit__": lambda self, *exc: None})())
    _kernels._module("block_quantize.cu", 0)
    assert ("-DFP8CORE_FORCE_SOFT_FP8=1" in made[0]) is soft
    assert ("-arch=sm_100f" in made[0]) is not soft, "the forced software path never takes the family target"


def test_gemm_refuses_older_gpus(monkeypatch):
    monkeypatch.setattr(cublaslt, "compute_capability", lambda device: 86)
    with pytest.raises(ValueError, match="compute capability 8.9 or newer.*8.6"):
        cublaslt._check_device(0)


class FakeLt:
    """Counts descriptor destruction: evicted plans must be freed."""

    def __init__(self):
        self.destroyed = []

    def matrix_layout_destroy(self, layout):
        self.destroyed.append(layout)

    def matmul_desc_destroy(self, desc):
        self.destroyed.append(desc)


def test_plan_cache_is_bounded():
    lt, plans = FakeLt(), cublaslt._plans()
    plans.clear()
    try:
        for i in range(cublaslt._PLANS_PER_THREAD + 5):
            cublaslt._remember(lt, plans, i, cublaslt._Plan(i, (10 * i, 10 * i + 1, 10 * i + 2, 10 * i + 3), None,
                                                             False))
        plans.move_to_end(5)  # a hit makes it the most recent
        cublaslt._remember(lt, plans, "new", cublaslt._Plan(-1, (-1, -1, -1, -1), None, False))
        assert 5 in plans and 6 not in plans
        assert len(plans) == cublaslt._PLANS_PER_THREAD
        assert len(lt.destroyed) == 6 * 5 and 0 not in plans and 4 not in plans
    finally:
        plans.clear()


def _recording(calls):
    """A stand-in for Kernel.launch that records (kernel, device, instantiation, work, args, stream), the args
    checked against the kernel's C++ signature."""
    def launch(kernel, device, targs, work, stream, grid=None, block=None, cooperative=False, **args):
        kernel.signature.pack(args)
        calls.append((kernel.name, device, targs, work, args, stream))
    return launch


class _Dev:
    """A stand-in for a 1-element device array: only its pointer is read."""

    def __init__(self, ptr):
        self.data = type("Ptr", (), {"ptr": ptr})()


def test_gemm_with_no_rows_still_merges_amax_zero(monkeypatch):
    """M = 0 launches no GEMM, but out_amax still merges amax 0 (a slot holding -0.0 becomes 0, as on the CPU)."""
    calls = []
    monkeypatch.setattr(cublaslt, "compute_capability", lambda device: 90)
    monkeypatch.setattr(cublaslt, "lt_bindings", lambda: None)  # no cuBLASLt call is made for M = 0 (nvmath not needed)
    monkeypatch.setattr(_kernels.Kernel, "launch", _recording(calls))
    monkeypatch.setattr(cublaslt, "empty", lambda shape, dtype, like: ("D", shape))
    spec = type("Spec", (), {"m": 0, "n": 16, "out_dtype": "float8_e4m3fn", "a_fmt": None})()
    a = type("T", (), {"device": ("cuda", 3)})()
    d = cublaslt.gemm(spec, a, None, None, None, None, None, _Dev(0x1000), None, 77)
    assert d == ("D", (0, 16))
    assert calls == [("amax_kernel", 3, ("float32",), 1, {"x": 0, "amax_out": 0x1000, "n": 0}, 77)], \
        "x = null, n = 0: the kernel merges amax 0"


def test_merge_amax_packs_value_and_slot(monkeypatch):
    calls = []
    monkeypatch.setattr(_kernels.Kernel, "launch", _recording(calls))
    cuda_call.merge_amax(_Dev(0x2000), _Dev(0x3000), 0, 5)
    assert calls[0][4] == {"x": 0x3000, "amax_out": 0x2000, "n": 1} and _kernels.AMAX.signature.size == 24
