"""Checkpoint converters between flax's own fp8 op state and fp8core.jax's, both ways, on a whole variables tree.

flax's ops (``flax.linen.fp8_ops.Fp8DirectDotGeneralOp``, ``Fp8DotGeneralOp``, ``Fp8Einsum``) keep, per layer,
``{input,kernel,output_grad}_amax_history`` float32 [L] and ``{input,kernel,output_grad}_scale`` float32 [1];
fp8core.jax's (``Fp8DotGeneral``, ``Fp8Einsum``) ``amax_history`` float32 [L, 3], ``scale`` [3] and
``scale_inv`` [3], columns (input, kernel, output_grad). flax's "scale" is the divisor x is quantized by,
``amax / fp8_max``: fp8core's ``scale_inv`` (fp8core multiplies by ``scale``).

The two also differ in *when* the scale moves. After step t, flax holds the amaxes of the last L steps,
``[a_t, a_{t-L+1}, ..., a_{t-1}]`` (oldest first after slot 0), and the scale it used at step t; it computes
step t+1's scale from ``max(history)`` when step t+1 starts. fp8core has already done that at the end of step
t (docs/numerics.md, "delayed scaling"): it holds step t+1's scale and the history rolled,
``[0, a_{t-L+2}, ..., a_t]``, the oldest amax consumed. So:

* :func:`from_flax_fp8_state` runs flax's pending update with fp8core's scale rule (max over the L amaxes,
  margin 0, formats E4M3, E4M3, E5M2; a max of 0, inf or NaN keeps flax's scale: ``scale = 1 / flax scale``),
  then rolls the history; flax's next step and fp8core's next step use the same scale, bit for bit.
* :func:`to_flax_fp8_state` puts fp8core's history back in flax's order, the consumed oldest slot set to 0,
  or, where fp8core's scale did not come from the amaxes it still holds, to an amax giving fp8core's scale
  (the consumed amax was the max), else to NaN (fp8core kept its scale after a non-finite amax, or a
  ``margin``/``most_recent`` recipe chose it: flax then keeps its scale, set so that ``1 / (1 / it)`` is
  fp8core's). Flax's next step then quantizes by fp8core's ``scale_inv``, bit for bit; from then on flax's
  recipe applies. A scale flax can neither compute nor keep (about 14% of float32 scales are no float32
  number's reciprocal) is refused, naming the layer and operand.

Continue a flax checkpoint with ``fp8core.DelayedScaling(amax_history_len=L, amax_compute_algo="max")``
(HYBRID, margin 0: flax's recipe; interval 1, flax's ops have no interval). The layers' module names follow
the class (``Fp8DirectDotGeneralOp_0`` and ``Fp8DotGeneralOp_0`` become ``Fp8DotGeneral_0``, back to
``Fp8DirectDotGeneralOp_0``; ``Fp8Einsum_0`` stays); explicitly named layers keep their names. The
converters run on the host, on concrete arrays (a checkpoint between steps), not under ``jit``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import FrozenDict

import fp8core

__all__ = ["from_flax_fp8_state", "to_flax_fp8_state", "FLAX_KEYS"]

_OPERANDS = ("input", "kernel", "output_grad")
FLAX_KEYS = tuple(f"{o}_amax_history" for o in _OPERANDS) + tuple(f"{o}_scale" for o in _OPERANDS)
_KEYS = ("amax_history", "scale", "scale_inv")
_FORMATS = (fp8core.Format.E4M3, fp8core.Format.E4M3, fp8core.Format.E5M2)  # flax's e4m3_dtype, e4m3_dtype, e5m2_dtype
_FROM_FLAX_NAMES = {"Fp8DirectDotGeneralOp": "Fp8DotGeneral", "Fp8DotGeneralOp": "Fp8DotGeneral",
                    "Fp8Einsum": "Fp8Einsum"}
_TO_FLAX_NAMES = {"Fp8DotGeneral": "Fp8DirectDotGeneralOp", "Fp8Einsum": "Fp8Einsum"}


def _f32(value: Any, arg: str, ndim: int) -> np.ndarray:
    a = np.asarray(value)
    if a.dtype != np.float32 or a.ndim != ndim:
        raise TypeError(f"{arg}: expected a float32 array of {ndim} dimension(s), got {a.dtype} {a.shape}")
    return a


def _like(template: Any, a: np.ndarray) -> Any:
    """A JAX array where the tree held one, NumPy where it held NumPy (a restored checkpoint)."""
    return jnp.asarray(a) if isinstance(template, jax.Array) else a


def _scale_of(amax: np.float32, j: int, kept_scale: np.float32) -> np.float32:
    """fp8core's scale after flax's pending update of column j: the contract's rule on amax, else kept_scale."""
    s, _ = fp8core.compute_scale(np.array([amax], np.float32), _FORMATS[j], previous=np.array([kept_scale]))
    return np.asarray(s, np.float32)[0]


def _positive(values: np.ndarray, arg: str) -> None:
    bad = ~(np.isfinite(values) & (values > 0))
    if bad.any():
        raise ValueError(f"{arg}: expected finite scales > 0, got {values.tolist()}")


def _from_flax_layer(layer: Mapping[str, Any], path: str) -> dict[str, Any]:
    hist = [_f32(layer[f"{o}_amax_history"], f"{path}['{o}_amax_history']", 1) for o in _OPERANDS]
    scales = [_f32(layer[f"{o}_scale"], f"{path}['{o}_scale']", 1) for o in _OPERANDS]
    lengths = [h.shape[0] for h in hist]
    if len(set(lengths)) != 1 or lengths[0] < 1:
        raise ValueError(f"{path}: amax history lengths differ between operands or are 0 (input, kernel, "
                         f"output_grad: {lengths}); fp8core's [L, 3] history needs one L >= 1")
    for o, s in zip(_OPERANDS, scales):
        if s.shape != (1,):
            raise ValueError(f"{path}['{o}_scale']: expected shape (1,), got {s.shape}")
    flax_scale = np.concatenate(scales)
    _positive(flax_scale, f"{path}[input/kernel/output_grad_scale]")
    with np.errstate(divide="ignore", over="ignore"):
        kept = np.float32(1) / flax_scale
    _positive(kept, f"{path}: 1 / (input/kernel/output_grad_scale) (fp8core's scale)")
    h = np.stack(hist, axis=1)  # [L, 3]: flax's order is fp8core's before its roll
    window = h.max(axis=0)  # NaN propagates, as in flax's jnp.max: the scale is then kept
    scale = np.array([_scale_of(window[j], j, kept[j]) for j in range(3)], np.float32)
    rolled = np.concatenate([np.zeros((1, 3), np.float32), h[2:], h[:1]]) if len(h) > 1 else np.zeros_like(h)
    t = layer[FLAX_KEYS[0]]
    return {"amax_history": _like(t, rolled), "scale": _like(t, scale), "scale_inv": _like(t, np.float32(1) / scale)}


def _nearby(x: np.float32) -> list[np.float32]:
    """x and the floats up to 2 ulps either side (a quotient's neighbours)."""
    out, lo, hi = [x], x, x
    for _ in range(2):
        lo, hi = np.nextafter(lo, np.float32(0)), np.nextafter(hi, np.float32(np.inf))
        out += [lo, hi]
    return [v for v in out if np.isfinite(v) and v > 0]


def _to_flax_layer(layer: Mapping[str, Any], path: str) -> dict[str, Any]:
    if "interval_step" in layer:
        raise ValueError(f"{path}['interval_step']: flax's fp8 ops update their scales every step; a state of "
                         f"a recipe with interval > 1 does not convert")
    h = _f32(layer["amax_history"], f"{path}['amax_history']", 2)
    scale = _f32(layer["scale"], f"{path}['scale']", 1)
    scale_inv = _f32(layer["scale_inv"], f"{path}['scale_inv']", 1)
    if h.shape[0] < 1 or h.shape[1] != 3 or scale.shape != (3,) or scale_inv.shape != (3,):
        raise ValueError(f"{path}: expected amax_history [L >= 1, 3], scale [3], scale_inv [3], got "
                         f"{h.shape}, {scale.shape}, {scale_inv.shape}")
    _positive(scale, f"{path}['scale']")
    if (scale_inv.view(np.uint32) != (np.float32(1) / scale).view(np.uint32)).any():
        raise ValueError(f"{path}['scale_inv']: expected 1 / scale, bit for bit, got {scale_inv.tolist()} for "
                         f"scale {scale.tolist()}")
    if (h[0] != 0).any():
        raise ValueError(f"{path}['amax_history']: row 0 holds amaxes {h[0].tolist()}; a state between steps "
                         f"(the only one a checkpoint holds) has row 0 = 0")
    L = h.shape[0]
    hist, flax_scale = np.zeros((L, 3), np.float32), np.zeros(3, np.float32)
    for j in range(3):
        s = scale[j]
        # flax's scale matters only where its history gives no scale: it then keeps 1 / (1 / its scale)
        inverses = [v for v in _nearby(np.float32(1) / s) if np.float32(1) / v == s]
        flax_scale[j] = inverses[0] if inverses else np.float32(1) / s
        column = np.concatenate([h[-1:, j], [0], h[1:-1, j]]) if L > 1 else np.zeros(1, np.float32)
        oldest = 1 if L > 1 else 0  # the slot fp8core's state has already consumed
        with np.errstate(divide="ignore", over="ignore"):
            guess = np.float32(_FORMATS[j].max) / s
        # NaN last: flax then keeps its scale, as fp8core kept its own after a non-finite amax it has consumed
        for amax in [np.float32(0)] + _nearby(guess) + [np.float32(np.nan)]:
            column[oldest] = amax
            if _scale_of(column.max(), j, np.float32(1) / flax_scale[j]) == s:
                break
        else:
            raise ValueError(f"{path}['scale'][{j}] ({_OPERANDS[j]}): {float(s)} is neither the scale flax's op "
                             f"would compute next from this history (max over it, margin 0) nor one it can "
                             f"keep (no float32 flax scale has 1 / it == {float(s)})")
        hist[:, j] = column
    t = layer["amax_history"]
    out = {f"{o}_amax_history": _like(t, hist[:, j].copy()) for j, o in enumerate(_OPERANDS)}
    out.update({f"{o}_scale": _like(t, flax_scale[j:j + 1].copy()) for j, o in enumerate(_OPERANDS)})
    return out


def _rename(key: Any, names: Mapping[str, str]) -> Any:
    m = re.fullmatch(r"(\w+?)_(\d+)", key) if isinstance(key, str) else None
    return f"{names[m.group(1)]}_{m.group(2)}" if m and m.group(1) in names else key


def _walk(tree: Any, is_layer: Callable[[Mapping[str, Any], str], bool],
          convert: Callable[[Mapping[str, Any], str], dict[str, Any]], names: Mapping[str, str] | None,
          path: str, found: list[str]) -> Any:
    if not isinstance(tree, Mapping):
        return tree
    if is_layer(tree, path):
        found.append(path)
        return convert(tree, path)
    out: dict[Any, Any] = {}
    for key, value in tree.items():
        sub = f"{path}[{key!r}]"
        new = _walk(value, is_layer, convert, names, sub, found)
        name = _rename(key, names) if names is not None and found and found[-1] == sub else key
        if name in out or (name != key and name in tree):
            raise ValueError(f"{sub}: renamed to {name!r}, which {path or 'variables'} already holds; pass "
                             f"rename=False and rename the layers yourself")
        out[name] = new
    return FrozenDict(out) if isinstance(tree, FrozenDict) else out


def _is_flax_layer(d: Mapping[str, Any], path: str) -> bool:
    present = [k for k in FLAX_KEYS if k in d]
    if present and set(d) != set(FLAX_KEYS):
        raise ValueError(f"{path or 'variables'}: a flax fp8 op's state holds exactly {list(FLAX_KEYS)}, got "
                         f"{sorted(map(str, d))}")
    return bool(present)


def _is_fp8core_layer(d: Mapping[str, Any], path: str) -> bool:
    if "amax_history" not in d:
        return False
    if set(d) - {"interval_step"} != set(_KEYS):
        raise ValueError(f"{path or 'variables'}: an fp8core.jax layer's state holds {list(_KEYS)} (and "
                         f"interval_step), got {sorted(map(str, d))}")
    return True


def from_flax_fp8_state(variables: Mapping[str, Any], rename: bool = True) -> Any:
    """A variables tree with every flax fp8 op state (float32 histories [L], scales [1]) replaced by fp8core.jax's
    (``amax_history`` [L, 3], ``scale`` [3], ``scale_inv`` [3], float32), the rest untouched (the same arrays);
    ``rename``: the layers' auto-names follow the class (``Fp8DirectDotGeneralOp_0`` -> ``Fp8DotGeneral_0``).
    fp8core's next step uses the scales flax's next step would have. dict or FrozenDict in, the same out."""
    found: list[str] = []
    out = _walk(variables, _is_flax_layer, _from_flax_layer, _FROM_FLAX_NAMES if rename else None, "", found)
    if not found:
        raise ValueError(f"variables: no flax fp8 op state (a mapping of {list(FLAX_KEYS)}) found")
    return out


def to_flax_fp8_state(variables: Mapping[str, Any], rename: bool = True) -> Any:
    """The inverse of :func:`from_flax_fp8_state`: every fp8core.jax layer state (interval 1) replaced by flax's
    op state, whose next step uses fp8core's next scales (``scale_inv``); ``rename``: ``Fp8DotGeneral_0`` ->
    ``Fp8DirectDotGeneralOp_0``. ``from_flax_fp8_state(to_flax_fp8_state(v))`` is ``v``, bit for bit."""
    found: list[str] = []
    out = _walk(variables, _is_fp8core_layer, _to_flax_layer, _TO_FLAX_NAMES if rename else None, "", found)
    if not found:
        raise ValueError(f"variables: no fp8core.jax layer state (a mapping of {list(_KEYS)}) found")
    return out
