"""Float8Linear, a drop-in nn.Linear whose three GEMMs run in fp8, and convert_to_float8.

Forward: input and weight are cast (forward format) by ``cast_transpose``, which also writes the transposes
the backward GEMMs need, so the backward makes no extra pass over them. Backward: grad_output is cast (backward
format, E5M2 under HYBRID) the same way; dgrad = gemm(grad_q, weight_t), wgrad = gemm(grad_t, input_t).
Master weights stay in their own precision. The token count is zero-padded to a multiple of 16 for the
wgrad GEMM (zeros add nothing to the sums nor to the amaxes).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from fp8core import DelayedScaling, Float8CurrentScaling

from . import ops
from .scaling import SLOTS, SharedScaling, check_recipe, fp8_enabled

__all__ = ["Float8Linear", "convert_to_float8"]

_GEMM_MULTIPLE = 16
_BIAS_EPILOGUE = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}  # else added after the GEMM


def _cast(x: torch.Tensor, fmt: str, state: Optional[torch.Tensor], slot: int, current: tuple
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, q_t, scale_inv) of a 2-D tensor: delayed scaling reads and feeds slot ``slot`` of ``state``;
    current scaling (``state`` None) scales by x's own amax."""
    if state is None:
        margin, power_of_2, epsilon = current
        s, s_inv = ops.compute_scale(ops.amax(x), fmt, margin, power_of_2, epsilon)
        q, qt = ops.cast_transpose(x, s, fmt)
        return q, qt, s_inv
    n, hist = current  # (tensors in the state, history rows): the slot's scale and scale_inv positions
    scale_at, inv_at = hist * n + slot, hist * n + n + slot
    q, qt = ops.cast_transpose(x, state[scale_at:scale_at + 1], fmt, state[slot:slot + 1])
    return q, qt, state[inv_at:inv_at + 1].clone()  # the scale_inv of this cast, whatever updates follow


class _Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, state, slot, fwd, bwd, layout):
        w_q, w_t, w_inv = _cast(weight, fwd, state, slot + 1, layout)
        x_q, x_t, x_inv = _cast(x2, fwd, state, slot, layout)
        fused = bias is not None and _BIAS_EPILOGUE.get(x2.dtype) == bias.dtype
        y = ops.gemm(x_q, w_q, x_inv, w_inv, x2.dtype, bias if fused else None)
        if bias is not None and not fused:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(x_t, w_t, x_inv, w_inv)
        ctx.state, ctx.slot, ctx.bwd, ctx.layout = state, slot, bwd, layout
        ctx.dtypes = (x2.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, grad):
        x_t, w_t, x_inv, w_inv = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g_q, g_t, g_inv = _cast(grad.contiguous(), ctx.bwd, ctx.state, ctx.slot + 2, ctx.layout)
        dx = ops.gemm(g_q, w_t, g_inv, w_inv, x_dtype) if ctx.needs_input_grad[0] else None
        dw = ops.gemm(g_t, x_t, g_inv, x_inv, w_dtype) if ctx.needs_input_grad[1] else None
        db = grad.double().sum(0).to(b_dtype) if b_dtype is not None and ctx.needs_input_grad[2] else None
        # db summed in float64: the same bits whatever order a compiler picks for the reduction
        return dx, dw, db, None, None, None, None, None


class Float8Linear(torch.nn.Linear):
    """``nn.Linear`` with fp8 GEMMs forward and backward. ``in_features`` and ``out_features`` must be
    multiples of 16. x: [..., in_features] float32/bfloat16/float16 -> [..., out_features], x's dtype.

    recipe: DelayedScaling (default) or Float8CurrentScaling. ``shared``: the delayed-scaling state this module
    takes its 3 slots from (convert_to_float8 makes one for the whole model); a state of its own otherwise.
    Histories and scales are in ``state_dict`` (``fp8_amax_history`` [L, 3], ``fp8_scale``, ``fp8_scale_inv``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: Any = None, recipe: DelayedScaling | Float8CurrentScaling | None = None,
                 shared: SharedScaling | None = None) -> None:
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if v % _GEMM_MULTIPLE:
                raise ValueError(f"{name}: {v} is not a multiple of {_GEMM_MULTIPLE} (the FP8 GEMM's limit)")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._setup(recipe, shared)

    def _setup(self, recipe: Any, shared: SharedScaling | None) -> None:
        self.recipe = check_recipe(recipe if shared is None else shared.recipe)
        self._shared: SharedScaling | None = None
        if isinstance(self.recipe, DelayedScaling):
            shared = shared if shared is not None else SharedScaling(1, self.recipe, self.weight.device)
            self._shared = shared
            self._slot = shared.claim()
            self.register_buffer("_fp8_state", shared.buffer, persistent=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: Any = None, shared: SharedScaling | None = None
                    ) -> "Float8Linear":
        """The same parameters (shared, not copied) in a Float8Linear."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new._setup(recipe, shared)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fp8_enabled():
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        pad = -rows % _GEMM_MULTIPLE
        if pad:
            x2 = F.pad(x2, (0, 0, 0, pad))
        fmt = self.recipe.fp8_format
        fwd, bwd = fmt.fwd.value, fmt.bwd.value
        if self._shared is None:
            r = self.recipe
            state, slot, layout = None, 0, (r.margin, r.power_of_2, float(r.amax_epsilon))
        else:
            state, slot, layout = self._fp8_state, self._slot, (self._shared.num_tensors, self._shared.history_len)
        y = _Float8Matmul.apply(x2.contiguous(), self.weight, self.bias, state, slot, fwd, bwd, layout)
        if pad:
            y = y[:rows]
        return y.reshape(*lead, self.out_features)

    # ---- the module's 3 columns of the shared state, in and out of state_dict ----------------------------

    def _columns(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sh = self._shared
        n, L, s = sh.num_tensors, sh.history_len, self._slot
        hist = sh.buffer[: L * n].view(L, n)[:, s:s + SLOTS]
        return hist, sh.buffer[L * n + s: L * n + s + SLOTS], sh.buffer[L * n + n + s: L * n + n + s + SLOTS]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._shared is not None:
            hist, scale, scale_inv = self._columns()
            destination[prefix + "fp8_amax_history"] = hist.clone()
            destination[prefix + "fp8_scale"] = scale.clone()
            destination[prefix + "fp8_scale_inv"] = scale_inv.clone()
            destination[prefix + "fp8_steps"] = torch.tensor(self._shared.state.steps)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        keys = [prefix + k for k in ("fp8_amax_history", "fp8_scale", "fp8_scale_inv", "fp8_steps")]
        present = [k in state_dict for k in keys]
        if self._shared is not None and all(present):
            with torch.no_grad():
                for dst, key in zip(self._columns(), keys):
                    src = state_dict[key]
                    if src.shape != dst.shape:
                        error_msgs.append(f"{key}: shape {tuple(src.shape)} does not match {tuple(dst.shape)} "
                                          "(amax_history_len differs?)")
                        continue
                    dst.copy_(src)
            self._shared.state.steps = int(state_dict[keys[3]])
        elif self._shared is not None and strict:
            missing_keys.extend(k for k, p in zip(keys, present) if not p)
        state_dict = {k: v for k, v in state_dict.items() if k not in keys}
        for k in keys:
            if k in state_dict:
                del state_dict[k]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={type(self.recipe).__name__}, format={self.recipe.fp8_format.name}"


def convert_to_float8(module: torch.nn.Module, recipe: Any = None,
                      module_filter_fn: Callable[[torch.nn.Module, str], bool] | None = None) -> torch.nn.Module:
    """Swap every ``nn.Linear`` of ``module`` (in place; returned) for a Float8Linear sharing its parameters.

    Under delayed scaling all swapped layers share one state (one all-reduce and one update per step).
    ``module_filter_fn(linear, fqn) -> bool`` chooses layers; layers the FP8 GEMM cannot take (features not
    multiples of 16) are kept as they are, with a warning naming them.
    """
    recipe = check_recipe(recipe)
    chosen, skipped = [], []
    for fqn, child in module.named_modules():
        if type(child) is not torch.nn.Linear or (module_filter_fn is not None and not module_filter_fn(child, fqn)):
            continue
        if child.in_features % _GEMM_MULTIPLE or child.out_features % _GEMM_MULTIPLE:
            skipped.append(f"{fqn} ({child.in_features} -> {child.out_features})")
            continue
        chosen.append(fqn)
    if skipped:
        warnings.warn("convert_to_float8: kept as nn.Linear, features not multiples of 16: " + ", ".join(skipped),
                      stacklevel=2)
    if not chosen:
        return module
    first = module.get_submodule(chosen[0])
    shared = SharedScaling(len(chosen), recipe, first.weight.device) if isinstance(recipe, DelayedScaling) else None
    for fqn in chosen:
        parent_name, _, name = fqn.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        new = Float8Linear.from_linear(getattr(parent, name), recipe, shared)
        if fqn == "":
            return new
        setattr(parent, name, new)
    return module
