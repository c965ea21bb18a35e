"""A Linear's quantized training step as data: its roles, how each is quantized, and its three GEMMs, per recipe.

Every front-end's Linear (fp8core.torch's Float8Linear and its autograd.Function, fp8core.jax's dense and the flax
dot_generals with their custom_vjp) runs the same three GEMMs, each ``D [M, N] = a [M, K] · b [N, K]ᵀ`` (TN, b laid
out like a Linear weight), with its own autodiff:

  fprop  y  [tokens, out] = gemm(input [tokens, in],      weight [out, in])      K = in_features
  dgrad  dx [tokens, in]  = gemm(grad_output [tokens, out], weightᵀ [in, out])   K = out_features
  wgrad  dw [out, in]     = gemm(grad_outputᵀ [out, tokens], inputᵀ [in, tokens])  K = tokens, zero-padded

A role's tensor taken as it is uses its *rowwise* quantization, taken transposed its *columnwise* one (Transformer
Engine's usages; the columnwise operand is the transpose, with its scales' blocks along the transpose's rows, i.e.
along the GEMM's K). :func:`linear_plan` says, for one recipe, each role's encoding, layout and state slot per
usage, each GEMM's operands, output dtype and whether it runs in high precision (OverrideLinearPrecision,
torchao's rowwise_with_gw_hp), the multiple the features and the padded token count must be, and what the
forward saves for the backward. The front-ends hold the quantize and GEMM operations the plan names (one per
layout kind) and nothing of a recipe's shape. Style: torchao's Float8LinearConfig (roles and per-GEMM settings as
plain data); names: Transformer Engine's (fprop/dgrad/wgrad, rowwise/columnwise usage).
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple, Optional

from .blocks import FP32_BLOCK, MX_BLOCK
from .fp4 import FP4_GEMM_K
from .gemm import MULTIPLE
from .layouts import Layout
from .recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling,
                     MXFP8BlockScaling, NVFP4BlockScaling)

__all__ = ["Role", "Quantization", "RolePlan", "Operand", "Gemm", "ScaleRule", "LinearPlan", "linear_plan",
           "padding", "check_plan", "ROLE_NAMES"]


class Role(enum.IntEnum):
    """A Linear's quantized tensors; the value is the role's column in a delayed-scaling state ([L, 3] history,
    [3] scales), Transformer Engine's and flax's order."""

    INPUT = 0
    WEIGHT = 1
    GRAD_OUTPUT = 2


# the names the block recipe's fields and errors give the roles (x_block_scaling_dim, ...)
ROLE_NAMES = {Role.INPUT: "x", Role.WEIGHT: "w", Role.GRAD_OUTPUT: "grad"}


class Quantization(NamedTuple):
    """One usage of a role's tensor: its encoding ("e4m3", "e5m2", "e2m1") and the layout of the operand the GEMM
    takes (for the columnwise usage, the transpose's). ``hadamard``: NVFP4's random Hadamard transform first;
    ``stochastic``: stochastic rounding drawing from the layer's (seed, offset + ``stream``)."""

    encoding: str
    layout: Layout
    hadamard: bool = False
    stochastic: bool = False
    stream: int = 0


class RolePlan(NamedTuple):
    """How one role is quantized: ``rowwise`` (the tensor as it is) and ``columnwise`` (its transpose), None where no
    fp8 GEMM takes that usage; ``slot``: its column of the delayed-scaling state, None when the recipe keeps none."""

    role: Role
    rowwise: Optional[Quantization]
    columnwise: Optional[Quantization]
    slot: Optional[int]


class Operand(NamedTuple):
    """A GEMM operand: a role's tensor, as it is or transposed (its columnwise usage)."""

    role: Role
    transposed: bool

    @property
    def usage(self) -> str:
        return "columnwise" if self.transposed else "rowwise"


class Gemm(NamedTuple):
    """One of the three GEMMs: D = a · bᵀ in the dtype of ``out``'s high-precision tensor (y and dx in the input's,
    dw in the weight's); ``high_precision``: run in that dtype on the unquantized tensors instead."""

    name: str
    a: Operand
    b: Operand
    out: Role
    high_precision: bool = False


class ScaleRule(NamedTuple):
    """The scale rule's settings (docs/numerics.md), recipe-wide: margin, power_of_2, epsilon (the amax floor),
    scale_mode (MXFP8's E8M0 rounding, "rceil" or "floor"; None elsewhere)."""

    margin: int = 0
    power_of_2: bool = False
    epsilon: float = 0.0
    scale_mode: Optional[str] = None


class LinearPlan(NamedTuple):
    """One recipe's Linear: ``kind`` the layouts' kind its operations go by ("tensor", "mx", "blocks",
    "axiswise", "nvfp4"); ``roles`` by Role; ``gemms`` (fprop, dgrad, wgrad); ``multiple`` what in/out features
    and the zero-padded token count must be multiples of, and ``why``; ``state``: "amax_history" (delayed
    scaling), "rng" (stochastic rounding's seed and offset) or None; ``scale``: the scale rule's settings."""

    recipe: str
    kind: str
    roles: tuple[RolePlan, RolePlan, RolePlan]
    gemms: tuple[Gemm, Gemm, Gemm]
    multiple: int
    why: str
    state: Optional[str]
    scale: ScaleRule

    @property
    def fprop(self) -> Gemm:
        return self.gemms[0]

    @property
    def dgrad(self) -> Gemm:
        return self.gemms[1]

    @property
    def wgrad(self) -> Gemm:
        return self.gemms[2]

    def quantization(self, operand: Operand) -> Quantization:
        """The quantization of the tensor ``operand`` names, in its usage."""
        role = self.roles[operand.role.value]
        return role.columnwise if operand.transposed else role.rowwise

    def saved(self) -> tuple[tuple[Operand, bool], ...]:
        """What the forward saves for the backward: each operand of dgrad and wgrad made in the forward (input,
        weight), with whether it is the high-precision tensor (its GEMM runs in high precision) rather than its
        quantization, in the order (dgrad's, wgrad's)."""
        return tuple((op, g.high_precision) for g in self.gemms[1:] for op in (g.a, g.b)
                     if op.role is not Role.GRAD_OUTPUT)

    def usages(self, role: Role, gemms: tuple[Gemm, ...]) -> tuple[bool, bool]:
        """(rowwise, columnwise): which usages of ``role`` the fp8 GEMMs among ``gemms`` take."""
        ops = [op for g in gemms if not g.high_precision for op in (g.a, g.b) if op.role is role]
        return any(not op.transposed for op in ops), any(op.transposed for op in ops)


def _gemms(high: tuple[bool, bool, bool]) -> tuple[Gemm, Gemm, Gemm]:
    x, w, g = Role.INPUT, Role.WEIGHT, Role.GRAD_OUTPUT
    return (Gemm("fprop", Operand(x, False), Operand(w, False), x, high[0]),
            Gemm("dgrad", Operand(g, False), Operand(w, True), x, high[1]),
            Gemm("wgrad", Operand(g, True), Operand(x, True), w, high[2]))


def _both(encoding: str, layout: Layout, slot: Optional[int] = None, role: Role = Role.INPUT) -> RolePlan:
    q = Quantization(encoding, layout)
    return RolePlan(role, q, q, slot)


def _roles(make: Any) -> tuple[RolePlan, RolePlan, RolePlan]:
    return tuple(make(role) for role in Role)


def padding(rows: int, multiple: int) -> int:
    """The zero rows that take a token count to the wgrad GEMM's multiple; an empty batch to one multiple (the
    GEMM contracts over the tokens and needs K > 0). Zero rows add nothing to the sums and change no amax or
    block scale, so every other element's bits are kept."""
    return -rows % multiple or (multiple if rows == 0 else 0)


def linear_plan(recipe: Any) -> LinearPlan:
    """The plan of a Linear under ``recipe`` (any recipe of fp8core.recipe, checked by the caller)."""
    name = type(recipe).__name__
    if isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        fmt = recipe.fp8_format
        delayed = isinstance(recipe, DelayedScaling)

        def per_tensor(role: Role) -> RolePlan:
            enc = (fmt.bwd if role is Role.GRAD_OUTPUT else fmt.fwd).value
            return _both(enc, Layout.TENSORWISE, int(role) if delayed else None, role)

        rule = (ScaleRule(recipe.margin, recipe.power_of_2, float(recipe.epsilon)) if delayed else
                ScaleRule(recipe.margin, recipe.power_of_2, float(recipe.amax_epsilon)))
        # override_linear_precision keeps both usages: Transformer Engine casts every tensor still, so delayed
        # scaling's histories see each of them
        return LinearPlan(name, "tensor", _roles(per_tensor), _gemms(tuple(recipe.override_linear_precision)),
                          MULTIPLE, "the FP8 GEMM's limit", "amax_history" if delayed else None, rule)
    if isinstance(recipe, MXFP8BlockScaling):
        fmt = recipe.fp8_format
        roles = _roles(lambda r: _both((fmt.bwd if r is Role.GRAD_OUTPUT else fmt.fwd).value, Layout.MX_ROWWISE,
                                       role=r))
        return LinearPlan(name, "mx", roles, _gemms((False,) * 3), MX_BLOCK,
                          "the MXFP8 GEMM's K takes whole 1x32 blocks", None, ScaleRule(scale_mode=recipe.scale_mode))
    if isinstance(recipe, Float8BlockScaling):
        fmt, layouts = recipe.fp8_format, recipe.layouts
        roles = _roles(lambda r: _both((fmt.bwd if r is Role.GRAD_OUTPUT else fmt.fwd).value, layouts[r], role=r))
        return LinearPlan(name, "blocks", roles, _gemms((False,) * 3), FP32_BLOCK,
                          "the 1x128/128x128 block GEMM's K takes whole 128-element blocks", None,
                          ScaleRule(0, recipe.power_of_2, float(recipe.epsilon)))
    if isinstance(recipe, Float8RowwiseScaling):
        enc, hp = recipe.fp8_format.fwd.value, recipe.wgrad_high_precision
        rows = Quantization(enc, Layout.ROWWISE)
        # rowwise_with_gw_hp: wgrad in high precision takes no columnwise input nor grad_output, and dgrad takes
        # the weight under one scale (torchao's tensorwise cast of it)
        roles = (RolePlan(Role.INPUT, rows, None if hp else rows, None),
                 RolePlan(Role.WEIGHT, rows, Quantization(enc, Layout.TENSORWISE) if hp else rows, None),
                 RolePlan(Role.GRAD_OUTPUT, rows, None if hp else rows, None))
        return LinearPlan(name, "axiswise", roles, _gemms((False, False, hp)), MULTIPLE, "the FP8 GEMM's limit",
                          None, ScaleRule(0, recipe.power_of_2, float(recipe.epsilon)))
    if isinstance(recipe, NVFP4BlockScaling):
        enc, rht, sr = recipe.fp4_format.name.lower(), not recipe.disable_rht, not recipe.disable_stochastic_rounding
        w = Quantization(enc, Layout.NVFP4_1X16 if recipe.disable_2d_quantization else Layout.NVFP4_16X16)
        roles = (RolePlan(Role.INPUT, Quantization(enc, Layout.NVFP4_1X16),
                          Quantization(enc, Layout.NVFP4_1X16, hadamard=rht), None),
                 RolePlan(Role.WEIGHT, w, w, None),
                 RolePlan(Role.GRAD_OUTPUT, Quantization(enc, Layout.NVFP4_1X16, stochastic=sr, stream=0),
                          Quantization(enc, Layout.NVFP4_1X16, hadamard=rht, stochastic=sr, stream=1), None))
        return LinearPlan(name, "nvfp4", roles, _gemms((False,) * 3), FP4_GEMM_K,
                          f"the FP4 GEMM's K takes whole multiples of {FP4_GEMM_K}", "rng", ScaleRule())
    raise TypeError(f"recipe: expected a recipe of fp8core.recipe, got {type(recipe).__name__}")


_GEMM_WORDS = {"fprop": "forward"}  # the word the block recipe's error has always used


def check_plan(plan: LinearPlan) -> None:
    """cuBLASLt has no 128x128 x 128x128 GEMM: no GEMM of the plan may take two tiled operands."""
    for g in plan.gemms:
        if not g.high_precision and all(plan.quantization(op).layout is Layout.BLOCK_128X128 for op in (g.a, g.b)):
            a, b = sorted((g.a.role, g.b.role), key=lambda r: (r is not Role.GRAD_OUTPUT, r))
            a, b = ROLE_NAMES[a], ROLE_NAMES[b]
            gemm = _GEMM_WORDS.get(g.name, g.name)
            raise ValueError(f"recipe: {a}_block_scaling_dim and {b}_block_scaling_dim are both 2 (128x128 tiles), "
                             f"which makes the {gemm} GEMM 128x128 x 128x128 (cuBLASLt has none); set one to 1")
