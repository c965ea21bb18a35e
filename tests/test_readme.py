"""Every ```python block of README.md runs as written, each on its own, in a fresh namespace.

A block preceded by ``<!-- requires: gpu -->`` runs only where there is a GPU (it skips, saying why, elsewhere);
``<!-- requires: flax 0.12 -->`` only where that optional package is at least that version (flax NNX's API).
A block that imports an optional package that is not installed skips, naming it. New blocks are picked up
automatically."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest

from conftest import GPU_REASON

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"(?:<!--\s*requires:\s*(?P<requires>[\w., ]+?)\s*-->\s*\n)?^```python\n(?P<code>.*?)^```",
                    re.S | re.M)
OPTIONAL = {"torch", "jax", "cupy", "nvmath", "matplotlib", "safetensors", "flax"}


def blocks() -> list[tuple[int, frozenset, str]]:
    text = README.read_text(encoding="utf-8")
    found = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        requires = frozenset(r.strip() for r in (m.group("requires") or "").split(",") if r.strip())
        found.append((line, requires, m.group("code")))
    return found


BLOCKS = blocks()


def test_the_readme_has_examples():
    assert len(BLOCKS) >= 6
    assert all(r == "gpu" or re.fullmatch(r"(\w+) \d+(\.\d+)*", r) and r.split()[0] in OPTIONAL
               for _, requires, _ in BLOCKS for r in requires), "unknown requires: marker in README.md"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def _imports(code: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("line,requires,code", BLOCKS, ids=[f"README.md:{line}" for line, _, _ in BLOCKS])
def test_readme_example_runs_as_written(line, requires, code, tmp_path, monkeypatch):
    if "gpu" in requires and GPU_REASON is not None:
        pytest.skip(f"README.md:{line} needs a GPU: {GPU_REASON}")
    for name in sorted(_imports(code) & OPTIONAL):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"README.md:{line} needs {name}, not installed")
    for name, _, least in (r.partition(" ") for r in sorted(requires - {"gpu"})):
        have = importlib.metadata.version(name)
        if _version(have) < _version(least):
            pytest.skip(f"README.md:{line} needs {name} >= {least}, installed: {have}")
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
