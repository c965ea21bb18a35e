"""The ``fp8core`` command: info, inspect, demo, bench.

Errors are one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import runpy
import sys
from pathlib import Path
from typing import Any, Iterable

import numpy as np

import fp8core
from fp8core import Format


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


def _progress(done: int, total: int, text: str = "") -> None:
    if not sys.stderr.isatty() and done != total and done % max(1, total // 10):
        return  # a log, not a terminal: every tenth only
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {text}")
    if done == total:
        sys.stderr.write("\n")
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
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        if n < 1:
            return {"backend": "CPU only", "why": "no CUDA device"}
        props = cupy.cuda.runtime.getDeviceProperties(0)
        cc = int(cupy.cuda.Device(0).compute_capability)
    except ImportError:
        return {"backend": "CPU only", "why": "cupy is not installed (pip install 'fp8core[cuda13]')"}
    except Exception as e:
        return {"backend": "CPU only", "why": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    gemm = cc >= 89
    why = "" if gemm else "needs compute capability 8.9+"
    if gemm and _version("nvmath") is None:
        gemm, why = False, "nvmath-python is not installed (pip install 'fp8core[gemm]')"
    return {"backend": "cuda", "gpu": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
            "compute_capability": f"{cc // 10}.{cc % 10}", "devices": n, "fp8_gemm": gemm, "fp8_gemm_why": why}


def _stamp_status() -> str:
    from fp8core._kernels import cuda_sha256

    sha = cuda_sha256()
    stamp = Path(fp8core.__file__).resolve().parent.parent / "bench" / "results" / "gpu-verified.json"
    if not stamp.is_file():
        return f"no GPU-verified stamp found; installed kernels are cuda/ {sha[:12]}"
    verified = json.loads(stamp.read_text()).get("cuda_sha256")
    return f"installed kernels {'MATCH' if verified == sha else 'DO NOT MATCH'} the GPU-verified stamp " \
           f"({sha[:12]} vs {str(verified)[:12]})"


def cmd_info(args: argparse.Namespace) -> None:
    from fp8core._kernels import cache_dir

    report: dict[str, Any] = {"fp8core": fp8core.__version__, "python": platform.python_version()}
    for name in ("numpy", "ml_dtypes", "cupy", "torch", "jax", "nvmath"):
        report[name] = _version(name) or "not installed"
    try:
        import cupy

        report["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    except Exception:
        report["cuda_runtime"] = "unavailable"
    report.update(gpu_report())
    cache = Path(cache_dir())
    entries = len(list(cache.glob("*"))) if cache.is_dir() else 0
    report["kernel_cache"] = f"{cache} ({entries} compiled kernel files)" if cache.is_dir() else f"{cache} (empty)"
    report["gpu_verified"] = _stamp_status()
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for k, v in report.items():
        print(f"{k:<20} {v}")


# ---- inspect -------------------------------------------------------------------------------------------------

def _as_numpy(t: Any) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    import torch

    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.float().numpy() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t.numpy()
    raise CliError(f"unsupported tensor type {type(t).__name__}")


def load_tensors(path: str) -> dict[str, np.ndarray]:
    p = Path(path)
    if not p.is_file():
        raise CliError(f"{path}: no such file")
    suffix = p.suffix.lower()
    try:
        if suffix == ".npy":
            return {p.stem: np.load(p, allow_pickle=False)}
        if suffix == ".npz":
            with np.load(p, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        if suffix == ".safetensors":
            return _load_safetensors(p)
        if suffix in (".pt", ".pth"):
            return _load_torch(p)
    except CliError:
        raise
    except Exception as e:
        raise CliError(f"{path}: could not be read as {suffix[1:]} ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''})") from None
    raise CliError(f"{path}: unknown format {suffix or '(no suffix)'}; expected .npy, .npz, .safetensors or .pt")


def _load_safetensors(p: Path) -> dict[str, np.ndarray]:
    try:
        from safetensors import safe_open
    except ImportError:
        raise CliError(f"{p}: reading .safetensors needs the safetensors package (pip install safetensors)") from None
    framework = "pt" if _version("torch") else "np"
    with safe_open(str(p), framework=framework) as f:
        return {k: _as_numpy(f.get_tensor(k)) for k in f.keys()}


def _load_torch(p: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise CliError(f"{p}: reading .pt needs torch (pip install 'fp8core[torch]')") from None
    obj = torch.load(p, map_location="cpu", weights_only=True)
    if isinstance(obj, torch.Tensor):
        return {p.stem: _as_numpy(obj)}
    if isinstance(obj, dict):
        return {str(k): _as_numpy(v) for k, v in obj.items() if isinstance(v, torch.Tensor)}
    raise CliError(f"{p}: holds a {type(obj).__name__}, not a tensor or a dict of tensors")


def tensor_stats(x: np.ndarray) -> dict[str, Any]:
    """Per format, under current scaling with a power-of-2 scale: scale, SQNR, underflow, saturation, error."""
    row: dict[str, Any] = {"shape": list(x.shape), "dtype": str(x.dtype)}
    if x.dtype.name not in ("float32", "bfloat16", "float16"):
        x = x.astype(np.float32)
    x = np.ascontiguousarray(x)
    amax = fp8core.amax(x)
    row["amax"] = float(amax[0])
    ref = x.astype(np.float64).reshape(-1)
    finite = np.isfinite(ref)
    nonzero = finite & (ref != 0)
    for fmt in (Format.E4M3, Format.E5M2):
        scale, scale_inv = fp8core.compute_scale(amax, fmt, power_of_2=True)
        q = fp8core.quantize(x, scale, fmt)
        y = fp8core.dequantize(q, scale_inv, "float32").astype(np.float64).reshape(-1)
        err = (y - ref)[finite]
        signal = float(np.sum(ref[finite] ** 2))
        noise = float(np.sum(err ** 2))
        sqnr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
        codes = q.view(np.uint8).reshape(-1) & 0x7F
        max_code = 0x7E if fmt is Format.E4M3 else 0x7B
        rel = np.abs(err[nonzero[finite]] / ref[nonzero])
        row[fmt.name] = {
            "scale": float(scale[0]), "sqnr_db": sqnr,
            "underflow": float(np.mean((y[nonzero] == 0))) if nonzero.any() else 0.0,
            "saturated": float(np.mean(codes[finite] == max_code)) if finite.any() else 0.0,
            "max_rel_error": float(rel.max()) if rel.size else 0.0,
        }
    return row


def _plot(stats: dict[str, tuple[np.ndarray, dict]], out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError("--plot needs matplotlib (pip install 'fp8core[plot]')") from None
    n = len(stats)
    fig, axes = plt.subplots(n, 1, figsize=(8, 2.6 * n), squeeze=False)
    ranges = {Format.E4M3: (2.0 ** -9, 448.0, "tab:blue"), Format.E5M2: (2.0 ** -16, 57344.0, "tab:orange")}
    for ax, (name, (x, row)) in zip(axes[:, 0], stats.items()):
        v = np.abs(x.astype(np.float64).reshape(-1))
        v = v[np.isfinite(v) & (v > 0)]
        if v.size:
            ax.hist(np.log2(v), bins=120, color="0.3")
        for fmt, (lo, hi, color) in ranges.items():
            s = row[fmt.name]["scale"]
            ax.axvspan(math.log2(lo / s), math.log2(hi / s), color=color, alpha=0.15, label=f"{fmt.name} range")
        ax.set_title(f"{name}  {row['dtype']} {tuple(row['shape'])}  amax {row['amax']:.4g}")
        ax.set_xlabel("log2 |x|")
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def cmd_inspect(args: argparse.Namespace) -> None:
    rows, arrays = {}, {}
    files = list(args.files)
    for i, path in enumerate(files):
        tensors = load_tensors(path)
        if not tensors:
            raise CliError(f"{path}: holds no tensors")
        for name, x in tensors.items():
            key = f"{path}:{name}" if len(files) > 1 else name
            rows[key] = tensor_stats(x)
            arrays[key] = x
        _progress(i + 1, len(files), "files")
    if args.plot:
        _plot({k: (arrays[k], rows[k]) for k in rows}, args.plot)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    head = f"{'tensor':<28} {'shape':<16} {'dtype':<9} {'amax':>10}  {'fmt':<4} {'scale':>10} {'SQNR dB':>8} " \
           f"{'underflow':>9} {'saturated':>9} {'max rel err':>11}"
    print(head)
    print("-" * len(head))
    for key, r in rows.items():
        for j, fmt in enumerate(("E4M3", "E5M2")):
            f = r[fmt]
            lead = f"{key[:28]:<28} {str(tuple(r['shape']))[:16]:<16} {r['dtype']:<9} {r['amax']:>10.4g}" if j == 0 \
                else " " * 66
            print(f"{lead}  {fmt:<4} {f['scale']:>10.4g} {f['sqnr_db']:>8.2f} {f['underflow']:>9.2%} "
                  f"{f['saturated']:>9.2%} {f['max_rel_error']:>11.3g}")
    if args.plot:
        print(f"plot written to {args.plot}")


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
        raise CliError("demo needs torch (pip install 'fp8core[torch]')") from None
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
    bench = Path(fp8core.__file__).resolve().parent.parent / "bench"
    on_gpu = gpu_report()["backend"] == "cuda"
    scripts = ["bench_gpu.py", "bench_gemm.py", "bench_mlp.py"] if on_gpu else ["bench_cpu.py"]
    missing = [s for s in scripts if not (bench / s).is_file()]
    if missing:
        raise CliError(f"the benchmarks ({', '.join(missing)}) ship with the source checkout, not found in {bench}")
    sys.path.insert(0, str(bench))
    for script in scripts:
        print(f"== {script} on {'the GPU' if on_gpu else 'the CPU'}", flush=True)
        sys.argv = [script] + (["--quick"] if args.quick else [])
        runpy.run_path(str(bench / script), run_name="__main__")


# ---- entry ---------------------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fp8core", description="FP8 primitives with exact numerics: "
                                 "inspect tensors, check the install, train a demo, benchmark.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, the backend found, the kernel cache, the GPU-verified stamp")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("inspect", help="per tensor: amax and how it fares in E4M3 and E5M2")
    p.add_argument("files", nargs="+", help=".npy, .npz, .safetensors or .pt files")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", metavar="OUT.png", help="histograms of log2|x| with each format's range")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("demo", help="train a small MLP with Float8Linear next to an fp32 twin")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when usable, else cpu")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("bench", help="the benchmark suite on the device at hand")
    p.add_argument("--quick", action="store_true")
    p.set_defaults(fn=cmd_bench)
    return ap


def main(argv: Iterable[str] | None = None) -> int:
    args = parser().parse_args(None if argv is None else list(argv))
    try:
        if getattr(args, "steps", 1) < 1:
            raise CliError("--steps: expected a positive number")
        args.fn(args)
    except CliError as e:
        print(f"fp8core: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fp8core: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError) as e:
        print(f"fp8core: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
