"""The Linear's autograd.Function, one for every stateless recipe, run from the recipe's plan (fp8core.linear_plan):
which tensor each GEMM takes, in which usage and quantization, what the forward saves, the token padding and the
GEMMs kept in high precision are the plan's; the quantize and GEMM operations are those of the plan's layout kind
(block_linear.py, rowwise_linear.py, fp4_linear.py). torch.compile traces it through the ops' fakes.

The token count is zero-padded to the plan's multiple inside (the wgrad GEMM's K); the output is not a view (FSDP2
warns that in-place ops on a module's view output lose its pre-backward hook).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from fp8core.linear_plan import Gemm, LinearPlan, Role, padding

from . import block_linear, fp4_linear, rowwise_linear

__all__ = ["LinearFunction", "LinearOps", "padded"]


class LinearOps(NamedTuple):
    """A layout kind's operations. quantize(t, role_plan, plan, rowwise, columnwise, state) -> (rowwise operand,
    columnwise operand), each None where not made (it may make more than asked, and must make the same bits
    whichever it makes); gemm(a, b, out_dtype) -> D [M, N] = a · bᵀ."""

    quantize: Callable[..., tuple[Any, Any]]
    gemm: Callable[..., torch.Tensor]


_BLOCK = LinearOps(block_linear.quantize, block_linear.gemm)
OPS = {"mx": _BLOCK, "blocks": _BLOCK, "axiswise": LinearOps(rowwise_linear.quantize, rowwise_linear.gemm),
       "nvfp4": LinearOps(fp4_linear.quantize, fp4_linear.gemm)}


def padded(x2: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    """([rows, k] zero-padded to a multiple of ``multiple`` rows, contiguous; rows)."""
    rows = x2.shape[0]
    pad = padding(rows, multiple)
    return (F.pad(x2, (0, 0, 0, pad)) if pad else x2).contiguous(), rows


def _high_precision_gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """D = a · bᵀ in a's dtype on the unquantized tensors (OverrideLinearPrecision, rowwise_with_gw_hp)."""
    return (a @ b.to(a.dtype).t()).to(out_dtype)


class LinearFunction(torch.autograd.Function):
    """x [..., in] -> [..., out] = x · weightᵀ (+ bias) with the plan's GEMMs forward and backward. ``state``: the
    plan's state tensors (NVFP4: the (seed, offset) copy of this call, int64 [2], which the layer will not change
    afterwards)."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: LinearPlan, *state):
        ops = OPS[plan.kind]
        x2, rows = padded(x.reshape(-1, x.shape[-1]), plan.multiple)
        hp = {Role.INPUT: x2, Role.WEIGHT: weight.contiguous()}
        made = {}
        for role in (Role.INPUT, Role.WEIGHT):
            made[role] = ops.quantize(hp[role], plan.roles[role.value], plan, *plan.usages(role, plan.gemms), state)
        y = _run(plan.fprop, ops, made, hp, x2.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        saved, kinds = [], []
        for op, high in plan.saved():
            t = hp[op.role] if high else made[op.role][op.transposed]
            kinds.append(None if high else (type(t), t.layout))
            saved.extend((t,) if high else t)
        ctx.save_for_backward(*saved)
        ctx.plan, ctx.kinds, ctx.state, ctx.x_shape = plan, tuple(kinds), state, x.shape
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
        dtypes = {Role.INPUT: x_dtype, Role.WEIGHT: w_dtype}
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _run(plan.dgrad, ops, made, hp, dtypes[plan.dgrad.out])[:rows].reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = _run(plan.wgrad, ops, made, hp, dtypes[plan.wgrad.out])
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = g2.double().sum(0).to(b_dtype)  # float64: the same bits whatever order a compiler sums in
        return (dx, dw, db, None, *(None for _ in ctx.state))


def _run(gemm: Gemm, ops: LinearOps, made: dict, hp: dict, out_dtype: torch.dtype) -> torch.Tensor:
    """One of the plan's GEMMs: fp8 on the operands ``made`` ({role: {transposed: operand}}), or in high precision
    on ``hp`` ({role: tensor})."""
    if gemm.high_precision:
        a, b = (hp[op.role].t() if op.transposed else hp[op.role] for op in (gemm.a, gemm.b))
        return _high_precision_gemm(a, b, out_dtype)
    a, b = (made[op.role][op.transposed] for op in (gemm.a, gemm.b))
    return ops.gemm(a, b, out_dtype)

