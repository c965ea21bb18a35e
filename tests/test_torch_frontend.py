"""fp8core.torch on the CPU: custom ops (opcheck, compile, argument checks), Float8Linear against nn.Linear,
training, autocast (gradient accumulation, did-not-run), state_dict. test_torch_transforms.py: module transforms;
test_torch_distributed.py: DDP and FSDP2; test_gpu_torch.py: the device-specific parts on CUDA."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fp8core  # noqa: E402
from fp8core.torch import Float8Linear, autocast, convert_to_float8, ops  # noqa: E402
from twins import train_beside  # noqa: E402

RECIPE = fp8core.DelayedScaling(amax_history_len=16)
MXFP8, BLOCKS = fp8core.MXFP8BlockScaling(), fp8core.Float8BlockScaling()


def sqnr(x, ref):
    return (20 * torch.log10(ref.norm() / (x - ref).norm())).item()


def mlp(d_in=64, hidden=128, d_out=32, seed=0, act=torch.nn.GELU):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), act(), torch.nn.Linear(hidden, d_out))


def fp8_state(model):
    """Every Float8Linear's history, scale and scale_inv, flat, in module order."""
    return torch.cat([t.reshape(-1) for m in model.modules() if isinstance(m, Float8Linear)
                      for t in (m.fp8_amax_history, m.fp8_scale, m.fp8_scale_inv)])


def bits(t):
    return t.detach().contiguous().view(torch.uint8 if t.element_size() == 1 else torch.int32
                                        if t.element_size() == 4 else torch.int16)


# ---- the custom ops -----------------------------------------------------------------------------------------

def _op_cases():
    x = torch.randn(32, 48)
    s, a = torch.tensor([2.0]), torch.zeros(1)
    q = fp8core.quantize(x, 1.0, "e4m3")
    w = fp8core.quantize(torch.randn(16, 48), 1.0, "e5m2")
    st = fp8core.ScalingState(4, fp8core.DelayedScaling(amax_history_len=3))
    st.amax_history[...] = np.random.default_rng(0).uniform(0, 10, (3, 4)).astype(np.float32)
    h = torch.from_numpy(st.amax_history.copy())
    return [
        (torch.ops.fp8core.amax, (x,)),
        (torch.ops.fp8core.quantize, (x, s, "e4m3")),
        (torch.ops.fp8core.quantize_amax, (x, s, "e5m2", a)),
        (torch.ops.fp8core.quantize_dynamic, (x, "e4m3", 1, True, 0.0)),
        (torch.ops.fp8core.dequantize, (q, s, torch.bfloat16)),
        (torch.ops.fp8core.transpose, (q,)),
        (torch.ops.fp8core.cast_transpose, (x, s, "e4m3")),
        (torch.ops.fp8core.cast_transpose_amax, (x, s, "e4m3", a)),
        (torch.ops.fp8core.compute_scale, (torch.tensor([3.0, 0.0]), "e4m3", 0, False, 0.0)),
        (torch.ops.fp8core.gemm, (q, w, s, s, torch.float32, None, None, False)),
        (torch.ops.fp8core.gemm_amax, (q, w, s, s, torch.float8_e4m3fn, None, s, a, False)),
        (torch.ops.fp8core.update, (h, torch.ones(4), torch.ones(4), torch.full((4,), 448.0),
                                    torch.zeros(4, dtype=torch.bool), 0, "max", False, 0.0, True)),
    ]


@pytest.mark.parametrize("op,args", _op_cases(), ids=lambda v: str(v).split(".")[-1] if callable(v) else "")
def test_custom_op_schema_fake_and_autograd_registration(op, args):
    utils = ["test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration"]
    if not any(isinstance(a, torch.Tensor) and a.element_size() == 1 and a.is_floating_point() for a in args):
        utils.append("test_schema")  # the schema checker does arithmetic that torch lacks for fp8 on the CPU
    torch.library.opcheck(op, args, test_utils=utils)


def test_an_op_has_no_gradient_and_says_so_on_backward():
    x = torch.randn(8, 16, requires_grad=True)
    a = ops.amax(x)
    assert a.requires_grad  # as torch.library.custom_op's ops: the graph reaches the op, whose backward refuses
    with pytest.raises(RuntimeError, match="backward through fp8core::amax but no autograd formula"):
        a.sum().backward()
    with torch.no_grad():
        assert not ops.amax(x).requires_grad
    assert not ops.amax(x.detach()).requires_grad


def test_the_direct_and_the_dispatched_body_agree():
    """Plain tensors go from the op's Autograd kernel straight to its body; under a dispatch mode (as under
    torch.compile's tracing) the op is dispatched on to it. Both give the same bits and write the same slot."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x, s = torch.randn(24, 48, dtype=torch.bfloat16), torch.tensor([0.5])
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    slot_direct, slot_dispatched = torch.full((1,), 3.0), torch.full((1,), 3.0)
    version = slot_direct._version
    direct = ops.cast_transpose(x, s, "e5m2", slot_direct)
    assert slot_direct._version > version  # the write is seen by autograd, as an in-place op's
    with Seen() as seen:
        dispatched = ops.cast_transpose(x, s, "e5m2", slot_dispatched)
    assert "fp8core.cast_transpose_amax.default" in seen.ops
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(direct, dispatched))
    assert torch.equal(bits(slot_direct), bits(slot_dispatched)) and slot_direct.isnan().all()  # NaN propagates
    assert torch.equal(bits(direct[0]), bits(fp8core.quantize(x, s, "e5m2")))


def test_ops_give_the_core_bits_eager_and_compiled():
    x, s = torch.randn(48, 64), torch.tensor([0.5])

    def f(x, s, slot):
        q, qt = ops.cast_transpose(x, s, "e4m3", slot)
        return q, qt, ops.dequantize(q, s, torch.float32), ops.gemm(q, q, s, s, torch.bfloat16)

    slot_e, slot_c = torch.zeros(1), torch.zeros(1)
    eager = f(x, s, slot_e)
    compiled = torch.compile(f, fullgraph=True)(x, s, slot_c)
    core_q, core_qt = fp8core.cast_transpose(x, s, "e4m3")
    assert torch.equal(bits(eager[0]), bits(core_q)) and torch.equal(bits(eager[1]), bits(core_qt))
    for e, c in zip(eager, compiled):
        assert torch.equal(bits(e), bits(c))
    assert slot_e.item() == slot_c.item() == x.abs().max().item()


# ---- Float8Linear -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [RECIPE, fp8core.Float8CurrentScaling(), MXFP8, BLOCKS,
                                    fp8core.MXFP8BlockScaling(fp8core.Format.HYBRID, "floor"),
                                    fp8core.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)],
                         ids=["delayed", "current", "mxfp8", "blocks", "mxfp8_hybrid_floor", "blocks_x128x128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float8_linear_against_nn_linear(recipe, dtype):
    torch.manual_seed(1)
    ref = torch.nn.Linear(256, 128, dtype=dtype)
    lin = Float8Linear.from_linear(copy.deepcopy(ref), recipe)
    x = torch.randn(4, 33, 256, dtype=dtype)  # 132 tokens: padded to 144, 160 or 256 for the wgrad GEMM
    for _ in range(2):  # the second step runs on scales learned from the first
        with autocast():
            xa = x.clone().requires_grad_()
            y = lin(xa)
            lin.zero_grad()
            y.backward(torch.randn_like(y))
    torch.manual_seed(7)
    g = torch.randn(4, 33, 128, dtype=dtype)
    xa, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    lin.zero_grad()
    y, yr = lin(xa), ref(xr)
    y.backward(g)
    yr.backward(g)
    assert y.dtype == dtype and y.shape == yr.shape
    assert sqnr(y.float(), yr.float()) >= 18
    assert sqnr(xa.grad.float(), xr.grad.float()) >= 17
    assert sqnr(lin.weight.grad.float(), ref.weight.grad.float()) >= 17
    assert torch.allclose(lin.bias.grad.float(), ref.bias.grad.float(), rtol=1e-2, atol=1e-2)
    assert lin.weight.dtype == dtype  # master weights stay in their precision


@pytest.mark.parametrize("recipe", [RECIPE, MXFP8, BLOCKS], ids=["delayed", "mxfp8", "blocks"])
def test_compiled_mlp_forward_and_backward_match_eager_bits(recipe):
    # ReLU and a sum loss: torch's own elementwise ops are then exact, so any difference would be fp8core's
    d = 128 if recipe is BLOCKS else 64
    eager = convert_to_float8(mlp(d, 128, d // 2 if recipe is RECIPE else d, act=torch.nn.ReLU), recipe)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True)
    x = torch.randn(48, d)
    for _ in range(3):
        with autocast():
            ye, yc = eager(x), compiled(x)
            ye.sum().backward()
            yc.sum().backward()
        assert torch.equal(bits(ye), bits(yc))
        for pe, pc in zip(eager.parameters(), twin.parameters()):
            assert torch.equal(bits(pe.grad), bits(pc.grad))
        for a, b in zip(eager.modules(), twin.modules()):
            if isinstance(a, Float8Linear) and a._fp8_group is not None:
                assert torch.equal(bits(a.fp8_amax_history), bits(b.fp8_amax_history))
                assert torch.equal(bits(a.fp8_scale), bits(b.fp8_scale))


def _names(code):
    """Every global and attribute name a code object and the code nested in it use."""
    nested = (c for c in code.co_consts if hasattr(c, "co_names"))
    return set(code.co_names).union(*(_names(c) for c in nested))


def test_what_compile_traces_of_a_layer_is_the_same_python_on_every_device():
    """torch.compile traces Float8Linear's forward and backward, and the tests here compile them on the CPU only:
    a branch on the device in that Python would be traced first on a GPU. One was (a CuPy lookup with
    importlib.util.find_spec, which torch 2.11's dynamo refuses: CUDA's fullgraph compile failed). The device's
    needs are met inside the ops, which are not traced."""
    from fp8core.torch import block_linear, fp4_linear, linear, linear_function, rowwise_linear, te

    traced = [linear.Float8Linear.forward, te.Linear.forward, linear._Float8Matmul.forward,
              linear._Float8Matmul.backward, linear._cast, linear._weight_cast,
              linear_function.LinearFunction.forward, linear_function.LinearFunction.backward, linear_function._run,
              linear_function.padded, block_linear.quantize, rowwise_linear.quantize, fp4_linear.quantize,
              fp4_linear._quantize]
    for fn in traced:
        assert not _names(fn.__code__) & {"is_cuda", "importlib", "find_spec", "import_module", "__import__"}, \
            fn.__qualname__


def test_a_cuda_tensor_without_cupy_is_refused_by_name_inside_the_ops(monkeypatch):
    """What Float8Linear's forward does not check (above): the core refuses it where the first op reads the tensor,
    eager or compiled alike. A fake CUDA tensor (no GPU here) reaches that boundary as a real one does."""
    import sys

    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8core import _tensor

    with FakeTensorMode():
        x = torch.empty(16, 32, device="cuda")
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError, as without fp8core[cuda13]
    monkeypatch.setattr(_tensor, "_cupy", None)
    for call in (lambda: fp8core.amax(x), lambda: fp8core.quantize(x, 2.0, "e4m3")):
        with pytest.raises(RuntimeError, match=r"^x: a CUDA array needs CuPy for fp8core's kernels.*fp8core\[cuda13\]"):
            call()


def test_convert_to_float8_skips_what_the_gemm_cannot_take_and_honours_the_filter():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 10), torch.nn.Linear(10, 32),
                                torch.nn.Linear(32, 32))
    with pytest.warns(UserWarning, match=r"1 \(64 -> 10\), 2 \(10 -> 32\)"):
        convert_to_float8(model, RECIPE, module_filter_fn=lambda m, fqn: fqn != "3")
    assert [type(m).__name__ for m in model] == ["Float8Linear", "Linear", "Linear", "Linear"]
    with pytest.raises(ValueError, match="in_features: 24"):
        Float8Linear(24, 32)
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        Float8Linear(32, 32, recipe=fp8core.DelayedScaling(fp8_format=fp8core.Format.E5M2))


@pytest.mark.parametrize("recipe,multiple,why", [(MXFP8, 32, "whole 1x32 blocks"), (BLOCKS, 128, "128-element")])
def test_convert_to_float8_under_block_recipes_keeps_what_the_block_gemm_cannot_take(recipe, multiple, why):
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 80), torch.nn.Linear(80, 256),
                                torch.nn.Linear(256, 64))
    kept = {32: r"1 \(128 -> 80\), 2 \(80 -> 256\)$", 128: r"1 \(128 -> 80\), 2 \(80 -> 256\), 3 \(256 -> 64\)$"}
    with pytest.warns(UserWarning, match=f"not multiples of {multiple} under {type(recipe).__name__} .*{why}.*: "
                                         + kept[multiple]):
        convert_to_float8(model, recipe)
    assert [isinstance(m, Float8Linear) for m in model] == [True, False, False, multiple == 32]
    assert model[0].recipe is recipe and model[0].state_dict().keys() == {"weight", "bias"}


@pytest.mark.parametrize("recipe", [RECIPE, fp8core.Float8CurrentScaling(), MXFP8, BLOCKS],
                         ids=["delayed", "current", "mxfp8", "blocks"])
def test_outside_autocast_or_disabled_runs_exactly_nn_linear(recipe):
    # Transformer Engine's rule: fp8 only inside autocast, where the scales are kept up to date. Inputs near
    # 1e-3 would underflow with a scale that never left 1.0 (relative error 0.54 before this rule).
    lin = Float8Linear(128, 128, recipe=recipe)
    x = torch.randn(16, 128) * 1e-3
    ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
    with autocast(enabled=False):
        assert torch.equal(lin(x), ref)
    assert torch.equal(lin(x), ref)
    with autocast():
        with autocast(enabled=False):
            assert torch.equal(lin(x), ref)
        y = lin(x)
    assert not torch.equal(y, ref)  # inside: fp8
    if isinstance(recipe, fp8core.DelayedScaling):
        assert lin.fp8_scale[0].item() == pytest.approx(448 / x.abs().max().item(), rel=1e-6)
    assert torch.equal(lin(x), ref)  # and outside again: high precision


# ---- delayed scaling under autocast -------------------------------------------------------------------------

def test_gradient_accumulation_takes_the_max_over_micro_batches():
    model = convert_to_float8(mlp(), RECIPE)
    xs = [torch.randn(32, 64) * s for s in (1.0, 5.0, 0.5)]
    with autocast():
        for x in xs:
            model(x).sum().backward()
        row0 = model[0].fp8_amax_history[0].clone()
    assert row0[0].item() == max(x.abs().max().item() for x in xs)  # input amax of layer 0
    history = model[0].fp8_amax_history
    L = RECIPE.amax_history_len
    assert torch.equal(history[L - 1], row0) and history[0].abs().sum() == 0  # rolled once, row 0 cleared
    assert model[0].fp8_scale[0].item() == pytest.approx(448.0 / row0[0].item(), rel=1e-6)


def test_a_module_that_did_not_run_keeps_its_scale():
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

        def forward(self, x, head):
            return self.a(x) if head == "a" else self.b(x)

    model = convert_to_float8(TwoHeads(), RECIPE)
    with autocast():
        model(torch.randn(16, 32), "b").sum().backward()
    before_a, before_b = model.a.fp8_scale.clone(), model.b.fp8_scale.clone()
    hist_b = model.b.fp8_amax_history.clone()
    with autocast():
        model(torch.randn(16, 32) * 3, "a").sum().backward()
    assert torch.equal(model.b.fp8_scale, before_b) and torch.equal(model.b.fp8_amax_history, hist_b)
    assert not torch.equal(model.a.fp8_scale, before_a)


def test_state_dict_round_trip_gives_identical_bits(tmp_path):
    model = convert_to_float8(mlp(), RECIPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(4):
        with autocast():
            model(torch.randn(32, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    fresh = convert_to_float8(mlp(seed=99), RECIPE)
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    assert torch.equal(bits(fp8_state(fresh)), bits(fp8_state(model)))
    x = torch.randn(32, 64)
    with autocast():
        a, b = model(x), fresh(x)
    assert torch.equal(bits(a), bits(b))
    assert torch.equal(bits(fp8_state(fresh)), bits(fp8_state(model)))  # the same update


def test_training_200_steps_tracks_the_fp32_loss():
    torch.manual_seed(0)
    teacher = mlp(32, 64, 16, seed=5)
    ref = mlp(32, 64, 16, seed=3)
    fp8 = convert_to_float8(copy.deepcopy(ref), fp8core.DelayedScaling(amax_history_len=16))
    losses = train_beside(ref, fp8, teacher, lambda: torch.randn(64, 32), steps=200, lr=3e-3)
    first, last = np.mean(losses[:10], axis=0), np.mean(losses[-20:], axis=0)
    assert last[0] < 0.2 * first[0]  # the task is learnt
    assert abs(last[1] - last[0]) <= 0.25 * last[0] + 1e-3, f"fp32 {last[0]:.4g}, fp8 {last[1]:.4g}"


# ---- torch.ops.fp8core.update checks everything before it launches --------------------------------------------

def _update_args(**over):
    args = dict(history=torch.rand(4, 3) + 1, scale=torch.ones(3), scale_inv=torch.ones(3),
                fp8_max=torch.full((3,), 448.0), non_finite=torch.zeros(3, dtype=torch.bool), margin=0, algo="max",
                power_of_2=False, epsilon=0.0, update_scale=True)
    args.update(over)
    return args


@pytest.mark.parametrize("over,err,match", [
    ({"margin": 10000}, ValueError, r"margin: expected \|margin\| <= 512"),
    ({"algo": "mean"}, ValueError, "algo: expected one of"),
    ({"epsilon": float("inf")}, ValueError, "epsilon"),
    ({"epsilon": -1.0}, ValueError, "epsilon"),
    ({"history": torch.ones(4, 3, dtype=torch.float64)}, TypeError, "history: expected float32, got float64"),
    ({"history": torch.ones(12)}, ValueError, r"history: expected shape \[L, N\]"),
    ({"history": torch.ones(3, 4).t()}, ValueError, "history: expected a contiguous"),
    ({"scale": torch.ones(4)}, ValueError, r"scale: expected shape \(3,\)"),
    ({"scale_inv": torch.ones(3, dtype=torch.bfloat16)}, TypeError, "scale_inv: expected float32"),
    ({"fp8_max": torch.ones(2)}, ValueError, r"fp8_max: expected shape \(3,\)"),
    ({"non_finite": torch.zeros(3)}, TypeError, "non_finite: expected bool, got float32"),
    ({"non_finite": torch.zeros(4, dtype=torch.bool)}, ValueError, "non_finite: expected shape"),
])
def test_update_op_checks_before_it_writes(over, err, match):
    args = _update_args(**over)
    before = [a.clone() for a in args.values() if isinstance(a, torch.Tensor)]
    with pytest.raises(err, match=match):
        torch.ops.fp8core.update(*args.values())
    after = [a for a in args.values() if isinstance(a, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_update_op_matches_scaling_state():
    args = _update_args(margin=1)
    st = fp8core.ScalingState(3, fp8core.DelayedScaling(amax_history_len=4, margin=1),
                              formats=[fp8core.Format.E4M3] * 3)
    st.amax_history[...] = args["history"].numpy()
    torch.ops.fp8core.update(*args.values())
    st.update()
    assert torch.equal(bits(args["history"]), bits(torch.from_numpy(st.amax_history.copy())))
    assert torch.equal(bits(args["scale"]), bits(torch.from_numpy(st.scale.copy())))
