"""Host time of one CUDA kernel launch's Python side, measured without a GPU: the named arguments checked and packed
against the kernel's C++ signature, the plan looked up, the grid computed and a driver call that does nothing.

What a launch adds to the driver's own cost (cuLaunchKernel, a few us, only measurable on a GPU). The records'
plans are stood in for (no device, no compile). Medians with p20/p80 over alternating blocks, in microseconds.
Usage: python bench/bench_launch.py [--repeat 200] [--block 200]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from bench_cpu import interleaved  # noqa: E402

from fp8core import _kernels  # noqa: E402
from fp8core.backends import cuda  # noqa: E402

T = ("float32", 0)


class _NoDriver:
    def launchKernel(self, *args: object) -> None:
        pass


def _stand_in_plans() -> None:
    for kernel, targs in ((_kernels.QUANTIZE, T), (_kernels.FILL, ()), (_kernels.MULTI_QUANTIZE, T)):
        plan = object.__new__(_kernels._Plan)
        plan.function, plan.fn, plan.driver, plan.max_blocks = None, 1, _NoDriver(), 132 * 8
        _kernels._plans[(kernel, 0, targs)] = plan


def cases() -> dict:
    entries = [(0x1000 * i, 0x2000 * i, 0x3000, 0, 16 * i) for i in range(1, 9)]
    return {
        "quantize (11 arguments)": lambda: _kernels.QUANTIZE.launch(
            0, T, 16, 7, x=0x1000, q=0x2000, scale=0x3000, amax_in=0, amax_out=0, scale_inv_out=0, n=16,
            fp8_max=448.0, margin=0, power_of_2=0, epsilon=0.0),
        "fill (3 arguments)": lambda: _kernels.FILL.launch(0, (), 16, 7, out=0x1000, value=5, n=16),
        "multi_quantize (8 tensors, 2824 B)": lambda: cuda._multi_launch(_kernels.MULTI_QUANTIZE, 0, T, entries, 7),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=200, help="blocks per case")
    ap.add_argument("--block", type=int, default=200, help="launches per block")
    args = ap.parse_args()
    _stand_in_plans()
    stats, _ = interleaved(cases(), args.repeat, args.block)
    print(f"{'launch':36s} {'us':>7s} {'p20-p80':>13s}")
    for name, (median, p20, p80) in stats.items():
        print(f"{name:36s} {median * 1e6:7.2f} {p20 * 1e6:6.2f}-{p80 * 1e6:.2f}")


if __name__ == "__main__":
    main()
