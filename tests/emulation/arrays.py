"""Host data for the emulated device: upload (optionally misaligned), bits back, special values."""

import ml_dtypes
import numpy as np

import device
from fp8core._tensor import Tensor, storage_dtype
from fp8core.formats import dtype_name

SPECIALS = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, -1e-45, 448, 464, 57344, 61440, 3e38],
                    np.float32)


def upload(x: np.ndarray, offset: int = 0):
    """x (logical dtype) on the current emulated device, ``offset`` elements into a larger allocation (a
    misaligned view): a CuPy array, or a Tensor naming the logical dtype of bf16/fp8 storage."""
    name = dtype_name(x.dtype)
    storage = storage_dtype(name)
    base = device.empty(x.size + offset, storage)
    view = base[offset:offset + x.size].reshape(x.shape)
    view.set(np.ascontiguousarray(x).view(storage))
    return Tensor(view, name, ("cuda", device.current()), "cupy") if storage != x.dtype else view


def misaligned(x: np.ndarray, by: int, host: bool = False):
    """x (logical dtype) starting ``by`` bytes past a multiple of its element size (0: aligned), as a view of a byte
    buffer: on the current emulated device (as :func:`upload` gives it), or in host memory with ``host``. A GPU's
    loads of its elements would fault."""
    name = dtype_name(x.dtype)
    size = x.dtype.itemsize
    raw = np.zeros(x.nbytes + 2 * size, np.uint8) if host else device.empty(x.nbytes + 2 * size, np.uint8)
    start = (by - (raw.ctypes.data if host else raw.data.ptr)) % size
    if host:
        view = raw[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
        view[...] = x
        return view
    storage = storage_dtype(name)
    view = raw[start:start + x.nbytes].view(storage).reshape(x.shape)
    view.set(np.ascontiguousarray(x).view(storage))
    return Tensor(view, name, ("cuda", device.current()), "cupy") if storage != x.dtype else view


def bits(a) -> np.ndarray:
    if isinstance(a, Tensor):
        a = a.data
    a = a.get() if isinstance(a, device.ndarray) else np.asarray(a)
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def data(rng: np.random.Generator, shape, dtype, specials: bool = True) -> np.ndarray:
    """Normal values over 40 binades, with NaN, inf, -0, subnormals and saturation boundaries sprinkled in."""
    n = int(np.prod(shape))
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(np.float32)
    if specials and n:
        k = min(n, SPECIALS.size)
        x[rng.choice(n, k, replace=False)] = SPECIALS[:k]
    with np.errstate(over="ignore"):
        return x.astype(dtype).reshape(shape)


DTYPES = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)]
