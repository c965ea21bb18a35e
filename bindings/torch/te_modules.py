"""Transformer Engine's fused modules as TE users write them: ``te.LayerNorm``, ``te.RMSNorm``,
``te.LayerNormLinear`` and ``te.LayerNormMLP``, with TE's constructor arguments, defaults and parameter names.

The normalisation runs in high precision (torch's own ``layer_norm``/``rms_norm`` in the parameters' dtype)
and feeds :class:`~fp8core.torch.Linear` layers, which follow TE's rule: fp8 inside ``te.autocast``, high
precision outside. TE fuses the norm into the cast; fp8core casts the norm's output as any input, with the same
result. ``zero_centered_gamma=True``: the norm's weight starts at 0 and scales by (1 + weight), as in TE.
LayerNormMLP's activations are TE's: ``gelu`` (tanh approximation, as TE computes it), ``relu``, ``qgelu``
(x · sigmoid(1.702 x)), ``srelu`` (relu²), ``silu``, and the gated ``geglu``, ``reglu``, ``qgeglu``, ``sreglu``,
``swiglu``, whose fc1 is twice as wide: act(first half) · second half.

Arguments after ``eps`` go by keyword (TE's next positional ones are its parallel options). TE's arguments for
tensor or sequence parallelism, userbuffers and fused paths are refused by name (as
te.Linear refuses them). LayerNormMLP's two GEMMs are the submodules ``fc1`` and ``fc2``, so its state_dict keys
are ``fc1.weight``/``fc2.bias``...; TE's ``fc1_weight``... are attributes reading them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F

from .te import Linear

__all__ = ["LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP"]

_NORMS = ("LayerNorm", "RMSNorm")
_PARALLEL = ("sequence_parallel", "fuse_wgrad_accumulation", "tp_group", "tp_size", "get_rng_state_tracker",
             "rng_tracker_name", "return_bias", "parallel_mode", "set_parallel_mode", "parameters_split",
             "return_layernorm_output_gathered", "seq_length", "micro_batch_size", "ub_overlap_ag",
             "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_overlap_ag_fprop", "ub_overlap_rs_fprop", "ub_bulk_dgrad",
             "ub_bulk_wgrad", "ub_name", "delay_wgrad_compute", "symmetric_ar_type", "name", "checkpoint",
             "activation_params", "use_ln_bias", "bias_gelu_nvfusion")


def _refuse(cls: str, extra: dict[str, Any]) -> None:
    """TE arguments fp8core does not have are refused by name, never ignored (a model built silently without them
    would train differently); anything else is a typo."""
    if not extra:
        return
    known = sorted(k for k in extra if k in _PARALLEL)
    if known:
        raise TypeError(f"{', '.join(known)}: Transformer Engine's {cls} arguments for parallel or fused paths "
                        f"that fp8core.torch.{cls} does not have (wrap the model in DDP or FSDP2 instead)")
    raise TypeError(f"{cls}: unexpected keyword argument(s) {', '.join(sorted(extra))}")


def _check(cls: str, hidden_size: int, eps: float, zero_centered_gamma: bool,
           params_dtype: Optional[torch.dtype]) -> None:
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
        raise ValueError(f"hidden_size: expected a positive int, got {hidden_size!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {eps!r}")
    if not isinstance(zero_centered_gamma, bool):
        raise TypeError(f"zero_centered_gamma: expected a bool, got {type(zero_centered_gamma).__name__}")
    if params_dtype is not None and not (isinstance(params_dtype, torch.dtype) and params_dtype.is_floating_point):
        raise TypeError(f"params_dtype: expected a floating-point torch.dtype, got {params_dtype!r}")


def _gamma(hidden_size: int, zero_centered_gamma: bool, dtype: Any, device: Any) -> torch.nn.Parameter:
    fill = torch.zeros if zero_centered_gamma else torch.ones
    return torch.nn.Parameter(fill(hidden_size, dtype=dtype, device=device))


def _norm(x: torch.Tensor, normalization: str, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
          zero_centered_gamma: bool) -> torch.Tensor:
    """[..., hidden] in high precision (the weight's dtype, as TE's norm output)."""
    w = weight + 1 if zero_centered_gamma else weight
    x = x.to(weight.dtype)
    if normalization == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return F.layer_norm(x, (x.shape[-1],), w, bias, eps)


class LayerNorm(torch.nn.Module):
    """``te.LayerNorm(hidden_size, eps=1e-5, params_dtype=None, zero_centered_gamma=False, device=None)``:
    y = (x - mean) / sqrt(var + eps) · γ + β over the last dim, in high precision. Parameters ``weight`` (γ) and
    ``bias`` (β), [hidden_size], params_dtype (default torch's). x: [..., hidden_size] -> y in params_dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, params_dtype: Optional[torch.dtype] = None,
                 zero_centered_gamma: bool = False, device: Any = None, **te_only: Any) -> None:
        _refuse("LayerNorm", te_only)
        _check("LayerNorm", hidden_size, eps, zero_centered_gamma, params_dtype)
        super().__init__()
        self.hidden_size, self.eps, self.zero_centered_gamma = hidden_size, float(eps), zero_centered_gamma
        self.weight = _gamma(hidden_size, zero_centered_gamma, params_dtype, device)
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _norm(x, "LayerNorm", self.weight, self.bias, self.eps, self.zero_centered_gamma)


class RMSNorm(torch.nn.Module):
    """``te.RMSNorm(hidden_size, eps=1e-5, params_dtype=None, zero_centered_gamma=False, device=None)``:
    y = x / sqrt(mean(x²) + eps) · γ over the last dim, in high precision. Parameter ``weight`` (γ)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, params_dtype: Optional[torch.dtype] = None,
                 zero_centered_gamma: bool = False, device: Any = None, **te_only: Any) -> None:
        _refuse("RMSNorm", te_only)
        _check("RMSNorm", hidden_size, eps, zero_centered_gamma, params_dtype)
        super().__init__()
        self.hidden_size, self.eps, self.zero_centered_gamma = hidden_size, float(eps), zero_centered_gamma
        self.weight = _gamma(hidden_size, zero_centered_gamma, params_dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _norm(x, "RMSNorm", self.weight, None, self.eps, self.zero_centered_gamma)


def _check_normalization(normalization: str) -> None:
    if normalization not in _NORMS:
        raise ValueError(f"normalization: expected 'LayerNorm' or 'RMSNorm', got {normalization!r}")


class LayerNormLinear(Linear):
    """``te.LayerNormLinear(in_features, out_features, eps=1e-5, bias=True, normalization="LayerNorm",
    return_layernorm_output=False, zero_centered_gamma=False, params_dtype=None, device=None, init_method=None)``:
    the norm in high precision, then te.Linear (fp8 inside te.autocast). Parameters as TE names them:
    ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only), ``weight``, ``bias``.
    x: [..., in_features] -> [..., out_features], or (out, norm output) with ``return_layernorm_output``."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, *, bias: bool = True,
                 normalization: str = "LayerNorm", return_layernorm_output: bool = False,
                 zero_centered_gamma: bool = False, params_dtype: Optional[torch.dtype] = None, device: Any = None,
                 init_method: Optional[Callable[[torch.Tensor], Any]] = None, recipe: Any = None,
                 **te_only: Any) -> None:
        _refuse("LayerNormLinear", te_only)
        _check_normalization(normalization)
        _check("LayerNormLinear", in_features, eps, zero_centered_gamma, params_dtype)
        if not isinstance(return_layernorm_output, bool):
            raise TypeError(f"return_layernorm_output: expected a bool, got {type(return_layernorm_output).__name__}")
        super().__init__(in_features, out_features, bias, params_dtype=params_dtype, device=device,
                         init_method=init_method, recipe=recipe)
        self.eps, self.normalization, self.zero_centered_gamma = float(eps), normalization, zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        dtype = params_dtype
        self.layer_norm_weight = _gamma(in_features, zero_centered_gamma, dtype, device)
        self.layer_norm_bias = torch.nn.Parameter(torch.zeros(in_features, dtype=dtype, device=device)) \
            if normalization == "LayerNorm" else None

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        normed = _norm(x, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                       self.zero_centered_gamma)
        out = super().forward(normed)
        return (out, normed) if self.return_layernorm_output else out


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _qgelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _srelu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


# TE's activation names -> (the function, whether gated: fc1 twice as wide, act(first half) * second half)
ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "gelu": (_tanh_gelu, False), "relu": (F.relu, False), "qgelu": (_qgelu, False), "srelu": (_srelu, False),
    "silu": (F.silu, False), "geglu": (_tanh_gelu, True), "reglu": (F.relu, True), "qgeglu": (_qgelu, True),
    "sreglu": (_srelu, True), "swiglu": (F.silu, True),
}


class LayerNormMLP(torch.nn.Module):
    """``te.LayerNormMLP(hidden_size, ffn_hidden_size, eps=1e-5, bias=True, normalization="LayerNorm",
    activation="gelu", return_layernorm_output=False, zero_centered_gamma=False, params_dtype=None, device=None,
    init_method=None, output_layer_init_method=None)``: norm (high precision) -> fc1 (te.Linear, hidden ->
    ffn, 2·ffn for a gated activation) -> activation (high precision) -> fc2 (te.Linear, ffn -> hidden).
    Parameters ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only); ``fc1_weight``, ``fc1_bias``,
    ``fc2_weight``, ``fc2_bias`` read the submodules ``fc1``, ``fc2``. x: [..., hidden_size] -> [..., hidden_size],
    or (out, norm output) with ``return_layernorm_output``."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, *, bias: bool = True,
                 normalization: str = "LayerNorm", activation: str = "gelu", return_layernorm_output: bool = False,
                 zero_centered_gamma: bool = False, params_dtype: Optional[torch.dtype] = None, device: Any = None,
                 init_method: Optional[Callable[[torch.Tensor], Any]] = None,
                 output_layer_init_method: Optional[Callable[[torch.Tensor], Any]] = None, recipe: Any = None,
                 **te_only: Any) -> None:
        _refuse("LayerNormMLP", te_only)
        _check_normalization(normalization)
        _check("LayerNormMLP", hidden_size, eps, zero_centered_gamma, params_dtype)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {', '.join(ACTIVATIONS)} (Transformer Engine's names), "
                             f"got {activation!r}")
        if not isinstance(return_layernorm_output, bool):
            raise TypeError(f"return_layernorm_output: expected a bool, got {type(return_layernorm_output).__name__}")
        super().__init__()
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.eps, self.normalization, self.zero_centered_gamma = float(eps), normalization, zero_centered_gamma
        self.activation, self.return_layernorm_output = activation, return_layernorm_output
        self.layer_norm_weight = _gamma(hidden_size, zero_centered_gamma, params_dtype, device)
        self.layer_norm_bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device)) \
            if normalization == "LayerNorm" else None
        gated = ACTIVATIONS[activation][1]
        self.fc1 = Linear(hidden_size, ffn_hidden_size * (2 if gated else 1), bias, params_dtype=params_dtype,
                          device=device, init_method=init_method, recipe=recipe)
        self.fc2 = Linear(ffn_hidden_size, hidden_size, bias, params_dtype=params_dtype, device=device,
                          init_method=output_layer_init_method or init_method, recipe=recipe)

    fc1_weight = property(lambda self: self.fc1.weight)
    fc1_bias = property(lambda self: self.fc1.bias)
    fc2_weight = property(lambda self: self.fc2.weight)
    fc2_bias = property(lambda self: self.fc2.bias)

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        normed = _norm(x, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                       self.zero_centered_gamma)
        h = self.fc1(normed)
        act, gated = ACTIVATIONS[self.activation]
        h = act(h[..., :self.ffn_hidden_size]) * h[..., self.ffn_hidden_size:] if gated else act(h)
        out = self.fc2(h)
        return (out, normed) if self.return_layernorm_output else out
