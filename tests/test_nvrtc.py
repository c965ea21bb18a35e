"""Every kernel and every template instantiation compiles with NVRTC for each target, without a GPU."""

import pytest

from fp8core import _kernels

pytest.importorskip("cupy", reason="cupy (fp8core[cuda13]) is not installed: NVRTC comes with it")


@pytest.mark.parametrize("arch", ["89", "90", "100", "120"])
@pytest.mark.parametrize("filename", sorted(_kernels.KERNELS))
def test_nvrtc_compiles_every_instantiation(filename, arch):
    cubin, mapping = _kernels.compile_cubin(filename, arch)
    assert cubin[:4] == b"\x7fELF"
    assert set(mapping) == set(_kernels.KERNELS[filename])
    assert all(symbol.startswith("_Z") for symbol in mapping.values())


def test_cuda_hash_covers_every_file(tmp_path, monkeypatch):
    import shutil

    src = tmp_path / "cuda"
    shutil.copytree(_kernels.cuda_dir(), src)
    monkeypatch.setattr(_kernels, "cuda_dir", lambda: src)
    before = _kernels.cuda_sha256()
    (src / "common.cuh").write_text((src / "common.cuh").read_text() + "\n// edit\n")
    assert _kernels.cuda_sha256() != before
    assert _kernels._key("update.cu", "90") != _kernels._key("update.cu", "89")


def test_unwritable_cache_degrades_to_memory(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="not writable"):
        _kernels._write_disk(blocked / "sub" / "x.bin", b"cubin", {"a": "b"})
    good = tmp_path / "ok" / "x.bin"
    _kernels._write_disk(good, b"\x7fELFdata", {"k": "_Z1k"})
    assert _kernels._read_disk(good) == (b"\x7fELFdata", {"k": "_Z1k"})
