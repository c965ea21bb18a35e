"""fp8core's shape, checked from the source: layers that import only downward, no import cycle (imports inside
functions included), no private name imported across modules, no private module imported across packages. Reads
the files' syntax trees; imports nothing it checks. The layers are README's "Layout" section, top to bottom."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Where each package's source lives in a checkout (pyproject.toml's package-dir).
PACKAGES = {"fp8core": ROOT / "fp8core", "fp8core.torch": ROOT / "bindings" / "torch",
            "fp8core.jax": ROOT / "bindings" / "jax"}

# Layer of each module, by longest matching prefix; a higher layer may import a lower or its own, never a higher.
LAYERS = {
    "fp8core.cli": 5, "fp8core.selftest": 5, "fp8core.__main__": 5, "fp8core.torch": 5, "fp8core.jax": 5,
    "fp8core": 4, "fp8core.ops": 4, "fp8core.blocks": 4, "fp8core.fp4": 4, "fp8core.gemm": 4, "fp8core.scaling": 4,
    "fp8core.numerics_stats": 4, "fp8core.numerics_recipes": 4, "fp8core.declarations": 4, "fp8core.linear_plan": 4,
    "fp8core.recipe": 3, "fp8core.args": 3,
    "fp8core._tensor": 2, "fp8core._dlpack": 2, "fp8core.boundary": 2,
    "fp8core.backends": 1,
    "fp8core._kernels": 0, "fp8core._views": 0, "fp8core.formats": 0, "fp8core.layouts": 0, "fp8core._fpenv": 0,
    "fp8core.extras": 0,
    "fp8core.verified": 0, "fp8core._oracle": 0, "fp8core._caches": 0, "fp8core._signatures": 0,
    "fp8core.text": 0, "fp8core.declare": 0,
}
FRONT_ENDS = ("fp8core.cli", "fp8core.selftest", "fp8core.__main__", "fp8core.torch", "fp8core.jax")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _layer(name: str) -> int:
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len, default=None)
    if best is None:
        raise AssertionError(f"{name}: not in tests/test_layers.py's LAYERS (nor in README's Layout?)")
    return LAYERS[best]


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> list[tuple[str, str | None, int, str]]:
    """(module imported, name taken from it or None, line, the name it is bound to) for every import in ``name``'s
    file into the project."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    base = name if _is_package(name) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno, a.asname or a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                anchor = base.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                mod = ".".join(anchor + ([mod] if mod else []))
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub, None, node.lineno, a.asname or a.name) if sub in MODULES
                           else (mod, a.name, node.lineno, a.asname or a.name))
    return [i for i in out if i[0] in MODULES]


def _graph() -> dict[str, set[str]]:
    return {name: {m for m, *_ in _imports(name) if m != name} for name in MODULES}


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        _layer(name)


def test_imports_only_go_down() -> None:
    upward = [f"{name} (layer {_layer(name)}) imports {m} (layer {_layer(m)}) at line {line}"
              for name in MODULES for m, _, line, _ in _imports(name) if _layer(m) > _layer(name)]
    assert not upward, "\n".join(upward)


def test_core_never_imports_the_front_ends() -> None:
    core = [n for n in MODULES if not n.startswith(FRONT_ENDS)]
    bad = [f"{name} imports {m}" for name in core for m, *_ in _imports(name) if m.startswith(FRONT_ENDS)]
    assert not bad, "\n".join(bad)


def test_no_import_cycle() -> None:
    graph, index, low, stack, on, cycles = _graph(), {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_private_name_crosses_a_module() -> None:
    bad = [f"{name}:{line} takes {n} from {m}" for name in MODULES for m, n, line, _ in _imports(name)
           if n is not None and n.startswith("_") and not n.startswith("__")]
    assert not bad, "\n".join(bad)


def test_no_private_attribute_of_another_module() -> None:
    """``module._name`` where ``module`` is another of the project's modules, bound by an import."""
    bad = []
    for name in MODULES:
        tree = ast.parse(MODULES[name].read_text())
        modules = {alias for m, taken, _, alias in _imports(name) if taken is None and m != name}
        bad += [f"{name}:{node.lineno} reads {node.value.id}.{node.attr}" for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and node.attr.startswith("_") and not node.attr.startswith("__")]
    assert not bad, "\n".join(bad)


def _package(name: str) -> str:
    return max((p for p in PACKAGES if name == p or name.startswith(p + ".")), key=len)


def _private_module(name: str) -> bool:
    """Whether ``name`` is, or lies in, a private module of its package (fp8core._tensor, fp8core.jax._args)."""
    return any(part.startswith("_") and not part.startswith("__") for part in name[len(_package(name)):].split("."))


def test_no_private_module_crosses_a_package() -> None:
    """A package takes another's private module (fp8core._tensor) by no name: through its public modules only."""
    bad = [f"{name}:{line} imports {m}" for name in MODULES for m, _, line, _ in _imports(name)
           if _package(m) != _package(name) and _private_module(m)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name,package,private", [
    ("fp8core._tensor", "fp8core", True), ("fp8core.backends.cpu", "fp8core", False),
    ("fp8core.jax._args", "fp8core.jax", True), ("fp8core.jax.primitives", "fp8core.jax", False),
    ("fp8core.torch", "fp8core.torch", False), ("fp8core.__main__", "fp8core", False)])
def test_the_private_module_rule_reads_names(name: str, package: str, private: bool) -> None:
    assert _package(name) == package and _private_module(name) == private


@pytest.mark.parametrize("name", ["fp8core.ops", "fp8core.backends.cpu"])
def test_the_checker_sees_imports(name: str) -> None:
    """The checks above read real imports (a parser that found none would pass them all)."""
    assert any(m.startswith("fp8core") for m, *_ in _imports(name))
