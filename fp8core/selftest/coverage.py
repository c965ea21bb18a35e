"""The coverage rule: every backend function and every kernel instantiation must have run."""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from .harness import Target

# Functions of a backend module that are plumbing, not primitives.
_NOT_PRIMITIVES = {"launch_stream", "scale_value", "pow2_floor", "roll"}


def backend_pairs() -> list[tuple[str, Any, Any]]:
    """(prefix, CPU module, CUDA module) of every backend pair: cpu/cuda, and cpu_X/cuda_X for any X added."""
    import importlib
    import pkgutil

    from fp8core import backends

    names = {m.name for m in pkgutil.iter_modules(backends.__path__)}
    pairs = [("", "cpu", "cuda")] + [(f"{n[5:]}.", f"cpu_{n[5:]}", n) for n in sorted(names)
                                     if n.startswith("cuda_") and f"cpu_{n[5:]}" in names]
    return [(prefix, importlib.import_module(f"{backends.__name__}.{c}"),
             importlib.import_module(f"{backends.__name__}.{g}")) for prefix, c, g in pairs]


def primitives(mod: Any) -> set[str]:
    import inspect

    return {n for n, f in vars(mod).items() if inspect.isfunction(f) and f.__module__ == mod.__name__
            and not n.startswith("_")} - _NOT_PRIMITIVES


def backend_functions() -> list[str]:
    """The primitives every backend implements: public functions defined in both modules of a backend pair
    (``name`` for cpu/cuda, ``X.name`` for cpu_X/cuda_X)."""
    return sorted(prefix + n for prefix, c, g in backend_pairs() for n in primitives(c) & primitives(g))


def declared_functions() -> dict[str, tuple[str, ...]]:
    """The backend functions each declared primitive (fp8core.declarations) reaches, by primitive name."""
    from fp8core.declarations import PRIMITIVES

    return {name: p.backend for name, p in PRIMITIVES.items()}


class Coverage:
    """Records which backend functions (outermost calls under dut() only) and which kernels the checks reached.

    The functions are wrapped where callers look them up (module attributes), and ``get_function`` wherever a
    backend module holds it, so a kernel launched through any backend is seen.
    """

    def __init__(self, target: Target) -> None:
        self.cuda = target.backend_name == "cuda"
        self.target = target
        self.functions: set[str] = set()
        self.kernels: set[tuple[str, str]] = set()
        self._depth = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0 and self.target.in_dut:
                self.functions.add(name)
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth
        return recorded

    def _patch(self, module: Any, attr: str, value: Any) -> None:
        self._saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, value)

    def __enter__(self) -> "Coverage":
        from fp8core import _kernels

        for prefix, cpu_mod, cuda_mod in backend_pairs():
            module = cuda_mod if self.cuda else cpu_mod
            for name in primitives(cpu_mod) & primitives(cuda_mod):
                self._patch(module, name, self._wrap(prefix + name, getattr(module, name)))
        if self.cuda:
            get_function = _kernels.get_function

            def recorded(filename: str, expr: str, device_id: int) -> Any:
                self.kernels.add((filename, expr))
                return get_function(filename, expr, device_id)

            holders = [_kernels] + [m for _, _, m in backend_pairs() if getattr(m, "get_function", None) is get_function]
            for holder in holders:
                self._patch(holder, "get_function", recorded)
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, attr, value in reversed(self._saved):
            setattr(module, attr, value)
        self._saved.clear()

    def missing_kernels(self) -> list[str]:
        from fp8core._kernels import KERNELS

        return [f"{f}: {e}" for f, exprs in KERNELS.items() for e in exprs if (f, e) not in self.kernels]
