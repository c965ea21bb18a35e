"""cuda/block_quantize.cu on the family-specific Blackwell targets, where E8M0 "rceil" is one hardware
conversion (test_nvrtc.py compiles every file for the generic targets, where it is bit manipulation)."""

import pytest

from fp8core import _caches, _kernels

pytest.importorskip("cupy", reason="cupy (fp8core[cuda13]) is not installed: NVRTC comes with it")

FILE = "block_quantize.cu"
PROBE = "fp8core::mx_quantize_kernel<float, 0, true>"
HW = "cvt.rp.satfinite.ue8m0x2.f32"


def _ptx(arch: str, *extra: str) -> str:
    from cupy.cuda import nvrtc

    headers = [p for p in _kernels._sources() if p.suffix == ".cuh"]
    prog = nvrtc.createProgram((_kernels.cuda_dir() / FILE).read_text(), FILE, [p.read_bytes() for p in headers],
                               [p.name.encode() for p in headers])
    try:
        nvrtc.addNameExpression(prog, PROBE)
        nvrtc.compileProgram(prog, [*_kernels.OPTIONS, *extra, f"-arch=sm_{arch}", *_kernels.module_options(False)])
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


@pytest.mark.parametrize("cc", _kernels.FAMILY_ARCHS)
def test_the_loader_asks_for_the_family_target_on_blackwell(cc, monkeypatch):
    monkeypatch.setattr(_kernels, "nvrtc_version", lambda: (13, 0))  # whatever NVRTC this machine has
    assert _kernels.arch_options(FILE, cc, soft_fp8=False) == (f"-arch=sm_{cc}f",)
    assert _kernels.arch_options(FILE, cc, soft_fp8=True) == ()  # FP8CORE_FORCE_SOFT_FP8: software everywhere
    assert _kernels.arch_options("quantize.cu", cc, soft_fp8=False) == ()


@pytest.mark.parametrize("cc", [80, 89, 90])
def test_no_family_target_before_blackwell(cc):
    assert _kernels.arch_options(FILE, cc, soft_fp8=False) == ()


@pytest.mark.parametrize("cc", [100, 120])
def test_family_option_beside_cupys_generic_arch_compiles_for_the_family(cc):
    """CuPy appends -arch=sm_XX to what the loader gives; NVRTC given both builds the family target, where rceil
    is the hardware conversion, and the forced software define keeps it in software there."""
    extra = _kernels.arch_options(FILE, cc, soft_fp8=False)
    assert HW in _ptx(str(cc), *extra)
    assert HW not in _ptx(str(cc))
    assert HW not in _ptx(str(cc), *extra, "-DFP8CORE_FORCE_SOFT_FP8=1")


def test_cupy_compiles_block_quantize_with_the_family_option(monkeypatch):
    """The RawModule path on an sm_100 device (CuPy's options and its appended -arch) with the loader's option."""
    from cupy.cuda import compiler

    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc", lambda arch=None: (f"-arch=sm_{arch}", "cubin"))
    source = (_kernels.cuda_dir() / FILE).read_text()
    options = (*_kernels._RAWMODULE_OPTIONS, f"-I{_kernels.cuda_dir()}", *_kernels.module_options(False), "-ftz=true")
    family, _ = compiler.compile_using_nvrtc(source, options + _kernels.arch_options(FILE, 100, False), arch="100",
                                             name_expressions=_kernels.KERNELS[FILE])
    generic, mapping = compiler.compile_using_nvrtc(source, options, arch="100",
                                                    name_expressions=_kernels.KERNELS[FILE])
    assert family[:4] == b"\x7fELF" and set(mapping) == set(_kernels.KERNELS[FILE])
    assert family != generic


@pytest.mark.parametrize("version,family", [((12, 4), False), ((12, 8), False), ((12, 9), True), ((13, 0), True)])
@pytest.mark.parametrize("cc", [100, 120])
def test_family_target_only_where_nvrtc_has_it(monkeypatch, version, family, cc):
    """NVRTC before 12.9 refuses -arch=sm_100f/120f ("invalid value for --gpu-architecture"), and the cuda12 extra
    allows 12.4+: there the generic target, whose software E8M0 path gives the same bits."""
    monkeypatch.setattr(_kernels, "nvrtc_version", lambda: version)
    assert _kernels.arch_options(FILE, cc, soft_fp8=False) == ((f"-arch=sm_{cc}f",) if family else ())


@pytest.mark.parametrize("version,family", [((12, 9), False), ((13, 0), True)])
def test_sm110_family_target_needs_cuda13(monkeypatch, version, family):
    """sm_110 was sm_101 before CUDA 13.0: NVRTC 12.9 has no sm_110f."""
    monkeypatch.setattr(_kernels, "nvrtc_version", lambda: version)
    assert _kernels.arch_options(FILE, 110, soft_fp8=False) == (("-arch=sm_110f",) if family else ())


def test_nvrtc_version_is_read_once(monkeypatch):
    from cupy.cuda import nvrtc

    calls = []
    real = nvrtc.getVersion
    monkeypatch.setattr(nvrtc, "getVersion", lambda: calls.append(1) or real())
    _caches.reset("kernels.nvrtc_version")
    try:
        first = _kernels.nvrtc_version()
        for cc in _kernels.FAMILY_ARCHS:
            _kernels.arch_options(FILE, cc, soft_fp8=False)
        assert _kernels.nvrtc_version() == first == tuple(real()) and calls == [1]
    finally:
        _caches.reset("kernels.nvrtc_version")
