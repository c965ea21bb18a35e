"""Compile cuda/*.cu as host C++ (the emulator's modules): the real sources, their inline PTX rewritten.

A module is built from exactly what ``cupy.RawModule`` receives from fp8core._kernels (the file's text, the
options, the name expressions), so the emulator compiles what the loader would hand NVRTC: the -D options
pass through, ``-arch=sm_XXXf`` defines the family-specific macro NVRTC defines, and the device's compute
capability gives ``__CUDA_ARCH__``. The only changes to the text are mechanical: every inline-PTX statement
``asm("T" : "=c"(d) : "c"(a), ...)`` becomes a call of the host implementation of instruction "T"
(ptx_host.h), its operands in the statement's order; and every ``__shared__`` declaration is followed by the
poisoning of its variable once per block (poison_shared).

Modules are cached on disk by a hash of everything that goes into them: the .cu file and the headers it includes
(not every header offered), the shim, the options and the compiler. The loader's -DFP8CORE_CUDA_SHA option is a
hash of the same module's sources, so an edit of one kernel file rebuilds that module alone.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIM = ("cuda_host.h", "ptx_host.h", "launch.h", "runtime.cpp")
FLAGS = ("-std=c++17", "-O1", "-g", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-omit-frame-pointer",
         "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-pthread", "-w")


def compiler() -> str | None:
    """The host C++ compiler: $CXX, else g++ or clang++ from PATH (None: the emulation tests skip)."""
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def sanitizer_runtime() -> str:
    """The ASan runtime the test process must preload (a sanitized library cannot be loaded otherwise)."""
    cxx = compiler()
    path = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True, check=True)
    return path.stdout.strip()


def cache_root() -> Path:
    return Path(os.environ.get("FP8EMU_CACHE", Path(tempfile.gettempdir()) / "fp8core-emulation"))


def _operands(text: str) -> list[tuple[str, str]]:
    """'"=h"(r), "f"(a)' -> [("=h", "r"), ("f", "a")]; operands are plain expressions without parentheses."""
    found = re.findall(r'"(=?[a-z])"\s*\(([^()]*)\)', text)
    if ",".join(f'"{c}"({e})' for c, e in found).replace(" ", "") != text.replace(" ", ""):
        raise ValueError(f"inline asm operands the emulator cannot read: {text!r}")
    return found


def rewrite_asm(source: str, name: str) -> str:
    """Every ``asm("T" : outputs : inputs);`` of ``source`` as ``::fp8emu::ptx<op("T")>(out..., in...);``."""
    out, at = [], 0
    for m in re.finditer(r"\basm\s*(?:volatile\s*)?\(", source):
        if m.start() < at:
            continue
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            i += 1
        body = source[m.end():i - 1]
        parts = re.match(r'\s*"((?:[^"\\]|\\.)*)"\s*:(.*):(.*)$', body, re.S)
        if parts is None:
            line = source.count("\n", 0, m.start()) + 1
            raise ValueError(f"{name}:{line}: inline asm the emulator cannot read (expected asm(\"...\" : out : in))")
        template, outs, ins = parts.group(1), _operands(parts.group(2).strip()), _operands(parts.group(3).strip())
        if len(outs) != 1 or not outs[0][0].startswith("="):
            raise ValueError(f"{name}: asm {template!r}: expected one output operand")
        args = [f"::fp8emu::out<'{outs[0][0][1]}'>({outs[0][1]})"]
        args += [f"::fp8emu::in<'{c}'>({e})" for c, e in ins]
        out.append(source[at:m.start()])
        out.append(f'::fp8emu::ptx<::fp8emu::op("{template}")>({", ".join(args)})')
        at = i
    out.append(source[at:])
    return "".join(out)


_SHARED = re.compile(r"\b__shared__\b([^;{}]*?)\b([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*);")


def poison_shared(source: str) -> str:
    """Every ``__shared__ T name[...];`` of ``source`` followed by ``FP8EMU_SHARED(name);`` (cuda_host.h), which
    poisons the variable once per block: uninitialised shared memory then reads as neither zeros nor the
    previous block's data. Declarations at function scope, as CUDA's static shared memory is declared here."""
    return _SHARED.sub(lambda m: f"{m.group(0)} FP8EMU_SHARED({m.group(2)});", source)


def defines(options: tuple[str, ...], compute_capability: int) -> list[str]:
    """The host compiler's -D flags for NVRTC ``options`` on a device of ``compute_capability`` (e.g. 90)."""
    flags = [o for o in options if o.startswith("-D")]
    family = [o for o in options if re.fullmatch(r"-arch=sm_\d+f", o)]
    arch = compute_capability * 10
    if family:
        arch = int(family[0][len("-arch=sm_"):-1]) * 10
        flags.append(f"-D__CUDA_ARCH_FAMILY_SPECIFIC__={arch}")
    unknown = [o for o in options if not o.startswith(("-D", "-I", "--std=", "-arch=")) and o != "-ftz=true"]
    if unknown:
        raise ValueError(f"NVRTC options the emulator does not model: {unknown}")
    if "-ftz=true" in options:  # plain fp32 arithmetic flushes subnormals (runtime.cpp sets the host's FTZ and DAZ)
        flags.append("-DFP8EMU_FTZ=1")
    return [f"-D__CUDA_ARCH__={arch}", *flags]


def build_module(code: str, headers: dict[str, str], options: tuple[str, ...], compute_capability: int,
                 name_expressions: tuple[str, ...], filename: str) -> Path:
    """The shared library of one module: ``code`` (a .cu file's text) with the ``headers`` (name -> text) it
    includes; the others offered are not part of it."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no host C++ compiler (g++ or clang++) for the CUDA emulator")
    from fp8core._kernels import included

    flags = [*FLAGS, *defines(options, compute_capability)]
    sources = {filename: poison_shared(rewrite_asm(code, filename))}
    sources.update({h: poison_shared(rewrite_asm(headers[h], h)) for h in included(code, headers)})
    table = ",\n".join(f'  fp8emu::KernelOf<&{e}>::entry("{e}")' for e in name_expressions)
    unit = (f'#include "cuda_host.h"\n#include "{filename}"\n#include "launch.h"\n'
            f"static const fp8emu::Entry fp8emu_entries[] = {{\n{table}\n}};\nFP8EMU_EXPORTS\n")
    h = hashlib.sha256()
    for part in [cxx, *flags, unit, *sorted(sources.items()), *((HERE / s).read_text() for s in SHIM)]:
        h.update(str(part).encode() + b"\0")
    out = cache_root() / h.hexdigest()[:24]
    lib = out / "module.so"
    if lib.is_file():
        return lib
    work = Path(tempfile.mkdtemp(dir=cache_root().mkdir(parents=True, exist_ok=True) or cache_root()))
    for n, text in sources.items():
        (work / n).write_text(text)
    (work / "unit.cpp").write_text(unit)
    cmd = [cxx, *flags, f"-I{work}", f"-I{HERE}", str(work / "unit.cpp"), str(HERE / "runtime.cpp"), "-o",
           str(work / "module.so")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"host compile of cuda/{filename} failed:\n{' '.join(cmd)}\n{done.stderr[-6000:]}")
    try:
        work.rename(out)  # atomic: a concurrent build of the same module keeps one
    except OSError:
        shutil.rmtree(work, ignore_errors=True)
    return lib
