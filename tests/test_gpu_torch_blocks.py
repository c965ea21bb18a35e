"""Float8Linear under the block-scaling recipes on CUDA (issue 17): the CPU module is the oracle (its quantizations
are bit-exact and its GEMM emulation exact in float64; cuBLASLt accumulates in fp32, so the GEMM outputs agree to
within fp32 accumulation), compile against eager, and the outlier gap of test_torch_block_linear.py on the GPU.
Skipped, with the reason, where there is no GPU."""

import copy

import pytest

from conftest import requires_gpu

pytestmark = requires_gpu
torch = pytest.importorskip("torch")

import fp8core  # noqa: E402
from fp8core.torch import Float8Linear, autocast, convert_to_float8  # noqa: E402

from test_torch_block_linear import PER_TENSOR, outlier_layer, sqnr  # noqa: E402

RECIPES = [fp8core.MXFP8BlockScaling(), fp8core.Float8BlockScaling()]
IDS = ["mxfp8", "blocks"]


def refused(recipe) -> bool:
    """True, after checking the refusal by name, where this GPU has no cuBLASLt GEMM for the recipe's blocks
    (MXFP8: compute capability 10.0 and newer; 1x128/128x128: 9.0 only)."""
    major, minor = torch.cuda.get_device_capability()
    cc = 10 * major + minor
    mx = isinstance(recipe, fp8core.MXFP8BlockScaling)
    why = ("compute capability 10.0" if cc < 100 else "") if mx else ("compute capability 9.0" if cc != 90 else "")
    if why:
        lin = Float8Linear(256, 128, recipe=recipe).cuda()
        with pytest.raises(ValueError, match=f"needs a GPU of {why}"), autocast():
            lin(torch.randn(128, 256, device="cuda"))
    return bool(why)


def run(lin, x, g):
    x = x.clone().requires_grad_()
    with autocast():
        y = lin(x)
        y.backward(g)
    return y.detach().float().cpu(), x.grad.float().cpu(), lin.weight.grad.float().cpu(), lin.bias.grad.cpu()


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_cuda_module_against_the_cpu_module(recipe):
    if refused(recipe):
        return
    torch.manual_seed(0)
    cpu = Float8Linear(512, 256, recipe=recipe, dtype=torch.bfloat16)
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(3, 100, 512, dtype=torch.bfloat16)  # 300 tokens: padded for the wgrad GEMM
    g = torch.randn(3, 100, 256, dtype=torch.bfloat16)
    got, want = run(gpu, x.cuda(), g.cuda()), run(cpu, x, g)
    for a, b in zip(got[:3], want[:3]):
        assert sqnr(a, b) >= 45  # bf16 outputs of the same fp8 operands: one bf16 rounding apart at most
    assert torch.equal(got[3], want[3])  # db is summed in float64 on both


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_compiled_matches_eager_on_cuda(recipe):
    if refused(recipe):
        return
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).cuda()
    eager = convert_to_float8(base, recipe)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True)
    x = torch.randn(128, 256, device="cuda")
    for _ in range(2):
        with autocast():
            ye, yc = eager(x), compiled(x)
            ye.sum().backward()
            yc.sum().backward()
        assert torch.equal(ye, yc)
        for pe, pc in zip(eager.parameters(), twin.parameters()):
            assert torch.equal(pe.grad, pc.grad)


def test_block_scaling_beats_per_tensor_scaling_on_outlier_channels_on_cuda():
    ref, x = outlier_layer(3e4)
    ref, x = ref.cuda(), x.cuda()
    out = []
    for recipe in (PER_TENSOR, *RECIPES):
        if recipe is not PER_TENSOR and refused(recipe):
            out.append(None)
            continue
        lin = Float8Linear.from_linear(copy.deepcopy(ref), recipe)
        with autocast():
            out.append(sqnr(lin(x).detach(), ref(x).detach()))
    per_tensor, mx, blockwise = out
    assert (mx is None or mx > per_tensor + 9) and (blockwise is None or blockwise > per_tensor + 7), out
