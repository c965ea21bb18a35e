"""The hostile-input probes of `fp8core inspect` (issue 28, issue 27 item 9), one row each: the file is made in
tmp_path, the command runs in process, and the row's check says what must (and must not) come out."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from typing import Any, Callable

import numpy as np
import pytest

from conftest import GPU_REASON
from fp8core import cli
from fp8core.cli import files

ESC = "\x1b[31mred\x1b[0m"


def strict(text: str) -> Any:
    def refuse(name):
        raise AssertionError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def npz(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def declare_every_size(path, size: int):
    """Rewrite the uncompressed size the central directory declares for every member."""
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        data[at + 24:at + 28] = size.to_bytes(4, "little")
        at = data.find(b"PK\x01\x02", at + 4)
    path.write_bytes(bytes(data))
    return path


def torch_save(path, obj):
    torch = pytest.importorskip("torch")
    torch.save(obj, path)
    return path


def shared_nest(depth: int):
    import torch

    a = [torch.zeros(1)]
    for _ in range(depth):
        a = [a, a]
    return a


def deep_nest(depth: int):
    import torch

    inner: Any = {"w": torch.ones(2)}
    for _ in range(depth):
        inner = [inner]
    return {"top": torch.ones(3), "deep": inner}


def no_escape_codes(code, out, err):
    assert "\x1b" not in out + err and "\u202e" not in out + err and "\r" not in out


def widest(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def be_twin(tmp_path, dtype: str, values) -> tuple[list, Callable]:
    """A big-endian .npy and its native twin: the same statistics, the byte order noted."""
    x = np.asarray(values).astype(dtype)
    np.save(tmp_path / "be.npy", x.astype(np.dtype(dtype).newbyteorder(">")))
    np.save(tmp_path / "le.npy", x.astype(np.dtype(dtype).newbyteorder("<")))

    def check(code, out, err):
        assert code == 0, err
        rows = strict(out)
        be, le = rows[f"{tmp_path / 'be.npy'}:be"], rows[f"{tmp_path / 'le.npy'}:le"]
        assert "big-endian" in be["note"] and "byte order" in be["note"]
        for k in ("amax", "elements", "nan", "inf", "E4M3", "E5M2", "shape", "dtype"):
            assert be[k] == le[k], k
    return [tmp_path / "be.npy", tmp_path / "le.npy", "--json"], check


def legend_colours_drawn(tmp_path) -> tuple[list, Callable]:
    pytest.importorskip("matplotlib")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal(4096).astype(np.float32))

    def check(code, out, err):
        assert code == 0, err
        import matplotlib.image

        rgb = (matplotlib.image.imread(tmp_path / "p.png")[..., :3] * 255).round().astype(int)
        count = lambda c: int(np.all(rgb == c, axis=-1).sum())  # noqa: E731
        blue, orange = count((0x1F, 0x77, 0xB4)), count((0xFF, 0x7F, 0x0E))  # tab:blue, tab:orange
        assert blue > 2000 and orange > 2000, (blue, orange)  # each range a strip in the legend's own colour
        # the old bands: blue and orange at alpha 0.15 over white, and over each other (brown)
        for c in ((0xDD, 0xEB, 0xF4), (0xFF, 0xEF, 0xE2), (0xE0, 0xE0, 0xCF)):
            assert count(c) < 50, c
    return [tmp_path / "x.npy", "--plot", tmp_path / "p.png"], check


PROBES: list[Any] = [
    # ---- names from the file reach the terminal escaped; JSON stays strict and keeps them intact
    pytest.param(lambda p: [torch_save(p / "e.pt", {ESC: __import__("torch").ones(3)})],
                 lambda code, out, err: (no_escape_codes(code, out, err), code == 0 and "\\x1b[31mred" in out)[1],
                 id="escape-codes-in-a-pt-key-table"),
    pytest.param(lambda p: [torch_save(p / "e.pt", {ESC: __import__("torch").ones(3)}), "--json"],
                 lambda code, out, err: "\x1b" not in out and list(strict(out)) == [ESC],
                 id="escape-codes-in-a-pt-key-json"),
    pytest.param(lambda p: [npz(p / "e.npz", {f"\x1b[2J{ESC}.npy": npy(np.ones(3, np.float32))})],
                 lambda code, out, err: (no_escape_codes(code, out, err), code == 0 and "\\x1b[2J" in out)[1],
                 id="escape-codes-in-an-npz-member"),
    pytest.param(lambda p: [npz(p / "e.npz", {f"{ESC}.txt": b"hi"})],
                 lambda code, out, err: (no_escape_codes(code, out, err), code == 2 and "\\x1b[31m" in err
                                         and "not a .npy array" in err)[1],
                 id="escape-codes-in-an-error-message"),
    pytest.param(lambda p: [torch_save(p / "e.pt", {"ok\u202eevil\rX": __import__("torch").ones(3)})],
                 lambda code, out, err: (no_escape_codes(code, out, err), "ok\\u202eevil\\rX" in out)[1],
                 id="bidi-override-and-carriage-return-in-a-key"),
    pytest.param(lambda p: [torch_save(p / "e.pt", {f"{ESC}$x^2$ {{": __import__("torch").ones(3)}),
                            "--plot", p / "e.png"],
                 lambda code, out, err: code == 0 and "\x1b" not in out + err and "plot written" in out,
                 id="escape-codes-and-mathtext-in-a-plot-title"),
    pytest.param(lambda p: [np.save(p / "x.npy", np.ones(3, np.float32)) or p / "x.npy",
                            "--plot", p / f"no{ESC}dir" / "x.png"],
                 lambda code, out, err: (no_escape_codes(code, out, err), code == 2 and "\\x1b[31m" in err)[1],
                 id="escape-codes-in-an-os-error"),
    # ---- a .pt walk visits each container once, bounded, and says what it skipped
    pytest.param(lambda p: [torch_save(p / "n.pt", shared_nest(26))],
                 lambda code, out, err: code == 0 and out.count("(1,) float32") == 1
                 and "skipped 26 references to a dict/list/tuple already walked" in err,
                 id="shared-nesting-2^26-paths"),
    pytest.param(lambda p: [torch_save(p / "n.pt", deep_nest(100)), "--json"],
                 lambda code, out, err: code == 0 and list(strict(out)) == ["top"]
                 and f"nested more than {files.MAX_DEPTH} levels down" in err,
                 id="nesting-deeper-than-the-bound"),
    pytest.param(lambda p: [torch_save(p / "n.pt", {str(i): __import__("torch").ones(1) for i in range(20)}),
                            "--json", "MAX_ENTRIES=10"],
                 lambda code, out, err: code == 2 and "holds no tensors" in err and "beyond the first 10" in err,
                 id="more-entries-than-the-bound"),
    # ---- the .npz cap is the file's, checked on the declared sizes before anything is inflated
    pytest.param(lambda p: [npz(p / "t.npz", {f"{k}.npy": npy(np.zeros(1 << 19, np.float32)) for k in "abc"}),
                            "--max-bytes", str(5 << 20)],
                 lambda code, out, err: code == 2 and out == "" and "3 member(s) would inflate to 6291840 bytes in "
                 "all" in err and "--max-bytes" in err,
                 id="three-members-each-under-the-cap-together-over"),
    pytest.param(lambda p: [declare_every_size(npz(p / "t.npz", {f"{k}.npy": npy(np.zeros(4, np.float32))
                                                                for k in "abc"}), 1 << 30)],
                 lambda code, out, err: code == 2 and out == "" and f"would inflate to {3 << 30} bytes in all" in err,
                 id="three-members-declaring-1GiB-each"),
    pytest.param(lambda p: [npz(p / "t.npz", {f"{k}.npy": npy(np.ones(1 << 10, np.float32)) for k in "abc"}),
                            "--max-bytes", str(3 * (4096 + 128)), "--json"],
                 lambda code, out, err: code == 0 and sorted(strict(out)) == ["a", "b", "c"],
                 id="three-members-exactly-at-the-cap"),
    # ---- a big-endian file is the user's data: read in our byte order, same statistics as its twin
    pytest.param(lambda p: be_twin(p, "float32", [1.5, -3.0, np.nan, np.inf, 1e-40, 0.0, 448.0, 6e4]),
                 None, id="big-endian-float32"),
    pytest.param(lambda p: be_twin(p, "float16", [1.5, -3.0, np.nan, -np.inf, 6e-8, 0.0, 448.0, 6e4]),
                 None, id="big-endian-float16"),
    pytest.param(lambda p: be_twin(p, "float64", [1.5, -3.0, 1e300, 1e-300, 0.0]), None, id="big-endian-float64"),
    pytest.param(lambda p: be_twin(p, "int32", [1, -3, 2 ** 30, 0]), None, id="big-endian-int32"),
    # ---- the table fits 100 columns, whatever the names and notes
    pytest.param(lambda p: [torch_save(p / ("w" * 150 + ".pt"), {"model.layers.12.self_attn.q_proj." + "x" * 120:
                                                               __import__("torch").ones(3, dtype=__import__("torch")
                                                                                        .int32)}),
                            np.save(p / "n.npy", np.array([1.0, np.nan], ">f8")) or p / "n.npy"],
                 lambda code, out, err: code == 0 and widest(out) <= 100 and "q_proj." in out
                 and ("x" * 120) in out.replace("\n", ""),
                 id="table-fits-100-columns"),
    # ---- the plot's range strips are drawn in the legend's colours, nowhere blended
    pytest.param(legend_colours_drawn, None, id="plot-legend-matches-what-is-drawn"),
]


@pytest.mark.parametrize("build,check", PROBES)
def test_probe(tmp_path, capsys, monkeypatch, build, check):
    made = build(tmp_path)
    args, check = made if check is None else (made, check)
    for a in [a for a in args if isinstance(a, str) and a.startswith("MAX_")]:
        name, value = a.split("=")
        monkeypatch.setattr(files, name, int(value))
        args.remove(a)
    code = cli.main(["inspect", *map(str, args)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert check(code, out, err) is not False, (code, out, err)


@pytest.mark.skipif(GPU_REASON is None, reason="needs a machine without a GPU")
def test_probe_selftest_json_without_a_gpu_writes_the_verdict_to_stdout():
    p = subprocess.run([sys.executable, "-m", "fp8core", "selftest", "--json"], capture_output=True, text=True,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert p.returncode == 3, p.stderr
    report = strict(p.stdout)
    assert report["verdict"].startswith("NO GPU") and report["ok"] is False and report["cases"] == 0
    assert len(p.stderr.strip().splitlines()) == 1
