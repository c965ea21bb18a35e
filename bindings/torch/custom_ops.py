"""Torch custom ops made from fp8core's declarations (fp8core.declarations): the op's schema from the declared
arguments, its body the declared call into the core, its fake the declared output rule, so that
``torch.compile(fullgraph=True)`` and eager agree on shapes, dtypes and the core's errors.

An argument on the meta device beside real ones is refused with the core's error, as a hand-written op's fake
does (fake_rules.py says why).

An optional argument that an op mutates (an amax slot) trips Inductor when it is None (torch 2.13), so such a
declaration makes two ops: ``name`` without the slot and ``name_amax`` with it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch

import fp8core
from fp8core.declare import REQUIRED, Primitive, Spec

from .fake_rules import refuse_meta

__all__ = ["follow_torch_threads", "custom_op", "custom_ops"]

_LIB = "fp8core"
_TYPES = {"Tensor": torch.Tensor, "Tensor?": Optional[torch.Tensor], "str": str, "int": int, "float": float,
          "bool": bool, "dtype": torch.dtype}
_RETURNS = {0: None, 1: torch.Tensor}


def follow_torch_threads(fn: Callable) -> Callable:
    """The op's body inside ``fp8core.cpu_threads(torch.get_num_threads())``: fp8core's CPU work (its pool, NumPy's
    BLAS) takes the threads torch takes, so ``torch.set_num_threads`` is the one setting of a torch program."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with fp8core.cpu_threads(torch.get_num_threads()):
            return fn(*args, **kwargs)
    return run


def _unaliased(outs: tuple, ins: tuple) -> tuple:
    """An op's outputs may not alias its inputs: a copy of any output that is an input's storage."""
    storages = {t.untyped_storage().data_ptr() for t in ins if isinstance(t, torch.Tensor)}
    return tuple(t.clone() if t.untyped_storage().data_ptr() in storages else t for t in outs)


def custom_op(p: Primitive, name: str | None = None, without: tuple[str, ...] = ()) -> Any:
    """``torch.ops.fp8core.<name>`` (default p.name) for declaration ``p`` without the arguments ``without``:
    schema, CPU/CUDA body and fake from the declaration."""
    params = [a for a in p.args if a.name not in without]
    names = [a.name for a in params]
    tensors = [a for a in params if a.tensor]

    def body(*values: Any) -> Any:
        kwargs = dict(zip(names, values))
        with fp8core.cpu_threads(torch.get_num_threads()):
            out = p.call(**kwargs)
        if p.returns > 1:
            out = tuple(out)
            return _unaliased(out, values) if p.may_alias else out
        return out

    def fake(*values: Any) -> Any:
        kwargs = dict(zip(names, values))
        if p.precheck is not None:
            p.precheck(**{k: Spec.of(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
        refuse_meta(*((a.label or a.name, kwargs[a.name]) for a in tensors))
        like = kwargs[tensors[0].name]
        outs = tuple(like.new_empty(s.shape, dtype=getattr(torch, s.dtype)) for s in p.specs(**kwargs))
        return outs if p.returns > 1 else (outs[0] if outs else None)

    body.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  (what torch infers the schema from)
        [inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,  # a slot, where there is one, given
                           annotation=torch.Tensor if a.slot else _TYPES[a.type],
                           default=inspect.Parameter.empty if a.default is REQUIRED or a.slot else a.default)
         for a in params],
        return_annotation=_RETURNS.get(p.returns, tuple[(torch.Tensor,) * p.returns]))
    body.__name__ = body.__qualname__ = name or p.name
    body.__doc__ = p.doc
    op = torch.library.custom_op(f"{_LIB}::{name or p.name}", body,
                                 mutates_args=tuple(a.name for a in params if a.mutated))
    op.register_fake(fake)
    return op


def custom_ops(p: Primitive) -> tuple[Any, ...]:
    """The ops of ``p``: (``name``) or, for a declaration with an optional slot it mutates, (``name`` without
    the slot, ``name_amax`` with it)."""
    slots = tuple(a.name for a in p.args if a.slot is not None)
    if not slots:
        return (custom_op(p),)
    return custom_op(p, without=slots), custom_op(p, f"{p.name}_amax")
