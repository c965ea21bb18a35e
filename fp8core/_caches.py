"""The core's memos, owned in one place, and their one reset.

A memo is a value computed from its key alone and kept for the next call: the CPU reference's lookup tables (each
built in the IEEE environment, fp8core._fpenv), which scales were seen (when a table pays), a device's facts,
which backend serves a device. Each module makes its memos here, under a name (:func:`memo`, :func:`cached`), and
uses them as before. :func:`reset` empties them, all or by name: the next call computes the value again, the same
bits. Tests that must start cold call it instead of replacing a module's internals; call it while no fp8core call
runs in another thread.

Not memos, so not here: resources (the CPU pool and its per-thread scratch, cuBLASLt handles and workspaces, which
must be given back, not dropped), live state (exported DLPack capsules until their deleter runs), interning tables
whose values are compared by identity (fp8core._tensor's JAX placements), locks, registries, and the argument and
dtype memos of args.py and _tensor.py (keyed by a name or a dtype, computed from nothing that can change).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

__all__ = ["memo", "cached", "names", "reset"]

C = TypeVar("C")
F = TypeVar("F", bound=Callable[..., Any])

_CLEARS: dict[str, Callable[[], None]] = {}  # name -> what empties it


def memo(name: str, cache: C) -> C:
    """``cache`` (a dict, an OrderedDict or a set; anything with ``clear()``, or a functools cache) registered
    under ``name`` and returned. A module imported again registers its new cache under the same name."""
    clear = getattr(cache, "cache_clear", None) or getattr(cache, "clear", None)
    if not callable(clear):
        raise TypeError(f"cache: expected a dict, a set or a functools cache, got {type(cache).__name__}")
    _CLEARS[name] = clear
    return cache


def cached(name: str, maxsize: int | None = None) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)``, registered under ``name``."""
    def decorate(fn: F) -> F:
        return memo(name, functools.lru_cache(maxsize=maxsize)(fn))
    return decorate


def names() -> list[str]:
    """Every registered memo's name, sorted."""
    return sorted(_CLEARS)


def reset(*which: str) -> None:
    """Empty the memos named in ``which`` (every one when none is): the next call computes each value again."""
    unknown = [n for n in which if n not in _CLEARS]
    if unknown:
        raise KeyError(f"which: no memo named {', '.join(map(repr, unknown))}; the memos: {', '.join(names())}")
    for name in which or list(_CLEARS):
        _CLEARS[name]()
