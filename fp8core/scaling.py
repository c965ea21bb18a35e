"""ScalingState: the delayed-scaling state of N tensors in one contiguous allocation, and its batched update.

Invariant: a ScalingState holds the buffer *object* (its own NumPy/CuPy array, or the caller's tensor) and never
a view, NumPy array or pointer of the caller's memory across calls. ``amax_history``, ``scale`` and
``scale_inv`` are fresh views, in the buffer's own array type, made at each access; ``update`` and ``quantize``
re-read the buffer through DLPack at each call. So a caller may move the buffer's storage in place
(``share_memory_()``, FSDP's ``tensor.data = ...``) between calls, and a ScalingState pickles and deep-copies.
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from . import args, backends
from .backends.cpu import roll
from ._fpenv import ieee
from ._tensor import Tensor, wrap
from .args import as_format, check_update_shapes, reduce_amaxes
from .extras import install_hint
from .formats import Format
from .ops import quantize
from .recipe import DelayedScaling

__all__ = ["ScalingState", "check_update_args", "check_update_shapes", "check_state_values"]


def _parse_device(device: Any) -> tuple:
    text = str(device)
    if text == "cpu":
        return ("cpu", 0)
    if text != "cuda" and not (text.startswith("cuda:") and text[5:].isdigit()):
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError(f"device: {text!r} needs CuPy ({install_hint('cuda13', 'cuda12')})") from e
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        index = cupy.cuda.Device().id if text == "cuda" else int(text[5:])
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise RuntimeError(f"device: {text!r} has no usable CUDA GPU here (no GPU, or no driver that runs "
                           f"CuPy's CUDA runtime: {e}); use device='cpu'") from e
    if index >= count:
        raise ValueError(f"device: {text!r}, but this machine has {count} CUDA device(s)")
    return ("cuda", index)


def _device_str(device: tuple) -> str:
    return "cpu" if device[0] == "cpu" else f"cuda:{device[1]}"


# ---- checks shared by ScalingState, torch.ops.fp8core.update and the front-ends -----------------------------

def _vector(obj: Any, arg: str, dtype: str, n: int, like: Tensor) -> Any:
    t = args.contiguous(wrap(obj, arg), arg)
    check_update_shapes(("float32", like.shape), [(arg, t.dtype, t.shape, dtype)])
    args.same_device(t, like, arg, "history")
    if t.readonly:
        raise ValueError(f"{arg}: is read-only")
    return t.data


def check_update_args(history: Any, scale: Any, scale_inv: Any, fp8_max: Any, non_finite: Any, margin: Any,
                      algo: Any, epsilon: Any) -> tuple[Tensor, Any, Any, Any, Any, int, str, float]:
    """Validate the batched update's arguments before anything is launched or written.

    history: float32 [L, N] contiguous, writable; scale, scale_inv, fp8_max: float32 [N]; non_finite: bool [N]
    (or None); all on history's device. margin: int, |margin| <= 512; algo: 'max' or 'most_recent';
    epsilon: finite >= 0. Returns (history Tensor, scale, scale_inv, fp8_max, non_finite data, margin, algo,
    epsilon) as backend arrays.
    """
    h = args.contiguous(wrap(history, "history"), "history")
    n = check_update_shapes((h.dtype, h.shape), [])
    if h.readonly:
        raise ValueError("history: is read-only")
    s = _vector(scale, "scale", "float32", n, h)
    si = _vector(scale_inv, "scale_inv", "float32", n, h)
    fm = _vector(fp8_max, "fp8_max", "float32", n, h)
    nf = None if non_finite is None else _vector(non_finite, "non_finite", "bool", n, h)
    algo = args.amax_algo(algo)
    return h, s, si, fm, nf, args.margin(margin), algo, args.epsilon(epsilon)


def update_in_place(history: Any, scale: Any, scale_inv: Any, fp8_max: Any, non_finite: Any, margin: int, algo: str,
                    power_of_2: bool, epsilon: float, update_scale: bool) -> None:
    """The batched delayed-scaling update of N tensors, in place (arguments as :func:`check_update_args`): every
    argument is checked before the one launch, which goes on history's caller's stream."""
    h, s, si, fm, nf, margin, algo, epsilon = check_update_args(history, scale, scale_inv, fp8_max, non_finite,
                                                                margin, algo, epsilon)
    with _caller_stream(h):
        backends.for_device(h.device).update(h.data, s, si, fm, margin, algo, bool(power_of_2), epsilon,
                                             bool(update_scale), nf)


def _host(obj: Any, arg: str) -> tuple[np.ndarray, str, tuple]:
    """A host copy of a checkpoint array with its dtype name and shape (checkpoints are read once, on load)."""
    t = wrap(obj, arg)
    data = t.data if not t.is_cuda else t.data.get()
    return np.asarray(data), t.dtype, t.shape


@ieee  # by the values' bits: a subnormal scale is > 0 whatever flush-to-zero mode the caller set
def check_state_values(history: Any, scale: Any, scale_inv: Any, steps: Any, num_tensors: int, history_len: int,
                       prefix: str = "") -> int:
    """Validate a checkpoint's delayed-scaling state before anything is written; returns steps as an int.

    history: float32 [history_len, num_tensors], no negative value (not even -0.0: a negative amax never
    leaves row 0); NaN and inf are kept (the history records non-finite amaxes). scale, scale_inv: float32
    [num_tensors], finite and > 0. steps: an int >= 0.
    """
    n, L = num_tensors, history_len
    for arg, obj, shape in ((f"{prefix}amax_history", history, (L, n)), (f"{prefix}scale", scale, (n,)),
                            (f"{prefix}scale_inv", scale_inv, (n,))):
        data, dtype, got = _host(obj, arg)
        if dtype != "float32":
            raise TypeError(f"{arg}: expected float32, got {dtype}")
        if tuple(got) != shape:
            hint = f" (amax_history_len {got[0]} in the checkpoint, {L} here)" \
                if arg.endswith("amax_history") and len(got) == 2 and got[1:] == shape[1:] else ""
            raise ValueError(f"{arg}: expected shape {shape}, got {tuple(got)}{hint}")
        flat = np.ascontiguousarray(data).reshape(-1)
        if arg.endswith("amax_history"):
            bad = args.negative_amax_mask(flat)
            if bad.any():
                raise ValueError(f"{arg}: holds a negative amax ({args.f32_text(flat[bad][0])}); amaxes are >= +0")
        else:  # by bits: a subnormal scale is a scale in every floating-point mode
            bad = ~args.scale_mask(flat)
            if bad.any():
                raise ValueError(f"{arg}: expected finite values > 0, got {args.f32_text(flat[bad][0])} at index "
                                 f"{int(np.flatnonzero(bad)[0])}")
    return _steps(steps, f"{prefix}steps")


def _steps(steps: Any, arg: str) -> int:
    if hasattr(steps, "shape") and tuple(steps.shape) in ((), (1,)) and not isinstance(steps, np.generic):
        data, dtype, _ = _host(steps, arg)
        if not dtype.startswith("int"):
            raise TypeError(f"{arg}: expected an integer, got {dtype}")
        steps = int(data.reshape(-1)[0])
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or int(steps) < 0:
        raise ValueError(f"{arg}: expected an int >= 0, got {steps!r}")
    return int(steps)


@contextlib.contextmanager
def _caller_stream(t: Tensor) -> Iterator[None]:
    """Every launch and every CuPy write on the buffer's caller's current stream (torch's for a CUDA torch tensor:
    a torch side stream does not wait for CuPy's default stream)."""
    if t.is_cuda:
        import cupy

        from .backends.cuda import launch_stream

        handle = t.caller.stream(t.device[1])
        with launch_stream(handle), cupy.cuda.ExternalStream(handle, t.device[1]):
            yield
    else:
        yield


class ScalingState:
    """amax_history [L, N], scale [N] and scale_inv [N], float32, in one buffer on ``device``.

    Row 0 of the history is this step's amax of every tensor, contiguous, so one all-reduce covers all N.
    The buffer is a NumPy array on the CPU and a CuPy array on a GPU, or the caller's own ``buffer``; the
    views ``amax_history``, ``scale``, ``scale_inv`` are of the buffer's array type. Scales start at 1.0.
    ``formats``: one Format per tensor (default: the recipe's forward format for all).
    ``buffer``: optionally, memory to hold the state in place (any writable array fp8core reads zero-copy,
    e.g. a torch tensor): float32, contiguous, ``L * N + 2 * N`` elements on ``device``; initialised here.
    """

    def __init__(self, num_tensors: int, recipe: DelayedScaling | None = None,
                 formats: Sequence[Format | str] | None = None, device: Any = "cpu", buffer: Any = None) -> None:
        if isinstance(num_tensors, bool) or not isinstance(num_tensors, numbers.Integral) \
                or not 1 <= num_tensors <= args.MAX_TENSORS:
            raise ValueError(f"num_tensors: expected an int in [1, {args.MAX_TENSORS}], got {num_tensors!r}")
        num_tensors = int(num_tensors)
        self.recipe = recipe if recipe is not None else DelayedScaling()
        if not isinstance(self.recipe, DelayedScaling):
            raise TypeError(f"recipe: expected DelayedScaling, got {type(self.recipe).__name__}")
        n, L = num_tensors, self.recipe.amax_history_len
        if formats is not None:
            self.formats = [as_format(f, arg="formats") for f in formats]
            if len(self.formats) != n:
                raise ValueError(f"formats: expected {n} formats, got {len(self.formats)}")
        self.device = _parse_device(device)
        xp = backends.for_device(self.device).xp
        # the buffer before the default formats: a list of n formats is smaller than the buffer, so a state too
        # big for memory is refused before Python builds the list
        if buffer is None:
            with self._on_device():
                self.buffer = _allocate(xp, L * n + 2 * n, n, L, self.device)
        else:
            self._check_buffer(buffer, n)
            self.buffer = buffer
        if formats is None:
            self.formats = [self.recipe.fp8_format.fwd] * n
        t = self._check_buffer(self.buffer)
        with self._on_device(), _caller_stream(t):
            data = t.data.reshape(-1)
            data[...] = 0
            data[L * n:] = 1.0
            self.fp8_max = xp.asarray(np.array([f.max for f in self.formats], np.float32))
            self.non_finite = xp.zeros(n, dtype=xp.bool_)
        self.steps = 0

    # ---- the buffer, read afresh at every call -------------------------------------------------------------

    def _on_device(self) -> Any:
        if self.device[0] == "cuda":
            import cupy

            return cupy.cuda.Device(self.device[1])
        return contextlib.nullcontext()

    def _check_buffer(self, buffer: Any, n: int | None = None) -> Tensor:
        n = len(self.formats) if n is None else n
        size = self.recipe.amax_history_len * n + 2 * n
        t = args.contiguous(wrap(buffer, "buffer"), "buffer")
        if t.dtype != "float32" or t.size != size:
            raise ValueError(f"buffer: expected {size} float32 elements, got {t.size} {t.dtype}")
        if t.device != self.device:
            raise ValueError(f"buffer: is on {t.device_str()}, expected {_device_str(self.device)}")
        if t.readonly:
            raise ValueError("buffer: is read-only")
        return t

    def _data(self) -> Any:
        """The buffer as a flat backend array, for this call only."""
        return self._check_buffer(self.buffer).data.reshape(-1)

    @property
    def num_tensors(self) -> int:
        return len(self.formats)

    @property
    def history_len(self) -> int:
        return self.recipe.amax_history_len

    @property
    def amax_history(self) -> Any:
        """[L, N] view of the buffer (the buffer's array type); row 0 is this step's amaxes."""
        n, L = self.num_tensors, self.history_len
        return self.buffer.reshape(-1)[: L * n].reshape(L, n)

    @property
    def scale(self) -> Any:
        n, L = self.num_tensors, self.history_len
        return self.buffer.reshape(-1)[L * n: L * n + n]

    @property
    def scale_inv(self) -> Any:
        n, L = self.num_tensors, self.history_len
        return self.buffer.reshape(-1)[L * n + n:]

    def __repr__(self) -> str:
        fmts = ", ".join(f.name for f in self.formats[:6]) + (", ..." if self.num_tensors > 6 else "")
        return (f"ScalingState(num_tensors={self.num_tensors}, history_len={self.history_len}, formats=[{fmts}], "
                f"device='{_device_str(self.device)}', steps={self.steps}, buffer={type(self.buffer).__module__}."
                f"{type(self.buffer).__name__})")

    # ---- pickling and copying: the state, never a module or a backend ---------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "formats": [f.name for f in self.formats],
                "device": _device_str(self.device), "buffer": self.buffer, "steps": self.steps,
                "non_finite": self.non_finite}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.recipe = state["recipe"]
        self.formats = [as_format(f) for f in state["formats"]]
        self.device = _parse_device(state["device"])
        self.buffer, self.steps, self.non_finite = state["buffer"], state["steps"], state["non_finite"]
        with self._on_device():
            self.fp8_max = backends.for_device(self.device).xp.asarray(
                np.array([f.max for f in self.formats], np.float32))

    # ---- use -----------------------------------------------------------------------------------------------

    def _index(self, index: Any) -> int:
        n = self.num_tensors
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= int(index) < n:
            raise IndexError(f"index: expected an int in [0, {n}) (one of this state's {n} tensors), got {index!r}")
        return int(index)

    def quantize(self, x: Any, index: int) -> Any:
        """Quantize x (float32/bfloat16/float16, any shape) as tensor ``index``: its scale, its format, its amax
        into row 0. Returns fp8 of x's shape, in x's array type."""
        i = self._index(index)
        data = self._data()
        n, L = self.num_tensors, self.history_len
        return quantize(x, data[L * n + i: L * n + i + 1], self.formats[i], amax_out=data[i:i + 1])

    def update(self, reduce: Callable[[Any], Any] | None = None) -> None:
        """The batched update of the contract: optionally ``reduce(row0)`` (MAX across a group), then every
        tensor's scale from its history and the history rolled; one kernel launch on a GPU, no host
        synchronisation (except for callable recipe algorithms, which run on arrays and are checked).

        ``reduce`` receives row 0 [N] in the buffer's own array type (a torch tensor when the state lives in
        one, so ``functools.partial(torch.distributed.all_reduce, op=ReduceOp.MAX)`` works as it is) and
        reduces it in place, or returns the reduced row 0 (N float32), which is taken; a returned async handle
        with ``wait()`` is waited on. The rule of :func:`fp8core.args.reduce_amaxes`, as quantize_dynamic's:
        a negative reduced amax is refused (in host memory) and row 0 is left as it was.
        """
        r = self.recipe
        if reduce is not None:
            if not callable(reduce):
                raise TypeError(f"reduce: expected a callable or None, got {type(reduce).__name__}")
            t = self._check_buffer(self.buffer)
            with _caller_stream(t):
                reduce_amaxes(reduce, self.amax_history[0], t.data.reshape(-1)[: self.num_tensors])
        t = self._check_buffer(self.buffer)
        data = t.data.reshape(-1)
        n, L = self.num_tensors, self.history_len
        H, scale, scale_inv = data[: L * n].reshape(L, n), data[L * n: L * n + n], data[L * n + n:]
        update_scale = self.steps % r.interval == 0
        with _caller_stream(t):
            if callable(r.amax_compute_algo) or r.scaling_factor_compute_algo is not None:
                self._update_callable(H, scale, scale_inv, update_scale)
            else:
                h, s, si, fm, nf, margin, algo, eps = check_update_args(
                    H, scale, scale_inv, self.fp8_max, self.non_finite, r.margin, r.amax_compute_algo, r.epsilon)
                backends.for_device(self.device).update(h.data, s, si, fm, margin, algo, r.power_of_2, eps,
                                                        update_scale, nf, **self._device_step(t))
        self.steps += 1

    def _device_step(self, like: Any) -> dict[str, Any]:
        """On a GPU with ``interval > 1`` the interval's counter lives on the device, so a captured graph replays
        the schedule (the host's ``steps`` would be baked into the graph). The counter is made again from
        ``steps`` whenever the host count moved without it (load_state_dict, a copy, a new buffer)."""
        r = self.recipe
        if self.device[0] != "cuda" or r.interval == 1:
            return {}
        if getattr(self, "_step_counter_at", None) != self.steps:
            self._step_counter = backends.for_device(self.device).step_counter(self.steps % r.interval, like)
        self._step_counter_at = self.steps + 1
        return {"step": self._step_counter, "interval": r.interval}

    @ieee  # the host's arithmetic here (max, compares, 1 / s) must not flush subnormals in a flushing thread
    def _update_callable(self, H: Any, scale: Any, scale_inv: Any, update_scale: bool) -> None:
        """The array path for callable algorithms: same roll, same did-not-run rule. Every result is checked
        before anything is written (this reads the results on the host)."""
        r, backend, n = self.recipe, backends.for_device(self.device), self.num_tensors
        xp = backend.xp
        cur = H[0].copy()
        ran = (cur.view(xp.uint32) & xp.uint32(0x7FFFFFFF)) != 0  # on the bits: a subnormal amax ran, under DAZ too
        new = None
        if update_scale:
            if callable(r.amax_compute_algo):
                a = _callable_result(r.amax_compute_algo(H), "amax_compute_algo", n, xp, self.device)
                neg = args.negative_amax_mask(a, xp) & ((a.view(xp.uint32) & xp.uint32(0x7FFFFFFF)) != 0)
                if bool(neg.any()):
                    raise ValueError(f"amax_compute_algo: returned a negative amax for tensor "
                                     f"{int(xp.flatnonzero(neg)[0])}; amaxes are >= 0")
            else:
                a = _amax_of_history(H, xp) if r.amax_compute_algo == "max" else cur
            if r.scaling_factor_compute_algo is not None:
                s = _callable_result(r.scaling_factor_compute_algo(a, scale.copy(), self.fp8_max.copy(), r),
                                     "scaling_factor_compute_algo", n, xp, self.device)
                a_mag = a.view(xp.uint32) & xp.uint32(0x7FFFFFFF)  # bits: a subnormal amax has a scale
                ok = ran & (a_mag != 0) & (a_mag < xp.uint32(0x7F800000))
                bad = ok & ~args.scale_mask(s, xp)
                if bool(bad.any()):
                    i = int(xp.flatnonzero(bad)[0])
                    raise ValueError(f"scaling_factor_compute_algo: returned scale {args.f32_text(_np(s[i]))} "
                                     f"for tensor {i} (amax {args.f32_text(_np(a[i]))}); expected a finite "
                                     f"scale > 0")
                s_inv = _reciprocal(s, ok, xp)
            else:
                s, s_inv, ok = backend.scale_rule(a, self.fp8_max, r.margin, r.power_of_2, r.epsilon)
                ok = ran & ok
            new = (s, s_inv, ok)
        self.non_finite[...] = ~xp.isfinite(cur)
        if new is not None:
            s, s_inv, ok = new
            scale[ok] = s[ok]
            scale_inv[ok] = s_inv[ok]
        roll(H, ran, cur, self.history_len)  # the CPU reference's roll: array-generic, CuPy arrays too

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """{"amax_history": [L, N], "scale": [N], "scale_inv": [N] (copies, float32), "steps": int}."""
        return {"amax_history": _copy(self.amax_history),
                "scale": _copy(self.scale), "scale_inv": _copy(self.scale_inv), "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Validate everything (keys, dtypes, shapes, values: see :func:`check_state_values`), then write."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state: expected a mapping, got {type(state).__name__}")
        for key in ("amax_history", "scale", "scale_inv", "steps"):
            if key not in state:
                raise KeyError(f"state: missing key {key!r} (expected amax_history, scale, scale_inv, steps)")
        steps = check_state_values(state["amax_history"], state["scale"], state["scale_inv"], state["steps"],
                                   self.num_tensors, self.history_len)
        t = self._check_buffer(self.buffer)
        xp = backends.for_device(self.device).xp
        n, L = self.num_tensors, self.history_len
        with self._on_device(), _caller_stream(t):
            data = t.data.reshape(-1)
            parts = [xp.asarray(_host(state[k], k)[0]).reshape(-1) for k in ("amax_history", "scale", "scale_inv")]
            data[: L * n], data[L * n: L * n + n], data[L * n + n:] = parts
        self.steps = steps


def _allocate(xp: Any, size: int, n: int, L: int, device: tuple) -> Any:
    """The state's zeroed buffer; an allocation that fails says what it was for (NumPy's MemoryError says
    nothing, and an array too big to index is a ValueError)."""
    try:
        return xp.zeros(size, dtype=xp.float32)
    except (MemoryError, ValueError) as e:
        oom = e
    except Exception as e:  # CuPy's OutOfMemoryError
        if type(e).__name__ != "OutOfMemoryError":
            raise
        oom = e
    raise MemoryError(f"num_tensors, amax_history_len: a state of {n} tensors x {L} history rows needs "
                      f"{size * 4} bytes of float32 on {_device_str(device)}, which could not be allocated "
                      f"({type(oom).__name__}); use fewer tensors or a shorter history") from oom


def _np(value: Any) -> np.ndarray:
    """A backend element (NumPy or CuPy) on the host, for a message."""
    return value.get() if hasattr(value, "get") else np.asarray(value)


def _amax_of_history(H: Any, xp: Any) -> Any:
    """The history's max per column [N] on the values' bits: amaxes are >= 0, whose float order is their bits'
    order, so a subnormal amax survives where a max compiled with flush-to-zero (every CuPy kernel) loses it."""
    return (H.view(xp.uint32) & xp.uint32(0x7FFFFFFF)).max(axis=0).view(xp.float32)


def _reciprocal(s: Any, ok: Any, xp: Any) -> Any:
    """1 / s where ``ok`` (else 1), one IEEE float32 division: on the host, since CuPy's kernels flush a subnormal
    quotient (a scale above 2^126) to zero."""
    q = np.float32(1) / np.where(_np(ok), _np(s), np.float32(1))
    return q if xp is np else xp.asarray(q)


def _copy(a: Any) -> Any:
    return a.clone() if hasattr(a, "clone") else a.copy()


def _callable_result(value: Any, arg: str, n: int, xp: Any, device: tuple) -> Any:
    if value is None:
        raise TypeError(f"{arg}: returned None; expected {n} float32 values")
    try:
        t = wrap(value, arg) if not isinstance(value, (list, tuple, float, int)) else None
    except TypeError as e:
        raise TypeError(f"{arg}: returned {type(value).__name__}; expected an array of {n} values") from e
    if t is not None and t.device != device:
        raise ValueError(f"{arg}: returned an array on {t.device_str()}; expected {_device_str(device)}")
    data = xp.asarray(t.data if t is not None else value)
    if not (xp.issubdtype(data.dtype, xp.floating) or xp.issubdtype(data.dtype, xp.integer)) or data.size != n:
        raise ValueError(f"{arg}: returned {data.size} {data.dtype} values of shape {tuple(data.shape)}; "
                         f"expected {n} (one per tensor)")
    if data.dtype != xp.float32 and xp is not np:  # CuPy's cast flushes a float32-subnormal value to zero
        return xp.asarray(_np(data).astype(np.float32).reshape(n))
    return data.astype(xp.float32).reshape(n)

