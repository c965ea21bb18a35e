"""What a kernel's machine code costs, read without a GPU: NVRTC's cubin, disassembled by cuobjdump/nvdisasm, its
fast path found in the control-flow graph, and a static model of the SMs (occupancy, issue rates, Little's law).

tests/test_sass.py and tests/test_sass_budgets.py read SASS with this module; bench/bench_static.py turns the same
figures into the expected share of HBM bandwidth per device.

The fast path of a kernel is the cheapest route through its SASS, in instructions, that passes the instructions
its fast path must hold (e.g. one 16-byte load and one 8-byte store): for a kernel with a grid-stride loop, one turn
of the innermost loop holding them; for a one-tile-per-CTA kernel, from its entry to an EXIT. A route counts a
non-unrolled inner loop once, and takes the cheapest side of every data-dependent branch (FP4's software E2M1
conversion branches per element): the figures are per pass, a lower bound where the data or such a loop takes more.
"""

from __future__ import annotations

import glob
import heapq
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field


def find_tool(tool: str) -> str | None:
    """tool on PATH, or in the bin/ of an nvidia-* wheel on sys.path (nvidia/cu13/bin, nvidia/cuda_*/bin)."""
    found = shutil.which(tool)
    if found:
        return found
    for root in sys.path:
        for path in sorted(glob.glob(os.path.join(root, "nvidia", "*", "bin", tool))):
            if os.access(path, os.X_OK):
                return path
    return None


CUOBJDUMP, NVDISASM = find_tool("cuobjdump"), find_tool("nvdisasm")


class Disassembly:
    """One cubin's SASS, resource usage and parameter layout, per mangled kernel name."""

    def __init__(self, cubin: bytes, tmp: str) -> None:
        if CUOBJDUMP is None or NVDISASM is None:
            raise RuntimeError("cuobjdump and nvdisasm are needed (pip install nvidia-cuda-cuobjdump "
                               "nvidia-cuda-nvdisasm, the test extra)")
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        env = dict(os.environ, PATH=os.path.dirname(NVDISASM) + os.pathsep + os.environ.get("PATH", ""))
        run = lambda *args: subprocess.run([CUOBJDUMP, *args, path], check=True, capture_output=True,  # noqa: E731
                                           text=True, env=env).stdout
        self.sass = dict(self._split(run("-sass"), r"Function : (\S+)"))
        self.resources = {name: dict((k, int(v)) for k, v in re.findall(r"(\w+):(\d+)", body))
                          for name, body in self._split(run("-res-usage"), r"Function (\S+?):")}
        self.params = {}
        for name, body in self._split(run("-elf"), r"^\.nv\.info\.(\S+)$"):
            found = re.findall(r"Ordinal : 0x([0-9a-f]+)\s+Offset\s*: 0x([0-9a-f]+)\s+Size\s*: 0x([0-9a-f]+)", body)
            if found:
                self.params[name] = sorted((int(o, 16), int(off, 16), int(sz, 16)) for o, off, sz in found)

    @staticmethod
    def _split(text: str, header: str) -> list[tuple[str, str]]:
        parts = re.split(header, text, flags=re.M)
        return list(zip(parts[1::2], parts[2::2]))


# ---- instructions and the control-flow graph ---------------------------------------------------------------

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")

# The integer-ALU work of a conversion kernel: adds, multiply-adds (IMAD also moves and shifts), logic, shifts,
# byte permutes, compares, selects, min/max, address arithmetic. What the SM issues at 64 lanes a clock (16 per
# SM sub-partition on sm_80 .. sm_120), the ceiling the budgets are set against. VIMNMX3 is the three-input min/max
# (s32, u32, u16x2) ptxas makes of two chained ones on sm_90 and sm_100 (not on sm_120, which keeps two VIMNMX).
INT_ALU = frozenset({"IADD3", "IADD", "IADD32I", "IMAD", "IMUL", "IMNMX", "VIMNMX", "VIMNMX3", "VIADD", "VIADDMNMX",
                     "LOP3", "LOP", "LOP32I", "SHF", "SHL", "SHR", "PRMT", "ISETP", "SEL", "LEA", "FLO", "POPC", "BREV",
                     "BMSK", "SGXT", "IABS", "ISCADD", "BFE", "BFI", "IDP", "HMNMX2"})
# HMNMX2 (the packed 16-bit float min/max) runs beside the integer min/max; F2FP's fp32 -> f16/bf16 pack runs on the
# integer pipe on sm_80 (Nsight Compute's pipe table: "on Ampere the ALU pipeline performs fast FP32-to-FP16
# conversion"), and is counted there on every target. Its FP8/FP4 forms (F2FP.SATFINITE.E4M3...) are the hardware
# conversions, left out as before.
_FP8_FORMS = re.compile(r"\.(?:E4M3|E5M2|E2M1|E2M3|E3M2|UE8M0)\b")


def int_alu(ins: Instruction) -> bool:
    """Whether ``ins`` takes an integer-ALU issue slot in the model (INT_ALU, or F2FP's fp32 -> f16/bf16 pack)."""
    return ins.base in INT_ALU or (ins.base == "F2FP" and not _FP8_FORMS.search(ins.opcode))


@dataclass(frozen=True)
class Instruction:
    address: int
    guarded: bool  # under a predicate: @P0 / @!P0
    opcode: str    # with its modifiers, e.g. LDG.E.128.CONSTANT
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


def instructions(sass: str) -> list[Instruction]:
    """The instructions of one function's SASS, in address order."""
    return [Instruction(int(a, 16), bool(g), op, rest.strip()) for a, g, op, rest in _INSTRUCTION.findall(sass)]


def _target(ins: Instruction) -> int | None:
    m = re.search(r"(?:^|,\s*)0x([0-9a-f]+)", ins.operands)
    return int(m.group(1), 16) if m else None


def _conditional(ins: Instruction) -> bool:
    """A branch that may fall through: guarded, or with a predicate operand (BRA P1, 0x...)."""
    return ins.guarded or bool(re.match(r"!?U?P[T\d]", ins.operands))


@dataclass
class Block:
    start: int  # index of its first instruction
    end: int    # one past its last
    succ: list[int] = field(default_factory=list)
    exits: bool = False  # ends the thread (an unguarded or guarded EXIT)


def blocks(code: list[Instruction]) -> list[Block]:
    """Basic blocks of ``code`` and their successors (a CALL returns; a RET ends the route)."""
    index = {ins.address: k for k, ins in enumerate(code)}
    leaders = {0}
    for k, ins in enumerate(code):
        if ins.base in ("BRA", "EXIT", "RET", "BRX", "JMX", "JMP"):
            leaders.add(k + 1)
            t = _target(ins) if ins.base in ("BRA", "JMP") else None
            if t is not None and t in index:
                leaders.add(index[t])
    starts = sorted(s for s in leaders if s < len(code))
    out = [Block(s, e) for s, e in zip(starts, starts[1:] + [len(code)])]
    at = {b.start: n for n, b in enumerate(out)}
    for n, b in enumerate(out):
        last = code[b.end - 1]
        falls = True
        if last.base in ("BRA", "JMP"):
            t = _target(last)
            if t is not None and t in index:
                b.succ.append(at[index[t]])
            falls = _conditional(last)
        elif last.base == "EXIT":
            b.exits, falls = True, last.guarded
        elif last.base in ("RET", "BRX", "JMX"):
            falls = False
        if falls and n + 1 < len(out):
            b.succ.append(n + 1)
    return out


def _shortest(code: list[Instruction], graph: list[Block], must: dict[str, int], start: int, done: set[int],
              allowed: range | None) -> list[int] | None:
    """The blocks of the cheapest route from block ``start`` to any block of ``done`` (counted in instructions)
    holding ``must``'s patterns, each at least its count of times; None if there is none."""
    pats = [(re.compile(p), c) for p, c in must.items()]

    def counts(n: int, have: tuple[int, ...]) -> tuple[int, ...]:
        ops = [code[k].opcode for k in range(graph[n].start, graph[n].end)]
        return tuple(min(c, h + sum(bool(p.fullmatch(o)) for o in ops)) for (p, c), h in zip(pats, have))

    want = tuple(c for _, c in pats)
    first = (start, counts(start, (0,) * len(pats)))
    heap = [(graph[start].end - graph[start].start, first, (start,))]
    seen = set()
    while heap:
        cost, state, route = heapq.heappop(heap)
        if state in seen:
            continue
        seen.add(state)
        n, have = state
        if n in done and have == want:
            return list(route)
        for m in graph[n].succ:
            if allowed is not None and m not in allowed:
                continue
            nxt = (m, counts(m, have))
            if nxt not in seen:
                heapq.heappush(heap, (cost + graph[m].end - graph[m].start, nxt, route + (m,)))
    return None


def fast_path(sass: str, must: dict[str, int]) -> tuple[list[Instruction], bool]:
    """The instructions of the fast path (see the module's docstring) and whether it is one turn of a loop."""
    code = instructions(sass)
    graph = blocks(code)
    loops = []  # (size, head block, back-edge block) of each backward branch
    for n, b in enumerate(graph):
        last = code[b.end - 1]
        for m in b.succ:
            if m <= n and last.base == "BRA" and _target(last) == code[graph[m].start].address:
                loops.append((n - m, m, n))
    for _, head, back in sorted(loops):
        route = _shortest(code, graph, must, head, {back}, range(head, back + 1))
        if route is not None:
            return [code[k] for n in route for k in range(graph[n].start, graph[n].end)], True
    route = _shortest(code, graph, must, 0, {n for n, b in enumerate(graph) if b.exits}, None)
    if route is None:
        raise ValueError(f"no route through the kernel holds {must}")
    return [code[k] for n in route for k in range(graph[n].start, graph[n].end)], False


# ---- figures of a route ---------------------------------------------------------------------------------------

_LOAD_WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}


def load_bytes(ins: Instruction) -> int:
    """Bytes one global load (LDG) brings a thread, 0 for anything else."""
    if ins.base != "LDG":
        return 0
    return next((w for m, w in _LOAD_WIDTH.items() if f".{m}" in ins.opcode), 4)


def _registers(operand: str, count: int = 1) -> set[int]:
    m = re.match(r"R(\d+)", operand.strip())
    return set(range(int(m.group(1)), int(m.group(1)) + count)) if m else set()


def bytes_in_flight(route: list[Instruction]) -> int:
    """The most bytes of global loads one thread has outstanding on ``route``: loads issued before the first
    instruction that reads what any of them loads (the wait), summed, the largest such group."""
    best = 0
    pending: set[int] = set()
    group = 0
    for ins in route:
        if pending:
            operands = ins.operands.split(",")
            srcs = operands if ins.base.startswith(("ST", "RED", "ATOM")) else operands[1:]
            read = set().union(*(_registers(s, 4 if ".64" in s else 1) for s in srcs)) if srcs else set()
            if read & pending:
                best, pending, group = max(best, group), set(), 0
        width = load_bytes(ins)
        if width:
            pending |= _registers(ins.operands.split(",")[0], max(1, width // 4))
            group += width
    return max(best, group)


@dataclass(frozen=True)
class Figures:
    """One kernel's fast path on one target: per element of its input, and its resources."""

    instructions: float     # per element
    int_alu: float          # per element
    elements: int           # per thread and pass
    load_bytes: int         # global bytes loaded per thread and pass
    in_flight: int          # bytes of loads one thread has outstanding at once
    registers: int
    shared: int             # bytes of static shared memory per CTA
    spills: int             # local-memory instructions (LDL/STL) anywhere in the kernel
    loop: bool


def figures(sass: str, resources: dict[str, int], must: dict[str, int], element_bytes: int) -> Figures:
    """The fast path's figures; ``element_bytes``: bytes of one input element (the vector loads' unit)."""
    route, loop = fast_path(sass, must)
    loaded = sum(load_bytes(i) for i in route if ".128" in i.opcode or ".64" in i.opcode)
    elements = max(1, loaded // element_bytes)
    spills = len(re.findall(r"\b(?:LDL|STL)\b", sass))
    return Figures(instructions=len(route) / elements,
                   int_alu=sum(int_alu(i) for i in route) / elements,
                   elements=elements, load_bytes=loaded, in_flight=bytes_in_flight(route),
                   registers=resources.get("REG", 0), shared=resources.get("SHARED", 0), spills=spills, loop=loop)


# ---- the SM: occupancy and issue rates --------------------------------------------------------------------------

@dataclass(frozen=True)
class SM:
    """What bounds residency on one compute capability (the CUDA occupancy calculator's inputs)."""

    threads: int = 2048
    blocks: int = 32
    registers: int = 65536
    shared: int = 233472          # bytes per SM a kernel's blocks may use
    reserved_shared: int = 1024   # bytes the system keeps per block (sm_80+)
    register_unit: int = 256      # registers are allocated per warp in units of this many
    int_alu_lanes: int = 64       # integer-ALU operations per clock (4 sub-partitions x 16)
    issue_lanes: int = 128        # instructions per clock, thread-wise (4 sub-partitions x one warp instruction)


SMS = {"80": SM(shared=167936), "89": SM(threads=1536, blocks=24, shared=102400), "90": SM(), "100": SM(),
       "120": SM(threads=1536, blocks=32, shared=102400)}


def blocks_per_sm(sm: SM, threads: int, registers: int, shared: int) -> int:
    """CTAs of ``threads`` threads resident on one SM, from the cubin's registers and static shared memory."""
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // sm.register_unit) * sm.register_unit
    by_regs = (sm.registers // per_warp) // warps
    by_threads = sm.threads // (warps * 32)
    by_shared = sm.shared // (shared + sm.reserved_shared) if shared else sm.blocks
    return max(0, min(sm.blocks, by_regs, by_threads, by_shared))


def in_flight_per_sm(f: Figures, arch: str, threads: int = 256) -> int:
    """Bytes of global loads outstanding per SM at full residency: per thread x threads x resident CTAs."""
    return f.in_flight * threads * blocks_per_sm(SMS[arch], threads, f.registers, f.shared)


# ---- the kernels measured, and what each moves ------------------------------------------------------------------

@dataclass(frozen=True)
class Measured:
    """One kernel's fast path to measure: its file, name expression, the instructions its fast path holds,
    its input element's bytes, and the bytes it moves per element (read + written, scales included)."""

    name: str
    file: str
    expr: str
    must: dict
    element_bytes: int
    moved: float
    family: bool = False  # measured for the family-specific target (sm_100f) where the device has one, as the
    #                       loader compiles its file there (_kernels.FAMILY_FILES, arch_options)


BF16 = "fp8core::bf16"
KERNELS = (
    Measured("quantize", "quantize.cu", f"fp8core::quantize_kernel<{BF16}, 0>",
             {r"LDG\.E\.128.*": 1, r"STG\.E\.64.*": 1}, 2, 2 + 1),
    Measured("cast_transpose", "cast_transpose.cu", f"fp8core::cast_transpose_kernel<{BF16}, 0, true>",
             {r"LDG\.E\.128.*": 1, r"STG\.E\.128.*": 2}, 2, 2 + 2),
    Measured("mxfp8_rowwise", "block_quantize.cu", f"fp8core::mx_quantize_kernel<{BF16}, 0, true>",
             {r"LDG\.E\.128.*": 1, r"STG\.E\.128.*": 2}, 2, 2 + 1 + 1 / 32),
    Measured("mxfp8_both", "block_quantize.cu", f"fp8core::mx_quantize_kernel<{BF16}, 0, true>",
             {r"LDG\.E\.128.*": 1, r"BAR\.SYNC.*": 3, r"STG\.E\.128.*": 4}, 2, 2 + 2 + 2 / 32),
    Measured("nvfp4", "fp4_quantize.cu", f"fp8core::nvfp4_quantize_kernel<{BF16}>",
             {r"LDG\.E\.128.*": 2, r"STG\.E\.64.*": 1}, 2, 2 + 0.5 + 1 / 16, family=True),
    Measured("mxfp4", "fp4_quantize.cu", f"fp8core::mxfp4_quantize_kernel<{BF16}, true>",
             {r"LDG\.E\.128.*": 4, r"STG\.E\.128.*": 1}, 2, 2 + 0.5 + 1 / 32, family=True),
)


def measure(kernel: Measured, arch: str, tmp: str) -> Figures:
    """Compile ``kernel``'s file for sm_``arch`` (NVRTC, no GPU) and read its fast path's figures."""
    from fp8core import _kernels

    family = kernel.family and kernel.file in _kernels.FAMILY_FILES and int(arch) in _kernels.FAMILY_ARCHS
    cubin, mapping = _kernels.compile_cubin(kernel.file, f"{arch}f" if family else arch)
    dis = Disassembly(cubin, tmp)
    name = mapping[kernel.expr]
    return figures(dis.sass[name], dis.resources[name], kernel.must, kernel.element_bytes)


# ---- devices, budgets and the static roofline -------------------------------------------------------------------

@dataclass(frozen=True)
class Device:
    """Public figures of one GPU: its target, SMs, HBM/GDDR bandwidth (bytes/s) and boost clock (Hz)."""

    name: str
    arch: str
    sms: int
    bandwidth: float
    clock: float


# A100 is the software-conversion target's device (sm_80: no FP8 hardware); its lanes are SMS["80"]'s.
DEVICES = (Device("A100 SXM", "80", 108, 2.039e12, 1.41e9), Device("H100 SXM", "90", 132, 3.35e12, 1.98e9),
           Device("H200", "90", 132, 4.8e12, 1.98e9), Device("B200", "100", 148, 8.0e12, 1.965e9),
           Device("RTX 5090", "120", 170, 1.792e12, 2.407e9))
DRAM_LATENCY = 700e-9  # seconds from a load's issue to its data under load (HBM3/HBM3e, loaded; GDDR7 alike)
HEADROOM = 1.2          # a budget keeps the kernel's instruction and ALU rates this far above the memory's

BUDGET_IN_FLIGHT = 32 * 1024  # bytes of loads in flight per SM: Little's law for ~8 TB/s over 148 SMs at 700 ns


@dataclass(frozen=True)
class Roofline:
    """Elements per clock per SM each limit allows, and the share of the device's bandwidth the least gives."""

    memory: float   # the bandwidth's: bytes/clock/SM over the bytes moved per element
    issue: float    # instructions: 128 a clock
    int_alu: float  # integer-ALU ops: 64 a clock
    latency: float  # Little's law: bytes of loads in flight per SM over the latency, per element loaded
    share: float    # min of all over memory, at most 1

    @property
    def bound(self) -> str:
        limits = {"memory": self.memory, "issue": self.issue, "int_alu": self.int_alu, "latency": self.latency}
        return min(limits, key=limits.get)


def roofline(f: Figures, kernel: Measured, device: Device, threads: int = 256) -> Roofline:
    sm = SMS[device.arch]
    memory = _memory_rate(kernel, device)
    issue = sm.issue_lanes / f.instructions
    alu = sm.int_alu_lanes / f.int_alu if f.int_alu else float("inf")
    latency = in_flight_per_sm(f, device.arch, threads) / (DRAM_LATENCY * device.clock) / kernel.element_bytes
    return Roofline(memory, issue, alu, latency, min(1.0, issue / memory, alu / memory, latency / memory))


def _memory_rate(kernel: Measured, device: Device) -> float:
    return device.bandwidth / device.sms / device.clock / kernel.moved


def devices_of(arch: str) -> tuple[Device, ...]:
    """The devices of DEVICES that run sm_``arch`` code: the loader compiles each device's own target, so a
    target's SASS runs only on its devices (sm_90's on H100 and H200, never on B200)."""
    found = tuple(d for d in DEVICES if d.arch == arch)
    if not found:
        raise ValueError(f"arch: no device of DEVICES runs sm_{arch} code (targets with one: "
                         f"{sorted({d.arch for d in DEVICES}, key=int)})")
    return found


def budget(kernel: Measured, arch: str) -> tuple[float, float]:
    """(instructions, integer-ALU ops) per element that keep ``kernel``'s sm_``arch`` code memory-bound with
    HEADROOM on every device that runs it (devices_of): the issue and ALU rates of that device's SMs over HEADROOM
    times the elements per clock its memory feeds, the least over those devices. Per target, because a target's
    SASS only runs on its own devices: holding sm_90 code to B200's memory rate, or sm_80's software conversion to
    H100's, would budget for a machine that never runs the code."""
    devices = devices_of(arch)
    return (min(SMS[d.arch].issue_lanes / (HEADROOM * _memory_rate(kernel, d)) for d in devices),
            min(SMS[d.arch].int_alu_lanes / (HEADROOM * _memory_rate(kernel, d)) for d in devices))
