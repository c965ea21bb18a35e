"""A kernel's parameters read from its C++ signature in cuda/*.cu: the one place they are declared.

:func:`read` finds ``__global__ void name(...)`` in a .cu file and gives each parameter's name, C++ type and the
struct code of its bytes in the launch's parameter buffer (native alignment, as the driver lays kernel parameters
out). A by-value struct (quantize.cu's ``MultiArgs``) is read from its definition, its array bounds from the
file's ``constexpr`` integers. Typedefs come from the file and the headers it includes, so ``i64`` is what
common.cuh says it is. Anything the reader does not understand is refused by name, never guessed.

A launch names its arguments; :meth:`Signature.pack` lays them out, and a missing, unknown or misspelt name, or a
value of the wrong kind, raises naming the kernel and the parameter, before anything reaches a driver.
tests/test_kernel_signatures.py checks every kernel's reading against NVRTC's own mangled names; the emulator and
tests/test_sass.py check the offsets against the compiled kernels.
"""

from __future__ import annotations

import ast
import ctypes
import keyword
import operator
import re
import struct
import threading
from pathlib import Path
from typing import Any, Mapping, NamedTuple

# The C++ fundamental types a parameter or field may have, as struct codes (LP64, as nvcc and NVRTC lay them out).
_CODES = {"char": "b", "signed char": "b", "unsigned char": "B", "short": "h", "unsigned short": "H", "int": "i",
          "unsigned": "I", "unsigned int": "I", "long long": "q", "unsigned long long": "Q", "float": "f",
          "double": "d", "bool": "?"}
# The launch options of _kernels.Kernel.launch, passed by keyword among a kernel's arguments: no parameter may
# take these names.
RESERVED = frozenset({"grid", "block", "cooperative"})


class Param(NamedTuple):
    """One kernel parameter: ``ctype`` as declared (less ``__restrict__``/``__grid_constant__``), ``code`` the
    struct code of its bytes, ``fields`` a by-value struct's (name, array length or 0 for a scalar, struct code)
    in order."""

    name: str
    ctype: str
    code: str
    fields: tuple[tuple[str, int, str], ...] = ()


class Signature:
    """The parameter list of ``kernel`` in ``cuda/<file>``, and how a launch packs it.

    ``format``: the struct format of the whole buffer; ``size``: its bytes; ``layout``: (offset, size) of each
    parameter; ``constants``: the file's namespace-scope integer constants (e.g. MULTI_CHUNK).
    """

    def __init__(self, file: str, kernel: str, params: tuple[Param, ...], constants: dict[str, int]) -> None:
        self.file, self.kernel, self.params, self.constants = file, kernel, params, constants
        self.names = tuple(p.name for p in params)
        self.format = "@" + "".join(p.code for p in params)
        self.size = struct.calcsize(self.format)
        ends = [struct.calcsize("@" + "".join(p.code for p in params[:i + 1])) for i in range(len(params))]
        self.layout = [(end - struct.calcsize("@" + p.code), struct.calcsize("@" + p.code))
                       for end, p in zip(ends, params)]
        self._struct = struct.Struct(self.format)
        self._get = operator.itemgetter(*self.names) if len(params) > 1 else lambda a, k=self.names[0]: (a[k],)
        self._by_value = any(p.fields for p in params)
        self._local = threading.local()

    def where(self) -> str:
        """The kernel and its file, as every error names them."""
        return f"{self.kernel} (cuda/{self.file})"

    def pack(self, args: Mapping[str, Any]) -> int:
        """``args`` (name -> value; a by-value struct as a mapping of its fields, arrays as sequences of their exact
        length) laid out in this thread's parameter buffer; the address of the array of each argument's address
        (a launch's kernelParams).

        The buffer is rewritten by this thread's next pack: the driver copies the arguments when a launch is
        called (a graph capture too), so a launch is done with it when the call returns. One buffer per thread,
        its address table written once, leaves one struct pack per launch (a fresh buffer and table cost more
        than the whole launch call besides)."""
        try:
            values = self._get(args)
        except KeyError:
            raise self._names_error(args) from None
        if len(args) != len(self.names):
            raise self._names_error(args)
        if self._by_value:
            values = self._flatten(values)
        try:
            buf, table = self._local.buffer
        except AttributeError:
            buf, table = self._local.buffer = self._buffer()
        try:
            self._struct.pack_into(buf, 0, *values)
        except struct.error:
            raise self._value_error(args) from None
        return table

    def _buffer(self) -> tuple[Any, int]:
        """A parameter buffer and the address of its table of argument addresses (kept with the buffer)."""
        buf = ctypes.create_string_buffer(self.size)
        base = ctypes.addressof(buf)
        table = (ctypes.c_void_p * len(self.params))(*[base + offset for offset, _ in self.layout])
        buf._table = table  # the driver reads both through the address handed out
        return buf, ctypes.addressof(table)

    def _names_error(self, args: Mapping[str, Any]) -> TypeError:
        missing = [f"{p.name} ({p.ctype})" for p in self.params if p.name not in args]
        unknown = [n for n in args if n not in self.names]
        said = "; ".join(s for s in (f"no argument for {', '.join(missing)}" if missing else "",
                                     f"no parameter named {', '.join(unknown)}" if unknown else "") if s)
        return TypeError(f"{self.where()}: {said}; its parameters are {', '.join(self.names)}")

    def _flatten(self, values: tuple) -> list:
        """The values in order, a by-value struct's fields in its own order, each array of its exact length."""
        flat: list = []
        for p, value in zip(self.params, values):
            if not p.fields:
                flat.append(value)
                continue
            for field, length, _ in p.fields:
                try:
                    item = value[field]
                except (KeyError, TypeError, IndexError):
                    raise self._fields_error(p, value) from None
                if not length:
                    flat.append(item)
                elif len(item) != length:
                    raise ValueError(f"{self.where()}: argument {p.name}.{field} must hold {length} values (its "
                                     f"array length in {p.ctype}), got {len(item)}")
                else:
                    flat += item
            if len(value) != len(p.fields):
                raise self._fields_error(p, value)
        return flat

    def _fields_error(self, p: Param, value: Any) -> TypeError:
        got = sorted(value) if isinstance(value, Mapping) else type(value).__name__
        return TypeError(f"{self.where()}: argument {p.name} ({p.ctype}) must map its fields "
                         f"{', '.join(f for f, _, _ in p.fields)} to values; got {got}")

    def _value_error(self, args: Mapping[str, Any]) -> Exception:
        """The first argument (or struct field element) whose value its C++ type cannot hold, named."""
        for p in self.params:
            parts = [(p.name, p.code, args[p.name])] if not p.fields else [
                (f"{p.name}.{f}[{i}]" if n else f"{p.name}.{f}", c, item)
                for f, n, c in p.fields for i, item in enumerate(args[p.name][f] if n else [args[p.name][f]])]
            for name, code, value in parts:
                try:
                    struct.pack("@" + code, value)
                except struct.error as e:
                    kind = ValueError if "range" in str(e) else TypeError
                    return kind(f"{self.where()}: argument {name} ({p.ctype}) cannot be {value!r} "
                                f"({type(value).__name__}): {e}")
        return TypeError(f"{self.where()}: the arguments do not pack as {self.format!r}")


# ---- reading the source ------------------------------------------------------------------------------------

def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", " ", text, flags=re.S)


def _included(root: Path, file: str, seen: set[str]) -> list[str]:
    """``file``'s text after the text of every header it includes (quoted includes under ``root``), once each."""
    if file in seen or not (root / file).is_file():
        return []
    seen.add(file)
    text = _strip_comments((root / file).read_text())
    out = []
    for header in re.findall(r'^\s*#\s*include\s*"([^"]+)"', text, flags=re.M):
        out += _included(root, header, seen)
    return out + [text]


class _Source:
    """The declarations of one .cu file and its headers that a signature needs."""

    def __init__(self, root: Path, file: str) -> None:
        self.file = file
        self.text = "\n".join(_included(root, file, set()))
        self.aliases = {m[1]: " ".join(m[0].split())
                        for m in re.findall(r"\btypedef\s+([\w\s]+?)\s+(\w+)\s*;", self.text)}
        self.aliases.update((m[0], " ".join(m[1].split()))
                            for m in re.findall(r"\busing\s+(\w+)\s*=\s*([\w\s]+?)\s*;", self.text))
        self.raw_constants: dict[str, set[str]] = {}
        for name, expr in re.findall(r"\bconstexpr\s+[\w\s]+?\s(\w+)\s*=\s*([^;{}]+);", self.text):
            self.raw_constants.setdefault(name, set()).add(" ".join(expr.split()))
        self.structs = dict(re.findall(r"\bstruct\s+(\w+)\s*\{([^{}]*)\}\s*;", self.text))

    def fundamental(self, name: str) -> str:
        """``name`` with its typedefs resolved."""
        for _ in range(16):  # a chain of typedefs is short; a cycle is not C++
            name = self.aliases.get(name, name)
        return name

    def constant(self, name: str) -> int:
        exprs = self.raw_constants.get(name, set())
        if len(exprs) != 1:
            raise ValueError(f"cuda/{self.file}: {'no' if not exprs else 'more than one'} constexpr named {name}")
        return self.evaluate(next(iter(exprs)))

    def evaluate(self, expr: str) -> int:
        """An integer constant expression of literals, named constants and + - * / << ( ), as C++ evaluates it."""
        ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.LShift: operator.lshift,
               ast.Div: lambda a, b: abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)}  # C++ truncates

        def value(node: ast.AST) -> int:
            if isinstance(node, ast.Constant) and isinstance(node.value, int):
                return node.value
            if isinstance(node, ast.Name):
                return self.constant(node.id)
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
                return -value(node.operand)
            if isinstance(node, ast.BinOp) and type(node.op) in ops:
                return ops[type(node.op)](value(node.left), value(node.right))
            raise ValueError(f"cuda/{self.file}: {expr.strip()!r} is not an integer constant expression")

        try:
            tree = ast.parse(re.sub(r"\b(0x[0-9a-fA-F]+|\d+)[uUlL]+\b", r"\1", expr.strip()), mode="eval")
        except SyntaxError:
            raise ValueError(f"cuda/{self.file}: {expr.strip()!r} is not an integer constant expression") from None
        return value(tree.body)

    def code(self, ctype: str, where: str) -> tuple[str, tuple[tuple[str, int, str], ...]]:
        """The struct code of a value of C++ type ``ctype``, and a by-value struct's fields."""
        if "*" in ctype:
            return "P", ()
        base = self.fundamental(" ".join(w for w in ctype.split() if w not in ("const", "volatile")))
        if base in _CODES:
            return _CODES[base], ()
        if base in self.structs:
            return self.struct_code(base, where)
        raise ValueError(f"{where}: C++ type {ctype!r} has no fixed layout here (a template parameter, or a type "
                         "the signature reader does not know: pass it by pointer)")

    def struct_code(self, name: str, where: str) -> tuple[str, tuple[tuple[str, int, str], ...]]:
        """A by-value struct's code: its fields in order, aligned as a whole to its most aligned field (leading
        and trailing zero-count codes pad as C++ does)."""
        codes, fields = [], []
        for decl in (d.strip() for d in self.structs[name].split(";") if d.strip()):
            m = re.fullmatch(r"([\w\s]+?)\s+(\w+)\s*(?:\[([^\]]+)\])?", " ".join(decl.split()))
            if m is None:
                raise ValueError(f"{where}: field {decl!r} of struct {name}: the signature reader reads only "
                                 "'type name;' and 'type name[constant];'")
            code, sub = self.code(m[1], f"{where}: struct {name}")
            if sub:
                raise ValueError(f"{where}: struct {name} nests struct {m[1]} by value; not read here")
            length = self.evaluate(m[3]) if m[3] else 0
            codes.append(f"{length}{code}" if length else code)
            fields.append((m[2], length, code))
        align = max((c[-1] for c in codes), key=lambda c: struct.calcsize("@" + c))
        return f"0{align}{''.join(codes)}0{align}", tuple(fields)

    def signature(self, kernel: str) -> Signature:
        where = f"{kernel} (cuda/{self.file})"
        # Kernel parameter lists here hold no parentheses and no template types with commas; one that did would
        # not match, or would split into pieces that are not "type name", and be refused below.
        found = re.findall(rf"__global__\s+void\s+(?:__launch_bounds__\s*\([^()]*\)\s*)?{kernel}\s*\(([^()]*)\)",
                           self.text)
        if not found and re.search(rf"__global__\s+void\s+__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*"
                                   rf"{kernel}\s*\(", self.text):
            raise ValueError(f"{where}: its __launch_bounds__ holds parentheses, which the signature reader does not "
                             "read: name the expression (a constexpr constant or a template's static member)")
        if len(found) != 1:
            raise ValueError(f"{where}: {'no' if not found else 'more than one'} '__global__ void {kernel}(' in the "
                             "source")
        params: list[Param] = []
        for decl in (d for d in found[0].split(",") if d.strip()):
            decl = " ".join(w for w in decl.replace("*", " * ").split() if w not in ("__restrict__",
                                                                                     "__grid_constant__"))
            pm = re.fullmatch(r"(.+?)\s+(\w+)", decl)
            if pm is None or pm[2] in ("const", "volatile"):
                raise ValueError(f"{where}: parameter {decl!r} is not 'type name'")
            name, ctype = pm[2], pm[1].replace(" *", "*")
            if name in RESERVED or keyword.iskeyword(name):
                raise ValueError(f"{where}: parameter {name} cannot be passed by name to Kernel.launch (a Python "
                                 f"keyword, or one of its options {', '.join(sorted(RESERVED))}); rename it in the .cu")
            if name in (p.name for p in params):
                raise ValueError(f"{where}: two parameters named {name}")
            code, fields = self.code(ctype, f"{where}: parameter {name}")
            params.append(Param(name, ctype, code, fields))
        if not params:
            raise ValueError(f"{where}: a kernel without parameters is not launched by fp8core")
        constants = {}
        for name in self.raw_constants:
            try:
                constants[name] = self.constant(name)
            except ValueError:
                pass  # a template-dependent or floating constant: not an integer a launch can use
        return Signature(self.file, kernel, tuple(params), constants)


def read(root: Path, file: str, kernel: str) -> Signature:
    """The signature of ``fp8core::kernel`` in ``root/file`` (read and parsed now; the caller keeps it)."""
    return _Source(root, file).signature(kernel)
