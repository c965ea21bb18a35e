"""FP8 weight all-gather under FSDP2 (``fully_shard``): half the bytes of a bf16 all-gather on the wire.

:func:`enable_fsdp_float8_all_gather` wraps each Float8Linear's weight in a :class:`Float8AllGatherWeight`
(before ``fully_shard``). FSDP2 shards it like any parameter (the master weight keeps its precision); at each
all-gather every rank casts its own shard once, with the weight's scale, and FSDP2 gathers the fp8 bytes:

- delayed scaling: the weight's own scale (slot 1 of the module's state); the shard's amax goes into row 0,
  and the update's MAX all-reduce makes it the whole weight's amax, as the high-precision all-gather gives;
- current scaling: one MAX all-reduce of the shards' amaxes gives the whole weight's amax, then its scale.

The gathered weight (:class:`Float8GatheredWeight`, fp8 data and its scale_inv) feeds the GEMM without a
second cast, so outputs and gradients are those of the high-precision all-gather, bit for bit, with or without
a ``MixedPrecisionPolicy(param_dtype=...)`` (the shard is rounded to ``param_dtype`` before its amax and its
cast, as the high-precision all-gather rounds it before the GEMM's cast). Any other use of the gathered weight
(a forward outside ``autocast``) sees it dequantized to the parameter dtype.

Each all-gather casts: with FSDP2's default ``reshard_after_forward=True`` the weight is gathered again for the
backward, so each shard is cast to fp8 twice a step (the same bits both times: its scale changes only at the
update, after the step). ``fully_shard(..., reshard_after_forward=False)`` keeps the gathered fp8 weight from
the forward to the backward and casts once a step, for the memory of one unsharded fp8 weight per layer.
Checkpoints (``state_dict``, torch.distributed.checkpoint) hold the plain weight, not the wrapper.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from . import ops

__all__ = ["Float8AllGatherWeight", "Float8GatheredWeight", "plain_weight", "wrap_weight"]

_aten = torch.ops.aten
# what FSDP2 does to a parameter to shard, pad and copy it: the result stays a Float8AllGatherWeight
_PRESERVE = {_aten.empty_like, _aten.new_zeros, _aten.new_empty, _aten.slice, _aten.copy_, _aten.view,
             _aten.as_strided, _aten._to_copy, _aten._pin_memory, _aten.split, _aten.clone, _aten.detach,
             _aten.alias, _aten.chunk, _aten.narrow}

_VIEWS = {_aten.detach, _aten.alias, _aten.as_strided, _aten.view}


class Float8AllGatherWeight(torch.Tensor):
    """A high-precision weight that FSDP2 all-gathers in fp8 (see the module docstring). Everything else
    (the optimizer, initialisation, checkpoints) sees the weight itself."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor) -> "Float8AllGatherWeight":
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, device=tensor.device, layout=tensor.layout, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.high_precision = tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"Float8AllGatherWeight({self.high_precision!r})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["high_precision"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, outer_size: Any, outer_stride: Any) -> "Float8AllGatherWeight":
        return Float8AllGatherWeight(inner["high_precision"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs or {}))
        if func.overloadpacket in _PRESERVE:
            return tree_map(lambda t: cls(t) if type(t) is torch.Tensor else t, out)
        return out

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, outer_stride: Any, module: torch.nn.Module,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This rank's shard cast to fp8 (the bytes FSDP2 gathers), and its scale_inv. The shard is first rounded
        to the policy's ``param_dtype``, as the high-precision all-gather would give it to the GEMM's cast."""
        shard = self.high_precision
        param_dtype = getattr(mp_policy, "param_dtype", None)
        if param_dtype is not None and param_dtype != shard.dtype:
            shard = shard.to(param_dtype)
        return module.cast_for_all_gather(shard, mesh)

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype,
                             *, out: Any = None) -> Any:
        (data,) = outputs
        if out is not None:  # FSDP2 refilled the same storage: only the scale is new
            out.scale_inv.copy_(metadata)
            return None
        return Float8GatheredWeight(data, metadata, param_dtype), (data,)


class Float8GatheredWeight(torch.Tensor):
    """The unsharded weight as FSDP2 gathered it: fp8 ``data`` [out, in] and its ``scale_inv`` [1], seen as a
    ``dtype`` tensor (the parameter's). Float8Linear feeds the fp8 data to its GEMMs as it is."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> "Float8GatheredWeight":
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(), dtype=dtype,
                                                   device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> None:
        self.codes, self.scale_inv = data, scale_inv

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"Float8GatheredWeight({self.codes.dtype}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def dequantized(self) -> torch.Tensor:
        return ops.dequantize(self.codes, self.scale_inv, self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func.overloadpacket in _VIEWS:  # FSDP2's as_strided/detach of the gathered weight: the same fp8 bytes
            w, rest = args[0], args[1:]
            return cls(func(w.codes, *rest, **(kwargs or {})), w.scale_inv, w.dtype)

        def plain(t: Any) -> Any:
            return t.dequantized() if isinstance(t, cls) else t

        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))


def plain_weight(t: torch.Tensor) -> torch.Tensor:
    """The weight as a checkpoint holds it: a Float8AllGatherWeight (alone, or as a DTensor's shard under
    FSDP2) becomes the plain tensor it wraps, the same storage, so ``torch.load(weights_only=True)`` and
    ``torch.distributed.checkpoint`` take the checkpoint (they refuse unknown tensor classes)."""
    if isinstance(t, Float8AllGatherWeight):
        return t.high_precision
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, Float8AllGatherWeight):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local.high_precision, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    return t


def _unwrap(t: Any) -> Any:
    return t.high_precision if isinstance(t, Float8AllGatherWeight) else t


def wrap_weight(m: torch.nn.Module) -> None:
    """``m.weight`` as a Float8AllGatherWeight parameter (unless it is one already)."""
    w = m.weight
    if not isinstance(w, Float8AllGatherWeight):
        m.weight = torch.nn.Parameter(Float8AllGatherWeight(w.data), requires_grad=w.requires_grad)
