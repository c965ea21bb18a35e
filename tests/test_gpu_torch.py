"""fp8core.torch and fp8core.jax on CUDA: Float8Linear against nn.Linear, compile against eager, a training step
captured in a CUDA graph, module transforms across devices against untouched twins (issue 14), JAX primitives
inside jit on the GPU. Skipped, with the reason, where there is no GPU."""

import copy

import numpy as np
import pytest

from conftest import requires_gpu

pytestmark = requires_gpu
torch = pytest.importorskip("torch")

import fp8core  # noqa: E402
from fp8core.torch import Float8Linear, autocast, convert_to_float8  # noqa: E402

RECIPE = fp8core.DelayedScaling(amax_history_len=16)


def sqnr(x, ref):
    return (20 * torch.log10(ref.norm() / (x - ref).norm())).item()


def test_float8_linear_on_cuda_against_nn_linear():
    torch.manual_seed(0)
    ref = torch.nn.Linear(1024, 512, device="cuda", dtype=torch.bfloat16)
    lin = Float8Linear.from_linear(copy.deepcopy(ref), RECIPE)
    x = torch.randn(8, 128, 1024, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        with autocast():
            lin(x).sum().backward()
    lin.zero_grad()
    xa, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(8, 128, 512, device="cuda", dtype=torch.bfloat16)
    y, yr = lin(xa), ref(xr)
    y.backward(g)
    yr.backward(g)
    assert sqnr(y.float(), yr.float()) >= 18
    assert sqnr(xa.grad.float(), xr.grad.float()) >= 17
    assert sqnr(lin.weight.grad.float(), ref.weight.grad.float()) >= 17


def test_compiled_matches_eager_on_cuda():
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).cuda()
    eager = convert_to_float8(base, RECIPE)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True)
    x = torch.randn(128, 256, device="cuda")
    for _ in range(3):
        with autocast():
            ye, yc = eager(x), compiled(x)
            ye.sum().backward()
            yc.sum().backward()
        assert torch.equal(ye, yc)
        assert torch.equal(eager[0].fp8_amax_history, twin[0].fp8_amax_history)
        assert torch.equal(eager[2].fp8_scale, twin[2].fp8_scale)


def test_training_step_in_a_cuda_graph():
    torch.manual_seed(0)
    model = convert_to_float8(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                                  torch.nn.Linear(256, 256)).cuda(), RECIPE)
    x = torch.randn(64, 256, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: replays must see the same inputs

    def step():
        with autocast():
            model(x).square().mean().backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        step()
    before = model[0].fp8_amax_history.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(before, model[0].fp8_amax_history)  # the replay quantized, reduced and updated
    assert torch.isfinite(model[0].weight.grad).all()


def test_jax_primitives_on_the_gpu_inside_jit():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("GPU test: JAX sees no GPU")
    import fp8core.jax as fj

    x = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32) * 50
    xg = jax.device_put(x, jax.devices("gpu")[0])
    q, a = jax.jit(lambda v: fj.quantize(v, 2.0, "e4m3"))(xg)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), fp8core.quantize(x, 2.0, "e4m3").view(np.uint8))
    assert np.asarray(a)[0] == np.abs(x).max()


# ---- module transforms across devices, against twins that were not put through them (issue 14) ---------------

from test_torch_transforms import fp8_modules, make, same, snapshot, train  # noqa: E402


def cuda_twin(dtype=torch.float32):
    """make()'s model made on CUDA in ``dtype`` and converted there (never moved nor cast), holding make()'s initial
    weights: for one seed CUDA's generator draws other numbers than the CPU's, so they are copied from a CPU
    make() (in place: the twin goes through no module transform)."""
    twin = make(device="cuda", dtype=dtype)
    with torch.no_grad():
        for p, q in zip(twin.parameters(), make().parameters(), strict=True):
            p.copy_(q)
    return twin


@pytest.mark.parametrize("move", [lambda m: m.cuda(), lambda m: m.to("cuda"), lambda m: m.to(torch.device("cuda:0"))],
                         ids=["cuda", "to_cuda", "to_device"])
def test_cuda_after_conversion(move):
    model, twin = move(make()), cuda_twin()
    for m in fp8_modules(model):
        assert m.fp8_amax_history.is_cuda and m.fp8_amax_history.dtype == torch.float32
    assert same(train(model, 3, 1, device="cuda"), train(twin, 3, 1, device="cuda"))
    assert same(snapshot(model), snapshot(twin))  # before: the update wrote the old CPU buffer


def test_cpu_and_back_keeps_the_state():
    model, twin = cuda_twin(), cuda_twin()
    train(model, 2, 0, device="cuda"), train(twin, 2, 0, device="cuda")
    model.cpu()
    assert all(not m.fp8_scale.is_cuda for m in fp8_modules(model))
    model.cuda()
    assert same(snapshot(model), snapshot(twin))
    assert same(train(model, 2, 1, device="cuda"), train(twin, 2, 1, device="cuda"))
    assert same(snapshot(model), snapshot(twin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_then_cast_equals_cast_then_convert(dtype):
    model = make().cuda().to(dtype)
    twin = cuda_twin(dtype)
    assert {m.fp8_scale.dtype for m in fp8_modules(model)} == {torch.float32}
    assert same(train(model, 3, 1, dtype=dtype, device="cuda"), train(twin, 3, 1, dtype=dtype, device="cuda"))
    assert same(snapshot(model), snapshot(twin))


def test_meta_to_empty_on_cuda_then_load_state_dict():
    twin = cuda_twin()
    train(twin, 2, 0, device="cuda")
    with torch.device("meta"):
        model = make()
    model.to_empty(device="cuda")
    model.load_state_dict(twin.state_dict())
    assert same(train(model, 2, 1, device="cuda"), train(twin, 2, 1, device="cuda"))
    assert same(snapshot(model), snapshot(twin))


def test_the_state_follows_parameters_moved_one_by_one():
    # FSDP2's fully_shard moves parameters with tensor.data = tensor.to(device); the state follows at the forward
    model, twin = make(), cuda_twin()
    for p in model.parameters():
        p.data = p.data.cuda()
    assert same(train(model, 2, 1, device="cuda"), train(twin, 2, 1, device="cuda"))
    assert same(snapshot(model), snapshot(twin))


def test_a_cuda_model_and_a_cpu_model_in_one_process():
    gpu, cpu = cuda_twin(), make(seed=3)
    gpu_alone, cpu_alone = cuda_twin(), make(seed=3)
    for i in range(2):
        train(gpu, 1, 10 + i, device="cuda")
        train(cpu, 1, 20 + i)
        train(gpu_alone, 1, 10 + i, device="cuda")
        train(cpu_alone, 1, 20 + i)
    assert same(snapshot(gpu), snapshot(gpu_alone)) and same(snapshot(cpu), snapshot(cpu_alone))


@pytest.mark.parametrize("recipe", [RECIPE, fp8core.MXFP8BlockScaling()], ids=["delayed", "mxfp8"])
def test_cuda_without_cupy_is_a_clear_error_eager_and_compiled(monkeypatch, recipe):
    import sys

    from fp8core import _tensor

    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError, as without fp8core[cuda13]
    monkeypatch.setattr(_tensor, "_cupy", None)
    lin = Float8Linear(32, 32, device="cuda", recipe=recipe)
    x = torch.randn(4, 32, device="cuda")
    for run in (lin, torch.compile(lin, fullgraph=True)):  # compiled: the op raises it when the graph runs
        # named by what needs it: the delayed recipe's state ("device: 'cuda:0' needs CuPy") or the kernels' input
        with autocast(), pytest.raises(RuntimeError, match="needs CuPy.*cuda13"):
            run(x)


def test_an_nvfp4_layer_keeps_its_random_state_in_host_memory_on_the_gpu():
    """Stochastic rounding's (seed, offset) stays on the host when the layer moves to the GPU (as torch's CUDA
    generator keeps its own), so the quantize ops read it without waiting for the GPU; its value moves intact."""
    lin = Float8Linear(32, 32, recipe=fp8core.NVFP4BlockScaling())
    before = lin.fp4_rng.clone()
    lin = lin.cuda()
    assert lin.weight.is_cuda and lin.fp4_rng.device.type == "cpu" and torch.equal(lin.fp4_rng, before)
    assert lin.state_dict()["fp4_rng"].device.type == "cpu"


def test_nvfp4_quantize_reads_a_state_on_the_gpu_without_waiting_for_it():
    """A (seed, offset) state on the GPU is read by the kernel and advanced by a device op (torch's sync debug mode
    raises on any wait), with the bytes of the same state in host memory (by value) and of the CPU reference."""
    from fp8core.torch import fp4_ops

    g = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    host = torch.tensor([2 ** 62 + 7, -1], dtype=torch.int64)  # offset 2**64 - 1: + 2 wraps to 1
    device_state = host.cuda()
    torch.cuda.current_stream().synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        saved, after = fp4_ops.advance_rng(device_state, 2)
        opts = dict(hadamard=True, stochastic=True, stream=1, columnwise=True)
        by_pointer = fp4_ops.quantize_nvfp4(g, rng=saved, **opts)
        by_value = fp4_ops.quantize_nvfp4(g, rng=host, **opts)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    cpu = fp8core.quantize_nvfp4(g.cpu(), hadamard=True, rounding="stochastic", seed=2 ** 62 + 7, offset=0,
                                 columnwise=True)
    for a, b, c in zip(by_pointer, by_value, cpu):
        a, b = a.cpu().view(torch.uint8), b.cpu().view(torch.uint8)
        assert torch.equal(a, b) and torch.equal(a, c.view(torch.uint8))
    assert after.cpu().tolist() == [2 ** 62 + 7, 1] and saved.is_cuda


@pytest.mark.skipif(torch.cuda.is_available() and not 100 <= 10 * torch.cuda.get_device_capability()[0] < 130,
                    reason="NVFP4 training needs cuBLASLt's FP4 GEMM: compute capability 10.x-12.x")
def test_an_nvfp4_layer_whose_state_fsdp2_moved_to_the_gpu_trains_like_its_host_twin_without_waiting():
    """FSDP2 moves buffers itself (buf.data = buf.to(device)): the layer's fp4_rng then lives on the GPU, read there
    by the kernels and advanced there, with no wait, and the run gives the bits of its twin whose state stayed in
    host memory."""
    runs = []
    for move in (False, True):
        torch.manual_seed(0)
        lin = Float8Linear(64, 64, recipe=fp8core.NVFP4BlockScaling(), device="cuda")
        if move:
            lin.fp4_rng.data = lin.fp4_rng.to("cuda")
        xs = [torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(i)) for i in range(3)]
        torch.cuda.current_stream().synchronize()
        torch.cuda.set_sync_debug_mode("error" if move else "default")
        try:
            for x in xs:
                with autocast():
                    lin(x).square().mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        runs.append((lin.weight.grad.clone(), lin.fp4_rng.device.type, [int(v) for v in lin.fp4_rng.cpu()]))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][2] == runs[1][2] == [runs[0][2][0], 6]
    assert (runs[0][1], runs[1][1]) == ("cpu", "cuda")
