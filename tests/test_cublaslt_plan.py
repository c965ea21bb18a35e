"""What fp8core asks of cuBLASLt, checked on the CPU: the GEMM's plan is built against a recording stand-in for
``nvmath.bindings.cublasLt`` (its real enums and attribute dtypes, no library calls), so the row-major to
column-major mapping, the scale pointers' operands and the scale modes are checked without a GPU. The numbers
the plan passes (CUDA_R_*, CUBLAS_COMPUTE_32F) are read from nvmath's own enums here, not from fp8core."""

import ctypes

import numpy as np
import pytest

import fp8core
from fp8core.gemm import GemmSpec

lt_real = pytest.importorskip("nvmath.bindings.cublasLt", reason="nvmath-python (fp8core[gemm]) is not installed")
nvmath = pytest.importorskip("nvmath")
from fp8core.backends import cublaslt  # noqa: E402  (after the skip: it needs nvmath at call time only)

CUDA_R = {name: int(getattr(nvmath.CudaDataType, f"CUDA_R_{code}").value)
          for name, code in (("float32", "32F"), ("float16", "16F"), ("bfloat16", "16BF"),
                             ("float8_e4m3fn", "8F_E4M3"), ("float8_e5m2", "8F_E5M2"), ("float4_e2m1fn", "4F_E2M1"))}
A = lt_real.MatmulDescAttribute
SCALE = lt_real.MatmulMatrixScale


class Refused(Exception):
    """Stands in for nvmath's cuBLASLtError (whose constructor needs the library)."""


class RecordingLt:
    """The calls of cublaslt._make_plan, recorded: attribute values are read back from the buffers passed."""

    MatmulDescAttribute = lt_real.MatmulDescAttribute
    MatmulPreferenceAttribute = lt_real.MatmulPreferenceAttribute
    MatmulMatrixScale = lt_real.MatmulMatrixScale
    PointerMode = lt_real.PointerMode
    Epilogue = lt_real.Epilogue
    MatmulHeuristicResult = lt_real.MatmulHeuristicResult
    get_matmul_desc_attribute_dtype = staticmethod(lt_real.get_matmul_desc_attribute_dtype)
    get_matmul_preference_attribute_dtype = staticmethod(lt_real.get_matmul_preference_attribute_dtype)
    cuBLASLtError = Refused

    def __init__(self, found: int = 1, refuse: bool = False) -> None:
        self.found, self.refuse = found, refuse
        self.desc: dict[int, object] = {}
        self.pref: dict[int, object] = {}
        self.layouts: list[tuple[int, int, int, int]] = []
        self.created, self.destroyed = [], []

    @staticmethod
    def _read(buf: int, size: int, dtype) -> object:
        return np.frombuffer(ctypes.string_at(buf, size), dtype=dtype)[0].item()

    def matmul_desc_create(self, compute: int, scale: int) -> int:
        self.compute = (compute, scale)
        self.created.append(1000)
        return 1000

    def matmul_desc_set_attribute(self, desc: int, attr, buf: int, size: int) -> None:
        self.desc[attr] = self._read(buf, size, lt_real.get_matmul_desc_attribute_dtype(attr))

    def matrix_layout_create(self, dtype: int, rows: int, cols: int, ld: int) -> int:
        self.layouts.append((dtype, rows, cols, ld))
        self.created.append(2000 + len(self.layouts))
        return self.created[-1]

    def matmul_preference_create(self) -> int:
        return 3000

    def matmul_preference_set_attribute(self, pref: int, attr, buf: int, size: int) -> None:
        self.pref[attr] = self._read(buf, size, lt_real.get_matmul_preference_attribute_dtype(attr))

    def matmul_algo_get_heuristic(self, handle, desc, a, b, c, d, pref, n, results, found_ptr) -> None:
        self.heuristic_layouts = (a, b, c, d)
        if self.refuse:
            raise Refused("CUBLAS_STATUS_NOT_SUPPORTED")
        ctypes.c_int32.from_address(found_ptr).value = self.found

    def matmul_preference_destroy(self, pref: int) -> None:
        self.destroyed.append(pref)

    def matrix_layout_destroy(self, layout: int) -> None:
        self.destroyed.append(layout)

    def matmul_desc_destroy(self, desc: int) -> None:
        self.destroyed.append(desc)


# a [M, K], b [N, K] row-major; scale pointers and the bias as recognisable numbers
M, N, K = 48, 32, 256
A_S, B_S, BIAS, OUT_S, AMAX = 0x1100, 0x2200, 0x3300, 0x4400, 0x5500


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
    monkeypatch.setattr(cublaslt, "compute_capability", lambda device: 90)


def plan(spec, lt=None, amax=True):
    lt = lt or RecordingLt()
    p = cublaslt._make_plan(lt, spec, 7, cublaslt._workspace_size(0) - cublaslt._SCRATCH, 256,
                            (A_S, B_S, BIAS if spec.bias_dtype else 0, OUT_S, AMAX if amax else 0))
    return lt, p


def spec(a="e4m3", b="e5m2", out="bfloat16", bias=None, fast=False, a_block=None, b_block=None, m=M):
    return GemmSpec(m, N, K, fp8core.as_format(a), fp8core.as_format(b), out, bias, fast, a_block, b_block)


def test_row_major_d_is_cublaslts_column_major_transpose_in_tn_form():
    """D[M, N] = a b^T row-major is D^T[N, M] = b a^T column-major: cuBLASLt's A is our b (K x N, ld K,
    transposed), its B our a (K x M, ld K), C and D N x M with ld N; the types follow the operands."""
    lt, p = plan(spec())
    assert lt.desc[A.TRANSA] == 1 and lt.desc[A.TRANSB] == 0  # CUBLAS_OP_T, CUBLAS_OP_N: "TN"
    assert lt.layouts == [(CUDA_R["float8_e5m2"], K, N, K), (CUDA_R["float8_e4m3fn"], K, M, K),
                          (CUDA_R["bfloat16"], N, M, N), (CUDA_R["bfloat16"], N, M, N)]
    assert lt.heuristic_layouts == p.layouts
    assert lt.desc[A.A_SCALE_POINTER] == B_S and lt.desc[A.B_SCALE_POINTER] == A_S  # cuBLASLt's A is our b
    assert lt.desc[A.FAST_ACCUM] == 0
    assert A.D_SCALE_POINTER not in lt.desc and A.AMAX_D_POINTER not in lt.desc  # not an fp8 output
    assert A.EPILOGUE not in lt.desc and A.A_SCALE_MODE not in lt.desc


def test_compute_type_is_cublas_compute_32f():
    from nvmath.bindings import cublas

    lt, _ = plan(spec())
    assert lt.compute == (int(cublas.ComputeType.COMPUTE_32F), CUDA_R["float32"])


def test_fp8_output_with_bias():
    """An fp8 D: its scale and the amax word are set; C takes the bias type; the BIAS epilogue adds bias[N]
    (one value per row of D^T, per column of our D)."""
    lt, p = plan(spec(out="float8_e4m3fn", bias="float16", fast=True))
    assert lt.desc[A.D_SCALE_POINTER] == OUT_S and lt.desc[A.AMAX_D_POINTER] == AMAX
    assert lt.desc[A.EPILOGUE] == int(lt_real.Epilogue.BIAS) and lt.desc[A.BIAS_DATA_TYPE] == CUDA_R["float16"]
    assert lt.desc[A.BIAS_POINTER] == BIAS and lt.desc[A.FAST_ACCUM] == 1
    assert lt.layouts[2] == (CUDA_R["float16"], N, M, N) and lt.layouts[3] == (CUDA_R["float8_e4m3fn"], N, M, N)
    assert p.fp8_out


def test_fp8_output_without_bias_has_a_bf16_c():
    lt, _ = plan(spec(out="float8_e5m2"), amax=False)
    assert lt.layouts[2][0] == CUDA_R["bfloat16"]
    assert A.AMAX_D_POINTER not in lt.desc


def test_workspace_and_alignment_preferences():
    lt, _ = plan(spec())
    P = lt_real.MatmulPreferenceAttribute
    assert lt.pref[P.MAX_WORKSPACE_BYTES] == cublaslt._WORKSPACE_SM90 - cublaslt._SCRATCH
    assert all(lt.pref[a] == 256 for a in (P.MIN_ALIGNMENT_A_BYTES, P.MIN_ALIGNMENT_B_BYTES,
                                           P.MIN_ALIGNMENT_C_BYTES, P.MIN_ALIGNMENT_D_BYTES))


@pytest.mark.parametrize("a_block,b_block", [("1x128", "1x128"), ("1x128", "128x128"), ("128x128", "1x128"),
                                             ("1x32", "1x32")])
def test_block_scale_modes_follow_the_operands(a_block, b_block):
    """cuBLASLt's A scale mode is b's blocks, its B scale mode a's (the operands are swapped)."""
    mode = {"1x32": SCALE.VEC32_UE8M0, "1x128": SCALE.VEC128_32F, "128x128": SCALE.BLK128x128_32F}
    lt, _ = plan(spec(a="e4m3", b="e4m3", a_block=a_block, b_block=b_block))
    assert lt.desc[A.A_SCALE_MODE] == int(mode[b_block]) and lt.desc[A.B_SCALE_MODE] == int(mode[a_block])
    assert lt.desc[A.A_SCALE_POINTER] == B_S and lt.desc[A.B_SCALE_POINTER] == A_S


@pytest.mark.parametrize("refuse", [False, True])
def test_no_algorithm_is_a_clear_error_and_leaks_no_descriptor(refuse):
    lt = RecordingLt(found=0, refuse=refuse)
    with pytest.raises(RuntimeError, match=r"no FP8 GEMM algorithm for M=24, N=32, K=256, a E4M3 x b E4M3 -> "
                                           r"bfloat16.*blocks a 1x128 x b 128x128"):
        plan(spec(a="e4m3", b="e4m3", a_block="1x128", b_block="128x128", m=24), lt)
    assert sorted(lt.destroyed) == sorted(lt.created + [3000])  # the desc, the 4 layouts and the preference


def test_a_plan_that_fails_midway_destroys_what_it_made():
    lt = RecordingLt()
    calls = {"n": 0}
    create = lt.matrix_layout_create

    def third_fails(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Refused("CUBLAS_STATUS_INVALID_VALUE")
        return create(*args)

    lt.matrix_layout_create = third_fails
    with pytest.raises(Refused):
        plan(spec(), lt)
    assert sorted(lt.destroyed) == sorted(lt.created)


def test_the_scale_mode_enums_are_cublaslts():
    assert [cublaslt._scale_mode(lt_real, k) for k in ("1x32", "1x128", "128x128")] == \
        [int(SCALE.VEC32_UE8M0), int(SCALE.VEC128_32F), int(SCALE.BLK128x128_32F)]
    assert cublaslt._CUDA_R == CUDA_R


# ---- the rules fp8core.gemm enforces for cuBLASLt, the same on the CPU -------------------------------------

def _block_operands(rng, m, n, k, a_block, b_block):
    from fp8core import blocks

    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    return blocks.quantize_blockwise(x, block=a_block), blocks.quantize_blockwise(w, block=b_block)


@pytest.mark.parametrize("a_block,b_block", [("1x128", "1x128"), ("1x128", "128x128"), ("128x128", "1x128")])
def test_fast_accumulation_is_refused_for_fp32_block_gemms(rng, a_block, b_block):
    """torch._scaled_mm refuses fast accumulation with 1x128/128x128 blocks and Transformer Engine's
    Float8BlockScaling always splits the accumulator: the CPU refuses it too, so code moves to a GPU unchanged."""
    a, b = _block_operands(rng, 32, 16, 256, a_block, b_block)
    with pytest.raises(ValueError, match="use_fast_accum: a 1x128/128x128 block GEMM"):
        fp8core.gemm(a, b, out_dtype="float32", use_fast_accum=True)
    d = fp8core.gemm(a, b, out_dtype="float32")
    assert d.shape == (32, 16) and np.isfinite(d).all()


def test_fast_accumulation_stays_allowed_for_mxfp8(rng):
    from fp8core import blocks

    a = blocks.quantize_mxfp8(rng.standard_normal((32, 64)).astype(np.float32))
    b = blocks.quantize_mxfp8(rng.standard_normal((16, 64)).astype(np.float32))
    np.testing.assert_array_equal(fp8core.gemm(a, b, out_dtype="float32", use_fast_accum=True),
                                  fp8core.gemm(a, b, out_dtype="float32"))



@pytest.mark.parametrize("cc", [89, 100, 103, 120])
def test_fp32_block_gemm_is_refused_off_hopper_by_name(monkeypatch, cc):
    """cuBLASLt has the VEC128_32F/BLK128x128_32F scale modes on sm_90 only (torch xfails them elsewhere,
    PR #188996; Transformer Engine emulates the recipe through MXFP8 on Blackwell): a clear ValueError, not
    'no algorithm'."""
    monkeypatch.setattr(cublaslt, "compute_capability", lambda device: cc)
    with pytest.raises(ValueError, match=rf"needs a GPU of compute capability 9.0 \(Hopper\).* is {cc // 10}\."
                                         rf"{cc % 10}{'; on Blackwell use MXFP8' if cc >= 100 else '$'}"):
        cublaslt._block_scales(spec(a="e4m3", b="e4m3", a_block="1x128", b_block="128x128"), 0, None, None,
                               None, 0)


@pytest.mark.parametrize("cc", [89, 90])
def test_mxfp8_gemm_is_refused_before_blackwell(monkeypatch, cc):
    monkeypatch.setattr(cublaslt, "compute_capability", lambda device: cc)
    with pytest.raises(ValueError, match="an MXFP8 GEMM needs a GPU of compute capability 10.0"):
        cublaslt._block_scales(spec(a="e4m3", b="e4m3", a_block="1x32", b_block="1x32"), 0, None, None, None, 0)


def test_scales_off_a_16_byte_boundary_are_staged_in_the_scratch():
    """torch.compile passed a view of a state's second scale_inv (4 bytes past a boundary), which cuBLASLt refused
    on an H200: such a per-tensor scale is copied into its own 16-byte slot of the scratch first."""
    scratch = 0x10000
    pointers = (0x2000, 0x2004, 0x3002, 0x4008, 0x5000)  # a_scale_inv, b_scale_inv, bias, out_scale, amax
    staged, copies = cublaslt.staged_scales(pointers, scratch)
    assert staged == (0x2000, scratch + 32, 0x3002, scratch + 48, 0x5000)  # bias is refused by name before this
    assert copies == [(0x2004, scratch + 32), (0x4008, scratch + 48)]
    assert cublaslt.staged_scales((0x2000, 0x2010, 0, 0, 0), scratch) == ((0x2000, 0x2010, 0, 0, 0), [])
    with pytest.raises(ValueError, match="a_scale_inv: cuBLASLt needs a 16-byte aligned scale"):
        cublaslt.staged_scales((0x2004, 0x2010, 0, 0, 0), 0)


# ---- the FP4 GEMM (NVFP4, MXFP4): E2M1 operands, block scale modes, NVFP4's alpha on the device -------------

E2M1_R = CUDA_R["float4_e2m1fn"]


def fp4_spec(a_block="1x16", b_block="1x16", out="bfloat16", bias=None):
    return GemmSpec(M, N, K, fp8core.formats.E2M1, fp8core.formats.E2M1, out, bias, False, fp8core.Layout(a_block),
                    fp8core.Layout(b_block))


@pytest.mark.parametrize("a_block,b_block", [("1x16", "1x16"), ("1x16", "16x16"), ("16x16", "1x16")])
def test_nvfp4_plan(a_block, b_block):
    """E2M1 operands in TN form (K counted in elements, ld K), VEC16_UE4M3 scales on both (16x16 tiles are read as
    the 1x16 rows gemm_scale expands them to), the block scale pointers swapped with the operands, and alpha and
    beta read from the device (POINTER_MODE_DEVICE): alpha = S_dec_a * S_dec_b never visits the host."""
    lt, p = plan(fp4_spec(a_block, b_block, bias="bfloat16"))
    assert lt.desc[A.TRANSA] == 1 and lt.desc[A.TRANSB] == 0
    assert lt.layouts == [(E2M1_R, K, N, K), (E2M1_R, K, M, K), (CUDA_R["bfloat16"], N, M, N),
                          (CUDA_R["bfloat16"], N, M, N)]
    assert lt.desc[A.A_SCALE_MODE] == lt.desc[A.B_SCALE_MODE] == int(SCALE.VEC16_UE4M3)
    assert lt.desc[A.A_SCALE_POINTER] == B_S and lt.desc[A.B_SCALE_POINTER] == A_S
    assert lt.desc[A.POINTER_MODE] == int(lt_real.PointerMode.DEVICE) and p.device_alpha
    assert lt.compute[1] == CUDA_R["float32"]  # alpha's type (SCALE_TYPE): fp32
    assert lt.desc[A.EPILOGUE] == int(lt_real.Epilogue.BIAS) and lt.desc[A.BIAS_POINTER] == BIAS
    assert A.D_SCALE_POINTER not in lt.desc and A.AMAX_D_POINTER not in lt.desc


def test_mxfp4_plan():
    """MXFP4: VEC32_UE8M0 scales, alpha 1 from the host (the default pointer mode)."""
    lt, p = plan(fp4_spec("1x32", "1x32", out="float32"))
    assert lt.layouts[:2] == [(E2M1_R, K, N, K), (E2M1_R, K, M, K)]
    assert lt.desc[A.A_SCALE_MODE] == lt.desc[A.B_SCALE_MODE] == int(SCALE.VEC32_UE8M0)
    assert A.POINTER_MODE not in lt.desc and not p.device_alpha
    assert cublaslt.scalars(p, None) == (cublaslt._ONE.ctypes.data, cublaslt._ZERO.ctypes.data)


def test_nvfp4_alpha_and_beta_are_the_device_arrays_two_floats():
    _, p = plan(fp4_spec())

    class Alpha:
        data = type("Memory", (), {"ptr": 0x7000})()
        itemsize = 4

    assert cublaslt.scalars(p, Alpha()) == (0x7000, 0x7004)
    with pytest.raises(ValueError, match="^alpha: an NVFP4 GEMM reads alpha and beta from the device"):
        cublaslt.scalars(p, None)


def test_no_fp4_algorithm_names_fp4():
    with pytest.raises(RuntimeError, match=r"no FP4 GEMM algorithm for M=48, N=32, K=256, a E2M1 x b E2M1"):
        plan(fp4_spec(), RecordingLt(found=0))


@pytest.mark.parametrize("cc", [80, 89, 90])
def test_fp4_gemm_is_refused_before_blackwell_by_compute_capability(monkeypatch, cc):
    """The H100/H200 (9.0) and older have no block-scaled FP4 in cuBLASLt: a ValueError naming the capability."""
    monkeypatch.setattr(cublaslt, "compute_capability", lambda device: cc)
    with pytest.raises(ValueError, match=rf"^a: an FP4 GEMM \(NVFP4, MXFP4\) needs a GPU of compute capability "
                                         rf"10.x, 11.x or 12.x .*cuda:0 is {cc // 10}\.{cc % 10}: move the operands"):
        cublaslt.check_fp4_device(0)


@pytest.mark.parametrize("cc", [100, 103, 110, 120, 121])
def test_fp4_gemm_is_taken_on_blackwell(monkeypatch, cc):
    monkeypatch.setattr(cublaslt, "compute_capability", lambda device: cc)
    monkeypatch.setattr(cublaslt, "lt_bindings", lambda: type("Lt", (), {"get_version": staticmethod(lambda: 130100)}))
    cublaslt.check_fp4_device(0)
    monkeypatch.setattr(cublaslt, "lt_bindings", lambda: type("Lt", (), {"get_version": staticmethod(lambda: 120700)}))
    with pytest.raises(ValueError, match="^a: an FP4 GEMM needs cuBLAS 12.8 or newer, found 120700"):
        cublaslt.check_fp4_device(0)


# ---- cuda_fp4.gemm: what it launches before cuBLASLt, on the caller's stream --------------------------------

class _FP4Call:
    """cuda_fp4.gemm's surroundings replaced: the device guard, stream, allocator and launches recorded, and
    cublaslt.gemm recording what it is handed."""

    def __init__(self, monkeypatch, cc=100, capturing=False):
        pytest.importorskip("cupy", reason="cupy (fp8core[cuda13]) is not installed")
        from test_cupy_capture import FakeArray

        from fp8core import _kernels
        from fp8core.backends import cuda_fp4

        self.log, self.FakeArray, self.next = [], FakeArray, 0x100000
        monkeypatch.setattr(cublaslt, "compute_capability", lambda device: cc)
        monkeypatch.setattr(cublaslt, "lt_bindings", lambda: type("Lt", (), {"get_version": lambda: 130100}))
        monkeypatch.setattr(cuda_fp4, "Launch", lambda t: _Guard(self.log, t.device[1], (t.device[1], 77)))
        monkeypatch.setattr(cuda_fp4, "capture_outlives", lambda t, stream: capturing)
        monkeypatch.setattr(cuda_fp4, "empty", self.empty)
        monkeypatch.setattr(_kernels.Kernel, "launch", lambda kernel, *args, **kwargs: self.launch(kernel, *args,
                                                                                                   **kwargs))
        monkeypatch.setattr(cublaslt, "gemm", self.gemm)
        self.cuda_fp4 = cuda_fp4

    def empty(self, shape, dtype, like):
        self.next += 0x10000
        return self.FakeArray(shape, dtype, self.next)

    def launch(self, kernel, device, targs, work, stream, **args):
        kernel.signature.pack(args)  # the names and kinds the kernel's C++ signature takes
        self.log.append(("launch", kernel.name, stream, args))

    def gemm(self, spec, a, b, a_scale, b_scale, bias, out_scale, out_amax, out, stream, alpha=None):
        self.log.append(("cublaslt", spec, a_scale.data.ptr, b_scale.data.ptr, stream, alpha))
        return "D"

    def tensor(self, shape, dtype, ptr):
        from fp8core._tensor import Tensor

        return Tensor(self.FakeArray(shape, np.uint8 if dtype != "float32" else np.float32, ptr), dtype,
                      ("cuda", 0), "cupy")


class _Guard:
    def __init__(self, log, device, entered=None):
        self.log, self.device, self.entered = log, device, entered

    def __enter__(self):
        self.log.append(("device", self.device))
        return self.entered

    def __exit__(self, *exc):
        return False


def _fp4_operands(call):
    a, b = call.tensor((M, K // 2), "uint8", 0x1000), call.tensor((N, K // 2), "uint8", 0x2000)
    sa = call.tensor((M, K // 16), "float8_e4m3fn", 0x3000)
    sb = call.tensor((N // 16, K // 16), "float8_e4m3fn", 0x4000)
    amaxes = (call.tensor((1,), "float32", 0x5000), call.tensor((1,), "float32", 0x6000))
    return a, sa, b, sb, amaxes


def test_cuda_fp4_gemm_computes_alpha_and_scale_layouts_on_the_callers_stream(monkeypatch):
    """NVFP4 (a 1x16, b 16x16 tiles): alpha from the two amax pointers, both scales swizzled (b's tiles expanded to
    its N rows), all on the caller's stream, then cuBLASLt with those arrays; nothing read back to the host."""
    call = _FP4Call(monkeypatch)
    a, sa, b, sb, amaxes = _fp4_operands(call)
    assert call.cuda_fp4.gemm(fp4_spec("1x16", "16x16"), a, sa, b, sb, amaxes, None) == "D"
    launches = [e for e in call.log if e[0] == "launch"]
    assert [(e[1], e[2]) for e in launches] == [("nvfp4_gemm_alpha_kernel", 77), ("mx_scale_swizzle_kernel", 77),
                                                ("mx_scale_swizzle_kernel", 77)]
    alpha_args, a_sw, b_sw = (e[3] for e in launches)
    assert (alpha_args["amax_a"], alpha_args["amax_b"]) == (0x5000, 0x6000)
    assert (a_sw["s"], a_sw["rows"], a_sw["tile_rows"]) == (0x3000, M, 1)
    assert (b_sw["s"], b_sw["rows"], b_sw["tile_rows"]) == (0x4000, N, 16)
    (_, spec_, a_scale, b_scale, stream, alpha), = [e for e in call.log if e[0] == "cublaslt"]
    assert (a_scale, b_scale, stream) == (a_sw["out"], b_sw["out"], 77)
    assert alpha.data.ptr == alpha_args["alpha_beta"] and alpha.shape == (2,) and alpha.dtype == np.float32


def test_cuda_mxfp4_gemm_has_no_alpha(monkeypatch):
    call = _FP4Call(monkeypatch)
    a, b = call.tensor((M, K // 2), "uint8", 0x1000), call.tensor((N, K // 2), "uint8", 0x2000)
    sa, sb = call.tensor((M, K // 32), "float8_e8m0fnu", 0x3000), call.tensor((N, K // 32), "float8_e8m0fnu", 0x4000)
    call.cuda_fp4.gemm(fp4_spec("1x32", "1x32"), a, sa, b, sb, None, None)
    assert [e[1] for e in call.log if e[0] == "launch"] == ["mx_scale_swizzle_kernel"] * 2
    assert [e for e in call.log if e[0] == "cublaslt"][0][-1] is None


def test_cuda_fp4_gemm_on_a_hopper_is_refused_before_any_launch(monkeypatch):
    call = _FP4Call(monkeypatch, cc=90)
    with pytest.raises(ValueError, match=r"^a: an FP4 GEMM .* cuda:0 is 9\.0"):
        call.cuda_fp4.gemm(fp4_spec(), *_fp4_operands(call), None)
    assert call.log == []


def test_cuda_fp4_gemm_inside_a_cupy_capture_is_refused_before_any_launch(monkeypatch):
    call = _FP4Call(monkeypatch, capturing=True)
    with pytest.raises(ValueError, match=r"^a, b: an FP4 GEMM lays its block scales out .* captured with CuPy"):
        call.cuda_fp4.gemm(fp4_spec(), *_fp4_operands(call), None)
    assert not [e for e in call.log if e[0] != "device"]
# ---- rowwise (outer-vector) scaling -----------------------------------------------------------------------

def test_rowwise_gemm_sets_the_outer_vector_scale_mode_on_both_operands():
    """One fp32 scale per row of a and of b: cuBLASLt's OUTER_VEC_32F for its A (our b, N scales) and B (our a,
    M scales), the vectors passed as the scale pointers."""
    lt, _ = plan(spec(a="e4m3", b="e4m3", a_block="rowwise", b_block="rowwise"))
    assert lt.desc[A.A_SCALE_MODE] == lt.desc[A.B_SCALE_MODE] == int(SCALE.OUTER_VEC_32F) == 3
    assert lt.desc[A.A_SCALE_POINTER] == B_S and lt.desc[A.B_SCALE_POINTER] == A_S
    assert cublaslt._scale_mode(lt_real, fp8core.Layout.ROWWISE) == int(SCALE.OUTER_VEC_32F)


@pytest.mark.parametrize("cc", [89, 100, 120])
def test_rowwise_gemm_is_refused_off_hopper_by_name(monkeypatch, cc):
    """OUTER_VEC_32F is an sm_90 mode of cuBLASLt (PyTorch's rowwise _scaled_mm uses CUTLASS elsewhere)."""
    monkeypatch.setattr(cublaslt, "compute_capability", lambda device: cc)
    with pytest.raises(ValueError, match=rf"rowwise-scaled GEMM .* compute capability 9.0 \(Hopper\).* is "
                                         rf"{cc // 10}\.{cc % 10}$"):
        cublaslt._block_scales(spec(a="e4m3", b="e4m3", a_block="rowwise", b_block="rowwise"), 0, None, None,
                               None, 0)


def test_rowwise_gemm_needs_cublas_12_9(monkeypatch):
    class Old:
        @staticmethod
        def get_version():
            return 120804

    monkeypatch.setattr(cublaslt, "lt_bindings", lambda: Old)
    with pytest.raises(ValueError, match="rowwise-scaled GEMM needs cuBLAS 12.9 or newer, found 120804"):
        cublaslt._block_scales(spec(a="e4m3", b="e4m3", a_block="rowwise", b_block="rowwise"), 0, None, None,
                               None, 0)


def test_fast_accumulation_is_allowed_for_rowwise(rng):
    """torchao runs its rowwise forward GEMM with fast accumulation: allowed (no effect on the CPU)."""
    a = fp8core.quantize_rowwise(rng.standard_normal((32, 64)).astype(np.float32))
    b = fp8core.quantize_rowwise(rng.standard_normal((16, 64)).astype(np.float32))
    np.testing.assert_array_equal(fp8core.gemm(a, b, out_dtype="float32", use_fast_accum=True),
                                  fp8core.gemm(a, b, out_dtype="float32"))
