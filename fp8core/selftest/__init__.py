"""``fp8core selftest``: fp8core on the GPU at hand against the CPU reference, compared by bits, as a table.

Users run it on a new GPU, driver or CUDA version, like a framework's environment check. Every primitive of
the backend and every kernel instantiation of ``fp8core._kernels.KERNELS`` must be exercised: one that no
check reaches is itself a failure, so a new kernel or backend function cannot go untested silently.

``--backend cpu`` runs the same checks with the CPU backend as the device under test (CI has no GPU): the
table and chunked paths against the direct, unchunked ones, and both against the independent per-element
oracle of ``fp8core._oracle``.

Exit status: 0 every check passed; 1 a check failed (or ``--stamp`` was refused); 2 a usage error;
3 no usable GPU (one line says why; nothing was checked).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import subprocess
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np

import fp8core

# The check modules register their checks on import: this order is the table's.
from . import conversions  # noqa: F401  isort: skip
from . import scaling  # noqa: F401  isort: skip
from . import gemm  # noqa: F401  isort: skip
from . import blocks  # noqa: F401  isort: skip
from . import fp4  # noqa: F401  isort: skip
from .blocks import gemm_scale_oracle  # noqa: F401  (tests/emulation compare the GPU's layouts with it)
from .coverage import Coverage, backend_functions, declared_functions
from .gpu import gpu_reason
from .harness import CHECKS, CheckResult, CpuTarget, CudaTarget, Recorder, Target

__all__ = ["run", "main", "configure_parser", "stamp_record", "versions", "commit_of_checkout", "EXIT_PASS",
           "EXIT_FAIL", "EXIT_USAGE", "EXIT_NO_GPU"]

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3
TABLE_COLUMNS = 100  # the widest line of the table: a terminal's or a log's
EPILOG = """exit status:
  0  every check passed
  1  a check failed, or --stamp was refused (something failed or was skipped)
  2  usage error
  3  no usable GPU (use --backend cpu for the CPU self-consistency check)"""


@dataclass
class Report:
    target: str
    backend: str
    quick: bool
    checks: list[CheckResult]
    seconds: float

    @property
    def cases(self) -> int:
        return sum(c.cases for c in self.checks)

    @property
    def failed(self) -> int:
        return sum(c.failed for c in self.checks)

    @property
    def skipped(self) -> list[CheckResult]:
        return [c for c in self.checks if c.skipped]

    @property
    def ok(self) -> bool:
        return self.failed == 0

    def verdict(self) -> str:
        head = "PASS" if self.ok else "FAIL"
        text = f"{head}: {self.cases - self.failed} of {self.cases} cases passed on {self.target} " \
               f"in {self.seconds:.1f} s"
        if self.skipped:
            text += f"; {len(self.skipped)} check(s) skipped"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target, "backend": self.backend, "quick": self.quick, "cases": self.cases,
                "passed": self.cases - self.failed, "failed": self.failed, "skipped": len(self.skipped),
                "ok": self.ok, "seconds": round(self.seconds, 2), "verdict": self.verdict(),
                "checks": [c.as_dict() for c in self.checks]}

    def table(self, columns: int = TABLE_COLUMNS) -> str:
        """The report for a terminal, every line at most ``columns`` wide: long check names and reasons wrap."""
        figures = 2 + 6 + 1 + 6 + 1 + 8 + 2 + len("skipped")  # the columns right of the name
        width = max(20, min(max(len(c.name) for c in self.checks), columns - figures))
        wrap = functools.partial(textwrap.wrap, width=columns, subsequent_indent="    ", break_on_hyphens=False)
        lines = wrap(f"fp8core {fp8core.__version__} selftest on {self.target}") + [""]
        lines.append(f"{'check':<{width}}  {'cases':>6} {'failed':>6} {'seconds':>8}  result")
        lines.append("-" * len(lines[-1]))
        for c in self.checks:
            result = "skipped" if c.skipped else ("ok" if not c.failed else "FAILED")
            name = textwrap.wrap(c.name, width=width, subsequent_indent="  ", break_on_hyphens=False)
            lines.append(f"{name[0]:<{width}}  {c.cases:>6} {c.failed:>6} {c.seconds:>8.2f}  {result}")
            lines += name[1:]
            if c.skipped:
                lines += wrap(f"  skipped: {c.skipped}")
        for c in self.checks:
            for f in c.failures:
                lines += wrap(f"  {c.name}: {f}")
        lines += [""] + wrap(self.verdict())
        return "\n".join(lines)


def run(backend: str = "cuda", quick: bool = False, device_id: int = 0, seed: int = 0,
        progress: Callable[[str], None] | None = None) -> Report:
    """Run every check on ``backend`` ("cuda" or "cpu") and return the report. Raises RuntimeError when
    ``backend`` is "cuda" and no usable GPU is found (the message says why)."""
    if backend == "cuda":
        reason = gpu_reason(device_id)
        if reason:
            raise RuntimeError(reason)
        target: Target = CudaTarget(device_id)
    elif backend == "cpu":
        target = CpuTarget()
    else:
        raise ValueError(f"backend: expected 'cuda' or 'cpu', got {backend!r}")
    rng = np.random.default_rng(seed)
    results: list[CheckResult] = []
    start = time.perf_counter()
    ctx = target.cp.cuda.Device(device_id) if isinstance(target, CudaTarget) else contextlib.nullcontext()
    with Coverage(target) as cov, ctx:
        skipped_covers: set[str] = set()
        for c in CHECKS:
            res = CheckResult(c.name)
            results.append(res)
            if progress:
                progress(c.name)
            res.skipped = c.needs(target) if c.needs else ""
            if res.skipped:
                skipped_covers.update(c.covers)
                continue
            t0 = time.perf_counter()
            rec = Recorder(res, target)
            try:
                with np.errstate(all="ignore"):
                    c.fn(target, rec, quick, rng)
                target.sync()
            except Exception as e:  # a crash is a failed case, reported in one line with where it happened
                frame = traceback.extract_tb(e.__traceback__)[-1]
                rec.truth("raised", False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                                           f"({Path(frame.filename).name}:{frame.lineno})")
            res.seconds = time.perf_counter() - t0
    cover = CheckResult("coverage: every backend function and kernel instantiation ran")
    missing = [f for f in backend_functions() if f not in cov.functions and f not in skipped_covers]
    for f in missing:
        cover.cases += 1
        cover.failed += 1
        cover.failures.append(f"backend function {f} was never called by any check")
    cover.cases += len(backend_functions()) - len(missing)
    for name, reached in declared_functions().items():  # the front-ends' ops, each through its backend functions
        cover.cases += 1
        if not any(f in cov.functions or f in skipped_covers for f in reached):
            cover.failed += 1
            cover.failures.append(f"primitive {name} ({', '.join(reached)}) was never reached by any check")
    if cov.cuda:
        from fp8core._kernels import KERNELS

        lost = cov.missing_kernels()
        cover.cases += sum(len(v) for v in KERNELS.values())
        cover.failed += len(lost)
        cover.failures += [f"kernel {k} was never launched by any check" for k in lost][:8]
    results.append(cover)
    return Report(target.name, target.backend_name, quick, results, time.perf_counter() - start)


def commit_of_checkout() -> str | None:
    root = Path(fp8core.__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, Any]:
    """Versions of what the kernels ran on, without importing the frameworks."""
    v: dict[str, Any] = {"fp8core": fp8core.__version__, "python": sys.version.split()[0],
                         "numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__,
                         "cupy": _dist_version("cupy-cuda13x", "cupy-cuda12x", "cupy"),
                         "torch": _dist_version("torch"), "jax": _dist_version("jax"),
                         "jaxlib": _dist_version("jaxlib"), "nvmath-python": _dist_version("nvmath-python"),
                         "torchao": _dist_version("torchao")}
    try:
        import cupy

        v["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        v["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
        v["nvrtc"] = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
    except Exception:
        v["cuda_runtime"] = v["cuda_driver"] = v["nvrtc"] = None
    return v


def stamp_record(report: Report) -> dict[str, Any]:
    """The GPU-verified stamp (shared/GPU.md) for a report that passed on a GPU."""
    from fp8core._kernels import cuda_sha256

    return {"cuda_sha256": cuda_sha256(), "commit": commit_of_checkout(), "device": report.target,
            "passed": report.cases - report.failed, "failed": report.failed, "versions": versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "by": "fp8core selftest" + (" --quick" if report.quick else "")}


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0].replace("``", "")
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--quick", action="store_true", help="fewer scales and sizes (seconds instead of a minute)")
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    p.add_argument("--stamp", metavar="FILE", help="write the GPU-verified stamp JSON to FILE, only when every "
                   "check ran and passed on a GPU")
    p.add_argument("--device", type=int, default=0, metavar="N", help="CUDA device ordinal (default 0)")
    p.add_argument("--backend", choices=["cuda", "cpu"], default="cuda",
                   help="cuda (default): the GPU against the CPU reference; cpu: the CPU backend's own paths "
                        "against each other and the oracle")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    """Run the command for parsed ``args``; returns the exit status."""
    if args.stamp and args.backend != "cuda":
        print("fp8core selftest: error: --stamp records a GPU verification; it needs --backend cuda",
              file=sys.stderr)
        return EXIT_USAGE
    def progress(name: str) -> None:
        if not args.json and sys.stderr.isatty():
            sys.stderr.write(f"\r\033[K{name}")
            sys.stderr.flush()
    try:
        report = run(args.backend, args.quick, args.device, args.seed, progress)
    except RuntimeError as e:
        print(f"fp8core selftest: no GPU to check: {e}. Nothing was checked; "
              "`fp8core selftest --backend cpu` checks the CPU backend.", file=sys.stderr)
        if args.json:  # a script reading stdout gets a verdict, not an empty string
            print(json.dumps({"target": None, "backend": args.backend, "quick": args.quick, "cases": 0, "passed": 0,
                              "failed": 0, "skipped": 0, "ok": False, "verdict": f"NO GPU: nothing was checked ({e})",
                              "checks": []}, indent=1, allow_nan=False), flush=True)
        return EXIT_NO_GPU
    if sys.stderr.isatty() and not args.json:
        sys.stderr.write("\r\033[K")
    print(json.dumps(report.as_dict(), indent=1) if args.json else report.table(), flush=True)
    if not report.ok:
        if args.stamp:
            print(f"fp8core selftest: stamp not written: {report.failed} case(s) failed", file=sys.stderr)
        return EXIT_FAIL
    if args.stamp:
        if report.skipped:
            print(f"fp8core selftest: stamp not written: {len(report.skipped)} check(s) skipped "
                  f"({'; '.join(c.skipped for c in report.skipped)})", file=sys.stderr)
            return EXIT_FAIL
        try:
            Path(args.stamp).parent.mkdir(parents=True, exist_ok=True)
            Path(args.stamp).write_text(json.dumps(stamp_record(report), indent=1) + "\n")
        except OSError as e:
            print(f"fp8core selftest: error: --stamp {args.stamp}: {e.strerror or e}", file=sys.stderr)
            return EXIT_USAGE
        if not args.json:
            print(f"stamp written to {args.stamp}")
    return EXIT_PASS
