"""Transformer Engine's module-level helpers, as ``te.*``: what the device supports (``is_fp8_available``,
``is_mxfp8_available``, ``is_fp8_block_scaling_available``, with TE's ``return_reason``) and the context that
keeps the weights of the layers made inside it in fp8 only (``fp8_model_init``, and its newer name
``quantized_model_init``).

fp8core's FP8 runs on the CPU wherever torch runs (the exact reference backend) and on CUDA devices through
CuPy; the answers say so per the current device, as TE's do. A weight kept in fp8 is cast once, when the layer
is made, with a scale of its own amax (the recipe's margin; the recipe's forward format), and never
updated: fp8core trains high-precision weights only, so such a layer is for inference or stays frozen, and
a gradient asked of it is refused by name.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import threading
from typing import Any, Iterator, Optional, Union

import torch

from fp8core import DelayedScaling, Float8CurrentScaling

from . import ops
from .scaling import check_recipe

__all__ = ["is_fp8_available", "is_mxfp8_available", "is_fp8_block_scaling_available", "fp8_model_init",
           "quantized_model_init"]

_local = threading.local()


def _answer(ok: bool, reason: str, return_reason: bool) -> Union[bool, tuple[bool, str]]:
    if not isinstance(return_reason, bool):
        raise TypeError(f"return_reason: expected a bool, got {type(return_reason).__name__}")
    return (ok, "" if ok else reason) if return_reason else ok


def _cuda_reason(need: tuple[int, int], what: str, exact: bool = False) -> str:
    """Why the current CUDA device cannot run ``what`` ("" where it can)."""
    if importlib.util.find_spec("cupy") is None:
        return "fp8core's CUDA backend needs CuPy (pip install fp8core[cuda13]); CPU tensors run fp8 without it"
    cc = torch.cuda.get_device_capability()
    if (cc != need) if exact else (cc < need):
        return (f"{what} needs compute capability {need[0]}.{need[1]}{'' if exact else ' or newer'}; "
                f"cuda:{torch.cuda.current_device()} is {cc[0]}.{cc[1]}")
    return ""


def _available(need: tuple[int, int], what: str, return_reason: bool, exact: bool = False
               ) -> Union[bool, tuple[bool, str]]:
    reason = _cuda_reason(need, what, exact) if torch.cuda.is_available() else ""
    return _answer(not reason, reason, return_reason)


def is_fp8_available(return_reason: bool = False) -> Union[bool, tuple[bool, str]]:
    """TE's ``te.is_fp8_available``: whether delayed and current scaling run in fp8 on the current device, and
    with ``return_reason=True`` the pair (available, why not; "" when available). Without a CUDA device: the CPU
    reference, always available. CUDA: the FP8 GEMM needs compute capability 8.9 (Ada) or newer, and CuPy."""
    return _available((8, 9), "the FP8 GEMM", return_reason)


def is_mxfp8_available(return_reason: bool = False) -> Union[bool, tuple[bool, str]]:
    """TE's ``te.is_mxfp8_available``: MXFP8BlockScaling's GEMM (CUDA: compute capability 10.0, Blackwell)."""
    return _available((10, 0), "the MXFP8 GEMM", return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> Union[bool, tuple[bool, str]]:
    """TE's ``te.is_fp8_block_scaling_available``: Float8BlockScaling's GEMM (CUDA: cuBLASLt has its scale modes
    on compute capability 9.0, Hopper, only)."""
    return _available((9, 0), "the 1x128/128x128 block GEMM", return_reason, exact=True)


class _ModelInit:
    def __init__(self, enabled: bool, recipe: Any, preserve: bool) -> None:
        self.enabled, self.recipe, self.preserve = enabled, recipe, preserve


def model_init_context() -> Optional[_ModelInit]:
    """The innermost enabled fp8_model_init, or None (layers made now keep high-precision weights)."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack and stack[-1].enabled else None


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Any] = None,
                         preserve_high_precision_init_val: bool = False) -> Iterator[None]:
    """TE's ``te.quantized_model_init`` (``fp8_model_init`` its older name): te.Linear, te.LayerNormLinear and
    te.LayerNormMLP made inside keep their weights in fp8 only (per-tensor: ``recipe`` DelayedScaling, the
    default, or Float8CurrentScaling; block recipes are refused). ``preserve_high_precision_init_val=True``:
    each such weight keeps its initial high-precision value on the CPU, read by the parameter's
    ``get_high_precision_init_val()`` and dropped by ``clear_high_precision_init_val()``, as TE does (to start a
    high-precision master copy). fp8core runs these layers in fp8 inside autocast and dequantizes the weight
    outside it; it does not train them (module docstring)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    if not isinstance(preserve_high_precision_init_val, bool):
        raise TypeError(f"preserve_high_precision_init_val: expected a bool, got "
                        f"{type(preserve_high_precision_init_val).__name__}")
    recipe = check_recipe(recipe)
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(f"recipe: fp8core keeps weights in fp8 under DelayedScaling or Float8CurrentScaling (one "
                        f"scale per weight), not {type(recipe).__name__}")
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(_ModelInit(enabled, recipe, preserve_high_precision_init_val))
    try:
        yield
    finally:
        stack.pop()


def fp8_model_init(enabled: bool = True, recipe: Optional[Any] = None,
                   preserve_high_precision_init_val: bool = False) -> contextlib.AbstractContextManager:
    """TE's older name for :func:`quantized_model_init`."""
    return quantized_model_init(enabled, recipe, preserve_high_precision_init_val)


def _init_val(store: dict) -> Optional[torch.Tensor]:
    return store.get("value")


def _clear_init_val(store: dict) -> None:
    store.pop("value", None)


@torch.no_grad()
def keep_weight_in_fp8(layer: torch.nn.Module, init: _ModelInit) -> None:
    """Replace ``layer.weight`` by its fp8 cast (a frozen parameter of torch's fp8 dtype) and register its
    ``weight_scale_inv`` [1] float32 buffer (both in state_dict)."""
    weight = layer.weight
    fmt = init.recipe.fp8_format.fwd.value
    r = init.recipe
    epsilon = float(getattr(r, "amax_epsilon", 0.0))  # DelayedScaling has none: TE's default 0
    scale, scale_inv = ops.compute_scale(ops.amax(weight), fmt, r.margin, r.power_of_2, epsilon)
    q = torch.nn.Parameter(ops.quantize(weight, scale, fmt), requires_grad=False)
    if init.preserve:
        store = {"value": weight.detach().to("cpu", copy=True)}
        q.get_high_precision_init_val = functools.partial(_init_val, store)
        q.clear_high_precision_init_val = functools.partial(_clear_init_val, store)
    layer.weight = q
    layer.register_buffer("weight_scale_inv", scale_inv.reshape(1).clone())
