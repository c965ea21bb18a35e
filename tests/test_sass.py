"""The machine code of every kernel, read in CI without a GPU: NVRTC compiles each for sm_80, 89, 90, 100 and
120, cuobjdump disassembles it, and the tests assert what the fast paths and the numerics rely on, so a change
that loses one fails here before any GPU runs it.

cuobjdump comes from the ``nvidia-cuda-cuobjdump`` wheel and, for SASS, calls nvdisasm from the
``nvidia-cuda-nvdisasm`` wheel (both in the ``test`` extra); bench/sass.py runs them (its Disassembly).
"""

import re

import pytest

from fp8core import _kernels
from fp8core.bench.sass import CUOBJDUMP, NVDISASM, Disassembly

pytest.importorskip("cupy", reason="cupy (fp8core[cuda13]) is not installed: NVRTC comes with it")
RECORD = {k.name: k for k in _kernels.RECORDS}

ARCHS = ["80", "89", "90", "100", "120"]
TARGETS = [(a, False) for a in ARCHS] + [("90", True)]  # the software conversion forced on sm_90 too
# The family-specific targets the loader compiles some files for on sm_100/120 (_kernels.arch_options), and one
# with the software path forced, which must then stay in software there too.
FAMILY_TARGETS = [("100f", False), ("120f", False), ("100f", True)]
MAX_REGS = {256: 64, 512: 128}  # threads per block -> registers that keep >= 1024 threads resident per SM
# Kernels that hold more per thread by design: quantize_128x128 keeps its 64 values of the tile in registers
# (x read once, the tile's amax known before the first store); the MXFP8 quantize a whole 32-element row block and
# cast_transpose 4 x 16 elements (issue 40: more elements per thread, fewer integer-ALU ops per element), 128 or
# 256 bytes of fp32 loads in flight per thread; 2 CTAs (512 threads) per SM still run.
MAX_REGS_OF = {"quantize_128x128_kernel": 128, "mx_quantize_kernel": 128, "cast_transpose_kernel": 128}

pytestmark = pytest.mark.skipif(
    CUOBJDUMP is None or NVDISASM is None,
    reason=f"cuobjdump ({CUOBJDUMP or 'not found'}) and nvdisasm ({NVDISASM or 'not found'}) are needed: "
           "pip install -e '.[test]' in a checkout (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)")


_cache: dict = {}


def disassemble(filename: str, arch: str, soft: bool, tmp_path_factory) -> tuple[Disassembly, dict[str, str]]:
    key = (filename, arch, soft)
    if key not in _cache:
        cubin, mapping = _kernels.compile_cubin(filename, arch, soft_fp8=soft)
        _cache[key] = (Disassembly(cubin, str(tmp_path_factory.mktemp("sass"))), mapping)
    return _cache[key]


def kernels(filename: str):
    return [pytest.param(filename, e, id=e.replace("fp8core::", "")) for e in _kernels.KERNELS[filename]]


ALL = [p for f in sorted(_kernels.KERNELS) for p in kernels(f)]


def kind(expr: str) -> str:
    return expr.split("::")[1].split("<")[0]


def template_args(expr: str) -> list[str]:
    return [a.strip() for a in expr[expr.index("<") + 1:-1].split(",")] if "<" in expr else []


def fp8_format(expr: str) -> str | None:
    """"E4M3"/"E5M2" for kernels that convert to or from fp8, else None."""
    k, args = kind(expr), template_args(expr)
    if k in ("quantize_kernel", "quantize_dynamic_kernel", "multi_quantize_kernel"):
        return ("E4M3", "E5M2")[int(args[1])]
    if k == "cast_transpose_kernel" and args[2] == "true":
        return ("E4M3", "E5M2")[int(args[1])]
    if k in ("dequantize_kernel", "block_dequantize_kernel"):
        return ("E4M3", "E5M2")[int(args[0])]
    if k in ("mx_quantize_kernel", "quantize_1x128_kernel", "quantize_128x128_kernel"):
        return ("E4M3", "E5M2")[int(args[1])]
    return None


# Vector global accesses the fast path of each kernel must keep (16-byte, or 8 where 8 bytes is the whole vector).
VECTOR = {
    "amax_kernel": [r"LDG\.E\.128"],
    "multi_amax_kernel": [r"LDG\.E\.128"],
    "quantize_kernel": [r"LDG\.E\.128", r"STG\.E\.64"],
    "quantize_dynamic_kernel": [r"LDG\.E\.128", r"STG\.E\.64"],
    "multi_quantize_kernel": [r"LDG\.E\.128", r"STG\.E\.64"],
    "dequantize_kernel": [r"LDG\.E\.64", r"STG\.E\.128"],
    "cast_transpose_kernel": [r"LDG\.E\.128", r"STG\.E\.128"],
    "mx_quantize_kernel": [r"LDG\.E\.128", r"STG\.E\.128"],
    "quantize_128x128_kernel": [r"LDG\.E\.128", r"STG\.E\.64"],
    "block_dequantize_kernel": [r"LDG\.E\.64", r"STG\.E\.128"],
    "nvfp4_quantize_kernel": [r"LDG\.E\.128", r"STG\.E\.64"],
    "mxfp4_quantize_kernel": [r"LDG\.E\.128", r"STG\.E\.128"],
}


# Kernels whose codes go out with store4/store8/store16 (cuda/common.cuh) where the destination is not aligned to
# the vector: 16-bit and 32-bit global stores must be there, and byte stores only in the short heads and tails
# (at most this many in the whole kernel; byte-at-a-time vectors held 26-34 in quantize). A route that falls back to
# one byte at a time loses its 16-bit stores or goes over the count.
# The 1-7 codes at either end of a range, or a row's last, go by store_partial8 (byte stores only at an odd
# address): 2 byte stores each, where the byte loops they replaced held 4-12 (quantize, whose loops
# byte_store_loops finds), 6-14 (1x128) and 80 (128x128).
MISALIGNED_STORES = {
    "quantize_kernel": 4,          # store8_misaligned's head and tail, and store_partial8's
    "quantize_dynamic_kernel": 4,
    "multi_quantize_kernel": 4,
    "quantize_1x128_kernel": 4,    # store4's head and tail, and store_partial8's (a row's last 1-3 codes)
    "quantize_128x128_kernel": 32,  # 8 rows a thread, each with store8's head and tail and store_partial8's
}


def byte_store_loops(sass: str) -> list[str]:
    """The loops (a backward branch's target up to the branch) whose global stores are all byte stores: a byte-at-a-
    time loop, which store_partial8 and store8 replace by the widest stores each address allows."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    found = []
    for address, text in lines:
        branch = re.search(r"\bBRA(?:\.\w+)*\s+(?:`\()?0x([0-9a-f]+)", text)
        if branch is None or int(branch.group(1), 16) >= address:
            continue
        body = [t for a, t in lines if int(branch.group(1), 16) <= a <= address]
        stores = [re.search(r"\bSTG\.E(\.\w+)?", t).group(1) or "" for t in body if re.search(r"\bSTG\.E", t)]
        if stores and all(w == ".U8" for w in stores):
            found.append(f"{int(branch.group(1), 16):#x}..{address:#x}")
    return found


def vector_patterns(expr: str) -> list[str]:
    """VECTOR's patterns; a 1x128 block is one warp, 4 elements a lane: 16 bytes of fp32 or 8 of bf16/fp16 in."""
    if kind(expr) == "quantize_1x128_kernel":
        return [r"LDG\.E\.128" if template_args(expr)[0] == "float" else r"LDG\.E\.64"]
    return VECTOR.get(kind(expr), [])


def rceil_in_hardware(expr: str, arch: str, soft: bool) -> bool:
    """Where E8M0 "rceil" must be cvt.rp.satfinite.ue8m0x2.f32 (F2FP...E8...RP): family targets, not forced soft."""
    rceil = ((kind(expr) == "mx_quantize_kernel" and template_args(expr)[2] == "true")
             or (kind(expr) == "mxfp4_quantize_kernel" and template_args(expr)[1] == "true"))
    return rceil and arch.endswith("f") and not soft


def e2m1_in_hardware(expr: str, arch: str, soft: bool) -> bool:
    """Where the FP4 quantizers' plain path must convert with cvt.rn.satfinite.e2m1x2.f32 (F2FP...E2M1): family
    targets, not forced soft; nowhere else (NVRTC refuses it for sm_90 and the generic sm_100)."""
    return kind(expr) in ("nvfp4_quantize_kernel", "mxfp4_quantize_kernel") and arch.endswith("f") and not soft


def function(filename, expr, arch, soft, tmp_path_factory):
    dis, mapping = disassemble(filename, arch, soft, tmp_path_factory)
    name = mapping[expr]
    assert name in dis.sass, f"{expr}: {name} not in the SASS of {filename} for sm_{arch}"
    return dis, name


@pytest.mark.parametrize("arch,soft", TARGETS, ids=[f"sm{a}{'-soft' if s else ''}" for a, s in TARGETS])
@pytest.mark.parametrize("filename,expr", ALL)
def test_sass_of_every_kernel(filename, expr, arch, soft, tmp_path_factory):
    check_sass(filename, expr, arch, soft, tmp_path_factory)


FAMILY = [p for f in sorted(_kernels.FAMILY_FILES) for p in kernels(f)]


@pytest.mark.parametrize("arch,soft", FAMILY_TARGETS, ids=[f"sm{a}{'-soft' if s else ''}" for a, s in FAMILY_TARGETS])
@pytest.mark.parametrize("filename,expr", FAMILY)
def test_sass_on_family_targets(filename, expr, arch, soft, tmp_path_factory):
    check_sass(filename, expr, arch, soft, tmp_path_factory)


def without_divisions(sass: str) -> str:
    """The SASS less the subroutines ptxas calls for a division (a CALL's target up to its RET, holding the
    reciprocal estimate MUFU.RCP: div.rn.f32's full-range path, 64-bit integer division): their internal steps
    may flush, the IEEE division they implement does not."""
    lines = sass.splitlines()
    at = {int(m.group(1), 16): k for k, line in enumerate(lines) if (m := re.search(r"/\*([0-9a-f]{4,})\*/", line))}
    drop = set()
    for target in {int(t, 16) for t in re.findall(r"\bCALL\.REL[.\w]*\s+0x([0-9a-f]+)", sass)}:
        if target not in at:
            continue
        end = next((k for k in range(at[target], len(lines)) if re.search(r"\bRET\b", lines[k])), len(lines) - 1)
        if any("MUFU.RCP" in line for line in lines[at[target]:end + 1]):
            drop.update(range(at[target], end + 1))
    return "\n".join(line for k, line in enumerate(lines) if k not in drop)


def check_sass(filename, expr, arch, soft, tmp_path_factory):
    dis, name = function(filename, expr, arch, soft, tmp_path_factory)
    cc = int(arch.rstrip("f"))
    sass, res = dis.sass[name], dis.resources[name]

    # No local memory: no spills, no stack, no struct argument copied out of the parameter bank.
    assert not re.search(r"\b(LDL|STL)\b", sass), f"{expr}: local memory on sm_{arch}"
    assert res.get("LOCAL", 0) == 0 and res.get("STACK", 0) == 0, f"{expr}: {res}"

    # No flush-to-zero arithmetic anywhere (CuPy compiles with -ftz=true; the contract keeps subnormals) but inside
    # ptxas's own routine for the IEEE division div.rn.f32 (the block scales), which is defined without flush.
    ftz = re.findall(r"\b(?:FMUL|FFMA|FADD|FMNMX|HMUL2|HFMA2|HADD2)[.\w]*\.FTZ[.\w]*", without_divisions(sass))
    assert not ftz, f"{expr}: flush-to-zero arithmetic on sm_{arch}: {sorted(set(ftz))}"

    # fp8 conversions: the hardware's on sm_89+, none (the software path) on sm_80 or when forced.
    fmt = fp8_format(expr)
    hw_fp8 = re.findall(r"\bF2FP\.[.\w]*(?:E4M3|E5M2)[.\w]*", sass)
    if cc < 89 or soft:
        assert not hw_fp8, f"{expr}: hardware fp8 conversions on sm_{arch} (soft={soft}): {sorted(set(hw_fp8))}"
    elif fmt is not None:
        if kind(expr) in ("dequantize_kernel", "block_dequantize_kernel"):
            want = rf"\bF2FP\.F16\.{fmt}\.UNPACK_B\b"  # cvt.rn.f16x2.{fmt}x2: two codes per instruction
        else:
            want = rf"\bF2FP\.SATFINITE\.{fmt}\.F32\.PACK_AB"
        assert re.search(want, sass), f"{expr}: no {want} on sm_{arch}"

    # E8M0 "rceil": one hardware conversion exactly where the loader's target has it, bit patterns elsewhere.
    e8m0 = re.findall(r"\bF2FP\.[.\w]*\bE8\b[.\w]*", sass)
    if rceil_in_hardware(expr, arch, soft):
        assert any(".RP" in i for i in e8m0), f"{expr}: no cvt.rp.satfinite.ue8m0x2.f32 on sm_{arch}"
    else:
        assert not e8m0, f"{expr}: hardware E8M0 conversion on sm_{arch} (soft={soft}): {sorted(set(e8m0))}"

    # E2M1: the hardware conversion exactly where the family target has it; software (FP-pipe arithmetic) elsewhere.
    e2m1 = re.findall(r"\bF2FP\.[.\w]*\bE2M1\b[.\w]*", sass)
    if e2m1_in_hardware(expr, arch, soft):
        assert e2m1, f"{expr}: no cvt.rn.satfinite.e2m1x2.f32 on sm_{arch}"
    else:
        assert not e2m1, f"{expr}: hardware E2M1 conversion on sm_{arch} (soft={soft}): {sorted(set(e2m1))}"

    # The vectorised fast path is there.
    for pattern in vector_patterns(expr):
        assert re.search(rf"\b{pattern}\b", sass), f"{expr}: no {pattern} on sm_{arch}"

    # Misaligned destinations take the widest stores their alignment allows, not bytes.
    if kind(expr) in MISALIGNED_STORES:
        byte_stores = len(re.findall(r"\bSTG\.E\.U8\b", sass))
        assert re.search(r"\bSTG\.E\.U16\b", sass) and re.search(r"\bSTG\.E\s", sass), \
            f"{expr}: no 16- and 32-bit stores for a misaligned destination on sm_{arch}"
        assert byte_stores <= MISALIGNED_STORES[kind(expr)], f"{expr}: {byte_stores} byte stores on sm_{arch}"
        loops = byte_store_loops(sass)
        assert not loops, f"{expr}: loops storing byte by byte on sm_{arch} at {loops}"

    # cast_transpose's vector path transposes through shared memory in 32-bit words (byte permutes, a quad
    # shuffle); byte-wide shared loads are left only in the edge path.
    if kind(expr) == "cast_transpose_kernel":
        byte_loads = len(re.findall(r"\bLDS\.U8\b", sass))
        assert byte_loads <= 8 and re.search(r"\bPRMT\b", sass), f"{expr}: {byte_loads} byte-wide shared loads"

    # Registers leave room for what the launches assume (the grids are sized by the occupancy API).
    threads = 512 if kind(expr) == "update_kernel" else 256
    limit = MAX_REGS_OF.get(kind(expr), MAX_REGS[threads])
    assert res["REG"] <= limit, f"{expr}: {res['REG']} registers on sm_{arch}"


@pytest.mark.parametrize("filename,expr", ALL)
def test_launch_arguments_match_the_kernel(filename, expr, tmp_path_factory):
    """A launch packs its named arguments as the loader read the kernel's C++ signature (_signatures): offsets and
    sizes must be those of the compiled kernel."""
    dis, name = function(filename, expr, "90", False, tmp_path_factory)
    got = [(offset, size) for _, offset, size in dis.params[name]]
    assert got == RECORD[kind(expr)].signature.layout, expr


def test_multi_args_fit_the_parameter_limit(tmp_path_factory):
    dis, mapping = disassemble("quantize.cu", "80", False, tmp_path_factory)
    (_, offset, size), = dis.params[mapping["fp8core::multi_quantize_kernel<float, 0>"]]
    assert size == _kernels.MULTI_QUANTIZE.signature.size and size <= 4096


# ---- memory order: what the emulator's x86 atomics cannot show ------------------------------------------------
# The host's atomics are sequentially consistent and its loads are never cached across a spin, so the emulated
# suite passes with the grid barrier's fences removed or its spin made a plain load. The machine code shows both.

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
# What a spin loop may hold besides its loads: compares, branches and scheduling hints, nothing that moves on.
_SPIN_BODY = {"ISETP", "FSETP", "PLOP3", "BRA", "YIELD", "NOP", "NANOSLEEP", "BSSY", "BSYNC", "WARPSYNC"}


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode with its modifiers, operands) of each instruction, in address order."""
    return [(int(a, 16), op, rest.strip()) for a, _, op, rest in _INSTRUCTION.findall(sass)]


def _entered(sass: str, start: int, end: int) -> bool:
    """Whether the loop [start, end] can be entered: a branch from outside it targets ``start``, or the instruction
    before it may fall through (the unconditional self-branch that pads every kernel after its last EXIT cannot)."""
    code = [(int(a, 16), pred, op, rest) for a, pred, op, rest in _INSTRUCTION.findall(sass)]
    if any(op.split(".")[0] == "BRA" and re.match(rf"{start:#x}\b", rest.strip()) and not start <= a <= end
           for a, _, op, rest in code):
        return True
    before = [(pred, op) for a, pred, op, _ in code if a < start][-1:]
    return not before or bool(before[0][0]) or before[0][1].split(".")[0] not in ("EXIT", "BRA", "RET", "JMP")


def spin_loops(sass: str) -> list[list[tuple[int, str, str]]]:
    """Each loop (a backward branch and the instructions from its target) that changes nothing but what it loads
    and its predicates: it waits on memory another thread writes."""
    code = instructions(sass)
    loops = []
    for at, op, rest in code:
        target = re.match(r"0x([0-9a-f]+)", rest) if op.split(".")[0] == "BRA" else None
        if target and int(target.group(1), 16) <= at:
            start = int(target.group(1), 16)
            body = [i for i in code if start <= i[0] <= at]
            if all(o.split(".")[0] in _SPIN_BODY | {"LDG", "LD"} for _, o, _ in body) and _entered(sass, start, at):
                loops.append(body)
    return loops


def grid_barrier_problems(sass: str) -> list[str]:
    """What breaks a grid barrier on a weakly ordered GPU: a spin loop whose load is not strong (volatile or
    acquire: a weak load may be served from L1 forever) or was hoisted out of it, and a global store before the
    first arrival atomic with no MEMBAR between them (another block may see the arrival before the store)."""
    problems = []
    loops = spin_loops(sass)
    for body in loops:
        loads = [op for _, op, _ in body if op.split(".")[0] in ("LDG", "LD")]
        if not loads:
            problems.append(f"a spin loop at {body[0][0]:#x} loads nothing (its load was hoisted out)")
        problems += [f"a weak load {op} in the spin loop at {body[0][0]:#x}" for op in loads if ".STRONG" not in op]
    if loops:
        code = instructions(sass)
        arrival = next((k for k, (_, op, _) in enumerate(code) if op.startswith(("ATOMG", "ATOM.", "RED"))), None)
        if arrival is None:
            return problems + ["spin loops and no arrival atomic"]
        stores = [k for k, (_, op, _) in enumerate(code[:arrival]) if op.startswith(("STG", "ST."))]
        if stores and not any(op.startswith("MEMBAR") for _, op, _ in code[stores[-1]:arrival]):
            problems.append(f"no MEMBAR between the store at {code[stores[-1]][0]:#x} and the arrival atomic at "
                            f"{code[arrival][0]:#x}")
    return problems


SPIN = ["quantize_dynamic_kernel"]  # the kernels with a cooperative grid barrier


@pytest.mark.parametrize("arch", ["80", "90", "100"])
@pytest.mark.parametrize("filename,expr", ALL)
def test_memory_order_of_every_kernel(filename, expr, arch, tmp_path_factory):
    dis, name = function(filename, expr, arch, False, tmp_path_factory)
    assert bool(spin_loops(dis.sass[name])) == (kind(expr) in SPIN), f"{expr}: spin loops on sm_{arch}"
    assert not grid_barrier_problems(dis.sass[name]), f"{expr} on sm_{arch}"


# Planted in cuda/quantize.cu: both release fences before the arrival gone; the generation read as a plain load.
PLANTS = {
    "no_release_fences": [("  if (threadIdx.x == 0) ((volatile u32*)partials)[blockIdx.x] = m;\n  __threadfence();\n",
                           "  if (threadIdx.x == 0) ((volatile u32*)partials)[blockIdx.x] = m;\n"),
                          ("    const u32 gen = *generation;\n    __threadfence();\n",
                           "    const u32 gen = *generation;\n")],
    "weak_spin": [("volatile u32* generation) {", "u32* generation) {"),
                  ("atomicAdd((u32*)generation, 1u);", "atomicAdd(generation, 1u);")],
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_grid_barrier_bug_is_caught(plant, tmp_path, monkeypatch):
    import shutil

    src = tmp_path / "cuda"
    shutil.copytree(_kernels.cuda_dir(), src)
    text = (src / "quantize.cu").read_text()
    for old, new in PLANTS[plant]:
        assert old in text
        text = text.replace(old, new)
    (src / "quantize.cu").write_text(text)
    monkeypatch.setattr(_kernels, "cuda_dir", lambda: src)
    cubin, mapping = _kernels._compile_cubin("quantize.cu", "90", False)
    dis = Disassembly(cubin, str(tmp_path))
    assert grid_barrier_problems(dis.sass[mapping["fp8core::quantize_dynamic_kernel<float, 0>"]])
