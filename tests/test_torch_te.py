"""``import fp8core.torch as te``: Transformer Engine's documented usage, written as a TE user writes it.

``te.Linear(in, out, bias=..., params_dtype=..., device=...)`` takes its recipe from the autocast it runs in, as in
TE. Each pattern is checked bit for bit against its twin: a Float8Linear given the same recipe at construction
(the path that does not adopt a recipe), with the same weights and inputs."""

import os

import pytest

torch = pytest.importorskip("torch")

import fp8core  # noqa: E402
import fp8core.torch as te  # noqa: E402
from fp8core.torch import Float8Linear  # noqa: E402
from ranks import WORLD, init_group, spawn  # noqa: E402

HISTORY_MAX = te.recipe.DelayedScaling(fp8_format=te.recipe.Format.HYBRID, amax_history_len=1024,
                                       amax_compute_algo="max")


def bits(t):
    if not t.is_floating_point():
        return t.detach()
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_bits_equal(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(bits(a), bits(b)), what


def twin_of(layer, recipe):
    twin = Float8Linear(layer.in_features, layer.out_features, layer.bias is not None, dtype=layer.weight.dtype,
                        recipe=recipe)
    with torch.no_grad():
        twin.weight.copy_(layer.weight)
        if layer.bias is not None:
            twin.bias.copy_(layer.bias)
    return twin


def train(layer, recipe, steps, autocast_kwargs=None):
    """TE's loop: forward and backward inside ``te.autocast(enabled=True, recipe=recipe)``, then the optimizer."""
    opt = torch.optim.SGD(layer.parameters(), lr=0.01)
    outs = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        inp = (torch.randn(32, layer.in_features, generator=g) * (1 + 4 * step)).to(torch.bfloat16)
        with te.autocast(enabled=True, recipe=recipe, **(autocast_kwargs or {})):
            out = layer(inp)
            out.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append(out.detach())
    return outs


@pytest.mark.parametrize("recipe", [HISTORY_MAX, te.recipe.Float8CurrentScaling(), te.recipe.DelayedScaling()],
                         ids=["delayed_history1024_max", "current", "delayed_default"])
def test_te_linear_trains_like_float8linear_given_the_recipe(recipe):
    torch.manual_seed(0)
    layer = te.Linear(64, 128, bias=True, params_dtype=torch.bfloat16)
    twin = twin_of(layer, recipe)
    assert layer.weight.dtype == layer.bias.dtype == torch.bfloat16
    got, want = train(layer, recipe, 4), train(twin, recipe, 4)
    assert layer.recipe == recipe
    for step, (a, b) in enumerate(zip(got, want)):
        assert_bits_equal(a, b, f"output of step {step}")
    assert_bits_equal(layer.weight, twin.weight, "weight after 4 steps")
    assert_bits_equal(layer.bias, twin.bias, "bias after 4 steps")
    assert layer.state_dict().keys() == twin.state_dict().keys()
    if isinstance(recipe, fp8core.DelayedScaling):
        assert layer.fp8_amax_history.shape == (recipe.amax_history_len, 3)
        for name in ("fp8_amax_history", "fp8_scale", "fp8_scale_inv"):
            assert_bits_equal(getattr(layer, name), getattr(twin, name), name)
        assert layer.fp8_scale[0] != 1.0  # the scales moved: the layer really ran in fp8 under this recipe
    else:
        assert not any(k.startswith("fp8_") for k in layer.state_dict())  # stateless: nothing kept


def test_te_linear_constructor_arguments():
    layer = te.Linear(32, 16, bias=False, params_dtype=torch.float16, device="cpu")
    assert layer.bias is None and layer.weight.dtype == torch.float16 and layer.weight.device.type == "cpu"
    assert layer.weight.shape == (16, 32)
    assert te.Linear(32, 16).weight.dtype == torch.get_default_dtype()
    meta = te.Linear(32, 16, device="meta")
    assert meta.weight.is_meta and meta.bias.is_meta
    init = te.Linear(32, 16, init_method=lambda w: torch.nn.init.constant_(w, 0.5))
    assert torch.all(init.weight == 0.5) and torch.all(init.bias == 0)  # TE's rule: the bias starts at zero


def test_te_linear_refuses_bad_arguments_by_name():
    with pytest.raises(TypeError, match="params_dtype: expected a floating-point torch.dtype, got torch.int32"):
        te.Linear(32, 16, params_dtype=torch.int32)
    with pytest.raises(TypeError, match="^sequence_parallel, tp_group: Transformer Engine's Linear arguments"):
        te.Linear(32, 16, tp_group=None, sequence_parallel=True)
    with pytest.raises(TypeError, match="unexpected keyword argument.*bogus"):
        te.Linear(32, 16, bogus=1)
    with pytest.raises(ValueError, match="in_features: 20 is not a positive multiple of 16"):
        te.Linear(20, 16)


def test_te_linear_keeps_the_recipe_of_its_first_autocast():
    layer = te.Linear(32, 32, params_dtype=torch.bfloat16)
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        layer(x)
    with pytest.raises(ValueError, match="which it took from its first autocast; the autocast's DelayedScaling"):
        with te.autocast(recipe=HISTORY_MAX):
            layer(x)
    fixed = te.Linear(32, 32, recipe=HISTORY_MAX)
    with pytest.raises(ValueError, match="which it was given; the autocast's Float8CurrentScaling"):
        with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
            fixed(x.float())


def test_te_linear_adopts_a_block_recipe_only_where_its_features_allow():
    layer = te.Linear(48, 32)  # 48: a multiple of 16, not of 32
    with pytest.raises(ValueError, match="in_features: 48 is not a positive multiple of 32 under MXFP8BlockScaling"):
        with te.autocast(recipe=te.recipe.MXFP8BlockScaling()):
            layer(torch.randn(4, 48))
    assert layer.recipe == fp8core.DelayedScaling()  # refused: nothing adopted


def test_te_linear_outside_autocast_is_nn_linear():
    layer = te.Linear(32, 16, params_dtype=torch.bfloat16)
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert_bits_equal(layer(x), want, "outside autocast")
    with te.autocast(enabled=False, recipe=HISTORY_MAX):
        assert_bits_equal(layer(x), want, "autocast(enabled=False)")
    assert layer.recipe_from_autocast  # no fp8 step yet: the recipe is still open


# ---- te.autocast(recipe=recipe, amax_reduction_group=group) on 2 CPU processes ---------------------------------

def rank_batch(step, rank):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(WORLD * 16, 32, generator=g) * (1 + 2 * step)
    x[16:] *= 7  # rank 1 sees the larger amaxes: without the reduction rank 0's state would differ
    return x[rank * 16:(rank + 1) * 16].to(torch.bfloat16)


def _te_rank_main(rank, out_dir):
    import torch.distributed as dist

    init_group(rank, out_dir)
    group = dist.new_group(ranks=list(range(WORLD)))
    torch.manual_seed(0)
    model = te.Linear(32, 32, bias=True, params_dtype=torch.bfloat16)
    for step in range(3):
        with te.autocast(enabled=True, recipe=HISTORY_MAX, amax_reduction_group=group):
            out = model(rank_batch(step, rank))
            out.float().sum().backward()
    torch.save({k: v for k, v in model.state_dict().items() if k.startswith("fp8_")},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_te_autocast_amax_reduction_group_on_two_processes(tmp_path):
    spawn(_te_rank_main, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    # the twin: one process, one Float8Linear given the recipe, both ranks' micro-batches in each autocast
    torch.manual_seed(0)
    ref = Float8Linear(32, 32, dtype=torch.bfloat16, recipe=HISTORY_MAX)
    alone = te.Linear(32, 32, params_dtype=torch.bfloat16)  # rank 0's data alone: what no reduction would give
    with torch.no_grad():
        alone.weight.copy_(ref.weight)
        alone.bias.copy_(ref.bias)
    for step in range(3):
        with te.autocast(recipe=HISTORY_MAX):
            for r in range(WORLD):
                ref(rank_batch(step, r)).float().sum().backward()
        with te.autocast(recipe=HISTORY_MAX):
            alone(rank_batch(step, 0)).float().sum().backward()
    want = {k: v for k, v in ref.state_dict().items() if k.startswith("fp8_")}
    for r, got in enumerate(ranks):
        assert got.keys() == want.keys()
        for k in want:
            assert_bits_equal(got[k], want[k], f"rank {r}'s {k}")
    assert not torch.equal(ranks[0]["fp8_scale"], alone.fp8_scale)  # the reduction changed rank 0's scales
