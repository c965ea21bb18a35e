"""The ``fp8core`` command: info, inspect, demo, bench.

Errors are one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import pickle
import platform
import re
import runpy
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

import fp8core
from fp8core import Format
from fp8core.extras import install_hint
from fp8core.selftest.gpu import ANSI as _ANSI, gpu_unavailable_reason, one_line as _one_line


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


def _progress(done: int, total: int, text: str = "") -> None:
    """A bar redrawn in place on a terminal; in a log (stderr not a terminal), plain lines, every tenth step."""
    width = 30
    filled = width * done // max(total, 1)
    bar = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {text}"
    if sys.stderr.isatty():
        sys.stderr.write(f"\r{bar}" + ("\n" if done == total else ""))
    elif done == total or done % max(1, total // 10) == 0:
        sys.stderr.write(bar.rstrip() + "\n")
    else:
        return
    sys.stderr.flush()


# ---- info ----------------------------------------------------------------------------------------------------

def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:
        return None
    return getattr(mod, "__version__", "installed")


def gpu_report() -> dict[str, Any]:
    """The backend found: GPU name and compute capability, or why there is none."""
    why = gpu_unavailable_reason()
    if why is not None:
        return {"backend": "CPU only", "why": why}
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        props = cupy.cuda.runtime.getDeviceProperties(0)
        cc = int(cupy.cuda.Device(0).compute_capability)
    except Exception as e:
        return {"backend": "CPU only", "why": _one_line(e)}
    gemm = cc >= 89
    why = "" if gemm else "needs compute capability 8.9+"
    if gemm and _version("nvmath") is None:
        gemm, why = False, f"nvmath-python is not installed ({install_hint('gemm')})"
    return {"backend": "cuda", "gpu": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
            "compute_capability": f"{cc // 10}.{cc % 10}", "devices": n, "fp8_gemm": gemm, "fp8_gemm_why": why}


def cmd_info(args: argparse.Namespace) -> None:
    from fp8core._kernels import cache_dir

    report: dict[str, Any] = {"fp8core": fp8core.__version__, "python": platform.python_version()}
    for name in ("numpy", "ml_dtypes", "cupy", "torch", "jax", "nvmath"):
        report[name] = _version(name) or "not installed"
    try:
        import cupy

        version = cupy.cuda.runtime.runtimeGetVersion()  # 1000 * major + 10 * minor: 13020 is CUDA 13.2
        report["cuda_runtime"] = f"{version // 1000}.{version % 1000 // 10}"
    except Exception:
        report["cuda_runtime"] = "unavailable"
    report.update(gpu_report())
    cache = Path(cache_dir())
    entries = len(list(cache.glob("*"))) if cache.is_dir() else 0
    report["kernel_cache"] = f"{cache} ({entries} compiled kernel files)" if cache.is_dir() else f"{cache} (empty)"
    from fp8core import verified

    report["gpu_verified"] = verified.status()[1]
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for k, v in report.items():
        print(f"{k:<20} {v}")


# ---- inspect -------------------------------------------------------------------------------------------------
#
# Files are hostile until read: nothing is unpickled, an .npz member's declared size is checked against a cap
# before it is inflated, a header's shape against the bytes really there, and tensors are read and measured one
# at a time, in chunks, so memory stays near one tensor plus a few chunk-sized temporaries.

DEFAULT_MAX_BYTES = 1 << 30  # what a compressed .npz may inflate to, all members together; --max-bytes raises it
MAX_DEPTH = 64  # nesting levels of a .pt checkpoint's containers that are walked
MAX_ENTRIES = 1_000_000  # container entries walked in a .pt checkpoint
_CHUNK = 1 << 20  # elements per step of the statistics
_RAW_FP8 = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
_HIST_BINS = np.linspace(-152.0, 130.0, 565)  # log2|x| of every finite fp32/fp64-in-fp32-range value, 0.5 wide


def printable(text: str) -> str:
    """``text`` with every non-printable character (terminal escapes, carriage returns, bidi overrides) written
    as its Python escape: names come from the files, and a terminal would act on them."""
    return text if text.isprintable() else "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def _as_numpy(t: Any) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    import torch

    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            import ml_dtypes

            name = "float8_e4m3fn" if t.dtype == torch.float8_e4m3fn else "float8_e5m2"
            return t.view(torch.uint8).numpy().view(getattr(ml_dtypes, name))
        try:
            return t.numpy()
        except TypeError:  # a dtype NumPy has no counterpart for (complex32, quantized, ...)
            return np.empty(tuple(t.shape), dtype=np.dtype([("unsupported " + str(t.dtype), "V1")]))
    raise CliError(f"unsupported tensor type {type(t).__name__}")


def _raw_bytes_dtype(x: np.ndarray, raw_fp8: str) -> tuple[np.ndarray, str | None]:
    """ml_dtypes arrays saved to .npy come back as raw bytes (|V1, |V2): the header names no float type."""
    if x.dtype.kind != "V" or x.dtype.fields is not None:
        return x, None
    import ml_dtypes

    if x.dtype.itemsize == 1:
        name = _RAW_FP8[raw_fp8]
        other = "e5m2" if raw_fp8 == "e4m3" else "e4m3"
        note = f"raw 1-byte data (|V1) read as {name}; --raw-fp8 {other} for the other"
        return x.view(getattr(ml_dtypes, name)), note
    if x.dtype.itemsize == 2:
        return x.view(ml_dtypes.bfloat16), "raw 2-byte data (|V2) read as bfloat16 (how ml_dtypes saves it)"
    return x, None


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
        raise CliError(f"{path}: could not be read as {suffix[1:]} ({_one_line(e)})") from None


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
    yield p.stem, np.memmap(p, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")


def _npy_member(f: Any, name: str, declared: int) -> np.ndarray:
    shape, fortran, dtype = _npy_header(f, f"member {name}")
    count = math.prod(shape)
    if count * dtype.itemsize > declared:
        raise CliError(f"member {name}: its header claims {count * dtype.itemsize} bytes of data but the member "
                       f"holds {declared}: corrupt or crafted")
    data = f.read(count * dtype.itemsize)
    if len(data) != count * dtype.itemsize:
        raise CliError(f"member {name}: truncated")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C")


def _read_npz(p: Path, max_bytes: int) -> Iterator[tuple[str, np.ndarray]]:
    with zipfile.ZipFile(p) as z:
        members = [info for info in z.infolist() if not info.is_dir()]
        for info in members:
            if not info.filename.endswith(".npy"):
                raise CliError(f"{p}: member {info.filename} is not a .npy array")
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


def _read_safetensors(p: Path, max_bytes: int) -> Iterator[tuple[str, np.ndarray]]:
    try:
        from safetensors import safe_open
    except ImportError:
        raise CliError(f"{p}: reading .safetensors needs the safetensors package (pip install safetensors)") from None
    framework = "pt" if _version("torch") else "np"
    with safe_open(str(p), framework=framework) as f:
        for k in f.keys():
            yield k, _as_numpy(f.get_tensor(k))


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
        text = _ANSI.sub("", str(e))
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        if found:
            raise CliError(f"{p}: holds pickled Python objects ({found.group(1)}: a whole nn.Module, say), which "
                           "fp8core does not unpickle; save a state_dict (torch.save(model.state_dict(), path)) and "
                           "inspect that") from None
        why = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
        raise CliError(f"{p}: could not be read as pt (not a tensor checkpoint: "
                       f"{why.group(1) if why else _one_line(e)})") from None
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


def _finite_float(v: float) -> Any:
    """JSON has no inf or NaN: infinities become the strings "inf"/"-inf", NaN the string "nan"."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def _strict(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strict(v) for v in obj]
    return _finite_float(obj)


def _measurable(x: np.ndarray, raw_fp8: str) -> tuple[np.ndarray | None, str | None]:
    """The data in a dtype fp8core's amax and quantize take, or None; and a note on what was done to it."""
    x, note = _raw_bytes_dtype(x, raw_fp8)
    name = x.dtype.name
    if not x.dtype.isnative and x.dtype.itemsize > 1:  # converted chunk by chunk (_chunk_f32)
        note = f"big-endian {name} data: read in native byte order"
    if name in ("float32", "bfloat16", "float16"):
        return x, note
    if name in ("float8_e4m3fn", "float8_e5m2"):
        return x, note or f"{name} data: statistics of re-quantizing its values"
    if x.dtype.kind == "f":
        return x, f"{name} data: rounded to float32 first" + (f" ({note})" if note else "")
    if x.dtype.kind in "iub":
        return x, f"integer data ({name}): statistics of its float32 conversion" + (f" ({note})" if note else "")
    return None, None


def _chunk_f32(x: np.ndarray, a: int, b: int) -> np.ndarray:
    c = x[a:b]
    if not c.dtype.isnative:  # a file's byte order is the file's business: read it in ours
        c = c.astype(c.dtype.newbyteorder("="))
    if c.dtype.name in ("float32", "bfloat16", "float16"):
        return np.ascontiguousarray(c)
    with np.errstate(over="ignore"):
        return c.astype(np.float32)


def tensor_stats(x: np.ndarray, raw_fp8: str = "e4m3", hist: np.ndarray | None = None,
                 scale: float | None = None) -> dict[str, Any]:
    """How x fares in E4M3 and E5M2 under current scaling with a power-of-2 scale.

    Per format: scale (from the amax of the finite values), sqnr_db (over the finite values; inf when exact,
    None when there is no signal), underflow (nonzero values that become 0), clipped (values with
    |x * scale| > max before the cast, which saturate), at_max (values that land on +-max, clipped ones
    included), max_rel_error. Fractions are of the finite values. nan and inf count the non-finite inputs.
    ``scale``, when given, replaces the per-format scale. ``hist``, when given, accumulates a histogram of
    log2|x| over :data:`_HIST_BINS`.
    """
    row: dict[str, Any] = {"shape": list(x.shape), "dtype": str(x.dtype)}
    data, note = _measurable(x, raw_fp8)
    if note:
        row["note"] = note
    if data is None:
        row["skipped"] = f"not real-valued numbers ({x.dtype})"
        return row
    row["dtype"] = str(data.dtype if data.dtype.isnative else data.dtype.newbyteorder("="))
    flat = data.reshape(-1, order="A") if data.flags.f_contiguous else data.reshape(-1)
    n = flat.size
    bounds = [(a, min(a + _CHUNK, n)) for a in range(0, n, _CHUNK)]
    amax_bits, finite_amax, nans, infs = 0, 0.0, 0, 0
    for a, b in bounds:
        c = _chunk_f32(flat, a, b)
        amax_bits = max(amax_bits, int(fp8core.amax(c).view(np.uint32)[0]))
        v = c.astype(np.float64)
        fin = np.isfinite(v)
        nans += int(np.isnan(v).sum())
        infs += int((~fin).sum()) - int(np.isnan(v).sum())
        if fin.any():
            av = np.abs(v[fin])
            finite_amax = max(finite_amax, float(av.max()))
            if hist is not None:
                nz = av[av > 0]
                hist += np.histogram(np.log2(nz), bins=_HIST_BINS)[0]
    row["amax"] = float(np.array([amax_bits], np.uint32).view(np.float32)[0])
    row["elements"], row["nan"], row["inf"] = n, nans, infs
    amax = np.array([finite_amax], np.float32)
    for fmt in (Format.E4M3, Format.E5M2):
        if scale is None:
            scales = fp8core.compute_scale(amax, fmt, power_of_2=True)
        else:
            scales = (np.array([scale], np.float32), np.array([1 / np.float32(scale)], np.float32))
        s32 = np.float32(scales[0][0])
        max_code = 0x7E if fmt is Format.E4M3 else 0x7B
        signal = noise = 0.0
        finite = nonzero = under = clipped = at_max = 0
        max_rel = 0.0
        for a, b in bounds:
            c = _chunk_f32(flat, a, b)
            q = fp8core.quantize(c, scales[0], fmt)
            y = fp8core.dequantize(q, scales[1], "float32").astype(np.float64)
            v = c.astype(np.float64)
            fin = np.isfinite(v)
            err = y[fin] - v[fin]
            signal += float(np.sum(v[fin] ** 2))
            noise += float(np.sum(err ** 2))
            finite += int(fin.sum())
            nz = fin & (v != 0)
            nonzero += int(nz.sum())
            under += int((nz & (y == 0)).sum())
            with np.errstate(over="ignore", invalid="ignore"):
                scaled = np.abs(c.astype(np.float32) * s32)  # the contract's one fp32 multiply
            clipped += int((fin & (scaled > np.float32(fmt.max))).sum())
            at_max += int((fin & ((q.view(np.uint8) & 0x7F) == max_code)).sum())
            if nz.any():
                max_rel = max(max_rel, float(np.max(np.abs((y[nz] - v[nz]) / v[nz]))))
        if signal > 0:
            sqnr: float | None = math.inf if noise == 0 else 10 * math.log10(signal / noise)
        else:
            sqnr = None
        row[fmt.name] = {
            "scale": float(s32), "sqnr_db": sqnr,
            "underflow": under / nonzero if nonzero else 0.0,
            "clipped": clipped / finite if finite else 0.0,
            "at_max": at_max / finite if finite else 0.0,
            "max_rel_error": max_rel,
        }
    return row


def _plot_target(out: str) -> Path:
    """The file matplotlib will write: it adds ".png" to a name without a known image extension."""
    import matplotlib.pyplot as plt

    p = Path(out)
    known = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    return p if p.suffix[1:].lower() in known else p.with_name(p.name + ".png")


def _plot(stats: dict[str, tuple[np.ndarray, dict]], out: str) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError(f"--plot needs matplotlib ({install_hint('plot')})") from None
    target = _plot_target(out)
    n = len(stats)
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.6 * n), squeeze=False)
    # Each format's range is its own opaque strip along the top, so no colour is a blend of two and the
    # legend's swatches are what is drawn; dashed lines carry the range edges down over the histogram.
    ranges = {Format.E4M3: (2.0 ** -9, 448.0, "tab:blue", (0.93, 1.0)),
              Format.E5M2: (2.0 ** -16, 57344.0, "tab:orange", (0.86, 0.93))}
    centers = (_HIST_BINS[:-1] + _HIST_BINS[1:]) / 2
    for ax, (name, (hist, row)) in zip(axes[:, 0], stats.items()):
        if hist.any():
            used = np.nonzero(hist)[0]
            lo, hi = used[0], used[-1] + 1
            ax.bar(centers[lo:hi], hist[lo:hi], width=_HIST_BINS[1] - _HIST_BINS[0], color="0.3")
        ax.set_ylim(0, max(1, int(hist.max())) * 1.25)  # headroom: the strips cover no bar
        for fmt, (lo_v, hi_v, color, (y0, y1)) in ranges.items():
            s = row[fmt.name]["scale"]
            edges = (math.log2(lo_v / s), math.log2(hi_v / s))
            ax.axvspan(*edges, ymin=y0, ymax=y1, color=color, label=f"{fmt.name} range (scale {s:.4g})")
            for edge in edges:
                ax.axvline(edge, ymax=y1, color=color, linestyle="--", linewidth=0.8)
        # mathtext would read "$" in a name: escape it, and control characters, which no font draws
        title = printable(f"{name}  {row['dtype']} {tuple(row['shape'])}  amax {row['amax']:.4g}")
        ax.set_title(title.replace("$", r"\$"), fontsize=9)
        ax.set_xlabel("log2 |x|")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # beside the plot: covers no bar
    fig.tight_layout()
    fig.savefig(target, dpi=90)
    plt.close(fig)
    return target


def _cell(v: Any, spec: str, width: int) -> str:
    if v is None:
        return f"{'n/a':>{width}}"
    return f"{v:>{width}{spec}}"


TABLE_WIDTH = 100


def _fit(text: str, width: int = TABLE_WIDTH) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _table(rows: dict[str, dict]) -> Iterator[str]:
    """The inspect table, TABLE_WIDTH columns at most: a line naming each tensor, then a line per format."""
    fields = f"{'scale':>10} {'SQNR dB':>8} {'underflow':>9} {'clipped':>8} {'at ±max':>8} {'max rel err':>11}"
    yield "tensor  shape  dtype  amax"
    yield f"  {'fmt':<4} {fields}"
    yield "-" * (7 + len(fields))
    for key, r in rows.items():
        shape = str(tuple(r["shape"]))
        rest = f"  {shape} {r['dtype']}  " + (f"skipped: {r['skipped']}" if "skipped" in r else f"amax {r['amax']:.4g}")
        name = printable(key)
        if len(name) + len(rest) <= TABLE_WIDTH:
            yield name + rest
        else:  # a long name whole, on lines of its own: any part of it may be what tells tensors apart
            yield from (name[i:i + TABLE_WIDTH] for i in range(0, len(name), TABLE_WIDTH))
            yield _fit(rest)
        if "skipped" in r:
            continue
        for fmt in ("E4M3", "E5M2"):
            f = r[fmt]
            yield (f"  {fmt:<4} {f['scale']:>10.4g} {_cell(f['sqnr_db'], '.2f', 8)} {f['underflow']:>9.2%} "
                   f"{f['clipped']:>8.2%} {f['at_max']:>8.2%} {f['max_rel_error']:>11.3g}")
        notes = [r["note"]] if "note" in r else []
        if r["nan"] or r["inf"]:
            notes.append(f"{r['nan']} NaN and {r['inf']} inf of {r['elements']} values: the statistics are of the "
                         "finite values")
        for note in notes:
            yield from textwrap.wrap(printable(note), TABLE_WIDTH, initial_indent="  note: ",
                                     subsequent_indent=" " * 8)


def cmd_inspect(args: argparse.Namespace) -> None:
    try:
        _inspect(args)
    except CliError as e:  # messages name members and keys from the files
        raise CliError(printable(str(e))) from None
    except (ValueError, TypeError, OSError) as e:  # main's own handler, but the text escaped (paths, names)
        raise CliError(printable(_one_line(e, kind=False))) from None


def _inspect(args: argparse.Namespace) -> None:
    rows: dict[str, dict] = {}
    hists: dict[str, np.ndarray] = {}
    files = list(args.files)
    for i, path in enumerate(files):
        count = 0
        try:
            for name, x in iter_tensors(path, args.max_bytes):
                key = f"{path}:{name}" if len(files) > 1 else name
                hist = np.zeros(len(_HIST_BINS) - 1, np.int64) if args.plot else None
                rows[key] = tensor_stats(x, args.raw_fp8, hist, args.scale)
                if hist is not None and "skipped" not in rows[key]:
                    hists[key] = hist
                count += 1
                del x  # one tensor at a time
        except CliError:
            raise
        except MemoryError:
            raise CliError(f"{path}: not enough memory to measure it") from None
        if not count:
            raise CliError(f"{path}: holds no tensors")
        _progress(i + 1, len(files), "files")
    written = _plot({k: (hists[k], rows[k]) for k in hists}, args.plot) if args.plot and hists else None
    if args.json:  # json escapes control characters itself: strict JSON, names intact
        print(json.dumps(_strict(rows), indent=1, allow_nan=False))
        return
    for line in _table(rows):
        print(line)
    if written is not None:
        print(f"plot written to {printable(str(written))}")


# ---- demo ----------------------------------------------------------------------------------------------------

def _device(requested: str | None) -> str:
    report = gpu_report()
    if requested == "cuda":
        if report["backend"] != "cuda":
            raise CliError(f"--device cuda: no usable GPU ({report['why']})")
        if not report["fp8_gemm"]:
            raise CliError(f"--device cuda: the FP8 GEMM is unavailable here ({report['fp8_gemm_why']})")
        return "cuda"
    if requested is None and report["backend"] == "cuda" and report.get("fp8_gemm"):
        return "cuda"
    return "cpu"


def cmd_demo(args: argparse.Namespace) -> None:
    try:
        import torch
    except ImportError:
        raise CliError(f"demo needs torch ({install_hint('torch')})") from None
    import copy

    from fp8core.torch import autocast, convert_to_float8

    device = _device(args.device)
    torch.manual_seed(0)
    recipe = fp8core.DelayedScaling(amax_history_len=16, fp8_format=Format.HYBRID)

    def net(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                                   torch.nn.GELU(), torch.nn.Linear(64, 16)).to(device)

    teacher, fp32 = net(1), net(2)
    fp8 = convert_to_float8(copy.deepcopy(fp32), recipe)
    opts = [torch.optim.Adam(m.parameters(), lr=2e-3) for m in (fp32, fp8)]
    layer = fp8[0]
    L = layer.recipe.amax_history_len
    print(f"fp8core {fp8core.__version__} demo on {device}: a 64-256-64-16 MLP learns a random teacher; "
          f"Float8Linear under DelayedScaling(HYBRID, amax_history_len={L}) next to an fp32 twin.")
    curve, track = [], []
    for step in range(1, args.steps + 1):
        x = torch.randn(128, 64, device=device)
        with torch.no_grad():
            target = teacher(x)
        losses = []
        for model, opt in zip((fp32, fp8), opts):
            with autocast():
                loss = torch.nn.functional.mse_loss(model(x), target)
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        curve.append(losses)
        h, s = layer.fp8_amax_history, layer.fp8_scale
        track.append((step, h[L - 1, 0].item(), s[0].item(), h[L - 1, 2].item(), s[2].item()))
        _progress(step, args.steps, f"loss fp32 {losses[0]:.4f} fp8 {losses[1]:.4f}")
    every = max(1, args.steps // 10)
    print(f"\n{'step':>6} {'fp32 loss':>12} {'fp8 loss':>12} {'ratio':>7}")
    for i in range(every - 1, args.steps, every):
        a, b = curve[i]
        print(f"{i + 1:>6} {a:>12.5f} {b:>12.5f} {b / a if a else float('nan'):>7.3f}")
    print("\nlayer 0 of the fp8 model, over the steps (newest amax in the history; the scale after the update):")
    print(f"{'step':>6} {'input amax':>11} {'input scale':>12} {'grad amax':>11} {'grad scale':>11}")
    for row in track[every - 1::every]:
        print(f"{row[0]:>6} {row[1]:>11.4g} {row[2]:>12.4g} {row[3]:>11.4g} {row[4]:>11.4g}")
    a, b = np.mean(curve[-max(1, args.steps // 10):], axis=0)
    print(f"\nfinal loss (mean of the last tenth): fp32 {a:.5f}, fp8 {b:.5f} ({(b - a) / a:+.1%})")


# ---- bench ---------------------------------------------------------------------------------------------------

def cmd_bench(args: argparse.Namespace) -> None:
    from fp8core.verified import bench_dir

    bench = bench_dir()
    on_gpu = gpu_report()["backend"] == "cuda"
    scripts = ["bench_gpu.py", "bench_gemm.py", "bench_mlp.py"] if on_gpu else ["bench_cpu.py"]
    missing = [s for s in scripts if not (bench / s).is_file()]
    if missing:
        raise CliError(f"the benchmarks ({', '.join(missing)}) are not in {bench}: a broken install "
                       "(reinstall fp8core)")
    sys.path.insert(0, str(bench))
    for script in scripts:
        print(f"== {script} on {'the GPU' if on_gpu else 'the CPU'}", flush=True)
        sys.argv = [script] + (["--quick"] if args.quick else []) + \
            (["--torch-threads", str(args.torch_threads)] if script == "bench_cpu.py" and args.torch_threads else [])
        runpy.run_path(str(bench / script), run_name="__main__")


# ---- entry ---------------------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fp8core", description="FP8 primitives with exact numerics: "
                                 "inspect tensors, check the install, train a demo, benchmark.")
    ap.add_argument("--version", action="version", version=f"fp8core {fp8core.__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, the backend found, the kernel cache, the GPU-verified stamp")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("inspect", help="per tensor: amax and how it fares in E4M3 and E5M2",
                       description="Per tensor, under current scaling with a power-of-2 scale from the amax of its "
                       "finite values: SQNR, underflow (nonzero values that become 0), clipped (|x*scale| beyond "
                       "the format's max before the cast: they saturate), at ±max (values that land on ±max, "
                       "clipped ones included), the largest relative error, and counts of NaN and inf inputs. "
                       "Nothing in the files is unpickled.")
    p.add_argument("files", nargs="+", help=".npy, .npz, .safetensors or .pt files")
    p.add_argument("--json", action="store_true",
                   help="machine-readable output, strict JSON: inf and NaN are written as the strings "
                        '"inf", "-inf", "nan"; a SQNR with no signal (an all-zero or empty tensor) is null')
    p.add_argument("--plot", metavar="OUT.png", help="histograms of log2|x| with each format's range "
                   "(.png is added to a name without an image extension)")
    p.add_argument("--raw-fp8", choices=sorted(_RAW_FP8), default="e4m3",
                   help="how to read 1-byte raw (|V1) .npy data, which is how ml_dtypes fp8 arrays are saved "
                        "(default e4m3); 2-byte raw data is read as bfloat16")
    p.add_argument("--scale", type=float, default=None, metavar="S",
                   help="measure with this scale instead of each tensor's own (what a stale delayed-scaling scale "
                        "would do: values beyond max/S are clipped)")
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, metavar="N",
                   help=f"refuse an .npz file whose members would inflate to more than N bytes in all (default "
                        f"{DEFAULT_MAX_BYTES})")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("demo", help="train a small MLP with Float8Linear next to an fp32 twin")
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when usable, else cpu")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("bench", help="the benchmark suite on the device at hand",
                       description="Without a usable GPU: the CPU backend's throughput per primitive against torch "
                       "eager (its intra-op threads pinned and printed) and plain ml_dtypes, interleaved call by call "
                       "so that a busy machine slows all alike; '—' where a peer lacks the primitive. With one: the "
                       "GPU kernels, the FP8 GEMM and a small MLP against torch (and JAX where installed). "
                       "Figures from a shared or loaded machine are not figures to quote.")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats: a smoke run in about a minute, "
                   "not figures to quote")
    p.add_argument("--torch-threads", type=int, default=0, metavar="N",
                   help="on the CPU: torch's intra-op threads (default: as many as fp8core's CPU pool, all cores up "
                        "to 8; 1 keeps torch's thread team from stalling on a loaded machine)")
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("selftest", help="check fp8core on this GPU against the CPU reference, bit for bit "
                       "(exit 0 pass, 1 fail, 3 no GPU)")
    from fp8core import selftest

    selftest.configure_parser(p)
    p.set_defaults(fn=lambda a: sys.exit(selftest.main(a)))
    return ap


def main(argv: Iterable[str] | None = None) -> int:
    args = parser().parse_args(None if argv is None else list(argv))
    try:
        if getattr(args, "steps", 1) < 1:
            raise CliError("--steps: expected a positive number")
        scale = getattr(args, "scale", None)
        if scale is not None and not (math.isfinite(scale) and 0 < scale <= float(np.finfo(np.float32).max)
                                      and np.float32(scale) > 0):
            raise CliError(f"--scale: expected a float32 number > 0, got {scale}")
        if getattr(args, "torch_threads", 0) < 0:
            raise CliError("--torch-threads: expected a number >= 0")
        if getattr(args, "max_bytes", 1) < 1:
            raise CliError("--max-bytes: expected a positive number")
        args.fn(args)
    except CliError as e:
        print(f"fp8core: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fp8core: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError, MemoryError) as e:
        print(f"fp8core: error: {_one_line(e, kind=False)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
