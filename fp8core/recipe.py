"""Scaling recipes, in Transformer Engine's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

from . import args
from .args import AMAX_ALGOS, MAX_HISTORY_LEN
from .formats import E2M1, Encoding, Format
from .layouts import Layout

__all__ = ["DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling",
           "Float8RowwiseScaling", "OverrideLinearPrecision", "RECIPE_NAMES"]


class OverrideLinearPrecision(NamedTuple):
    """Transformer Engine's ``_OverrideLinearPrecision``: which of a Linear's three GEMMs run in high precision
    (the caller's dtype, on the unquantized tensors) instead of FP8. fprop: y = x W^T; dgrad: dx = dy W;
    wgrad: dW = dy^T x."""

    fprop: bool = False
    dgrad: bool = False
    wgrad: bool = False


def _override(recipe: Any) -> None:
    value = recipe.override_linear_precision
    if not isinstance(value, tuple) or len(value) != 3:
        raise TypeError(f"override_linear_precision: expected (fprop, dgrad, wgrad), three bools "
                        f"(OverrideLinearPrecision), got {value!r}")
    flags = [args.flag(v, f"override_linear_precision.{name}")
             for v, name in zip(value, OverrideLinearPrecision._fields)]
    _set(recipe, "override_linear_precision", OverrideLinearPrecision(*flags))


# ---- field checks shared by every recipe: at construction, naming the field -------------------------------

def _set(recipe: Any, field: str, value: Any) -> None:
    object.__setattr__(recipe, field, value)


def _int(recipe: Any, field: str, low: int | None = None, high: int | None = None) -> None:
    _set(recipe, field, args.integer(getattr(recipe, field), field, low, high))


def _bool(recipe: Any, field: str) -> None:
    _set(recipe, field, args.flag(getattr(recipe, field), field))


def _epsilon(recipe: Any, field: str) -> None:
    _set(recipe, field, args.epsilon(getattr(recipe, field), field))


def _repr(recipe: Any) -> str:
    """``DelayedScaling(margin=0, ..., fp8_format=Format.HYBRID, ...)``: formats and callables by name."""
    def show(v: Any) -> str:
        if isinstance(v, Format):
            return f"Format.{v.name}"
        if callable(v):
            return getattr(v, "__qualname__", None) or repr(v)
        return repr(v)

    # TE's per-GEMM override shows only where it overrides something (most recipes never set it)
    fields = ", ".join(f"{f}={show(getattr(recipe, f))}" for f in recipe.__dataclass_fields__
                       if f != "override_linear_precision" or any(recipe.override_linear_precision))
    return f"{type(recipe).__name__}({fields})"


def _format(recipe: Any) -> None:
    _set(recipe, "fp8_format", args.as_format(recipe.fp8_format, arg="fp8_format", allow_hybrid=True))


@dataclass(frozen=True, repr=False)
class DelayedScaling:
    """Delayed scaling: each tensor's scale comes from the amax history of earlier steps.

    margin: the scale is divided by 2**margin. interval: steps between scale updates (the history rolls
    every step). amax_history_len: L, rows of the history (at most 2**31 - 1). amax_compute_algo: "max",
    "most_recent", or a callable ``(history[L, N]) -> amax[N]``. scaling_factor_compute_algo: optional callable
    ``(amax[N], scale[N], fp8_max[N], recipe) -> scale[N]``. power_of_2: round scales down to powers of two.
    reduce_amax: all-reduce (MAX) row 0 across the group before each update. override_linear_precision:
    (fprop, dgrad, wgrad), the GEMMs a Linear runs in high precision (Transformer Engine's field).
    """

    margin: int = 0
    interval: int = 1
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Any = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    power_of_2: bool = False
    reduce_amax: bool = True
    epsilon: float = 0.0
    override_linear_precision: OverrideLinearPrecision = OverrideLinearPrecision()

    def __post_init__(self) -> None:
        _override(self)
        _format(self)
        _set(self, "margin", args.margin(self.margin))
        _int(self, "interval", low=1)
        _int(self, "amax_history_len", low=1, high=MAX_HISTORY_LEN)
        algo = self.amax_compute_algo
        if not callable(algo) and not (isinstance(algo, str) and algo in AMAX_ALGOS):
            raise ValueError(f"amax_compute_algo: expected 'max', 'most_recent' or a callable, "
                             f"got {self.amax_compute_algo!r}")
        if self.scaling_factor_compute_algo is not None and not callable(self.scaling_factor_compute_algo):
            raise TypeError(f"scaling_factor_compute_algo: expected a callable or None, "
                            f"got {type(self.scaling_factor_compute_algo).__name__}")
        _bool(self, "power_of_2")
        _bool(self, "reduce_amax")
        _epsilon(self, "epsilon")

    __repr__ = _repr


@dataclass(frozen=True, repr=False)
class Float8CurrentScaling:
    """Current (dynamic) scaling: each tensor is scaled by its own amax, taken just before the cast.

    override_linear_precision: (fprop, dgrad, wgrad), the GEMMs a Linear runs in high precision (Transformer
    Engine's field).
    """

    fp8_format: Format = Format.HYBRID
    power_of_2: bool = False
    amax_epsilon: float = 0.0
    margin: int = 0
    override_linear_precision: OverrideLinearPrecision = OverrideLinearPrecision()

    def __post_init__(self) -> None:
        _override(self)
        _format(self)
        _bool(self, "power_of_2")
        _epsilon(self, "amax_epsilon")
        _set(self, "margin", args.margin(self.margin))

    __repr__ = _repr


@dataclass(frozen=True, repr=False)
class MXFP8BlockScaling:
    """MXFP8 (OCP Microscaling): one E8M0 scale per 32 consecutive elements, made from the block's own amax.

    Stateless, like current scaling. scale_mode: "rceil" rounds the scale up (the block's amax lands at or
    below fp8_max; NVIDIA's hardware conversion and Transformer Engine), "floor" is the OCP specification's.
    """

    fp8_format: Format = Format.E4M3
    scale_mode: str = "rceil"

    def __post_init__(self) -> None:
        _format(self)
        args.scale_mode(self.scale_mode)

    __repr__ = _repr


_BLOCK_DIMS = (1, 2)


@dataclass(frozen=True, repr=False)
class Float8BlockScaling:
    """DeepSeek-V3's block scaling: fp32 scales per 1x128 block (activations, gradients) and per 128x128 tile
    (weights), each from its block's amax by the per-tensor scale rule. Stateless, like current scaling.

    power_of_2: round every block scale down to a power of two (Transformer Engine's default here).
    epsilon: floor of each block's amax. x/w/grad_block_scaling_dim: 1 = 1x128 blocks, 2 = 128x128 tiles.
    """

    fp8_format: Format = Format.E4M3
    power_of_2: bool = True
    epsilon: float = 0.0
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self) -> None:
        _format(self)
        _bool(self, "power_of_2")
        _epsilon(self, "epsilon")
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in _BLOCK_DIMS:
                raise ValueError(f"{name}: expected 1 (1x128 blocks) or 2 (128x128 tiles), got {value!r}")

    @property
    def layouts(self) -> tuple[Layout, Layout, Layout]:
        """The (input, weight, grad_output) layouts the block dims name: 1 -> 1x128, 2 -> 128x128."""
        dims = (self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim)
        return tuple(Layout.BLOCK_1X128 if d == 1 else Layout.BLOCK_128X128 for d in dims)

    __repr__ = _repr


@dataclass(frozen=True, repr=False)
class Float8RowwiseScaling:
    """torchao's rowwise (axiswise) recipes: one fp32 scale per row of each GEMM operand, over the GEMM's K
    (docs/numerics.md, "Rowwise (axiswise) scaling"). Stateless, like current scaling.

    Input per token, weight per output channel (forward) and per input channel (dgrad), grad_output per token
    (dgrad) and per output channel (wgrad), every operand ``fp8_format`` (E4M3, as torchao's recipes set it).
    power_of_2: round scales down to powers of two (torchao's ``round_scales_to_power_of_2=True``). epsilon: floor
    of each amax, torchao's EPS (1e-12) by default, so rows of tiny or zero amax get torchao's scale (2^48).
    wgrad_high_precision: torchao's ``rowwise_with_gw_hp``: the weight-gradient GEMM in high
    precision, the dgrad GEMM with one (power-of-two) scale for the weight. :meth:`from_recipe_name` takes
    torchao's names.
    """

    fp8_format: Format = Format.E4M3
    power_of_2: bool = True
    epsilon: float = 1e-12
    wgrad_high_precision: bool = False

    def __post_init__(self) -> None:
        _format(self)
        if self.fp8_format is not Format.E4M3:
            raise ValueError(f"fp8_format: expected Format.E4M3 (torchao's rowwise recipes cast every operand, "
                             f"grad_output included, to E4M3), got Format.{self.fp8_format.name}")
        _bool(self, "power_of_2")
        _epsilon(self, "epsilon")
        _bool(self, "wgrad_high_precision")

    @classmethod
    def from_recipe_name(cls, name: str) -> "Float8RowwiseScaling":
        """torchao's ``Float8LinearConfig.from_recipe_name`` for its rowwise names: "rowwise" or
        "rowwise_with_gw_hp" (see :data:`RECIPE_NAMES` for "tensorwise")."""
        recipe = recipe_from_name(name)
        if not isinstance(recipe, cls):
            raise ValueError(f"name: expected 'rowwise' or 'rowwise_with_gw_hp', got {name!r}")
        return recipe

    __repr__ = _repr


RECIPE_NAMES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName values


def recipe_from_name(name: Any) -> Any:
    """The recipe torchao's ``Float8LinearConfig.from_recipe_name(name)`` describes: "tensorwise" (current
    scaling, E4M3 forward and E5M2 grad_output: Float8CurrentScaling()), "rowwise" or "rowwise_with_gw_hp"
    (:class:`Float8RowwiseScaling`)."""
    if name == "tensorwise":
        return Float8CurrentScaling()
    if name in ("rowwise", "rowwise_with_gw_hp"):
        return Float8RowwiseScaling(wgrad_high_precision=name == "rowwise_with_gw_hp")
    raise ValueError(f"recipe: expected a recipe or one of torchao's recipe names {', '.join(map(repr, RECIPE_NAMES))}"
                     f", got {name!r}")


@dataclass(frozen=True, repr=False)
class NVFP4BlockScaling:
    """Transformer Engine's NVFP4 recipe: E2M1 elements in 1x16 blocks with E4M3 block scales under an fp32 global
    scale from the tensor's amax (docs/numerics.md, "NVFP4"). Stateless, like current scaling.

    By default weights take one scale per 16x16 tile, inputs and gradients the random Hadamard transform on their
    columnwise (wgrad GEMM) operand, and gradients stochastic rounding. disable_rht: no Hadamard transform on any
    tensor. disable_stochastic_rounding: round every tensor to nearest. disable_2d_quantization: 1x16 blocks for
    weights too. fp4_format: the elements' encoding (only fp8core.formats.E2M1, or its name "e2m1";
    fp8core's Format holds the FP8 choices only). fp8_format: the block scales'
    encoding (only Format.E4M3). TE's further fields (row-scaled activations, 4over6, backward_override) are not in
    fp8core's contract. Stochastic rounding's (seed, offset) is each layer's state (docs/numerics.md, "Training with
    NVFP4BlockScaling").
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    fp4_format: Encoding = E2M1
    fp8_format: Format = Format.E4M3

    def __post_init__(self) -> None:
        for name in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            _bool(self, name)
        fp4 = self.fp4_format
        if fp4 is not E2M1 and not (isinstance(fp4, str) and fp4.lower() == "e2m1"):
            raise ValueError(f"fp4_format: expected fp8core.formats.E2M1 or 'e2m1' (NVFP4's elements), got {fp4!r}")
        _set(self, "fp4_format", E2M1)
        _format(self)
        if self.fp8_format is not Format.E4M3:
            raise ValueError(f"fp8_format: expected Format.E4M3 (NVFP4's block scales), got "
                             f"Format.{self.fp8_format.name}")

    __repr__ = _repr
