"""The static roofline: the share of HBM bandwidth each conversion kernel can reach on A100, H100, H200, B200 and
RTX 5090, from its SASS alone (NVRTC cubins, no GPU), by bench/sass.py's model.

Per kernel and device, elements per clock per SM under four limits: the memory's (bandwidth over SMs and clock,
over the bytes the kernel moves per element), the issue rate's (128 thread-instructions a clock over the fast
path's instructions per element), the integer ALU's (64 a clock over its integer-ALU ops per element), and
Little's law's (the bytes of loads one SM holds in flight, from the fast path's loads before their first use times
the resident threads the cubin's registers and shared memory allow, over the DRAM latency). The expected share is
the least of the four over the memory's. Each device runs the code of its own target (sm_80 on A100: the software FP8
conversion), and each target's budgets hold it memory-bound on the devices that run it, and only on those
(sass.budget). Every assumption is printed with the tables; the GPU issue compares these with measured figures.
Usage: python bench/bench_static.py [--json out.json] [--txt out.txt] [--note "what changed" ...]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from typing import Any

from fp8core.bench import sass


def assumptions() -> list[str]:
    out = [f"{d.name}: sm_{d.arch}, {d.sms} SMs, {d.bandwidth / 1e12:.2f} TB/s, {d.clock / 1e9:.3f} GHz boost "
           f"({d.bandwidth / d.sms / d.clock:.1f} bytes/clock/SM)" for d in sass.DEVICES]
    sm = sass.SMS["90"]
    out += [f"DRAM latency {sass.DRAM_LATENCY * 1e9:.0f} ns under load; issue {sm.issue_lanes} thread-instructions "
            f"and {sm.int_alu_lanes} integer-ALU ops per clock per SM on every target (B200's and RTX 5090's INT32 "
            "rate is taken as Hopper's: unconfirmed)",
            "256 threads per CTA; occupancy from the cubin's registers and static shared memory (1 KiB reserved "
            "per CTA); loads in flight: the fast path's global loads issued before the first instruction reading "
            "one of them",
            "fast path: the cheapest route through the SASS holding the kernel's vector loads and stores (one turn "
            "of a grid-stride loop, or entry to EXIT of a tile kernel); bf16 in, E4M3 out",
            f"budgets per target: instructions and integer-ALU ops per element that keep the kernel memory-bound with "
            f"{sass.HEADROOM:.1f}x headroom on every device running that target's code, and on no other (a target's "
            "SASS runs only on its devices): "
            + "; ".join(f"sm_{arch} on {' and '.join(d.name for d in sass.devices_of(arch))}"
                        for arch in sorted({d.arch for d in sass.DEVICES}, key=int))
            + f"; >= {sass.BUDGET_IN_FLIGHT // 1024} KiB of loads in flight per SM",
            "writes are not in Little's law (a store does not wait); L2 and DRAM efficiency are taken as 100%"]
    return out


def run() -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        measured: dict[tuple[str, str], sass.Figures] = {}
        for kernel in sass.KERNELS:
            for device in sass.DEVICES:
                ins, alu = sass.budget(kernel, device.arch)
                key = (kernel.name, device.arch)
                if key not in measured:
                    measured[key] = sass.measure(kernel, device.arch, tmp)
                f = measured[key]
                r = sass.roofline(f, kernel, device)
                rows.append({"kernel": kernel.name, "device": device.name, "arch": device.arch,
                             "instructions_per_element": round(f.instructions, 2),
                             "int_alu_per_element": round(f.int_alu, 2), "registers": f.registers,
                             "in_flight_per_sm": sass.in_flight_per_sm(f, device.arch),
                             "budget_instructions": round(ins, 2), "budget_int_alu": round(alu, 2),
                             "bytes_per_element": round(kernel.moved, 4),
                             "rates": {k: round(getattr(r, k), 3) for k in ("memory", "issue", "int_alu", "latency")},
                             "bound": r.bound, "share": round(r.share, 3)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'kernel':15s} {'device':9s} {'instr/el':>8s} {'int/el':>7s} {'budget':>12s} {'regs':>4s} "
            f"{'KiB/SM':>6s}  {'elements/clock/SM: mem issue alu latency':41s} {'bound':8s} {'share':>5s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        rates = r["rates"]
        lines.append(f"{r['kernel']:15s} {r['device']:9s} {r['instructions_per_element']:8.1f} "
                     f"{r['int_alu_per_element']:7.1f} {r['budget_instructions']:5.1f}/{r['budget_int_alu']:<6.1f} "
                     f"{r['registers']:4d} {r['in_flight_per_sm'] / 1024:6.0f}  "
                     f"{rates['memory']:9.2f} {rates['issue']:6.2f} {rates['int_alu']:6.2f} {rates['latency']:7.2f}"
                     f"{'':11s} {r['bound']:8s} {r['share']:5.0%}")
    return "\n".join(lines)


def budgets() -> str:
    """The budgets per kernel and target (instructions / integer-ALU ops per element), and the devices setting them."""
    archs = sorted({d.arch for d in sass.DEVICES}, key=int)
    head = f"{'kernel':15s} " + " ".join(f"{'sm_' + a:>12s}" for a in archs)
    lines = [head, "-" * len(head)]
    for kernel in sass.KERNELS:
        cells = [sass.budget(kernel, a) for a in archs]
        lines.append(f"{kernel.name:15s} " + " ".join(f"{f'{i:.1f}/{b:.1f}':>12s}" for i, b in cells))
    lines.append("set by: " + "; ".join(
        f"sm_{a} " + max(sass.devices_of(a), key=lambda d: d.bandwidth / d.sms / d.clock).name for a in archs))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the rows and assumptions here")
    p.add_argument("--txt", help="write the printed report here")
    p.add_argument("--note", action="append", default=[],
                   help="a line printed under the header, e.g. what changed since the previous results (repeatable)")
    args = p.parse_args()
    rows = run()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = "\n".join([f"static roofline (SASS from NVRTC, no GPU), {when}", *args.note,
                      "assumptions:", *("  " + a for a in assumptions()), "",
                      "budgets per target (instructions / integer-ALU ops per element):", budgets(), "", table(rows)])
    print(text)
    if args.txt:
        with open(args.txt, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": f"{platform.machine()}, {platform.node()}", "notes": args.note,
                       "assumptions": assumptions(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
