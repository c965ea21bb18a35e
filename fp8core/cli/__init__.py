"""The ``fp8core`` command: info, inspect, demo, bench (a module each here) and selftest (``fp8core.selftest``).

Errors are one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Iterable

import numpy as np

import fp8core
from fp8core import selftest
from fp8core.selftest.gpu import gpu_unavailable_reason, one_line

from .bench import cmd_bench
from .common import CliError
from .demo import cmd_demo
from .files import DEFAULT_MAX_BYTES
from .info import cmd_info
from .inspect import RAW_FP8, cmd_inspect
from .recipes import RECIPES

__all__ = ["main", "parser", "gpu_unavailable_reason"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fp8core", description="FP8 primitives with exact numerics: "
                                 "inspect tensors, check the install, train a demo, benchmark.")
    ap.add_argument("--version", action="version", version=f"fp8core {fp8core.__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, the backend found, the kernel cache, the GPU-verified stamp")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("inspect", help="per tensor: amax and how it fares in E4M3 and E5M2, or in each recipe",
                       description="Per tensor, under current scaling with a power-of-2 scale from the amax of its "
                       "finite values: SQNR, underflow (nonzero values that become 0), clipped (|x*scale| beyond "
                       "the format's max before the cast: they saturate), at ±max (values that land on ±max, "
                       "clipped ones included), the largest relative error, and counts of NaN and inf inputs. "
                       "Nothing in the files is unpickled.")
    p.add_argument("files", nargs="+", help=".npy, .npz, .safetensors or .pt files, or records of "
                   "fp8core.torch.record_numerics (.json, rec.save(path)): per layer and operand, each recipe's "
                   "worst step")
    p.add_argument("--json", action="store_true",
                   help="machine-readable output, strict JSON: inf and NaN are written as the strings "
                        '"inf", "-inf", "nan"; a SQNR with no signal (an all-zero or empty tensor) is null')
    p.add_argument("--plot", metavar="OUT.png", help="histograms of log2|x| with each format's range "
                   "(.png is added to a name without an image extension); with --recipes also OUT.recipes.png, "
                   "SQNR per tensor per recipe; for a record OUT.png is that chart, per layer and operand")
    p.add_argument("--raw-fp8", choices=sorted(RAW_FP8), default="e4m3",
                   help="how to read 1-byte raw (|V1) .npy data, which is how ml_dtypes fp8 arrays are saved "
                        "(default e4m3); 2-byte raw data is read as bfloat16")
    p.add_argument("--scale", type=float, default=None, metavar="S",
                   help="measure with this scale instead of each tensor's own (what a stale delayed-scaling scale "
                        "would do: values beyond max/S are clipped)")
    p.add_argument("--recipes", metavar="all|LIST", default=None,
                   help="compare recipes per tensor instead: 'all' or a comma-separated list of "
                        f"{', '.join(RECIPES)} (Float8CurrentScaling, torchao's rowwise: a power-of-2 scale per row, "
                        "MXFP8BlockScaling's scale modes, "
                        "Float8BlockScaling's blocks, NVFP4BlockScaling's 1x16 E4M3-scaled blocks under a global "
                        "scale, nvfp4_rht: the tensor as NVFP4's wgrad operand x^T with the random Hadamard "
                        "transform, measured on the transformed values, and MXFP4; one row each, the best SQNR "
                        "starred, a summary of how often each is within 1 dB of the best; clipped: more than half "
                        "a step beyond the block's ±max). Block recipes run along the last dimension, partial "
                        "blocks zero-padded in effect, n/a for a scalar")
    p.add_argument("--blocks", action="store_true",
                   help="with --recipes: per-block statistics of each block recipe: the stored block scales' "
                        "spread and the blocks at the scale format's floor and ceiling (E8M0 2^-127 and 2^127; "
                        "NVFP4's E4M3 zero and subnormal scales, 448), all-zero blocks, each block's dynamic "
                        "range, the blocks with elements flushed to 0, and the worst blocks by SQNR, named by "
                        "(row block, col block) of the tensor viewed as [rows, last dim] (nvfp4_rht: of x^T); "
                        "in JSON under each tensor's 'blocks'; with --plot also OUT.blocks.png, the histograms of "
                        "block scales (limits marked) and of per-block SQNR over every tensor")
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, metavar="N",
                   help=f"refuse an .npz file whose members would inflate to more than N bytes in all, or a larger "
                        f"record (default "
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
        print(f"fp8core: error: {one_line(e, kind=False)}", file=sys.stderr)
        return 2
    return 0
