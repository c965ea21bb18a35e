"""How many threads fp8core's CPU work may use, and NumPy's BLAS held to one thread while it does.

By default the CPU backend sizes its pool from the machine (up to 8 threads) and lets NumPy's BLAS run its own
threads, as NumPy does. A program that sets its own thread count (torch's ``torch.set_num_threads``; the torch
front-end passes ``torch.get_num_threads()`` on every call) runs fp8core's calls inside ``cpu_threads(n)``: then
at most n threads work for a call, the calling one and n - 1 of the pool, and each GEMM span runs BLAS on one
thread. Two teams of busy threads on the same cores (BLAS's own, besides torch's and fp8core's) took a small HF
Llama's CPU training step 4-6x as long on a shared 2-core machine (issue 37). The bits never depend on it: the
spans split whole output columns (see cpu.gemm).

BLAS's thread count is set through the BLAS library NumPy loaded (OpenBLAS, as NumPy's wheels ship it: its
``openblas_set_num_threads`` under the wheel's symbol prefix), found among the libraries already loaded. Not
threadpoolctl: it would be a new dependency of the core for two calls into one library, and its limits are
process-wide contexts with no count of concurrent users. The setting is process-wide in OpenBLAS too, so it is
counted: the first call entering sets one thread and the last one leaving restores what it found. A NumPy call
of the program's own that runs meanwhile in another thread runs on one BLAS thread too. Where no such library is
found (MKL, Accelerate, a BLAS without the call) BLAS keeps its threads and fp8core's pool alone follows ``n``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Callable, Iterator, Optional

from .._caches import cached

__all__ = ["cpu_threads", "thread_budget", "blas_on_one_thread"]

_local = threading.local()
_lock = threading.Lock()
_users = 0
_saved: list[int] = []


class cpu_threads:
    """Within the context, on this thread: fp8core's CPU calls use at most ``n`` threads (>= 1), BLAS one per
    GEMM span. ``None``: the default (the pool sized from the machine, BLAS's own threads). Nests; the innermost
    counts. The torch front-end enters it with ``torch.get_num_threads()`` around every CPU call, so
    ``torch.set_num_threads`` is the one setting of a torch program. A class, not a generator context: it is
    entered on every torch op, and contextlib's generator costs a 16-element call several microseconds."""

    __slots__ = ("n", "_previous")

    def __init__(self, n: Optional[int]) -> None:
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"n: expected an int >= 1 or None, got {n!r}")
        self.n = n

    def __enter__(self) -> None:
        self._previous = getattr(_local, "budget", None)
        _local.budget = self.n

    def __exit__(self, *exc: object) -> None:
        _local.budget = self._previous


def thread_budget() -> Optional[int]:
    """The innermost :func:`cpu_threads` of this thread, or None (the default)."""
    return getattr(_local, "budget", None)


@cached("cpu_threads.blas_setters")
def _blas_setters() -> tuple[tuple[Callable[[], int], Callable[[int], None]], ...]:
    """(get, set) of each OpenBLAS already loaded in this process (NumPy's), by its exported names."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line})
    except OSError:
        return ()
    found = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        for prefix in ("scipy_openblas_", "openblas_"):
            for suffix in ("64_", ""):
                get = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
                put = getattr(lib, f"{prefix}set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    get.restype, get.argtypes = ctypes.c_int, []
                    put.restype, put.argtypes = None, [ctypes.c_int]
                    found.append((get, put))
                    break
            else:
                continue
            break
    return tuple(found)


@contextlib.contextmanager
def blas_on_one_thread() -> Iterator[bool]:
    """NumPy's BLAS on one thread inside (counted across threads; see the module docstring); yields whether it
    could be set."""
    global _users
    setters = _blas_setters()
    if not setters:
        yield False
        return
    with _lock:
        if _users == 0:
            _saved[:] = [get() for get, _ in setters]
            for _, put in setters:
                put(1)
        _users += 1
    try:
        yield True
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                for (_, put), n in zip(setters, _saved):
                    put(n)
