"""The FP8 dots' derivatives: first order only, a second refused at trace time by name.

The fp8 GEMMs and casts are ``buffer_callback`` primitives, which JAX cannot differentiate: ``jax.grad`` of
``jax.grad`` (``jax.hessian``, forward-over-reverse Hessian-vector products) would reach JAX's internal
"Buffer callbacks do not support JVP", naming nothing the user wrote. The dots' forward passes run under
:func:`first_order_only`, whose JVP rule (met only when a derivative of the derivative is traced: a first
``jax.grad`` evaluates the forward pass on plain values) raises an error naming the FP8 dot and what to do.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax

__all__ = ["first_order_only", "SECOND_DERIVATIVE"]

SECOND_DERIVATIVE = (
    "{dot}: fp8core's FP8 dot has first derivatives only (its forward and backward passes are fp8 casts and "
    "GEMMs in callbacks, which JAX cannot differentiate again), so jax.grad of jax.grad, jax.hessian or a "
    "jvp of a grad through it is refused. Take second derivatives through a plain dot_general (the layer "
    "without the FP8 dot_general), or jax.lax.stop_gradient what reaches the FP8 dot in the outer derivative")


@partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _once(fn: Callable[..., Any], dot: str, args: tuple[Any, ...]) -> Any:
    return fn(*args)


@_once.defjvp
def _once_jvp(fn, dot, primals, tangents):
    raise NotImplementedError(SECOND_DERIVATIVE.format(dot=dot))


def first_order_only(fn: Callable[..., Any], dot: str, *args: Any) -> Any:
    """``fn(*args)`` (a dot's forward pass, array arguments), refusing a JVP through it with an error naming
    ``dot``."""
    return _once(fn, dot, args)
