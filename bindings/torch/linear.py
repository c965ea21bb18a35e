"""Float8Linear, a drop-in nn.Linear whose three GEMMs run in fp8 inside ``autocast`` (in high precision, exactly
nn.Linear, outside it), and convert_to_float8. Where its delayed-scaling state lives and why: scaling.py.

Every recipe runs one autograd.Function (linear_function.py) from its plan (fp8core.linear_plan): the per-tensor
recipes (DelayedScaling, Float8CurrentScaling: ``cast_transpose`` writes the transposes the backward GEMMs take,
so the backward makes no extra pass over them) through tensor_linear.py, the block-scaling recipes
(MXFP8BlockScaling, Float8BlockScaling) through block_linear.py, torchao's rowwise recipes (Float8RowwiseScaling)
through rowwise_linear.py, NVFP4BlockScaling through fp4_linear.py. Master weights stay in their own precision; the
token count is zero-padded to the plan's multiple for the wgrad GEMM (zeros add nothing to the sums nor to the
amaxes). The layer holds the recipe's state: delayed scaling's amax history and scales (scaling.py), NVFP4's
(seed, offset) of stochastic rounding (a buffer); the others are stateless. A per-tensor recipe's
``override_linear_precision`` (Transformer Engine's) runs the GEMMs it names in the caller's dtype.
"""

from __future__ import annotations

import logging
import numbers
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

import fp8core
from fp8core import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling
from fp8core.layouts import Layout
from fp8core.linear_plan import Role, linear_plan
from fp8core.scaling import check_state_values

from . import ops
from .block_linear import BLOCK_RECIPES
from .fp4_ops import advance_rng
from .fp4_linear import STREAMS, initial_rng
from .linear_function import HIGH_PRECISION as _HIGH, LinearFunction
from .rowwise_linear import is_rowwise
from .fsdp import Float8AllGatherWeight, plain_weight, wrap_weight
from .scaling import (SLOTS, STATE, SharedScaling, autocast_disabled, calibrating_context, check_recipe,
                      current_context, initial_state)

__all__ = ["Float8Linear", "Float8Conv1D", "convert_to_float8", "enable_fsdp_float8_all_gather"]

logger = logging.getLogger("fp8core.torch")

_KEYS = ("fp8_amax_history", "fp8_scale", "fp8_scale_inv", "fp8_steps")
RECORDERS = "_fp8_recorders"  # in a recorded layer's __dict__: record_numerics' recorders (numerics.py)


def _record_eagerly(module: "Float8Linear", x: torch.Tensor, y: Optional[torch.Tensor]) -> None:
    """Hand a recorded layer's fp8 forward (its input, and its output, None before a block-scaled one) to the
    record_numerics contexts open on it."""
    for recorder in list(module.__dict__.get(RECORDERS, ())):
        recorder(module, x, y)


# Outside the graph: the recorder measures on the host, eagerly, under torch.compile too. What fullgraph=True
# says when it meets it:
_RECORDING = ("fp8core.torch.record_numerics measures a layer's casts on the host, outside the graph: compile "
              "without fullgraph=True to record, or record the eager model")
try:
    _record = torch.compiler.disable(_record_eagerly, reason=_RECORDING)
except TypeError:  # torch before 2.8 takes no reason
    _record = torch.compiler.disable(_record_eagerly)


class Float8Linear(torch.nn.Linear):
    """``nn.Linear`` with fp8 GEMMs forward and backward inside :func:`autocast`; outside it, exactly ``nn.Linear``
    (high precision, Transformer Engine's rule) by default, fp8 with ``autocast_only=False`` (torchao's usage;
    what :func:`convert_to_float8` makes: see it for when delayed scaling then updates).
    ``in_features`` and ``out_features`` must be positive multiples of 16 (32 under
    MXFP8BlockScaling and NVFP4BlockScaling, 128 under Float8BlockScaling: the block GEMM's K takes whole blocks).
    x: [..., in_features] float32/bfloat16/float16 -> [..., out_features], x's dtype.

    recipe: DelayedScaling (default), Float8CurrentScaling, Float8RowwiseScaling (or torchao's recipe names
    "tensorwise", "rowwise", "rowwise_with_gw_hp"), MXFP8BlockScaling, Float8BlockScaling (these four stateless:
    nothing in ``state_dict``) or NVFP4BlockScaling (E2M1 GEMMs, fp4_linear.py; its stochastic rounding's
    ``fp4_rng`` buffer, int64 [2] (seed, offset), in ``state_dict``). ``shared``: the delayed-scaling
    group this module joins (convert_to_float8 makes one for the whole model: one all-reduce and one update per step);
    a group of its own otherwise. The module owns its state (see fp8core.torch.scaling): float32
    ``fp8_amax_history`` [L, 3], ``fp8_scale`` [3], ``fp8_scale_inv`` [3] (input, weight, grad_output),
    in ``state_dict`` with ``fp8_steps`` (the group's step count; each key is an attribute, as
    torch.distributed.checkpoint requires); every module transform carries it, in float32.

    ``load_state_dict`` checks the whole checkpoint (every fp8 entry, every parameter's shape) when it reaches the
    first delayed-scaling Float8Linear or module :func:`convert_to_float8` marked: a bad one raises torch's
    ``RuntimeError("Error(s) in loading state_dict for ...")`` listing every mismatch. Nothing is written when the
    load starts at this module, at a module convert_to_float8 marked, or above them where no parameter or buffer
    comes first (a torch.compile wrapper, DDP, a Sequential of these layers). A module built around them later and
    never given to convert_to_float8 is not marked (fp8core installs no process-wide hook): a load from it writes
    the entries it visits before the first of them, its own included, before it refuses the checkpoint.
    """

    # Whether a record_numerics context records this layer: a plain bool, which torch.compile guards on (so a
    # model compiled before the context recompiles with the recording and after it without).
    _fp8_recording = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: Any = None,
                 recipe: DelayedScaling | Float8CurrentScaling | MXFP8BlockScaling | Float8BlockScaling
                 | NVFP4BlockScaling | None = None,
                 shared: SharedScaling | None = None, autocast_only: bool = True) -> None:
        _check_features(in_features, out_features, recipe, shared, autocast_only)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if not autocast_only:
            self.autocast_only = False
        self._setup(recipe, shared)

    # Whether the layer runs in fp8 only inside autocast (Transformer Engine's rule: te.Linear, and a Float8Linear
    # built directly), or wherever it runs (torchao's: what convert_to_float8 makes); see convert_to_float8.
    autocast_only = True
    in_out = False  # the weight stored [in, out] (Float8Conv1D)

    def _setup(self, recipe: Any, shared: SharedScaling | None) -> None:
        if shared is not None and recipe is not None and check_recipe(recipe) != shared.recipe:
            raise ValueError(f"recipe: {recipe} is not the shared state's recipe {shared.recipe}")
        self.recipe = check_recipe(recipe if shared is None else shared.recipe)
        self._fp8_plan = linear_plan(self.recipe)
        self._fp8_group: SharedScaling | None = None
        if isinstance(self.recipe, DelayedScaling):
            self._fp8_group = shared if shared is not None else SharedScaling(self.recipe)
            self._fp8_slot = self._fp8_group.join(self)
            self._fp8_history, self._fp8_scale, self._fp8_scale_inv = initial_state(
                self.recipe.amax_history_len, self.weight.device)
        if isinstance(self.recipe, NVFP4BlockScaling) and "fp4_rng" not in self._buffers:
            # stochastic rounding's (seed, offset): a buffer, so state_dict, module transforms and
            # torch.compile (an in-place update, no recompile) carry it; in host memory through the module's
            # transforms (see _apply), as torch's CUDA generator keeps its own; read where it lives, never waited for
            self.register_buffer("fp4_rng", initial_rng("meta" if self.weight.is_meta else "cpu"))

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: Any = None, shared: SharedScaling | None = None,
                    autocast_only: bool = True) -> "Float8Linear":
        """The same parameters (shared, not copied) in a Float8Linear. ``autocast_only=False``: fp8 outside
        autocast too (what :func:`convert_to_float8` makes)."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        return cls._sharing(linear, linear.in_features, linear.out_features, recipe, shared, autocast_only)

    @classmethod
    def _sharing(cls, layer: torch.nn.Module, in_features: int, out_features: int, recipe: Any,
                 shared: SharedScaling | None, autocast_only: bool) -> "Float8Linear":
        _check_features(in_features, out_features, recipe, shared, autocast_only)
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features = in_features, out_features
        new.weight, new.bias = layer.weight, layer.bias
        new.autocast_only = autocast_only
        new._setup(recipe, shared)
        return new

    # ---- the state: read where it is now, carried by every transform -----------------------------------

    fp8_amax_history = property(lambda self: self._fp8_history)
    fp8_scale = property(lambda self: self._fp8_scale)
    fp8_scale_inv = property(lambda self: self._fp8_scale_inv)

    @property
    def fp8_steps(self) -> torch.Tensor:
        """The group's step count as an int64 0-d tensor (what ``state_dict`` holds; every key of a state_dict
        names an attribute, as torch.distributed.checkpoint looks them up)."""
        return torch.tensor(self._fp8_group.steps)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if self.__dict__.get("_fp8_group") is not None:  # a copy or an unpickled module joins its group's copy
            self._fp8_slot = self._fp8_group.join(self, self._fp8_slot)

    def _apply(self, fn: Callable, recurse: bool = True) -> "Float8Linear":
        rng = self._buffers.get("fp4_rng")
        super()._apply(fn, recurse)
        new_rng = self._buffers.get("fp4_rng")
        if new_rng is not None and new_rng.device.type not in ("cpu", "meta") and rng is not None \
                and (rng.device.type == "cpu" or rng.is_meta):
            # moved with the module (cuda(), to(device), to_empty): kept in host memory, where torch's CUDA
            # generator keeps its seed and offset too (the ops pass it to the kernels by value). A state put on a
            # device by other means (FSDP2 moves buffers itself) stays there: the kernels read it by pointer.
            new_rng = rng if rng.device.type == "cpu" else torch.empty(2, dtype=torch.int64)  # (meta: drawn below)
            self._buffers["fp4_rng"] = new_rng
        if rng is not None and rng.is_meta and new_rng is not None and not new_rng.is_meta:
            with torch.no_grad():  # materialised (to_empty): uninitialised memory is no seed; a new layer's draw
                new_rng.copy_(initial_rng(new_rng.device))
        if self._fp8_group is None:
            return self
        L = self.recipe.amax_history_len
        for i, name in enumerate(STATE):
            old = getattr(self, name)
            new = fn(old)
            if new is old:  # in place (share_memory_) or nothing to do
                continue
            if old.is_meta:  # no values to keep: materialising gives the initial state
                new = new if new.is_meta else initial_state(L, new.device)[i]
            else:  # the values, float32, wherever fn put the tensor (to_empty keeps them: never garbage)
                new = old.to(device=new.device)
            setattr(self, name, new)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = current_context()
        if not self.runs_in_fp8():
            calibrating = calibrating_context()
            if calibrating is not None and self._fp8_group is not None and x.numel():
                self._calibrate(x, calibrating)
            return self._high_precision(x)
        if x.dtype not in _HIGH:
            raise TypeError(f"x: expected float32, bfloat16 or float16, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected shape [..., {self.in_features}], got {tuple(x.shape)}")
        if self.weight.is_meta or x.is_meta:
            raise RuntimeError("Float8Linear: the module is on the meta device; materialise it first "
                               "(module.to_empty(device=...), then initialise or load_state_dict)")
        # No check for CuPy here: torch.compile traces this Python, and a package lookup is not traceable on every
        # torch (2.11 refuses importlib's find_spec). The first op refuses a CUDA tensor without CuPy, by name.
        if x.numel() == 0:
            return self._high_precision(x)
        weight_scale_inv = self._fp8_weight_scale_inv()  # refuses a bad weight before any state moves
        state, group = (), None
        if isinstance(self.recipe, NVFP4BlockScaling):
            rng, after = advance_rng(self.fp4_rng, STREAMS)
            if torch.is_grad_enabled():  # a backward may follow: the next step draws fresh bytes
                with torch.no_grad():
                    self.fp4_rng.copy_(after)
            state = (rng,)
        elif self._fp8_group is not None:
            if self._fp8_history.device != self.weight.device:
                self._fp8_follow(self.weight.device)
            if ctx is None:
                self._fp8_group.open_step(self._fp8_slot)
                group = self._fp8_group  # told that a backward ran
            else:
                ctx.ran[self._fp8_group] = None
            state = (self._fp8_history, self._fp8_scale, self._fp8_scale_inv)
        y = LinearFunction.apply(x, self.weight, self.bias, self._fp8_plan, self.in_out, group, weight_scale_inv,
                                 *state)
        if self._fp8_recording:
            _record(self, x, y)
        return y

    def _fp8_weight_scale_inv(self) -> Optional[torch.Tensor]:
        """The scale_inv [1] of a weight kept in fp8 (te.fp8_model_init), checked against the plan; None for a
        high-precision weight."""
        if self.weight.dtype in _HIGH:
            return None
        if self.weight.requires_grad:
            raise RuntimeError("weight: kept only in fp8 (made inside fp8_model_init); fp8core trains "
                               "high-precision weights only: make the layer outside fp8_model_init to train it")
        role = self._fp8_plan.roles[Role.WEIGHT.value].rowwise
        fwd = role.encoding if role.layout is Layout.TENSORWISE else None
        if fwd is None or self.weight.dtype != fp8core.as_format(fwd).torch_dtype:
            raise TypeError(f"weight: kept in fp8 as {self.weight.dtype} under one scale (fp8_model_init); the "
                            f"layer's {type(self.recipe).__name__} "
                            f"{'scales blocks' if fwd is None else f'casts its forward to {fwd}'}")
        return self.weight_scale_inv

    def _high_precision(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype not in _HIGH:  # kept in fp8 (fp8_model_init)
            weight = ops.dequantize(self.weight, self.weight_scale_inv, x.dtype)
            return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))
        return F.linear(x, self.weight, self.bias)

    @torch.no_grad()
    def _calibrate(self, x: torch.Tensor, ctx: Any) -> None:
        """Transformer Engine's calibration: the amaxes of the input and the weight into row 0 (the context's exit
        updates), the GEMM in high precision."""
        if self._fp8_history.device != self.weight.device:
            self._fp8_follow(self.weight.device)
        row = self._fp8_history[0]
        for role, t in ((Role.INPUT, x.reshape(-1, x.shape[-1])), (Role.WEIGHT, self.weight)):
            slot = self._fp8_plan.roles[role.value].slot
            torch.maximum(row[slot:slot + 1], ops.amax(t), out=row[slot:slot + 1])
        ctx.ran[self._fp8_group] = None

    def runs_in_fp8(self) -> bool:
        """Whether a forward now runs in fp8: inside an enabled :func:`autocast`, or outside any autocast for a
        layer made with ``autocast_only=False`` (convert_to_float8's)."""
        if current_context() is not None:
            return True
        return not self.autocast_only and not autocast_disabled()

    def _fp8_follow(self, device: torch.device) -> None:
        """The state to the weight's device (FSDP2's fully_shard moves parameters and buffers only)."""
        for name in STATE:
            setattr(self, name, getattr(self, name).to(device))

    def cast_for_all_gather(self, shard: torch.Tensor, mesh: Any) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        """FSDP2's fp8 all-gather (fsdp.py): this rank's weight ``shard`` cast to the forward format as the
        weight's own cast would cast it, and its scale_inv [1]. Delayed scaling: the layer's weight scale, the
        shard's amax into the weight's history slot; current scaling: the amax all-reduced over the device
        ``mesh``'s process group first, so that every rank casts with one scale."""
        weight = self._fp8_plan.roles[Role.WEIGHT.value]
        fwd, slot = weight.rowwise.encoding, weight.slot
        if self._fp8_group is not None:
            if self._fp8_history.device != shard.device:
                self._fp8_follow(shard.device)
            q = ops.quantize(shard, self._fp8_scale[slot:slot + 1], fwd, self._fp8_history[0, slot:slot + 1])
            return (q,), self._fp8_scale_inv[slot:slot + 1].clone()
        rule = self._fp8_plan.scale
        amax = ops.amax(shard)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group())
        scale, scale_inv = ops.compute_scale(amax, fwd, rule.margin, rule.power_of_2, rule.epsilon)
        return (ops.quantize(shard, scale, fwd),), scale_inv

    # ---- state_dict --------------------------------------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars and prefix + "weight" in destination:  # a checkpoint holds plain tensors
            destination[prefix + "weight"] = plain_weight(destination[prefix + "weight"])
        if self._fp8_group is not None:
            for key, name in zip(_KEYS, STATE):
                t = getattr(self, name)
                destination[prefix + key] = t if keep_vars else t.detach()
            destination[prefix + "fp8_steps"] = self.fp8_steps

    def _fp8_history_len(self, state_dict: Any, prefix: str) -> int:
        """The amax history length this module's fp8 entries in ``state_dict`` must have to load: the recipe's."""
        return self.recipe.amax_history_len

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self._fp8_group is not None:
            check_whole_load(self, state_dict, prefix)
        errors = module_load_errors(self, state_dict, prefix)  # everything checked before anything is written
        if errors:
            error_msgs.extend(errors)
            return
        keys = [prefix + k for k in _KEYS] if self._fp8_group is not None else []
        found = _checked_state(self, state_dict, prefix) if keys else None
        if keys and found is None:
            missing_keys.extend(keys)
        elif found is not None:
            hist, scale, scale_inv, steps = found
            assign = local_metadata.get("assign_to_params_buffers", False)
            with torch.no_grad():
                for name, src in zip(STATE, (hist, scale, scale_inv)):
                    if assign:
                        setattr(self, name, src.detach())
                    else:
                        getattr(self, name).copy_(src)
            self._fp8_group.steps = steps
        gathers_fp8 = isinstance(self.weight, Float8AllGatherWeight)
        super()._load_from_state_dict({k: v for k, v in state_dict.items() if k not in keys}, prefix,
                                      local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if gathers_fp8:  # assign=True put the checkpoint's plain tensor in its place
            wrap_weight(self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={type(self.recipe).__name__}, format={self.recipe.fp8_format.name}"


class Float8Conv1D(Float8Linear):
    """transformers' ``Conv1D`` (GPT-2's y = x · weight + bias, weight stored [nx, nf] = [in, out]) with
    Float8Linear's fp8 GEMMs, numerics and state. The weight keeps its [in, out] layout and the state_dict its
    keys, so a checkpoint stays loadable by transformers; the fp8 cast's transpose gives the [out, in] operand
    the forward GEMM takes, so no extra pass is made. Bit for bit a Float8Linear holding weightᵀ (block recipes
    take a copy of weightᵀ). In high precision: Conv1D's own ``addmm``. Made by :func:`convert_to_float8`,
    which runs it in fp8 with or without autocast. x: [..., nx] -> [..., nf], x's dtype.
    """

    in_out = True

    @classmethod
    def from_layer(cls, conv: torch.nn.Module, recipe: Any = None, shared: SharedScaling | None = None
                   ) -> "Float8Conv1D":
        """The same parameters (shared, not copied) of transformers' Conv1D ``conv``."""
        weight = getattr(conv, "weight", None)
        if not isinstance(conv, torch.nn.Module) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(f"conv: expected transformers' Conv1D (a module with a 2-D weight [nx, nf]), got "
                            f"{type(conv).__name__}")
        nx, nf = weight.shape
        new = cls._sharing(conv, nx, nf, recipe, shared, autocast_only=False)
        new.nx, new.nf = nx, nf
        return new

    def _high_precision(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight) if self.bias is not None else \
            x.reshape(-1, x.shape[-1]) @ self.weight
        return y.view(*x.shape[:-1], self.nf)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, recipe={type(self.recipe).__name__}, " \
               f"format={self.recipe.fp8_format.name}"


def _check_features(in_features: int, out_features: int, recipe: Any, shared: SharedScaling | None,
                    autocast_only: bool) -> None:
    """The layer's features (multiples of what the recipe's plan takes) and ``autocast_only``."""
    recipe = check_recipe(recipe) if shared is None else shared.recipe
    plan = linear_plan(recipe)
    for name, v in (("in_features", in_features), ("out_features", out_features)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__} {v!r}")
        if v <= 0 or v % plan.multiple:
            raise ValueError(f"{name}: {v} is not a positive multiple of {plan.multiple} under "
                             f"{type(recipe).__name__} ({plan.why})")
    if not isinstance(autocast_only, bool):
        raise TypeError(f"autocast_only: expected a bool, got {type(autocast_only).__name__}")


def _checked_state(module: Float8Linear, state_dict: Any, prefix: str) -> Optional[tuple]:
    """The module's fp8 entries of ``state_dict``, validated; None when all are absent (torch then reports them
    as missing keys when strict, and the module keeps its state when not: modules cannot see ``strict``)."""
    keys = [prefix + k for k in _KEYS]
    present = [k in state_dict for k in keys]
    if not any(present):
        return None
    if not all(present):
        missing = [k for k, p in zip(keys, present) if not p]
        raise KeyError(f"state_dict: missing {', '.join(missing)} (it has the other fp8 entries of "
                       f"{prefix[:-1] or 'the module'})")
    steps = check_state_values(*(state_dict[k] for k in keys), SLOTS, module._fp8_history_len(state_dict, prefix),
                               prefix=prefix + "fp8_")
    return state_dict[keys[0]], state_dict[keys[1]], state_dict[keys[2]], steps


def _fp8_entry_errors(module: Float8Linear, state_dict: Any, prefix: str) -> list[str]:
    """What is wrong with each fp8 entry of ``state_dict``, each checked beside the initial state's others."""
    L = module._fp8_history_len(state_dict, prefix)
    good = [*initial_state(L, "cpu"), 0]
    errors = []
    for i, key in enumerate(_KEYS):
        args = good[:i] + [state_dict[prefix + key]] + good[i + 1:]
        try:
            check_state_values(*args, SLOTS, L, prefix=prefix + "fp8_")
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    return errors


def module_load_errors(m: torch.nn.Module, state_dict: Any, prefix: str) -> list[str]:
    """Every reason ``state_dict`` cannot load into ``m`` itself (not its children) that torch would find only
    while it copies: a delayed-scaling Float8Linear's fp8 entries, and each parameter's or buffer's shape, in
    torch's words."""
    errors = []
    if isinstance(m, Float8Linear) and m._fp8_group is not None:
        try:
            _checked_state(m, state_dict, prefix)
        except KeyError as e:
            errors.append(str(e.args[0]))
        except (TypeError, ValueError):
            errors += _fp8_entry_errors(m, state_dict, prefix)
    persistent = [(k, v) for k, v in m._buffers.items() if k not in m._non_persistent_buffers_set]
    for name, t in (*m._parameters.items(), *persistent):
        key = prefix + name
        if t is None or key not in state_dict or torch.nn.parameter.is_lazy(t):
            continue
        got = state_dict[key]
        if not torch.overrides.is_tensor_like(got):
            errors.append(f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like object '
                          f"from checkpoint but received {type(got)}")
        elif got.shape != t.shape and not (t.dim() == 0 and tuple(got.shape) == (1,)):  # torch takes [1] for 0-d
            errors.append(f"size mismatch for {key}: copying a param with shape {got.shape} from checkpoint, "
                          f"the shape in current model is {t.shape}.")
    return errors


def _walk(module: torch.nn.Module, prefix: str) -> list[tuple[torch.nn.Module, str]]:
    """(module, its state_dict prefix) for ``module`` and every module below it, as load_state_dict visits them: a
    module shared by two parents under each of its names (named_modules would take it once, and would need
    modules to be hashable)."""
    out, todo = [], [(module, prefix)]
    while todo:
        m, p = todo.pop()
        out.append((m, p))
        todo.extend((c, f"{p}{name}.") for name, c in reversed(m._modules.items()) if c is not None)
    return out


def _running_load() -> Optional[tuple[torch.nn.Module, Mapping]]:
    """(module, state_dict) of the innermost ``torch.nn.Module.load_state_dict`` running on this thread, or None.
    torch gives each module only its own entries, and no handle on the module the load started from: a module
    above the ones convert_to_float8 marked can be found only here, short of a process-wide hook."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _LOAD_STATE_DICT:
            root, whole = frame.f_locals.get("self"), frame.f_locals.get("state_dict")
            if isinstance(root, torch.nn.Module) and isinstance(whole, Mapping):
                return root, whole
            return None
        frame = frame.f_back
    return None


_LOAD_STATE_DICT = torch.nn.Module.load_state_dict.__code__
_CHECKED = "_fp8core_checked"  # set on load_state_dict's own copy of the checkpoint: checked once per load


def check_whole_load(module: torch.nn.Module, state_dict: Mapping, prefix: str) -> None:
    """Refuse, before anything more is written, a load that reached ``module`` (a delayed-scaling Float8Linear, or a
    module convert_to_float8 marked) with a checkpoint that cannot load: the whole checkpoint from the module the
    load started at, once per load; everything below ``module`` where that module is not known. The error is
    torch's RuntimeError, listing every mismatch."""
    running = _running_load()
    if running is None:
        root, whole, top = module, state_dict, prefix
    else:
        (root, whole), top = running, ""
        if getattr(whole, _CHECKED, False):
            return
        try:
            setattr(whole, _CHECKED, True)
        except AttributeError:  # a mapping that takes no attribute: checked again at the next module, no harm
            pass
    errors = [e for m, p in _walk(root, top) for e in module_load_errors(m, whole, p)]
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(root).__name__}:\n\t" + "\n\t".join(errors))


def check_before_load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                      error_msgs) -> None:
    """The load_state_dict pre-hook of each module :func:`mark_loads` marked: :func:`check_whole_load` before the
    module writes its own entries."""
    check_whole_load(module, state_dict, prefix)


def mark_loads(module: torch.nn.Module) -> None:
    """Make ``load_state_dict`` check the whole checkpoint as soon as it reaches ``module`` (once per module; a
    Float8Linear checks itself first thing in _load_from_state_dict)."""
    if isinstance(module, Float8Linear) or module.__dict__.get("_fp8_checks_load"):
        return
    module.register_load_state_dict_pre_hook(check_before_load)
    module.__dict__["_fp8_checks_load"] = True  # in __dict__, not an attribute: a wrapper (torch.compile's
    # OptimizedModule) reads an attribute it lacks from the module it wraps


def _conv1d_type() -> Optional[type]:
    """transformers' Conv1D where transformers is loaded (a model holding one has loaded it); fp8core does not
    import transformers."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return getattr(utils, "Conv1D", None)


def _kept_why(child: torch.nn.Module, base: type, names: tuple[str, ...]) -> Optional[str]:
    """Why a subclass of nn.Linear or Conv1D cannot be swapped for fp8core's layer, or None when it can: its
    forward must be the base's and its state only the base's (the swap keeps weight and bias only)."""
    if type(child).forward is not base.forward:
        return f"{type(child).__name__} has its own forward"
    extra = [n for n, _ in child.named_parameters(recurse=False) if n not in names]
    extra += [n for n, _ in child.named_buffers(recurse=False)] + list(child._modules)
    if extra:
        return f"{type(child).__name__} holds more than {base.__name__}'s state ({', '.join(extra)})"
    return None


def convert_to_float8(module: torch.nn.Module, recipe: Any = None,
                      module_filter_fn: Callable[[torch.nn.Module, str], bool] | None = None) -> torch.nn.Module:
    """Swap every ``nn.Linear`` of ``module`` (in place; returned) for a Float8Linear sharing its parameters, and
    every ``transformers.pytorch_utils.Conv1D`` (GPT-2's) for a :class:`Float8Conv1D`, which keeps its [in, out]
    weight and its state_dict keys (a checkpoint stays loadable by transformers). Subclasses of either convert
    when their forward is the base's and they hold nothing more (torchao's rule); the others stay as they are.

    The layers made run in fp8 with or without :func:`autocast` (torchao's usage: a plain training loop, HF's
    ``Trainer``). Under delayed scaling all swapped layers join one group. Outside autocast its update runs at the
    first fp8 forward of a new step, the step boundary read from ``module``'s trainable parameters: written by the
    optimizer (their version counters) or their gradients cleared by ``zero_grad()`` since a backward; gradient
    accumulation's micro-batches do neither, so the update runs once per optimizer step (the rule and what it does
    not see: :meth:`SharedScaling.open_step`). Inside autocast the context's exit updates, as in Transformer
    Engine; under ``torch.compile(fullgraph=True)`` delayed scaling needs that context (the boundary is Python).
    ``module`` and every module between it and a delayed-scaling Float8Linear (converted now or before) are marked:
    ``load_state_dict`` on any of them checks the whole checkpoint before it writes anything (see
    :class:`Float8Linear`); ``module_filter_fn=lambda m, fqn: False`` marks a module built around converted layers
    later, converting nothing.
    ``module_filter_fn(layer, fqn) -> bool`` chooses layers. Layers left in high precision are named in a
    warning with the reason: the FP8 GEMM cannot take their features (not multiples of 16; of 32 under
    MXFP8BlockScaling, of 128 under Float8BlockScaling), or a subclass has its own forward or state. Those the
    filter declined are logged (logger ``fp8core.torch``, INFO).
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(f"module_filter_fn: expected a callable (module, fqn) -> bool, got "
                        f"{type(module_filter_fn).__name__}")
    recipe = check_recipe(recipe)
    plan = linear_plan(recipe)
    multiple, why = plan.multiple, plan.why
    conv1d = _conv1d_type()
    chosen, skipped, own, declined = [], [], [], []
    for fqn, child in module.named_modules():
        if isinstance(child, Float8Linear):
            continue
        if isinstance(child, torch.nn.Linear):
            kind, features = Float8Linear, (child.in_features, child.out_features)
            reason = _kept_why(child, torch.nn.Linear, ("weight", "bias"))
        elif conv1d is not None and isinstance(child, conv1d):
            kind, features = Float8Conv1D, tuple(child.weight.shape)
            reason = _kept_why(child, conv1d, ("weight", "bias"))
        else:
            continue
        if module_filter_fn is not None and not module_filter_fn(child, fqn):
            declined.append(fqn)
            continue
        if reason is not None:
            own.append(f"{fqn} ({reason})")
            continue
        if not all(f > 0 and f % multiple == 0 for f in features):
            skipped.append(f"{fqn} ({features[0]} -> {features[1]})")
            continue
        chosen.append((fqn, kind))
    if skipped:
        warnings.warn(f"convert_to_float8: kept in high precision, features not multiples of {multiple} under "
                      f"{type(recipe).__name__} ({why}): " + ", ".join(skipped), stacklevel=2)
    if own:
        warnings.warn("convert_to_float8: kept in high precision, a subclass whose forward or state fp8core's "
                      "layer would not keep (swap it yourself, or give it nn.Linear's forward): " + ", ".join(own),
                      stacklevel=2)
    if declined:
        logger.info("convert_to_float8: kept in high precision by module_filter_fn: %s", ", ".join(declined))
    shared = SharedScaling(recipe) if chosen and isinstance(recipe, DelayedScaling) else None
    for fqn, kind in chosen:
        parent_name, _, name = fqn.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        new = kind.from_layer(getattr(parent, name), recipe, shared) if kind is Float8Conv1D else \
            kind.from_linear(getattr(parent, name), recipe, shared, autocast_only=False)
        if fqn == "":
            module = new
        else:
            setattr(parent, name, new)
    if shared is not None:
        shared.watch(module)
    if chosen and chosen[0][0] == "":
        return module
    _mark_paths(module)
    return module


def _mark_paths(module: torch.nn.Module) -> bool:
    """Mark ``module`` and every module between it and a delayed-scaling Float8Linear below it (see
    :func:`mark_loads`); whether there is one."""
    if isinstance(module, Float8Linear):
        return module._fp8_group is not None
    found = False
    for child in module._modules.values():
        if child is not None and _mark_paths(child):
            found = True
    if found:
        mark_loads(module)
    return found


def enable_fsdp_float8_all_gather(module: torch.nn.Module) -> torch.nn.Module:
    """Make FSDP2 all-gather every Float8Linear weight of ``module`` in fp8 (call before ``fully_shard``).
    In place; returns ``module``. Per-tensor recipes only: a block-scaled weight (MXFP8, 1x128/128x128, NVFP4) is
    gathered in high precision, as FSDP2 gathers it without this call."""
    for name, m in module.named_modules():
        if isinstance(m, Float8Linear) and (isinstance(m.recipe, (*BLOCK_RECIPES, NVFP4BlockScaling))
                                            or is_rowwise(m.recipe)):
            raise TypeError(f"module: {name or 'the module'} uses {type(m.recipe).__name__}; fp8 all-gather takes "
                            "DelayedScaling or Float8CurrentScaling (one scale per weight), not block or rowwise "
                            "scaling (an NVFP4 weight's 16x16 tiles and global amax span the shards: FSDP2 gathers "
                            "it in high precision without this call)")
    for m in module.modules():
        if isinstance(m, Float8Linear):
            wrap_weight(m)
    return module
