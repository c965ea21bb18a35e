"""fp8core.linear_plan: each recipe's Linear as data (roles, usages, GEMMs, padding, what is saved), framework-free."""

from __future__ import annotations

import pytest

import fp8core
from fp8core.layouts import Layout
from fp8core.linear_plan import Operand, Role, check_plan, linear_plan, padding

X, W, G = Role.INPUT, Role.WEIGHT, Role.GRAD_OUTPUT

RECIPES = {
    "delayed": fp8core.DelayedScaling(),
    "current": fp8core.Float8CurrentScaling(),
    "mxfp8": fp8core.MXFP8BlockScaling(),
    "blocks": fp8core.Float8BlockScaling(),
    "rowwise": fp8core.Float8RowwiseScaling(),
    "rowwise_with_gw_hp": fp8core.Float8RowwiseScaling(wgrad_high_precision=True),
    "nvfp4": fp8core.NVFP4BlockScaling(),
}


@pytest.mark.parametrize("name", RECIPES)
def test_every_plan_runs_the_three_tn_gemms_of_a_linear(name):
    plan = linear_plan(RECIPES[name])
    assert [g.name for g in plan.gemms] == ["fprop", "dgrad", "wgrad"]
    assert [(g.a, g.b) for g in plan.gemms] == [(Operand(X, False), Operand(W, False)),
                                                (Operand(G, False), Operand(W, True)),
                                                (Operand(G, True), Operand(X, True))]
    assert [g.out for g in plan.gemms] == [X, X, W]
    assert [r.role for r in plan.roles] == [X, W, G]
    hash(plan)  # a constant torch.compile and jax's nondiff arguments take
    for g in plan.gemms:  # every fp8 GEMM's operands are quantized in the usage it takes them
        if not g.high_precision:
            assert plan.quantization(g.a) is not None and plan.quantization(g.b) is not None


@pytest.mark.parametrize("fmt,fwd,bwd", [(fp8core.Format.HYBRID, "e4m3", "e5m2"), (fp8core.Format.E4M3, "e4m3", "e4m3")])
def test_per_tensor_plans_keep_the_recipes_formats_and_state_slots(fmt, fwd, bwd):
    delayed = linear_plan(fp8core.DelayedScaling(fp8_format=fmt, margin=2, power_of_2=True, epsilon=0.5))
    assert [r.rowwise.encoding for r in delayed.roles] == [fwd, fwd, bwd]
    assert [r.slot for r in delayed.roles] == [0, 1, 2] and delayed.state == "amax_history"
    assert {r.rowwise.layout for r in delayed.roles} == {Layout.TENSORWISE}
    assert tuple(delayed.scale) == (2, True, 0.5, None)
    current = linear_plan(fp8core.Float8CurrentScaling(fp8_format=fmt, amax_epsilon=0.25))
    assert [r.slot for r in current.roles] == [None] * 3 and current.state is None
    assert current.scale.epsilon == 0.25 and current.multiple == 16


def test_override_linear_precision_marks_gemms_but_keeps_every_cast():
    """Transformer Engine's override: the named GEMMs in high precision, the casts all kept (the histories see
    every tensor); what the forward saves for a high-precision GEMM is the unquantized tensor."""
    recipe = fp8core.DelayedScaling(override_linear_precision=fp8core.OverrideLinearPrecision(False, True, True))
    plan = linear_plan(recipe)
    assert [g.high_precision for g in plan.gemms] == [False, True, True]
    assert all(r.rowwise and r.columnwise for r in plan.roles)
    assert plan.saved() == ((Operand(W, True), True), (Operand(X, True), True))
    assert plan.usages(G, plan.gemms) == (False, False)


def test_rowwise_with_gw_hp_quantizes_no_columnwise_input_nor_gradient():
    plan = linear_plan(RECIPES["rowwise_with_gw_hp"])
    assert [g.high_precision for g in plan.gemms] == [False, False, True]
    assert plan.roles[X].columnwise is None and plan.roles[G].columnwise is None
    assert plan.roles[W].columnwise.layout is Layout.TENSORWISE  # dgrad's weight under one scale
    assert plan.usages(X, plan.gemms) == (True, False) and plan.usages(W, plan.gemms) == (True, True)
    assert plan.saved() == ((Operand(W, True), False), (Operand(X, True), True))
    plain = linear_plan(RECIPES["rowwise"])
    assert plain.saved() == ((Operand(W, True), False), (Operand(X, True), False))
    assert {q.layout for r in plain.roles for q in (r.rowwise, r.columnwise)} == {Layout.ROWWISE}


@pytest.mark.parametrize("flags", [(False, False, False), (True, True, True)])
def test_nvfp4_plan_follows_the_recipes_switches(flags):
    rht_off, sr_off, one_d = flags
    plan = linear_plan(fp8core.NVFP4BlockScaling(disable_rht=rht_off, disable_stochastic_rounding=sr_off,
                                                 disable_2d_quantization=one_d))
    x, w, g = plan.roles
    assert plan.multiple == 32 and plan.state == "rng" and x.rowwise.encoding == "e2m1"
    assert w.rowwise.layout is (Layout.NVFP4_1X16 if one_d else Layout.NVFP4_16X16)
    assert (x.columnwise.hadamard, g.columnwise.hadamard, x.rowwise.hadamard) == (not rht_off, not rht_off, False)
    assert (g.rowwise.stochastic, g.columnwise.stochastic, x.rowwise.stochastic) == (not sr_off, not sr_off, False)
    assert (g.rowwise.stream, g.columnwise.stream) == (0, 1)  # the step's two draws are independent


def test_block_plans_multiples_and_the_tiled_gemm_refusal():
    assert linear_plan(RECIPES["mxfp8"]).multiple == 32
    blocks = linear_plan(RECIPES["blocks"])
    assert blocks.multiple == 128
    assert [r.rowwise.layout for r in blocks.roles] == [Layout.BLOCK_1X128, Layout.BLOCK_128X128, Layout.BLOCK_1X128]
    check_plan(blocks)
    for dims, gemm in (((2, 2, 1), "forward"), ((1, 2, 2), "dgrad"), ((2, 1, 2), "wgrad")):
        recipe = fp8core.Float8BlockScaling(x_block_scaling_dim=dims[0], w_block_scaling_dim=dims[1],
                                            grad_block_scaling_dim=dims[2])
        with pytest.raises(ValueError, match=f"makes the {gemm} GEMM 128x128 x 128x128"):
            check_plan(linear_plan(recipe))


@pytest.mark.parametrize("rows,multiple,pad", [(0, 16, 16), (1, 16, 15), (16, 16, 0), (17, 32, 15), (128, 128, 0)])
def test_padding_takes_tokens_to_the_multiple_and_an_empty_batch_to_one(rows, multiple, pad):
    assert padding(rows, multiple) == pad


def test_a_non_recipe_is_refused_by_name():
    with pytest.raises(TypeError, match="recipe: expected a recipe of fp8core.recipe, got str"):
        linear_plan("tensorwise")
