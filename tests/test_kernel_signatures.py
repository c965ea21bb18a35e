"""Kernel parameters have one source, each kernel's C++ signature in cuda/*.cu, read by fp8core._signatures; a
launch names its arguments. Checked here on the CPU: every record's reading against the compiler's own view of
the kernel (NVRTC's mangled names, demangled), and that a launch with a missing, unknown or misspelt name, or a
value of the wrong kind, is refused by name before any device is asked. (The offsets are checked against the
compiled kernels by tests/test_sass.py and under the emulator by tests/emulation/test_launch.py.)"""

import ast
import ctypes
import pathlib
import re
import shutil
import struct
import subprocess

import pytest

from fp8core import _kernels, _signatures

ROOT = pathlib.Path(__file__).resolve().parent.parent

QUANTIZE_ARGS = dict(x=0x1000, q=0x2000, scale=0x3000, amax_in=0, amax_out=0, scale_inv_out=0, n=16, fp8_max=448.0,
                     margin=0, power_of_2=0, epsilon=0.0)


@pytest.fixture
def no_device(monkeypatch):
    """Any step past packing the arguments (the plan: device query, compile, load) fails the test."""
    monkeypatch.setattr(_kernels.Kernel, "_plan", lambda *a: pytest.fail("reached the device"))


def test_quantize_reads_as_declared():
    sig = _kernels.QUANTIZE.signature
    assert [(p.name, p.ctype) for p in sig.params] == [
        ("x", "const T*"), ("q", "u8*"), ("scale", "const float*"), ("amax_in", "const float*"),
        ("amax_out", "u32*"), ("scale_inv_out", "float*"), ("n", "i64"), ("fp8_max", "float"), ("margin", "int"),
        ("power_of_2", "int"), ("epsilon", "float")]
    assert sig.format == "@PPPPPPqfiif" and sig.size == 72
    assert sig.layout == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8), (40, 8), (48, 8), (56, 4), (60, 4), (64, 4),
                          (68, 4)]


def test_every_record_reads_its_signature():
    for k in _kernels.RECORDS:
        sig = k.signature
        assert sig.kernel == k.name and sig.file == k.file and sig.names
        assert all(n.isidentifier() for n in sig.names) and len(set(sig.names)) == len(sig.names), k.name
        ends = [offset + size for offset, size in sig.layout]
        assert all(end <= offset for end, (offset, _) in zip(ends, sig.layout[1:])) and ends[-1] == sig.size, k.name


def test_the_multi_tensor_table_is_declared_once():
    """MULTI_CHUNK and MultiArgs are quantize.cu's: the table's arrays are read from its definition."""
    chunk = _kernels.MULTI_QUANTIZE.constant("MULTI_CHUNK")
    (table,) = _kernels.MULTI_QUANTIZE.signature.params
    assert chunk == 64 and table.ctype == "const MultiArgs"
    assert table.fields == (("x", chunk, "Q"), ("q", chunk, "Q"), ("scale", chunk, "Q"), ("amax", chunk, "Q"),
                            ("n", chunk, "q"), ("first_block", chunk + 1, "I"), ("count", 0, "i"))
    assert _kernels.MULTI_QUANTIZE.signature.size == 4 * 8 * chunk + 8 * chunk + 4 * (chunk + 1) + 4 == 2824
    with pytest.raises(ValueError, match=r"cuda/quantize.cu: no integer constexpr named MULTI_CHUNKS"):
        _kernels.MULTI_QUANTIZE.constant("MULTI_CHUNKS")


# ---- against the compiler --------------------------------------------------------------------------------------

def _canonical(ctype: str, source: "_signatures._Source", templates: dict[str, str]) -> str:
    """A parameter's C++ type as the demangler writes it: typedefs resolved, template arguments substituted,
    "const float*" as "float const*", a by-value parameter's own const dropped, fp8core:: left off."""
    pointer = ctype.endswith("*")
    words = ctype.rstrip("*").split()
    const = "const" in words
    base = " ".join(w for w in words if w != "const")
    base = templates.get(base, source.fundamental(base)).removeprefix("fp8core::")
    return f"{base}{' const' if const else ''}*" if pointer else base


def _demangle(names: list[str]) -> list[str]:
    done = subprocess.run([shutil.which("c++filt")], input="\n".join(names), capture_output=True, text=True,
                          check=True)
    return done.stdout.splitlines()


def _template_names(source: "_signatures._Source", kernel: str) -> list[str]:
    m = re.search(rf"template\s*<([^<>]*)>\s*__global__\s+void\s+(?:__launch_bounds__\s*\([^()]*\)\s*)?{kernel}\s*\(",
                  source.text)
    return [p.split()[-1] for p in m[1].split(",")] if m else []


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="c++filt (binutils) demangles NVRTC's names")
@pytest.mark.parametrize("filename", sorted(_kernels.KERNELS))
def test_signatures_match_the_compiled_kernels(filename):
    """Each instantiation's parameter types, in order, as NVRTC mangled them, against the signature read from the
    source (names are the source's alone; the emulated suite runs every launch site with them)."""
    pytest.importorskip("cupy", reason="cupy (fp8core[cuda13]) is not installed: NVRTC comes with it")
    _, mapping = _kernels.compile_cubin(filename, "90")
    source = _signatures._Source(_kernels.cuda_dir(), filename)
    records = [k for k in _kernels.RECORDS if k.file == filename]
    exprs = [(k, targs) for k in records for targs in k.instances]
    demangled = _demangle([mapping[k.expr(targs)] for k, targs in exprs])
    for (k, targs), text in zip(exprs, demangled):
        assert text.removeprefix("void ").startswith(f"{k.expr(targs)}("), text  # templates mangle the return type
        compiled = [t.strip().removeprefix("fp8core::") for t in text[text.rindex("(") + 1:-1].split(",")]
        templates = dict(zip(_template_names(source, k.name), map(_kernels._cxx, targs)))
        read = [_canonical(p.ctype, source, templates) for p in k.signature.params]
        assert read == compiled, k.expr(targs)


# ---- a launch names its arguments ------------------------------------------------------------------------------

def test_a_misspelt_name_is_refused_before_any_device(no_device):
    args = dict(QUANTIZE_ARGS)
    args["epsilion"] = args.pop("epsilon")
    with pytest.raises(TypeError, match=r"^quantize_kernel \(cuda/quantize.cu\): no argument for epsilon \(float\); no "
                                        r"parameter named epsilion; its parameters are x, q, scale, "):
        _kernels.QUANTIZE.launch(0, ("float32", 0), 16, 0, **args)


@pytest.mark.parametrize("change, error, match", [
    ({"scale_inv_out": None}, TypeError, r"argument scale_inv_out \(float\*\) cannot be None \(NoneType\)"),
    ({"margin": 1.5}, TypeError, r"argument margin \(int\) cannot be 1.5 \(float\)"),
    ({"n": 1 << 63}, ValueError, r"argument n \(i64\) cannot be 9223372036854775808 \(int\)"),
    ({"fp8_max": "448"}, TypeError, r"argument fp8_max \(float\) cannot be '448' \(str\)"),
])
def test_a_value_of_the_wrong_kind_is_refused_by_name(no_device, change, error, match):
    with pytest.raises(error, match=r"^quantize_kernel \(cuda/quantize.cu\): " + match):
        _kernels.QUANTIZE.launch(0, ("float32", 0), 16, 0, **{**QUANTIZE_ARGS, **change})


def test_missing_and_extra_names_are_refused(no_device):
    with pytest.raises(TypeError, match=r"^fill_kernel \(cuda/update.cu\): no argument for value \(u32\), n \(i64\); "):
        _kernels.FILL.launch(0, (), 1, 0, out=0x1000)
    with pytest.raises(TypeError, match=r"^fill_kernel \(cuda/update.cu\): no parameter named stride; its "
                                        r"parameters are out, value, n$"):
        _kernels.FILL.launch(0, (), 1, 0, out=0x1000, value=0, n=1, stride=4)


def test_a_by_value_struct_names_its_fields(no_device):
    chunk = _kernels.MULTI_AMAX.constant("MULTI_CHUNK")
    table = {"x": [0] * chunk, "q": [0] * chunk, "scale": [0] * chunk, "amax": [0] * chunk, "n": [0] * chunk,
             "first_block": [0] * (chunk + 1), "count": 1}
    sig = _kernels.MULTI_AMAX.signature
    params = sig.pack({"a": table})
    (address,) = (ctypes.c_void_p * 1).from_address(params)
    assert ctypes.string_at(address, sig.size) == struct.pack(sig.format, *[0] * (6 * chunk + 1), 1)
    with pytest.raises(ValueError, match=r"^multi_amax_kernel \(cuda/quantize.cu\): argument a.first_block must "
                                         r"hold 65 values \(its array length in const MultiArgs\), got 64$"):
        _kernels.MULTI_AMAX.launch(0, ("float32",), None, 0, a={**table, "first_block": [0] * chunk})
    with pytest.raises(TypeError, match=r"argument a \(const MultiArgs\) must map its fields x, q, scale, amax, n, "
                                        r"first_block, count to values; got \['amax', 'count', 'first_block', 'n', "
                                        r"'q', 'scale', 'tensors', 'x'\]"):
        _kernels.MULTI_AMAX.launch(0, ("float32",), None, 0, a={**table, "tensors": 1})
    with pytest.raises(TypeError, match=r"argument a.n\[1\] \(const MultiArgs\) cannot be 0.5 \(float\)"):
        _kernels.MULTI_AMAX.launch(0, ("float32",), None, 0, a={**table, "n": [0] + [0.5] * (chunk - 1)})
    with pytest.raises(TypeError, match=r"parameters are a$"):  # an option misspelt is an unknown argument
        _kernels.MULTI_AMAX.launch(0, ("float32",), None, 0, a=table, gird=1)


# ---- the reader refuses what it cannot read ------------------------------------------------------------------

def _read(tmp_path, source: str, kernel: str = "k") -> "_signatures.Signature":
    (tmp_path / "k.cu").write_text(source)
    return _signatures.read(tmp_path, "k.cu", kernel)


def test_a_struct_is_aligned_as_cxx_aligns_it(tmp_path):
    sig = _read(tmp_path, "using idx = long long;\nstatic constexpr int N = 3;\n"
                          "struct S { int a; idx b[(N * 4 + 1) / 2]; char c[1 << 2]; };\n"
                          "__global__ void k(int first, const __grid_constant__ S s, float last) {}\n")
    assert sig.layout == [(0, 4), (8, 64), (72, 4)] and sig.constants["N"] == 3


WHERE = r"^k \(cuda/k.cu\): "


@pytest.mark.parametrize("source, match", [
    ("template <typename T> __global__ void k(T x) {}", WHERE + r"parameter x: C\+\+ type 'T' has no fixed layout"),
    ("__global__ void k(float* grid) {}", WHERE + r"parameter grid cannot be passed by name to Kernel.launch"),
    ("__global__ void k(int a, float a) {}", WHERE + r"two parameters named a"),
    ("__global__ void k(Pair<int, int> p) {}", WHERE + r"parameter 'Pair<int' is not 'type name'"),
    ("__global__ void j(int a) {}", WHERE + r"no '__global__ void k\(' in the source"),
    ("template <typename T> __global__ void __launch_bounds__(256, sizeof(T) == 4 ? 2 : 3) k(int a) {}",
     WHERE + r"its __launch_bounds__ holds parentheses, which the signature reader does not read"),
    ("constexpr int N = 1;\nconstexpr int N = 2;\nstruct S { int v[N]; };\n__global__ void k(S s) {}",
     r"^cuda/k.cu: more than one constexpr named N"),
])
def test_the_reader_refuses_by_name(tmp_path, source, match):
    with pytest.raises(ValueError, match=match):
        _read(tmp_path, source)


# ---- every launch site, read from the source -----------------------------------------------------------------

def _keywords(call: ast.Call, function: ast.AST) -> tuple[set, dict]:
    """The keyword names a launch call passes (a ``**name`` resolved through the dict literal assigned to it in
    the same function), and the keys of each dict literal passed by keyword."""
    literals = {t.id: node.value for node in ast.walk(function) if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name) and isinstance(node.value, ast.Dict)}
    names, keys = set(), {}
    for kw in call.keywords:
        value = kw.value if kw.arg else literals[kw.value.id]
        if kw.arg is None:
            names |= {k.value for k in value.keys}
        else:
            names.add(kw.arg)
            if isinstance(value, ast.Dict):
                keys[kw.arg] = {k.value for k in value.keys}
    return names - _signatures.RESERVED, keys


def _launch_sites():
    """(record, keyword names, dict keys, where) of every ``<record>.launch(...)`` in the CUDA backend; a launch
    through a parameter (``kernel.launch``) stands for each record its function is called with."""
    records = {name: k for name, k in vars(_kernels).items() if isinstance(k, _kernels.Kernel)}
    for path in sorted((ROOT / "fp8core" / "backends").glob("cuda*.py")):
        tree = ast.parse(path.read_text())
        functions = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)]
        passed = {}  # function -> the records passed as its first argument
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.args and \
                    isinstance(call.args[0], ast.Name) and call.args[0].id in records:
                passed.setdefault(call.func.id, set()).add(call.args[0].id)
        for function in functions:
            for call in ast.walk(function):
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                        and call.func.attr == "launch" and isinstance(call.func.value, ast.Name)):
                    continue
                receiver = call.func.value.id
                names, keys = _keywords(call, function)
                for record in [receiver] if receiver in records else sorted(passed[function.name]):
                    yield records[record], names, keys, f"{path.name}:{call.lineno} ({record})"


def test_every_launch_site_names_its_kernels_parameters():
    """Checked from the source (the emulated suite also runs each one): each launch in backends/cuda*.py passes
    exactly its kernel's parameters by name, a by-value struct exactly its fields; every record is launched."""
    launched = set()
    for record, names, keys, where in _launch_sites():
        sig = record.signature
        assert names == set(sig.names), f"{where}: unknown {names - set(sig.names)}, missing {set(sig.names) - names}"
        for p in sig.params:
            if p.fields:
                assert keys[p.name] == {f for f, _, _ in p.fields}, f"{where}: the fields of {p.name}"
        launched.add(record.name)
    assert launched == {k.name for k in _kernels.RECORDS}
