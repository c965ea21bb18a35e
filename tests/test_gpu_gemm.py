"""fp8core.gemm on cuBLASLt against the CPU emulation and torch._scaled_mm, with tolerances that grow with K.
Skipped, with the reason, where there is no GPU."""

import numpy as np
import pytest

import fp8core
from conftest import requires_gpu
from gemm_cases import CASES, as_fp8, fp8_codes
from oracle import gemm_reference, gemm_tolerance

pytestmark = requires_gpu
torch = pytest.importorskip("torch")


def cuda_fp8(codes, fmt):
    return torch.from_numpy(codes.copy()).cuda().view(fp8core.as_format(fmt).torch_dtype)


def scalar(v):
    return torch.tensor([v], dtype=torch.float32, device="cuda")


def to_f64(t):
    return t.float().cpu().numpy().astype(np.float64)


def check(got, ref, atol, rtol):
    err = np.abs(got - ref)
    bad = err > atol + rtol * np.abs(ref)
    assert not bad.any(), f"{bad.sum()} elements out of tolerance, worst {err[bad].max()}"


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("a_fmt,b_fmt,out_dtype", CASES)
def test_against_float64_and_the_emulation(rng, a_fmt, b_fmt, out_dtype, fast):
    m, n, k = 129, 96, 1024
    ac, bc = fp8_codes(rng, (m, k), a_fmt), fp8_codes(rng, (n, k), b_fmt)
    fp8_out = out_dtype.startswith("float8")
    out_scale = 2.0 ** -4 if fp8_out else 1.0
    kw = {"out_scale": scalar(out_scale)} if fp8_out else {}
    d = fp8core.gemm(cuda_fp8(ac, a_fmt), cuda_fp8(bc, b_fmt), scalar(0.5), scalar(0.25), out_dtype=out_dtype,
                     use_fast_accum=fast, **kw)
    assert d.is_cuda and d.shape == (m, n) and str(d.dtype) == f"torch.{out_dtype}"
    ref = gemm_reference(ac, a_fmt, bc, b_fmt, 0.5, 0.25) * out_scale
    atol, rtol = gemm_tolerance(ac, a_fmt, bc, b_fmt, 0.125, out_dtype, out_scale, tensor_core=True,
                                fast_accum=fast)
    if fp8_out:
        fmax = fp8core.as_format(out_dtype).max
        ref = np.clip(ref, -fmax, fmax)
    check(to_f64(d), ref, atol, rtol)
    emulated = fp8core.gemm(as_fp8(ac, a_fmt), as_fp8(bc, b_fmt), 0.5, 0.25, out_dtype=out_dtype,
                            **({"out_scale": out_scale} if fp8_out else {}))
    check(to_f64(d), np.asarray(emulated).astype(np.float64), 2 * atol, 2 * rtol)


@pytest.mark.parametrize("k", [16, 256, 8192])
def test_against_torch_scaled_mm(rng, k):
    m, n = 256, 512
    ac, bc = fp8_codes(rng, (m, k), "e4m3"), fp8_codes(rng, (n, k), "e4m3")
    a, b = cuda_fp8(ac, "e4m3"), cuda_fp8(bc, "e4m3")
    sa, sb = scalar(0.5), scalar(2.0)
    ours = fp8core.gemm(a, b, sa, sb, out_dtype="bfloat16")
    theirs = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    atol, rtol = gemm_tolerance(ac, "e4m3", bc, "e4m3", 1.0, "bfloat16", tensor_core=True)
    check(to_f64(ours), to_f64(theirs), 2 * atol, 2 * rtol)


def test_fp8_output_amax_and_bias(rng):
    m, n, k = 64, 128, 256
    ac, bc = fp8_codes(rng, (m, k), "e4m3"), fp8_codes(rng, (n, k), "e5m2")
    bias = torch.randn(n, dtype=torch.bfloat16, device="cuda") * 4
    a, b = cuda_fp8(ac, "e4m3"), cuda_fp8(bc, "e5m2")
    d32 = fp8core.gemm(a, b, scalar(1.0), scalar(0.5), out_dtype="float32", bias=bias)
    ref = gemm_reference(ac, "e4m3", bc, "e5m2", 1.0, 0.5, bias.float().cpu().numpy())
    atol, rtol = gemm_tolerance(ac, "e4m3", bc, "e5m2", 0.5, "float32", tensor_core=True)
    check(to_f64(d32), ref, atol, rtol)
    amax = torch.zeros(1, device="cuda")
    d8 = fp8core.gemm(a, b, scalar(1.0), scalar(0.5), out_dtype="e5m2", bias=bias, out_scale=scalar(8.0),
                      out_amax=amax)
    assert abs(amax.item() - np.abs(ref).max()) <= atol.max() + 2.0 ** -23 * np.abs(ref).max()
    atol8, rtol8 = gemm_tolerance(ac, "e4m3", bc, "e5m2", 0.5, "float8_e5m2", 8.0, tensor_core=True)
    check(to_f64(d8), np.clip(ref * 8.0, -57344, 57344), atol8, rtol8)
    big = torch.full((1,), 1e30, device="cuda")
    fp8core.gemm(a, b, scalar(1.0), scalar(0.5), out_dtype="e5m2", out_scale=scalar(1.0), out_amax=big)
    assert big.item() == pytest.approx(1e30)  # accumulates: max(out_amax, amax(D))


def test_plan_cache_rewrites_pointers(rng):
    """The second call reuses the cached plan with new operands, scales and outputs."""
    results = []
    for scale in (1.0, 4.0):
        ac, bc = fp8_codes(rng, (32, 64), "e4m3"), fp8_codes(rng, (48, 64), "e4m3")
        d = fp8core.gemm(cuda_fp8(ac, "e4m3"), cuda_fp8(bc, "e4m3"), scalar(scale), scalar(1.0),
                         out_dtype="float32")
        ref = gemm_reference(ac, "e4m3", bc, "e4m3", scale, 1.0)
        atol, rtol = gemm_tolerance(ac, "e4m3", bc, "e4m3", scale, "float32", tensor_core=True)
        check(to_f64(d), ref, atol, rtol)
        results.append(d)
    assert results[0].data_ptr() != results[1].data_ptr()


def test_cupy_storage_and_unaligned_rows(rng):
    cp = pytest.importorskip("cupy")
    ac, bc = fp8_codes(rng, (5, 32), "e5m2"), fp8_codes(rng, (16, 32), "e4m3")
    d = fp8core.gemm(cp.asarray(ac), cp.asarray(bc), 1.0, 1.0, out_dtype="float32", a_fmt="e5m2", b_fmt="e4m3")
    assert isinstance(d, cp.ndarray)
    ref = gemm_reference(ac, "e5m2", bc, "e4m3", 1.0, 1.0)
    atol, rtol = gemm_tolerance(ac, "e5m2", bc, "e4m3", 1.0, "float32", tensor_core=True)
    check(d.get().astype(np.float64), ref, atol, rtol)


def test_the_same_errors_as_the_cpu(rng):
    a = torch.zeros(8, 32, device="cuda", dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        fp8core.gemm(a, torch.zeros(16, 32, device="cuda", dtype=torch.float8_e5m2), scalar(1.0), scalar(1.0))
    flat = torch.zeros(8 * 32 + 1, device="cuda", dtype=torch.float8_e4m3fn)
    b = torch.zeros(16, 32, device="cuda", dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="16-byte aligned"):
        fp8core.gemm(flat[1:].view(8, 32), b, scalar(1.0), scalar(1.0))
    with pytest.raises(ValueError, match="a_scale_inv: is on cpu"):
        fp8core.gemm(b, b, torch.ones(1), scalar(1.0))


def test_cuda_graph_capture(rng):
    ac, bc = fp8_codes(rng, (64, 128), "e4m3"), fp8_codes(rng, (64, 128), "e4m3")
    a, b = cuda_fp8(ac, "e4m3"), cuda_fp8(bc, "e4m3")
    sa, sb, amax = scalar(1.0), scalar(1.0), torch.zeros(1, device="cuda")
    out = torch.empty(64, 64, device="cuda", dtype=torch.float8_e4m3fn)
    fp8core.gemm(a, b, sa, sb, out_dtype="e4m3", out_scale=sa, out_amax=amax, out=out)  # plan and workspace first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8core.gemm(a, b, sa, sb, out_dtype="e4m3", out_scale=sa, out_amax=amax, out=out)
    ac2 = fp8_codes(rng, (64, 128), "e4m3")
    a.copy_(cuda_fp8(ac2, "e4m3"))
    sa.fill_(0.5)
    amax.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ref = np.clip(gemm_reference(ac2, "e4m3", bc, "e4m3", 0.5, 1.0) * 0.5, -448, 448)
    atol, rtol = gemm_tolerance(ac2, "e4m3", bc, "e4m3", 0.5, "float8_e4m3fn", 0.5, tensor_core=True)
    check(to_f64(out), ref, atol, rtol)
    assert amax.item() > 0


def test_cuda_graph_10_replays_equal_eager(rng):
    """The GEMM with an fp8 output and an amax, captured once (its first call on the capture stream: the
    workspace comes from the graph's pool) and replayed 10 times on new data, bit for bit against eager."""
    bc = fp8_codes(rng, (64, 128), "e4m3")
    a, b = cuda_fp8(fp8_codes(rng, (96, 128), "e4m3"), "e4m3"), cuda_fp8(bc, "e4m3")
    sa, sb, so = scalar(1.0), scalar(0.5), scalar(2.0)
    amax = torch.zeros(1, device="cuda")
    out = torch.empty(96, 64, device="cuda", dtype=torch.float8_e4m3fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8core.gemm(a, b, sa, sb, out_dtype="e4m3", out_scale=so, out_amax=amax, out=out)
    for replay in range(10):
        a.copy_(cuda_fp8(fp8_codes(np.random.default_rng(replay), (96, 128), "e4m3"), "e4m3"))
        amax.zero_()
        graph.replay()
        got, got_amax = out.view(torch.uint8).clone(), amax.clone()
        eager_amax = torch.zeros(1, device="cuda")
        eager = fp8core.gemm(a, b, sa, sb, out_dtype="e4m3", out_scale=so, out_amax=eager_amax)
        torch.cuda.synchronize()
        assert torch.equal(got, eager.view(torch.uint8))
        assert torch.equal(got_amax.view(torch.int32), eager_amax.view(torch.int32))


def test_concurrent_gemms_on_streams(rng):
    """Threads on their own streams: each has its own workspace and AMAX_D scratch word."""
    import threading

    cases, errors = [], []
    for k in range(4):
        ac, bc = fp8_codes(rng, (256, 512), "e4m3"), fp8_codes(rng, (128, 512), "e4m3")
        cases.append((ac, bc, 2.0 ** -k))

    def work(k, out):
        try:
            ac, bc, s = cases[k]
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                a, b = cuda_fp8(ac, "e4m3"), cuda_fp8(bc, "e4m3")
                for _ in range(10):
                    amax = torch.zeros(1, device="cuda")
                    d = fp8core.gemm(a, b, scalar(s), scalar(1.0), out_dtype="float32")
                    d8 = fp8core.gemm(a, b, scalar(s), scalar(1.0), out_dtype="e4m3", out_scale=scalar(1.0),
                                      out_amax=amax)
            stream.synchronize()
            out[k] = (d.cpu(), d8.float().cpu(), amax.cpu())
        except Exception as e:  # reported below
            errors.append((k, e))

    out = {}
    threads = [threading.Thread(target=work, args=(k, out)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k, (d, d8, amax) in out.items():
        ac, bc, s = cases[k]
        ref = gemm_reference(ac, "e4m3", bc, "e4m3", s, 1.0)
        atol, rtol = gemm_tolerance(ac, "e4m3", bc, "e4m3", s, "float32", tensor_core=True)
        check(d.numpy().astype(np.float64), ref, atol, rtol)
        assert abs(float(amax[0]) - np.abs(ref).max()) <= atol.max() + 2.0 ** -20 * np.abs(ref).max()
        check(d8.numpy().astype(np.float64), np.clip(ref, -448, 448),
              *gemm_tolerance(ac, "e4m3", bc, "e4m3", s, "float8_e4m3fn", 1.0, tensor_core=True))


def test_gemm_on_the_second_device(rng):
    if torch.cuda.device_count() < 2:
        pytest.skip("GPU test: needs two GPUs")
    ac, bc = fp8_codes(rng, (32, 64), "e4m3"), fp8_codes(rng, (48, 64), "e4m3")
    a = torch.from_numpy(ac.copy()).to("cuda:1").view(torch.float8_e4m3fn)
    b = torch.from_numpy(bc.copy()).to("cuda:1").view(torch.float8_e4m3fn)
    one = torch.ones(1, device="cuda:1")
    with torch.cuda.device(0):
        d = fp8core.gemm(a, b, one, one, out_dtype="float32")
        assert torch.cuda.current_device() == 0
    assert d.device == torch.device("cuda:1")
    ref = gemm_reference(ac, "e4m3", bc, "e4m3", 1.0, 1.0)
    atol, rtol = gemm_tolerance(ac, "e4m3", bc, "e4m3", 1.0, "float32", tensor_core=True)
    check(to_f64(d), ref, atol, rtol)


def test_amax_word_is_set_by_each_gemm_not_accumulated(rng):
    """cuBLASLt documents AMAX_D_POINTER as *set* to amax(D) on completion; fp8core merges that word into
    out_amax afterwards. If cuBLASLt max-accumulated into the word instead, the second, smaller GEMM on the same
    stream (same workspace word) would report the first one's amax."""
    big, small = fp8_codes(rng, (64, 128), "e4m3", spread=6.0), fp8_codes(rng, (64, 128), "e4m3", spread=0.0)
    bc = fp8_codes(rng, (32, 128), "e4m3")
    b = cuda_fp8(bc, "e4m3")
    amaxes = []
    for ac in (big, small):
        amax = torch.zeros(1, device="cuda")
        fp8core.gemm(cuda_fp8(ac, "e4m3"), b, scalar(1.0), scalar(1.0), out_dtype="e4m3", out_scale=scalar(2.0 ** -8),
                     out_amax=amax)
        ref = gemm_reference(ac, "e4m3", bc, "e4m3", 1.0, 1.0)
        atol, _ = gemm_tolerance(ac, "e4m3", bc, "e4m3", 1.0, "float32", tensor_core=True)
        assert abs(amax.item() - np.abs(ref).max()) <= atol.max() + 2.0 ** -20 * np.abs(ref).max()
        amaxes.append(amax.item())
    assert amaxes[1] < amaxes[0]


def test_bias_at_an_odd_address_is_refused_by_name(rng):
    """cuBLASLt 13.1 answered a bias view 2 bytes past an allocation's start with CUBLAS_STATUS_INVALID_VALUE (H200,
    2026-11-26), so fp8core refuses it by name, as the CPU does (test_gemm.py)."""
    m, n, k = 32, 64, 128
    ac, bc = fp8_codes(rng, (m, k), "e4m3"), fp8_codes(rng, (n, k), "e4m3")
    store = torch.randn(n + 1, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="bias: its data pointer must be 16-byte aligned"):
        fp8core.gemm(cuda_fp8(ac, "e4m3"), cuda_fp8(bc, "e4m3"), scalar(1.0), scalar(1.0), out_dtype="float32",
                     bias=store[1:])
    bias = store[:n]
    d = fp8core.gemm(cuda_fp8(ac, "e4m3"), cuda_fp8(bc, "e4m3"), scalar(1.0), scalar(1.0), out_dtype="float32",
                     bias=bias)
    ref = gemm_reference(ac, "e4m3", bc, "e4m3", 1.0, 1.0, bias.float().cpu().numpy())
    check(to_f64(d), ref, *gemm_tolerance(ac, "e4m3", bc, "e4m3", 1.0, "float32", tensor_core=True))


def test_scales_off_a_16_byte_boundary(rng):
    """torch.compile passes views of a state's scale_inv at any offset; cuBLASLt refused one 4 bytes past a 16-byte
    boundary (H200), so fp8core stages such scales in its scratch (cublaslt.staged_scales)."""
    m, n, k = 64, 32, 128
    ac, bc = fp8_codes(rng, (m, k), "e4m3"), fp8_codes(rng, (n, k), "e4m3")
    a, b = cuda_fp8(ac, "e4m3"), cuda_fp8(bc, "e4m3")
    store = torch.tensor([0.5, 0.25, 2.0, 4.0], device="cuda")
    d = fp8core.gemm(a, b, store[1:2], store[2:3], out_dtype="float32")
    ref = gemm_reference(ac, "e4m3", bc, "e4m3", 0.25, 2.0)
    atol, rtol = gemm_tolerance(ac, "e4m3", bc, "e4m3", 0.5, "float32", tensor_core=True)
    check(to_f64(d), ref, atol, rtol)
    amax = torch.zeros(1, device="cuda")
    d8 = fp8core.gemm(a, b, store[1:2], store[2:3], out_dtype="e4m3", out_scale=store[3:4], out_amax=amax)
    aligned = fp8core.gemm(a, b, store[1:2].clone(), store[2:3].clone(), out_dtype="e4m3",
                           out_scale=store[3:4].clone(), out_amax=torch.zeros(1, device="cuda"))  # the same plan
    assert torch.equal(d8.view(torch.uint8), aligned.view(torch.uint8))
    assert abs(amax.item() - np.abs(ref).max()) <= atol.max()


def test_cuda_graph_capture_of_a_threads_first_gemm(rng):
    """A fresh thread has no cuBLASLt handle, no plan and (on the capture stream) no workspace: all three are made
    inside torch.cuda.graph's capture (global mode, where a cudaMalloc would fail the capture). cublasLtCreate
    may allocate on the device; if this fails, create the handle before capture (e.g. at import of the thread's
    first gemm outside capture) and say so in the docs."""
    import threading

    ac, bc = fp8_codes(rng, (64, 128), "e4m3"), fp8_codes(rng, (48, 128), "e4m3")
    a, b = cuda_fp8(ac, "e4m3"), cuda_fp8(bc, "e4m3")
    one = scalar(1.0)
    out = torch.empty(64, 48, device="cuda", dtype=torch.float32)
    result = {}

    def work():
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fp8core.gemm(a, b, one, one, out_dtype="float32", out=out)
            graph.replay()
            torch.cuda.synchronize()
            result["out"] = out.cpu()
        except Exception as e:  # reported below
            result["error"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in result, result.get("error")
    ref = gemm_reference(ac, "e4m3", bc, "e4m3", 1.0, 1.0)
    check(result["out"].numpy().astype(np.float64), ref,
          *gemm_tolerance(ac, "e4m3", bc, "e4m3", 1.0, "float32", tensor_core=True))
