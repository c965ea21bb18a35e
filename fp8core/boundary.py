"""What a front-end built on the core takes to hand its own buffers to the backends (fp8core.jax does so inside
XLA's callbacks): :func:`wrap` reads an array of any framework once, zero-copy, into the :class:`Tensor` view the
backends work on; :func:`ieee` runs a function in the IEEE default floating-point environment whatever the calling
thread set (XLA:CPU calls back with flush-to-zero and denormals-are-zero). They live in the core's private modules
(_tensor, _views, _fpenv); another package imports them from here (tests/test_layers.py checks it)."""

from ._fpenv import ieee
from ._tensor import wrap
from ._views import Tensor

__all__ = ["Tensor", "wrap", "ieee"]
