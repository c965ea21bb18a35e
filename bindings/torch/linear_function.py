"""The Linear's autograd.Function, one for every recipe, run from the recipe's plan (fp8core.linear_plan): which
tensor each GEMM takes, in which usage and quantization, what the forward saves, the token padding and the GEMMs
kept in high precision are the plan's; the quantize and GEMM operations are those of the plan's layout kind
(tensor_linear.py, block_linear.py, rowwise_linear.py, fp4_linear.py). torch.compile traces it through the ops'
fakes.

The token count is zero-padded to the plan's multiple inside (the wgrad GEMM's K); the output is not a view (FSDP2
warns that in-place ops on a module's view output lose its pre-backward hook).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from fp8core.linear_plan import Gemm, LinearPlan, Role, padding

from . import block_linear, fp4_linear, rowwise_linear, tensor_linear
from .fsdp import Float8AllGatherWeight, Float8GatheredWeight

__all__ = ["LinearFunction", "LinearOps", "padded"]


def _never(out_dtype: torch.dtype, bias_dtype: torch.dtype) -> bool:
    return False


class LinearOps(NamedTuple):
    """A layout kind's operations. quantize(t, role_plan, plan, rowwise, columnwise, state, transposed=False) ->
    (rowwise operand, columnwise operand), each None where not made (it may make more than asked, and must make the
    same bits whichever it makes; ``transposed``: t is stored as the role's tensor's transpose);
    gemm(a, b, out_dtype[, bias]) -> D [M, N] = a · bᵀ; gemm_t(a, b, out_dtype) -> Dᵀ with D's bits, made as it is
    (None: D transposed); fuses_bias(out_dtype, bias_dtype): whether gemm adds such a bias in its epilogue."""

    quantize: Callable[..., tuple[Any, Any]]
    gemm: Callable[..., torch.Tensor]
    gemm_t: Optional[Callable[..., torch.Tensor]] = None
    fuses_bias: Callable[[torch.dtype, torch.dtype], bool] = _never


_BLOCK = LinearOps(block_linear.quantize, block_linear.gemm)
OPS = {"tensor": LinearOps(tensor_linear.quantize, tensor_linear.gemm, tensor_linear.gemm_t,
                           tensor_linear.fuses_bias),
       "mx": _BLOCK, "blocks": _BLOCK, "axiswise": LinearOps(rowwise_linear.quantize, rowwise_linear.gemm),
       "nvfp4": LinearOps(fp4_linear.quantize, fp4_linear.gemm)}
HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes a Linear computes in


def padded(x2: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    """([rows, k] zero-padded to a multiple of ``multiple`` rows, contiguous; rows)."""
    rows = x2.shape[0]
    pad = padding(rows, multiple)
    return (F.pad(x2, (0, 0, 0, pad)) if pad else x2).contiguous(), rows


def _high_precision_gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """D = a · bᵀ in a's dtype on the unquantized tensors (OverrideLinearPrecision, rowwise_with_gw_hp)."""
    return (a @ b.to(a.dtype).t()).to(out_dtype)


def _high_precision_weight(weight: torch.Tensor, in_out: bool) -> torch.Tensor:
    """The weight as [out, in] in high precision, for a GEMM the plan keeps out of fp8."""
    if isinstance(weight, Float8AllGatherWeight):
        weight = weight.high_precision
    if isinstance(weight, Float8GatheredWeight) or weight.dtype not in HIGH_PRECISION:
        raise TypeError("recipe: override_linear_precision runs a GEMM on the high-precision weight, but this "
                        "layer's weight is held in fp8 (fp8_model_init or FSDP2's fp8 all-gather); override no "
                        "GEMM there")
    return weight.t() if in_out else weight


class LinearFunction(torch.autograd.Function):
    """x [..., in] -> [..., out] = x · weightᵀ (+ bias) with the plan's GEMMs forward and backward.

    weight: [out, in], or [in, out] with ``in_out`` (transformers' Conv1D: its gradient comes back [in, out]);
    under a per-tensor plan it may be a weight FSDP2 gathers or gathered in fp8, or one kept in fp8 (fp8_model_init)
    with its ``weight_scale_inv`` [1] (None for any other). ``group``: a delayed-scaling group told that a backward ran (SharedScaling.open_step),
    or None. ``state``: the plan's state tensors: delayed scaling's (history [L, 3], scale [3], scale_inv [3]) of
    the layer, which the casts read at their role's slot and whose history's row 0 takes their amaxes (held, not
    saved: the backward's cast writes into the same tensor); NVFP4's (seed, offset) copy of this call, int64 [2],
    which the layer will not change afterwards."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: LinearPlan, in_out: bool, group: Any, weight_scale_inv, *state):
        ops = OPS[plan.kind]
        x2, rows = padded(x.reshape(-1, x.shape[-1]), plan.multiple)
        # the weight first, then the input: the order record_numerics and its users have always seen the casts in
        made = {Role.WEIGHT: ops.quantize(weight, plan.roles[Role.WEIGHT.value], plan,
                                          *plan.usages(Role.WEIGHT, plan.gemms), state, transposed=in_out,
                                          **({} if weight_scale_inv is None else {"scale_inv": weight_scale_inv}))}
        made[Role.INPUT] = ops.quantize(x2, plan.roles[Role.INPUT.value], plan, *plan.usages(Role.INPUT, plan.gemms),
                                        state)
        hp = {Role.INPUT: x2}
        if any(g.high_precision and Role.WEIGHT in (g.a.role, g.b.role) for g in plan.gemms):
            hp[Role.WEIGHT] = _high_precision_weight(weight, in_out)
        fused = bias is not None and not plan.fprop.high_precision and ops.fuses_bias(x2.dtype, bias.dtype)
        y = _run(plan.fprop, ops, made, hp, x2.dtype, bias if fused else None)
        if bias is not None and not fused:
            y = y + bias.to(y.dtype)
        saved, kinds = [], []
        for op, high in plan.saved():
            t = hp[op.role] if high else made[op.role][op.transposed]
            kinds.append(None if high else (type(t), t.layout))
            saved.extend((t,) if high else t)
        ctx.save_for_backward(*saved)
        ctx.plan, ctx.kinds, ctx.state, ctx.x_shape = plan, tuple(kinds), state, x.shape
        ctx.in_out, ctx.group = in_out, group
        ctx.dtypes = (x2.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y[:rows].reshape(*x.shape[:-1], y.shape[-1]).detach()

    @staticmethod
    def backward(ctx, grad):
        plan, ops = ctx.plan, OPS[ctx.plan.kind]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g2, rows = padded(grad.reshape(-1, grad.shape[-1]), plan.multiple)
        made, hp = {Role.GRAD_OUTPUT: {}}, {Role.GRAD_OUTPUT: g2}
        parts = iter(ctx.saved_tensors)
        for (op, high), kind in zip(plan.saved(), ctx.kinds):
            if high:
                hp[op.role] = next(parts)
            else:
                cls, layout = kind
                made.setdefault(op.role, {})[op.transposed] = cls(*(next(parts) for _ in cls._fields), layout)
        running = tuple(g for g, needed in zip(plan.gemms[1:], ctx.needs_input_grad[:2]) if needed)
        row, col = ops.quantize(g2, plan.roles[Role.GRAD_OUTPUT.value], plan, *plan.usages(Role.GRAD_OUTPUT, running),
                                ctx.state)
        made[Role.GRAD_OUTPUT] = {False: row, True: col}
        if ctx.group is not None:
            ctx.group.backward_ran = True
        dtypes = {Role.INPUT: x_dtype, Role.WEIGHT: w_dtype}
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _run(plan.dgrad, ops, made, hp, dtypes[plan.dgrad.out])[:rows].reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # [out, in], or [in, out] for a weight stored so
            dw = _run(plan.wgrad, ops, made, hp, dtypes[plan.wgrad.out], transposed=ctx.in_out)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = g2.double().sum(0).to(b_dtype)  # float64: the same bits whatever order a compiler sums in
        return (dx, dw, db, None, None, None, None, *(None for _ in ctx.state))


def _run(gemm: Gemm, ops: LinearOps, made: dict, hp: dict, out_dtype: torch.dtype,
         bias: Optional[torch.Tensor] = None, transposed: bool = False) -> torch.Tensor:
    """One of the plan's GEMMs: fp8 on the operands ``made`` ({role: {transposed: operand}}), or in high precision
    on ``hp`` ({role: tensor}); ``bias`` added in the fp8 GEMM's epilogue; ``transposed``: its result's transpose
    Dᵀ (a view of D where the kind cannot make Dᵀ itself)."""
    if gemm.high_precision:
        a, b = (hp[op.role].t() if op.transposed else hp[op.role] for op in (gemm.a, gemm.b))
        d = _high_precision_gemm(a, b, out_dtype)
        return d.t() if transposed else d
    a, b = (made[op.role][op.transposed] for op in (gemm.a, gemm.b))
    if transposed:
        return ops.gemm(a, b, out_dtype).t() if ops.gemm_t is None else ops.gemm_t(a, b, out_dtype)
    return ops.gemm(a, b, out_dtype) if bias is None else ops.gemm(a, b, out_dtype, bias)
