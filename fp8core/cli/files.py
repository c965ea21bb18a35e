"""Reading tensor files for ``fp8core inspect``: .npy, .npz, .safetensors and .pt.

Files are hostile until read: nothing is unpickled, an .npz member's declared size is checked against a cap
before it is inflated, a header's shape against the bytes really there, and tensors are read one at a time.
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import mmap
import os
import pickle
import re
import sys
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from fp8core.extras import install_hint
from fp8core.formats import ENCODINGS
from fp8core.selftest.gpu import ANSI, one_line

from .common import CliError, installed_version, printable

DEFAULT_MAX_BYTES = 1 << 30  # what a compressed .npz may inflate to, all members together; --max-bytes raises it
MAX_DEPTH = 64  # nesting levels of a .pt checkpoint's containers that are walked
MAX_ENTRIES = 1_000_000  # container entries walked in a .pt checkpoint
_READ_STEP = 1 << 20  # bytes inflated per step of an .npz member
_MAPPED_BYTES = 1 << 24  # bytes of tensors read through one memory map of a .safetensors file


def _as_numpy(t: Any) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    import torch

    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        fp8 = {row.torch_dtype: row.numpy_dtype for row in ENCODINGS.values()}
        if t.dtype in fp8:
            return t.view(torch.uint8).numpy().view(fp8[t.dtype])
        try:
            return t.numpy()
        except TypeError:  # a dtype NumPy has no counterpart for (complex32, quantized, ...)
            return np.empty(tuple(t.shape), dtype=np.dtype([("unsupported " + str(t.dtype), "V1")]))
    raise CliError(f"unsupported tensor type {type(t).__name__}")


def _check_path(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        raise CliError(f"{path}: is a directory; name the tensor files in it")
    if not p.exists():
        raise CliError(f"{path}: no such file")
    if not p.is_file():
        raise CliError(f"{path}: not a regular file")
    return p


def iter_tensors(path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for each tensor of a .npy, .npz, .safetensors or .pt file, read one at a time.

    Errors are :class:`CliError` with one line naming the file; .npy arrays come back memory-mapped."""
    p = _check_path(path)
    suffix = p.suffix.lower()
    readers = {".npy": _read_npy, ".npz": _read_npz, ".safetensors": _read_safetensors, ".pt": _read_torch,
               ".pth": _read_torch}
    if suffix not in readers:
        raise CliError(f"{path}: unknown format {suffix or '(no suffix)'}; expected .npy, .npz, .safetensors or .pt")
    try:
        yield from readers[suffix](p, max_bytes)
    except CliError:
        raise
    except MemoryError:
        raise CliError(f"{path}: not enough memory to read it") from None
    except Exception as e:
        raise CliError(f"{path}: could not be read as {suffix[1:]} ({one_line(e)})") from None


def _npy_header(f: Any, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) from an .npy header, read with ``ast.literal_eval`` (no code runs).

    NumPy's own reader refuses ``'<f1'``, which is how ml_dtypes' float8_e5m2 is saved: read here as E5M2.
    """
    magic = f.read(8)
    if len(magic) < 8 or magic[:6] != b"\x93NUMPY":
        raise CliError(f"{where}: not an .npy array (no NUMPY magic)")
    if magic[6] == 1:
        size = int.from_bytes(f.read(2), "little")
    elif magic[6] in (2, 3):
        size = int.from_bytes(f.read(4), "little")
    else:
        raise CliError(f"{where}: .npy format version {magic[6]}.{magic[7]} is not supported")
    if size > 1 << 16:
        raise CliError(f"{where}: an .npy header of {size} bytes is not plausible")
    try:
        header = ast.literal_eval(f.read(size).decode("latin1" if magic[6] < 3 else "utf8"))
        shape, fortran, descr = header["shape"], header["fortran_order"], header["descr"]
    except Exception:
        raise CliError(f"{where}: unreadable .npy header") from None
    if not (isinstance(shape, tuple) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise CliError(f"{where}: .npy header has an invalid shape {shape!r}")
    if isinstance(descr, str) and descr[1:] == "f1":
        import ml_dtypes

        dtype = np.dtype(ml_dtypes.float8_e5m2)
    else:
        try:
            dtype = np.lib.format.descr_to_dtype(descr)
        except Exception:
            raise CliError(f"{where}: .npy header has an unknown dtype {descr!r}") from None
    if dtype.hasobject:
        raise CliError(f"{where}: holds Python objects, which are not unpickled")
    return shape, bool(fortran), dtype


def _read_npy(p: Path, max_bytes: int) -> Iterator[tuple[str, np.ndarray]]:
    # A memory map: nothing is read before it is measured, and the header's shape is checked against the file.
    with open(p, "rb") as f:
        shape, fortran, dtype = _npy_header(f, str(p))
        offset = f.tell()
    nbytes = math.prod(shape) * dtype.itemsize
    if offset + nbytes > p.stat().st_size:
        raise CliError(f"{p}: its header claims {nbytes} bytes of data but the file holds "
                       f"{p.stat().st_size - offset}: truncated or crafted")
    if nbytes == 0:
        yield p.stem, np.empty(shape, dtype)
        return
    t = np.memmap(p, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")
    # NumPy pads its headers so the data is aligned; another writer's may not be, and fp8core's primitives refuse an
    # array not aligned to its element size: such a file's data is copied.
    yield p.stem, t if t.flags.aligned else np.array(t, order="K")


def _npy_member(f: Any, name: str, declared: int) -> np.ndarray:
    shape, fortran, dtype = _npy_header(f, f"member {name}")
    count = math.prod(shape)
    if count * dtype.itemsize > declared:
        raise CliError(f"member {name}: its header claims {count * dtype.itemsize} bytes of data but the member "
                       f"holds {declared}: corrupt or crafted")
    # Inflated straight into the array, a step at a time: one read of the whole member would hold it twice.
    out = np.empty(count, dtype)
    raw = memoryview(out.view(np.uint8))
    at = 0
    while at < len(raw):
        got = f.readinto(raw[at:at + _READ_STEP])
        if not got:
            raise CliError(f"member {name}: truncated")
        at += got
    return out.reshape(shape, order="F" if fortran else "C")


def _read_npz(p: Path, max_bytes: int) -> Iterator[tuple[str, np.ndarray]]:
    with zipfile.ZipFile(p) as z:
        members = [info for info in z.infolist() if not info.is_dir()]
        for info in members:
            if not info.filename.endswith(".npy"):
                raise CliError(f"{p}: member {info.filename} is not a .npy array")
        # A zip may hold two entries of one name (NumPy's np.load would give the last): which is the tensor?
        twice = sorted(n for n, k in Counter(info.filename for info in members).items() if k > 1)
        if twice:
            raise CliError(f"{p}: member name(s) {', '.join(twice)} appear more than once (a zip may hold two entries "
                           "of one name; which one is the tensor is not the reader's to guess): not an .npz that "
                           "np.savez writes")
        # Every member's declared size before any is read: a cap per member lets many members add up.
        total = sum(info.file_size for info in members)
        if total > max_bytes:
            raise CliError(f"{p}: its {len(members)} member(s) would inflate to {total} bytes in all, above the limit "
                           f"of {max_bytes} (--max-bytes raises it)")
        for info in members:
            name = info.filename[:-4]
            with z.open(info) as f:
                try:
                    yield name, _npy_member(f, info.filename, info.file_size)
                except CliError as e:
                    raise CliError(f"{p}: {e}") from None


# safetensors' dtypes that NumPy (with ml_dtypes) holds as they are stored (little-endian): read straight from the
# file's map, without torch (its import was 1.8 of inspect's 2.6 s of start on the 2-core machine). Any other dtype
# is read through torch as before (one NumPy has no type for comes out as an unsupported placeholder, as from a .pt).
_SAFETENSORS_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
                      "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
                      "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _safetensors_dtype(name: str) -> np.dtype | None:
    code = _SAFETENSORS_NUMPY.get(name)
    if code is None:
        return None
    if code[0] in "<i?u":
        return np.dtype(code)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, code)).newbyteorder("<")


def _read_safetensors(p: Path, max_bytes: int) -> Iterator[tuple[str, np.ndarray]]:
    try:
        import safetensors
    except ImportError:
        raise CliError(f"{p}: reading .safetensors needs the safetensors package (pip install safetensors)") from None
    # One open file for the whole read: safetensors checks the header (its JSON, every tensor's offsets within the
    # data and its size against its dtype and shape) as it opens the path, and the header and maps used here are
    # then that same file's, even where another is renamed into its path meanwhile (a writer's `latest`): its
    # identity is compared before and after the check, and each tensor's extent checked again as it is read.
    with open(p, "rb") as raw:
        opened = _identity(os.fstat(raw.fileno()))
        with safetensors.safe_open(str(p), framework="np") as f:
            keys = list(f.keys())
        _same_file(p, opened)
        size = int.from_bytes(raw.read(8), "little")
        header = json.loads(raw.read(size))
        start, length = 8 + size, opened[2]
        with contextlib.ExitStack() as stack:
            through_torch = None
            # Every page a read touches stays resident while its map lives: one map for the whole checkpoint
            # would hold all of it by the end. A new map is made once _MAPPED_BYTES of tensors have been read
            # through one; a map goes (with its pages) once the tensors read through it (views of it) are freed.
            # The resident pages stay near _MAPPED_BYTES plus one tensor whatever the file's size.
            at = 0
            while at < len(keys):
                mapped = mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ) if start < length else None
                read = 0
                while at < len(keys) and read < _MAPPED_BYTES:
                    k = keys[at]
                    entry = header[k]
                    dtype = _safetensors_dtype(entry["dtype"])
                    if dtype is None:
                        if through_torch is None:
                            through_torch = stack.enter_context(_torch_reader(safetensors, p, opened))
                        t = _as_numpy(through_torch.get_tensor(k))
                    else:
                        t = _mapped_tensor(mapped, p, k, entry, dtype, start, length)
                    at, read = at + 1, read + t.nbytes
                    yield k, t
                    del t  # held by the caller alone, which frees it before the next is read
                del mapped


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _same_file(p: Path, opened: tuple[int, int, int, int]) -> None:
    if _identity(os.stat(p)) != opened:
        raise CliError(f"{p}: the file changed while it was being read (replaced or written to); read it again")


@contextlib.contextmanager
def _torch_reader(safetensors: Any, p: Path, opened: tuple[int, int, int, int]) -> Iterator[Any]:
    """safetensors' torch reader of ``p`` (for the dtypes NumPy has no type for), checked to be the file opened."""
    if not installed_version("torch"):
        raise CliError(f"{p}: has tensors of a dtype only torch reads (E8M0, complex, ...): pip install torch")
    with safetensors.safe_open(str(p), framework="pt") as f:
        _same_file(p, opened)
        yield f


def _mapped_tensor(mapped: mmap.mmap | None, p: Path, name: str, entry: dict, dtype: np.dtype, start: int,
                   length: int) -> np.ndarray:
    """The tensor ``name`` of the header ``entry`` in a file's map: a read-only view of it, no copy, unless it lies
    at an offset that is not a multiple of its element size (the format allows it; fp8core's primitives refuse such
    an array): then a copy. Its extent is checked against its shape and dtype and the file's length first."""
    shape = [int(d) for d in entry["shape"]]
    begin, end = (int(o) for o in entry["data_offsets"])
    count = math.prod(shape)
    if end - begin != count * dtype.itemsize or begin < 0 or start + end > length:
        raise CliError(f"{p}: tensor {name!r}: its data_offsets [{begin}, {end}] do not hold {entry['dtype']} "
                       f"{shape} within the file's {length - start} bytes of data")
    if not count:
        return np.empty(shape, dtype)
    t = np.frombuffer(mapped, dtype, count, start + begin).reshape(shape)
    return t if t.flags.aligned else t.copy()


def _tensors_in(obj: Any, prefix: str, skipped: dict[str, int]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for the tensors in nested dicts, lists and tuples, depth first in order.

    Each container is walked once: a checkpoint can share one list under two entries at every level
    (1.7 KB that would otherwise be 2^26 paths). The walk stops MAX_DEPTH levels down and after MAX_ENTRIES
    entries; ``skipped`` counts what was not walked: "shared" containers, entries "too deep", entries
    "over the limit"."""
    import torch

    seen: set[int] = set()
    entries = 0
    stack: list[tuple[str, Any, int]] = [(prefix, obj, 0)]
    while stack:
        name, o, depth = stack.pop()
        if isinstance(o, torch.Tensor):
            yield name, o
            continue
        if not isinstance(o, (dict, list, tuple)):
            continue
        if id(o) in seen:
            skipped["shared"] = skipped.get("shared", 0) + 1
            continue
        seen.add(id(o))
        items = list(o.items()) if isinstance(o, dict) else list(enumerate(o))
        if depth >= MAX_DEPTH:
            skipped["too deep"] = skipped.get("too deep", 0) + len(items)
            continue
        if entries + len(items) > MAX_ENTRIES:
            skipped["over the limit"] = skipped.get("over the limit", 0) + len(items)
            continue
        entries += len(items)
        stack.extend((f"{name}.{k}" if name else str(k), v, depth + 1) for k, v in reversed(items))


def _read_torch(p: Path, max_bytes: int) -> Iterator[tuple[str, np.ndarray]]:
    try:
        import torch
    except ImportError:
        raise CliError(f"{p}: reading .pt needs torch ({install_hint('torch')})") from None
    try:
        try:
            obj = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            obj = torch.load(p, map_location="cpu", weights_only=True)  # the legacy (non-zip) format
    except pickle.UnpicklingError as e:
        text = ANSI.sub("", str(e))
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        if found:
            raise CliError(f"{p}: holds pickled Python objects ({found.group(1)}: a whole nn.Module, say), which "
                           "fp8core does not unpickle; save a state_dict (torch.save(model.state_dict(), path)) and "
                           "inspect that") from None
        why = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
        raise CliError(f"{p}: could not be read as pt (not a tensor checkpoint: "
                       f"{why.group(1) if why else one_line(e)})") from None
    skipped: dict[str, int] = {}
    found = list(_tensors_in(obj, "" if isinstance(obj, (dict, list, tuple)) else p.stem, skipped))
    if not found and not isinstance(obj, (dict, list, tuple)):
        raise CliError(f"{p}: holds a {type(obj).__name__}, not a tensor or a dict of tensors")
    what = {"shared": "references to a dict/list/tuple already walked (walked once)",
            "too deep": f"entries nested more than {MAX_DEPTH} levels down",
            "over the limit": f"entries beyond the first {MAX_ENTRIES:,}"}
    for kind, n in skipped.items():
        print(f"fp8core: note: {printable(str(p))}: skipped {n} {what[kind]}", file=sys.stderr)
    for name, t in found:
        yield name, _as_numpy(t)
