"""Every kernel and every template instantiation compiles with NVRTC for each target, without a GPU."""

import struct

import pytest

from fp8core import _kernels

pytest.importorskip("cupy", reason="cupy (fp8core[cuda13]) is not installed: NVRTC comes with it")

ARCHS = ["80", "89", "90", "100", "120"]


def elf_extent(cubin: bytes) -> int:
    """The bytes an ELF64 file needs: the end of its section header table or of its furthest section."""
    e_shoff, = struct.unpack_from("<Q", cubin, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", cubin, 0x3A)
    end = e_shoff + e_shentsize * e_shnum
    for i in range(e_shnum):
        sh_type, = struct.unpack_from("<I", cubin, e_shoff + i * e_shentsize + 4)
        sh_offset, sh_size = struct.unpack_from("<QQ", cubin, e_shoff + i * e_shentsize + 0x18)
        if sh_type != 8:  # NOBITS has no bytes in the file
            end = max(end, sh_offset + sh_size)
    return end


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", sorted(_kernels.KERNELS))
def test_nvrtc_compiles_every_instantiation(filename, arch):
    cubin, mapping = _kernels.compile_cubin(filename, arch)
    assert cubin[:4] == b"\x7fELF"
    assert elf_extent(cubin) <= len(cubin), "the cubin is cut short (nvrtcGetCUBINSize not used?)"
    assert set(mapping) == set(_kernels.KERNELS[filename])
    assert all(symbol.startswith("_Z") for symbol in mapping.values())


def test_forced_software_path_compiles_on_sm90():
    cubin, _ = _kernels.compile_cubin("quantize.cu", "90", soft_fp8=True)
    assert elf_extent(cubin) <= len(cubin)


def test_cuda_hash_covers_every_file(tmp_path, monkeypatch):
    import shutil

    src = tmp_path / "cuda"
    shutil.copytree(_kernels.cuda_dir(), src)
    monkeypatch.setattr(_kernels, "cuda_dir", lambda: src)
    before, options = _kernels.cuda_sha256(), _kernels.module_options(False)
    (src / "common.cuh").write_text((src / "common.cuh").read_text() + "\n// edit\n")
    assert _kernels.cuda_sha256() != before
    # CuPy keys its disk cache on the options: a header edit must change them, so the module recompiles.
    assert _kernels.module_options(False) != options
    assert _kernels.module_options(True) != _kernels.module_options(False)


def test_module_hash_covers_its_own_sources_only(tmp_path, monkeypatch):
    """A module's options (CuPy's cache key) change with its .cu and the headers it includes, directly or through
    another header, and with nothing else: an edit of one kernel file recompiles that module alone."""
    import shutil

    src = tmp_path / "cuda"
    shutil.copytree(_kernels.cuda_dir(), src)
    monkeypatch.setattr(_kernels, "cuda_dir", lambda: src)
    files = sorted(_kernels.KERNELS)
    options = lambda: {f: _kernels.module_options(False, f) for f in files}  # noqa: E731
    # each module's own file first, then what it includes: common.cuh directly or through another header
    assert all(_kernels.module_sources(f)[0] == src / f and src / "common.cuh" in _kernels.module_sources(f)
               for f in files)
    before = options()
    assert len(set(before.values())) == len(files)
    (src / "quantize.cu").write_text((src / "quantize.cu").read_text() + "\n// edit\n")
    after = options()
    assert [f for f in files if after[f] != before[f]] == ["quantize.cu"]
    (src / "unused.cuh").write_text("// included by no module\n")
    assert options() == after
    (src / "common.cuh").write_text((src / "common.cuh").read_text() + '\n#include "nested.cuh"\n')
    (src / "nested.cuh").write_text("// reached through common.cuh\n")
    nested = options()
    assert all(nested[f] != after[f] for f in files)
    assert all(src / "nested.cuh" in _kernels.module_sources(f) for f in files)
    (src / "nested.cuh").write_text("// edited\n")
    assert all(options()[f] != nested[f] for f in files)


@pytest.mark.parametrize("filename", sorted(_kernels.KERNELS))
def test_cupy_compiles_what_rawmodule_is_given(filename, monkeypatch):
    """CuPy's own NVRTC path (the one RawModule takes on a GPU: source in a temporary directory, -I for the
    headers, CuPy's added options) compiles every file; only the device's architecture is supplied here."""
    from cupy.cuda import compiler

    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc", lambda arch=None: (f"-arch=sm_{arch}", "cubin"))
    source = (_kernels.cuda_dir() / filename).read_text()
    options = (*_kernels._RAWMODULE_OPTIONS, f"-I{_kernels.cuda_dir()}", *_kernels.module_options(False, filename),
               "-ftz=true")
    cubin, mapping = compiler.compile_using_nvrtc(source, options, arch="90",
                                                  name_expressions=_kernels.KERNELS[filename])
    assert cubin[:4] == b"\x7fELF" and set(mapping) == set(_kernels.KERNELS[filename])


def test_rawmodule_is_built_lazily_without_a_gpu():
    """Constructing the RawModule compiles nothing: the compile happens on the device it runs on."""
    import cupy

    module = cupy.RawModule(code=(_kernels.cuda_dir() / "update.cu").read_text(), backend="nvrtc",
                            options=("--std=c++17", f"-I{_kernels.cuda_dir()}", *_kernels.module_options(False)),
                            name_expressions=_kernels.KERNELS["update.cu"])
    assert module is not None


def test_cache_dir_is_cupys(monkeypatch, tmp_path):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    assert _kernels.cache_dir() == tmp_path
