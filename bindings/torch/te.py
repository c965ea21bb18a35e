"""Transformer Engine's spelling of the FP8 Linear, so that ``import fp8core.torch as te`` switches a TE model.

TE writes::

    layer = te.Linear(1024, 1024, bias=True, params_dtype=torch.bfloat16)
    with te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group):
        out = layer(inp)

and the recipe belongs to the ``autocast``, not the layer. :class:`Linear` does the same: built without a
recipe, it takes the recipe of the first enabled autocast it runs in (TE's default ``DelayedScaling()`` when
that autocast names none), and keeps it; an autocast naming another recipe later is refused by name. Given
``recipe=`` it is a :class:`~fp8core.torch.Float8Linear` with that recipe from the start (a checkpoint made
under a recipe then loads before the first step). A checkpoint loaded before the first step keeps its FP8 state,
as TE keeps it, at the checkpoint's amax_history_len: the first autocast's recipe continues the loaded history,
scales and step count (refused by name where it cannot: another amax_history_len). Everything else, the
numerics and the state included, is Float8Linear's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from fp8core import DelayedScaling

from .linear import Float8Linear, check_whole_load, module_load_errors
from .scaling import SLOTS, STATE, current_context
from .te_support import keep_weight_in_fp8, model_init_context

__all__ = ["Linear"]

# TE's Linear arguments that select tensor/sequence parallelism, userbuffers or fused paths fp8core lacks:
# refused by name rather than ignored (a model silently run without them would train differently).
_TE_ONLY = ("sequence_parallel", "fuse_wgrad_accumulation", "tp_group", "tp_size", "get_rng_state_tracker",
            "rng_tracker_name", "return_bias", "parallel_mode", "parameters_split", "ub_overlap_ag",
            "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad", "ub_name",
            "delay_wgrad_compute", "symmetric_ar_type", "save_original_input", "name")


_PARAMS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Linear(Float8Linear):
    """``te.Linear``: y = x · weightᵀ + bias in fp8 inside :func:`~fp8core.torch.autocast`, exactly
    ``nn.Linear`` outside it. x: [..., in_features] float32/bfloat16/float16 -> [..., out_features], x's dtype.

    in_features, out_features: multiples of 16 (32 under MXFP8BlockScaling and NVFP4BlockScaling, 128 under
    Float8BlockScaling).
    bias: whether to learn an additive bias. params_dtype: the weight's and bias's dtype (default
    ``torch.get_default_dtype()``). device: where the parameters are made (default: torch's default device;
    TE's default is "cuda"). init_method: ``init_method(weight)`` initialises the weight in place, as in TE
    (default: ``nn.Linear``'s initialisation); the bias starts at zero then, as in TE. recipe: fix the recipe
    now instead of taking the first autocast's.
    """

    adopted = False  # whether the recipe came from an autocast (said in the error of a later, different one)
    loaded = False  # whether a checkpoint's fp8 state was loaded before the recipe was adopted (kept by _adopt)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: Optional[torch.dtype] = None, device: Any = None,
                 init_method: Optional[Callable[[torch.Tensor], Any]] = None, recipe: Any = None,
                 **te_only: Any) -> None:
        unsupported = sorted(k for k in te_only if k in _TE_ONLY)
        if unsupported:
            raise TypeError(f"{', '.join(unsupported)}: Transformer Engine's Linear arguments for parallel or fused "
                            "paths that fp8core.torch.Linear does not have (wrap the model in DDP or FSDP2 instead)")
        if te_only:
            raise TypeError(f"Linear: unexpected keyword argument(s) {', '.join(sorted(te_only))}")
        if params_dtype is not None and not (isinstance(params_dtype, torch.dtype) and params_dtype.is_floating_point):
            raise TypeError(f"params_dtype: expected a floating-point torch.dtype, got {params_dtype!r}")
        if params_dtype is not None and params_dtype not in _PARAMS_DTYPES:  # float64, the fp8 dtypes
            raise TypeError(f"params_dtype: expected torch.float32, torch.bfloat16 or torch.float16 (what the fp8 "
                            f"casts take, as in TE), got {params_dtype!r}")
        super().__init__(in_features, out_features, bias, device=device, dtype=params_dtype, recipe=recipe)
        self.recipe_from_autocast = recipe is None
        if init_method is not None:
            with torch.no_grad():
                init_method(self.weight)
                if self.bias is not None:
                    self.bias.zero_()
        init = model_init_context()
        if init is not None:  # inside te.fp8_model_init: the weight kept in fp8 only
            keep_weight_in_fp8(self, init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = current_context()
        if ctx is not None and ctx.recipe is not None and ctx.recipe != self.recipe:
            if not self.recipe_from_autocast:
                raise ValueError(f"recipe: this Linear runs under {self.recipe}, which it "
                                 f"{'took from its first autocast' if self.adopted else 'was given'}; the "
                                 f"autocast's {ctx.recipe} differs")
            self._adopt(ctx.recipe)
        if ctx is not None and self.recipe_from_autocast:
            self.recipe_from_autocast = False  # the first fp8 step fixes the recipe (TE's default if none named)
            self.adopted = True
        return super().forward(x)

    def _fp8_history_len(self, state_dict: Any, prefix: str) -> int:
        """Before the recipe is adopted, a checkpoint's history loads at its own length (TE's checkpoints carry
        theirs; amax_history_len=16 is common), which the first autocast's recipe must then keep."""
        history = state_dict.get(prefix + "fp8_amax_history")
        if self.recipe_from_autocast and torch.overrides.is_tensor_like(history) and history.dim() == 2 \
                and history.shape[0] >= 1 and history.shape[1] == SLOTS:
            return int(history.shape[0])
        return super()._fp8_history_len(state_dict, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        length = self._fp8_history_len(state_dict, prefix)
        if self._fp8_group is not None and length != self.recipe.amax_history_len:
            # the whole checkpoint checked first (it raises, writing nothing), then a state of its length to load into
            check_whole_load(self, state_dict, prefix)
            if not module_load_errors(self, state_dict, prefix):
                self._setup(dataclasses.replace(self.recipe, amax_history_len=length), None)
        errors = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if self.recipe_from_autocast and self._fp8_group is not None and prefix + "fp8_amax_history" in state_dict \
                and len(error_msgs) == errors:
            self.loaded = True

    def _adopt(self, recipe: Any) -> None:
        """Take ``recipe`` before the first fp8 step: a fresh state for it, as a Float8Linear made with it has, or
        the state a checkpoint loaded (TE keeps it), continued under ``recipe``."""
        # Float8Linear's own checks (the features against the recipe's blocks): a meta-device twin raises them.
        Float8Linear(self.in_features, self.out_features, bias=False, device="meta", recipe=recipe)
        kept = None
        if self.loaded and isinstance(recipe, DelayedScaling):
            length = self._fp8_history.shape[0]
            if recipe.amax_history_len != length:
                raise ValueError(f"recipe: this Linear holds the fp8 state of a checkpoint (an amax history of "
                                 f"{length}); the autocast's {recipe} keeps {recipe.amax_history_len}: load the "
                                 "checkpoint into a Linear built with recipe= that recipe, or run it under one with "
                                 f"amax_history_len={length}")
            kept = [getattr(self, name) for name in STATE], self._fp8_group.steps
        if not isinstance(recipe, DelayedScaling):
            for name in STATE:  # stateless recipes keep nothing
                self.__dict__.pop(name, None)
        self._setup(recipe, None)
        if kept is not None:
            for name, t in zip(STATE, kept[0]):
                setattr(self, name, t)
            self._fp8_group.steps = kept[1]
