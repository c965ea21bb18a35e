"""Torch custom ops made from fp8core's declarations (fp8core.declarations): the op's schema from the declared
arguments, its body the declared call into the core, its fake the declared output rule, so that
``torch.compile(fullgraph=True)`` and eager agree on shapes, dtypes and the core's errors.

An argument on the meta device beside real ones is refused with the core's error, as a hand-written op's fake
does (fake_rules.py says why).

An optional argument that an op mutates (an amax slot) trips Inductor when it is None (torch 2.13), so such a
declaration makes two ops: ``name`` without the slot and ``name_amax`` with it.

The op is registered with ``torch.library.Library`` directly, not through ``torch.library.custom_op``: that
wrapper puts four Python layers between the dispatcher and the body (its autograd function, a redispatch, a
dynamo-disabled frame, an output-aliasing check), 20-25 us a call on a 2-core VM, more than the core's own work on
16 elements (bench/results/cpu-2core-2026-11-27-torch-host-*). Here the dispatcher calls one Python function, the
op's Autograd kernel. For real CPU or CUDA tensors outside any dispatch mode or tracer it calls the body itself
(the dispatcher's next stop, without a second trip from Python through C++); otherwise (fake tensors, modes,
torch.compile's tracing, the meta device) it dispatches on to the body, registered for every backend
(CompositeExplicitAutograd) as custom_op registers it, or to the fake. The ops have no gradient formula: an output
that needs a gradient raises on backward, naming the op, as custom_op's do.
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


class _NoFormula(torch.autograd.Function):
    """An op's outputs when an input needs a gradient: they need one too, and backward names the op."""

    @staticmethod
    def forward(ctx: Any, name: str, run: Callable[[], Any], *inputs: Any) -> Any:
        ctx.name = name
        return run()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(f"Trying to backward through fp8core::{ctx.name} but no autograd formula was registered: "
                           "fp8core's ops have no gradient; wrap them in an autograd.Function (as Float8Linear does)")


def _schema(p: Primitive, params: list, name: str) -> str:
    """The op's schema, inferred by torch from a signature made of the declared arguments (a slot, where there is
    one, given)."""
    def sig() -> None: ...
    sig.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                           annotation=torch.Tensor if a.slot else _TYPES[a.type],
                           default=inspect.Parameter.empty if a.default is REQUIRED or a.slot else a.default)
         for a in params],
        return_annotation=_RETURNS.get(p.returns, tuple[(torch.Tensor,) * p.returns]))
    return torch.library.infer_schema(sig, op_name=name, mutates_args=tuple(a.name for a in params if a.mutated))


def custom_op(p: Primitive, name: str | None = None, without: tuple[str, ...] = ()) -> Any:
    """``torch.ops.fp8core.<name>`` (default p.name) for declaration ``p`` without the arguments ``without``:
    schema, body for every backend, Autograd kernel and fake from the declaration. Returns its overload
    (``torch.ops.fp8core.<name>.default``, called as ``op(*args)``: the packet's overload resolution costs a
    16-element call several microseconds); its registrations live as long as the process."""
    name = name or p.name
    params = [a for a in p.args if a.name not in without]
    names = tuple(a.name for a in params)
    tensors = [a for a in params if a.tensor]
    mutated = [i for i, a in enumerate(params) if a.mutated]
    # The dispatcher drops trailing arguments equal to their defaults before it calls a Python kernel.
    defaults = tuple(None if a.default is REQUIRED or a.slot else a.default for a in params)
    call, k = p.call, _in_order(p.call, names)
    keywords = names[k:]

    def full(values: tuple) -> dict[str, Any]:
        return dict(zip(names, values + defaults[len(values):]))

    def body(*values: Any) -> Any:
        values += defaults[len(values):]
        with fp8core.cpu_threads(torch.get_num_threads()):
            out = call(*values[:k], **dict(zip(keywords, values[k:]))) if keywords else call(*values)
        if p.returns > 1:
            out = tuple(out)
            return _unaliased(out, values) if p.may_alias else out
        return out

    def fake(*values: Any) -> Any:
        kwargs = full(values)
        if p.precheck is not None:
            p.precheck(**{n: Spec.of(v) if isinstance(v, torch.Tensor) else v for n, v in kwargs.items()})
        refuse_meta(*((a.label or a.name, kwargs[a.name]) for a in tensors))
        like = kwargs[tensors[0].name]
        outs = tuple(like.new_empty(s.shape, dtype=getattr(torch, s.dtype)) for s in p.specs(**kwargs))
        return outs if p.returns > 1 else (outs[0] if outs else None)

    lib = torch.library.Library(_LIB, "FRAGMENT")
    lib.define(_schema(p, params, name))
    op = getattr(torch.ops.fp8core, name)
    redispatch = op.default.redispatch

    def autograd(keyset: Any, *values: Any) -> Any:
        for i in mutated:  # what an in-place op's ADInplaceOrView kernel does: autograd sees the write
            if i < len(values) and values[i] is not None:
                torch.autograd.graph.increment_version(values[i])
        rest = keyset & _AFTER_AUTOGRAD
        if p.returns and torch.is_grad_enabled() and _any_requires_grad(*values):
            return _NoFormula.apply(name, lambda: redispatch(rest, *values), *values)
        if rest.raw_repr() in _PLAIN:
            # Real tensors of one device, no mode, no tracing, no gradient: the dispatcher would call the body
            # next, and a second trip through it (Python -> C++ -> Python) costs a 16-element call a third more.
            return body(*values)
        with _BELOW_AUTOGRAD():
            return redispatch(rest, *values)

    lib.impl(name, body, "CompositeExplicitAutograd")
    lib.impl(name, autograd, "Autograd", with_keyset=True)
    torch.library.register_fake(f"{_LIB}::{name}", fake, lib=lib)
    _LIBRARIES.append(lib)
    return op.default


_AFTER_AUTOGRAD = torch._C._after_autograd_keyset


def _any_requires_grad_py(*values: Any) -> bool:
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


# torch's C helper (2.8 on) costs a 16-element call less; torch 2.7, the declared minimum, lacks it.
_any_requires_grad = getattr(torch._C, "_any_requires_grad", _any_requires_grad_py)
_BELOW_AUTOGRAD = torch._C._AutoDispatchBelowAutograd
# The keys left below Autograd for real CPU or CUDA tensors outside any mode or tracer (a fake tensor, a dispatch
# mode or torch.compile's tracing adds Python, the meta device Meta): the body's own keys.
_PLAIN = frozenset(torch._C.DispatchKeySet(k).raw_repr() for k in (torch._C.DispatchKey.CPU,
                                                                   torch._C.DispatchKey.CUDA))


def _in_order(fn: Callable, names: tuple[str, ...]) -> int:
    """How many of the arguments ``names``, from the first, ``fn`` takes positionally in that order: the body
    passes those so and the rest by keyword (building keywords costs a 16-element call about a microsecond)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return 0
    ordered = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    k = 0
    while k < min(len(params), len(names)) and params[k].name == names[k] and params[k].kind in ordered:
        k += 1
    return k


# Each op's registrations last while its Library lives: for the life of the process, as torch's own ops.
_LIBRARIES: list = []


def custom_ops(p: Primitive) -> tuple[Any, ...]:
    """The ops of ``p``: (``name``) or, for a declaration with an optional slot it mutates, (``name`` without
    the slot, ``name_amax`` with it)."""
    slots = tuple(a.name for a in p.args if a.slot is not None)
    if not slots:
        return (custom_op(p),)
    return custom_op(p, without=slots), custom_op(p, f"{p.name}_amax")
