"""``fp8core bench``: the benchmark suite on the device at hand."""

from __future__ import annotations

import argparse
import runpy
import sys

from .common import CliError
from .info import gpu_report


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
