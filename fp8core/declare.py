"""How a primitive is declared once: its named arguments, the rule giving its outputs' shapes and dtypes from
its inputs', and its call into the core. The front-ends are driven by the declaration: fp8core.torch makes the
custom op and its fake from it, fp8core.jax the callback's ShapeDtypeStructs, selftest reads the list. The rows
are in :mod:`fp8core.declarations` (its PRIMITIVES); a hand-written op beside them needs nothing from here.

The rule sees each tensor argument as a :class:`Spec` (shape, dtype name), each dtype argument as its name and
every other argument as given; it raises the core's error wherever the core refuses an argument for its shape
(so that a traced call fails as the eager one does) and returns one Spec per output. The core functions allocate
their results from the same rule, so it is the one statement of a primitive's output shapes: which is why a
declaration names its core function by path ("ops.quantize", imported on first use), the core importing the
declarations and not the other way round.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, NamedTuple

from ._caches import memo
from .formats import dtype_name

__all__ = ["Spec", "Arg", "Primitive", "declare", "core_function", "CoreModules", "REQUIRED"]

REQUIRED: Any = object()  # an argument without a default

# the argument types a declaration may use (the names torch's schemas give them)
TYPES = ("Tensor", "Tensor?", "str", "int", "float", "bool", "dtype")


class Spec(NamedTuple):
    """An array's shape and dtype name ('float8_e4m3fn', 'float32', ...), without its data."""

    shape: tuple
    dtype: str

    @classmethod
    def of(cls, x: Any) -> "Spec":
        """The spec of anything with a shape and a dtype: a torch, JAX, NumPy or CuPy array, a tracer, a Spec."""
        return x if isinstance(x, Spec) else cls(tuple(x.shape), dtype_name(x.dtype))


@dataclasses.dataclass(frozen=True)
class Arg:
    """One named argument. label: its name in errors where that differs ("t.data" for a scaled tensor's part).
    mutated: written in place (an amax slot accumulates, the update's state). slot: the spec of a mutated
    argument that a functional front-end (JAX) returns instead of taking."""

    name: str
    type: str = "Tensor"
    default: Any = REQUIRED
    mutated: bool = False
    label: str = ""
    slot: Spec | None = None

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise ValueError(f"type: expected one of {', '.join(TYPES)}, got {self.type!r}")

    @property
    def tensor(self) -> bool:
        return self.type.startswith("Tensor")


@dataclasses.dataclass(frozen=True)
class Primitive:
    """A primitive as the front-ends see it.

    outputs: ``rule(**inputs) -> tuple[Spec, ...]`` (tensors as Specs, dtypes as names). target: the core's
    function, or its path in fp8core ("ops.quantize"); :attr:`call` is that function, called with the declared
    arguments by name, returning the outputs (one array, or a tuple (a ScaledTensor too) in the rule's order).
    returns: how many arrays it returns (0: it only mutates, 1: one array, n: a tuple). precheck: type rules the
    core applies before it looks at devices (the scaled operands' kinds), run first. backend: the backend
    functions it reaches (selftest's coverage). may_alias: an output may be an input itself (a 1-row transpose).
    """

    name: str
    args: tuple[Arg, ...]
    outputs: Callable[..., tuple[Spec, ...]]
    target: Callable[..., Any] | str
    returns: int
    backend: tuple[str, ...] = ()
    doc: str = ""
    precheck: Callable[..., None] | None = None
    may_alias: bool = False

    # the rule's answers by their inputs (results': the core's positional inputs; specs': "specs" and the named
    # ones), registered with fp8core._caches as "declare.<name>" and emptied when full
    _memo: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        memo(f"declare.{self.name}", self._memo)

    def results(self, *inputs: Any) -> tuple[Spec, ...]:
        """The rule on the core's positional inputs, each tensor given as its (shape, dtype name) pair: what the
        core allocates. Remembered by the inputs (a program's calls repeat their shapes), so a repeated call
        costs a lookup; a refused input raises every time."""
        found = self._memo.get(inputs)
        return found if found is not None else self._remember(inputs, lambda: self.outputs(*(
            Spec(*v) if a.tensor and v is not None else v for a, v in zip(self._ruled, inputs))))

    def _remember(self, key: tuple, rule: Callable[[], tuple[Spec, ...]]) -> tuple[Spec, ...]:
        found = rule()
        if len(self._memo) >= _MEMO_MAX:
            self._memo.clear()
        self._memo[key] = found
        return found

    @functools.cached_property
    def _ruled(self) -> tuple[Arg, ...]:
        """The rule's parameters, in order: the arguments but the slots."""
        return tuple(a for a in self.args if a.slot is None)

    @functools.cached_property
    def call(self) -> Callable[..., Any]:
        """The core function itself (a path imported on first use): a front-end that keeps it calls the core with
        no frame between."""
        return self.target if callable(self.target) else core_function(self.target)

    @functools.cached_property
    def _by_name(self) -> dict[str, Arg]:
        return {a.name: a for a in self.args}

    def arg(self, name: str) -> Arg:
        return self._by_name[name]

    def specs(self, **inputs: Any) -> tuple[Spec, ...]:
        """The outputs' specs from the inputs (arrays or Specs, dtypes in any spelling; slots left out), by the
        rule; remembered like :meth:`results` (by the arrays' shapes and dtypes, the other values with their
        types: ``1 == True`` in a key would let an int pass where the rule refuses a non-bool)."""
        def rule() -> tuple[Spec, ...]:
            return self.outputs(**{name: _abstract(self.arg(name), v) for name, v in inputs.items()
                                   if self.arg(name).slot is None})
        try:
            key = ("specs", *((k, (tuple(v.shape), v.dtype)) if _is_array(v) else (k, type(v), v)
                              for k, v in inputs.items()))
            found = self._memo.get(key)
        except TypeError:  # an unhashable value: the rule names what is wrong with it
            return rule()
        return found if found is not None else self._remember(key, rule)

    def functional(self, **inputs: Any) -> tuple[Spec, ...]:
        """The outputs a functional front-end returns: the rule's, then each mutated argument's new value (the
        given array's spec, or its slot's where it is not passed)."""
        mutated = tuple(Spec.of(inputs[a.name]) if inputs.get(a.name) is not None else a.slot
                        for a in self.args if a.mutated)
        return self.specs(**inputs) + mutated


_MEMO_MAX = 1024  # a primitive's remembered answers; a program's distinct shapes are far fewer


def _is_array(value: Any) -> bool:
    """Anything with a shape and a dtype (an array, a tracer, a Spec), not a dtype or its type (jnp.float32)."""
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, type)


def _abstract(arg: Arg, value: Any) -> Any:
    if value is None:
        return None
    if arg.tensor:  # a scale may be a Python number (the core converts it)
        return Spec.of(value) if _is_array(value) else value
    return dtype_name(value) if arg.type == "dtype" else value


def core_function(path: str) -> Callable[..., Any]:
    """The function at ``path`` in fp8core ("ops.quantize"). Imported when asked for, not when declared: a core
    module that allocates from its declaration imports fp8core.declarations, which therefore cannot import it."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(f"fp8core.{module}"), attr)


class CoreModules:
    """fp8core's core modules as attributes (``core.blocks``), each imported on its first use and then an
    ordinary attribute: the declarations' own calls reach the core through it, without importing it at their
    import and without a frame of their own."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        module = importlib.import_module(f"fp8core.{name}")
        setattr(self, name, module)
        return module


def declare(name: str, args: tuple[Arg, ...], *, returns: int, call: Callable[..., Any] | str,
            **fields: Any) -> Callable[[Callable], Primitive]:
    """Decorator: the rule below it (its docstring the primitive's) makes the declaration ``name``. call: the core
    function, or its path in fp8core ("ops.quantize")."""
    def make(rule: Callable[..., tuple[Spec, ...]]) -> Primitive:
        names = [a.name for a in args]
        if len(set(names)) != len(names):
            raise ValueError(f"args: {name}'s argument names repeat: {names}")
        return Primitive(name, tuple(args), rule, call, returns=returns, doc=rule.__doc__ or "", **fields)
    return make
