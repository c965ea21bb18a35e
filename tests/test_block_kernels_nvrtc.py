"""cuda/block_quantize.cu on the family-specific Blackwell targets, where E8M0 "rceil" is one hardware
conversion (test_nvrtc.py compiles every file for the generic targets, where it is bit manipulation)."""

import pytest

from fp8core import _kernels

pytest.importorskip("cupy", reason="cupy (fp8core[cuda13]) is not installed: NVRTC comes with it")

FILE = "block_quantize.cu"
PROBE = "fp8core::mx_quantize_kernel<float, 0, true>"
HW = "cvt.rp.satfinite.ue8m0x2.f32"


def _ptx(arch: str) -> str:
    from cupy.cuda import nvrtc

    headers = [p for p in _kernels._sources() if p.suffix == ".cuh"]
    prog = nvrtc.createProgram((_kernels.cuda_dir() / FILE).read_text(), FILE, [p.read_bytes() for p in headers],
                               [p.name.encode() for p in headers])
    try:
        nvrtc.addNameExpression(prog, PROBE)
        nvrtc.compileProgram(prog, [*_kernels.OPTIONS, f"-arch=sm_{arch}"])
        return nvrtc.getPTX(prog).decode()
    finally:
        nvrtc.destroyProgram(prog)


@pytest.mark.parametrize("arch", ["100f", "120f"])
def test_family_targets_compile_every_instantiation(arch):
    cubin, mapping = _kernels.compile_cubin(FILE, arch)
    assert cubin[:4] == b"\x7fELF"
    assert set(mapping) == set(_kernels.KERNELS[FILE])


@pytest.mark.parametrize("arch,hardware", [("90", False), ("100", False), ("100f", True), ("120f", True)])
def test_rceil_uses_the_hardware_conversion_only_where_it_exists(arch, hardware):
    assert (HW in _ptx(arch)) is hardware
