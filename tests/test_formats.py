"""The encoding rows of fp8core.formats against the libraries that define the same encodings: every code of every
row decodes (from the row's fields alone) to the value ml_dtypes gives it, max, NaN and inf codes, E2M1's packing
against ml_dtypes.float4_e2m1fn, and each row's names and type codes in torch, JAX, DLPack and cuBLASLt."""

import ctypes
import pickle

import ml_dtypes
import numpy as np
import pytest

import fp8core
from fp8core import Format, _kernels, _oracle
from fp8core.formats import E2M1, E4M3, E5M2, E8M0, ENCODINGS, ROWS, Encoding

IDS = [row.name for row in ROWS]


def _ml_values(row: Encoding) -> np.ndarray:
    """float64 value ml_dtypes gives every code of the row (its type holds one code per byte)."""
    return np.arange(1 << row.bits, dtype=np.uint8).view(row.numpy_dtype).astype(np.float64)


def test_the_table():
    assert ROWS == (E4M3, E5M2, E8M0, E2M1) and len({row.name for row in ROWS}) == len(ROWS)
    assert [row.index for row in ROWS if row.index is not None] == [0, 1]  # the kernels' instantiations
    assert list(ENCODINGS.values()) == [E4M3, E5M2]
    assert E4M3.nan_cast == E5M2.nan_cast == 0x7F and E2M1.nan_cast == 0x7  # the contract's NaN codes
    for row in ROWS:
        assert pickle.loads(pickle.dumps(row)) is row and repr(row) == f"Encoding({row.name})"
        assert 1 + row.exponent_bits + row.mantissa_bits - (not row.signed) == row.bits
        assert row.elements_per_byte * row.bits == 8 and row.storage_dtype == np.uint8


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_every_code_decodes_as_in_ml_dtypes(row):
    ours, theirs = row.values, _ml_values(row)
    assert not ours.flags.writeable
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    finite = ~np.isnan(theirs)
    np.testing.assert_array_equal(ours[finite].view(np.uint64), theirs[finite].view(np.uint64))  # -0.0 too


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_max_smallest_inf_and_nan_as_in_ml_dtypes(row):
    info, v = ml_dtypes.finfo(row.numpy_dtype), _ml_values(row)
    assert row.max == float(info.max) and row.values[row.max_code] == row.max
    assert row.smallest == float(info.smallest_subnormal) and row.emax == int(np.log2(float(info.max)))
    assert row.nan_codes == tuple(int(c) for c in np.flatnonzero(np.isnan(v)))
    assert row.has_inf == bool(np.isinf(v).any())
    # the saturation rule: +max is the largest finite value; NaN casts to a NaN code, or to +max without one
    assert row.max_code == int(np.flatnonzero(v == np.nanmax(v[np.isfinite(v)]))[0])
    assert row.nan_cast in row.nan_codes if row.nan_codes else row.nan_cast == row.max_code
    if row.signed:
        sign = 1 << (row.bits - 1)
        assert row.values[sign | row.max_code] == -row.max


@pytest.mark.parametrize("row", [E4M3, E5M2], ids=["E4M3", "E5M2"])
def test_the_fp8_cast_saturates_as_the_row_says(row):
    x = np.array([np.inf, -np.inf, 1e30, -1e30, np.nan, -np.nan, row.max], np.float32)
    sign = 1 << (row.bits - 1)
    want = [row.max_code, sign | row.max_code, row.max_code, sign | row.max_code, row.nan_cast, row.nan_cast,
            row.max_code]
    np.testing.assert_array_equal(fp8core.quantize(x, 1.0, row.dtype_name).view(np.uint8), want)


def test_the_kernels_nan_rule_is_the_rows():
    """common.cuh reads a NaN from HAS_INF/HAS_NAN (_kernels.module_options): with inf, the all-ones exponent with
    a mantissa; without, the all-ones magnitude. Each row the kernels convert must say the same."""
    for row in (r for r in ROWS if r.index is not None):
        codes = np.arange(1 << row.bits)
        magnitude = codes & ((1 << (row.bits - 1)) - 1)
        exponent, mantissa = magnitude >> row.mantissa_bits, codes & ((1 << row.mantissa_bits) - 1)
        if row.has_inf:
            nan = (exponent == (1 << row.exponent_bits) - 1) & (mantissa != 0)
        else:
            nan = (magnitude == (1 << (row.bits - 1)) - 1) & bool(row.nan_codes)
        assert tuple(int(c) for c in np.flatnonzero(nan)) == row.nan_codes
    define = [o for o in _kernels.module_options(False) if o.startswith("-DFP8CORE_ENCODINGS=")]
    assert define == ["-DFP8CORE_ENCODINGS=FP8CORE_ENCODING(E4M3,0,4,3,7,126,0,1,127)"
                      "FP8CORE_ENCODING(E5M2,1,5,2,15,123,1,1,127)"]



def test_the_fp4_kernels_read_e2m1_from_its_row():
    """common.cuh declares E2M1 from FP8CORE_FP4_ENCODINGS (its own template index, outside the FP8 kernels'
    instantiations): layout 1-2-1, bias 1, +max code 7 (6.0), no inf, no NaN, NaN cast to 0x7."""
    define = [o for o in _kernels.module_options(False) if o.startswith("-DFP8CORE_FP4_ENCODINGS=")]
    assert define == ["-DFP8CORE_FP4_ENCODINGS=FP8CORE_ENCODING(E2M1,16,2,1,1,7,0,0,7)"]
    assert E2M1.index is None and 16 not in [r.index for r in ROWS]

def test_e2m1_packing_against_ml_dtypes():
    """Two codes a byte along the row, element 2j in bits 0-3 of byte j (NUMERICS.md "FP4: E2M1"): ml_dtypes'
    float4_e2m1fn holds one code a byte, and its values come back through pack and unpack."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((3, 64)) * 3).astype(np.float32)
    x[0, :16] = E2M1.values[:16]  # every code, in order
    codes = x.astype(ml_dtypes.float4_e2m1fn)  # ml_dtypes: round to nearest even, as the codes are
    packed = E2M1.pack(codes)
    c8 = codes.view(np.uint8)
    assert packed.dtype == np.uint8 and packed.shape == E2M1.storage_shape(x.shape) == (3, 32)
    np.testing.assert_array_equal(packed, c8[:, 0::2] | (c8[:, 1::2] << 4))
    np.testing.assert_array_equal(packed[0, :8], [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE])
    unpacked = E2M1.unpack(packed)
    np.testing.assert_array_equal(unpacked, c8)
    np.testing.assert_array_equal(E2M1.values[unpacked], unpacked.view(ml_dtypes.float4_e2m1fn).astype(np.float64))
    with pytest.raises(ValueError, match="^shape: E2M1 packs 2 elements a byte"):
        E2M1.storage_shape((4, 3))
    for row in (E4M3, E5M2, E8M0):
        assert row.storage_shape((4, 3)) == (4, 3)
        np.testing.assert_array_equal(row.unpack(row.pack(c8)), c8)


def _dlpack_dtype(tensor) -> tuple[int, int, int]:
    """(code, bits, lanes) of a torch tensor's legacy DLPack capsule."""
    class DataType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", ctypes.c_int32 * 2), ("ndim", ctypes.c_int32),
                    ("dtype", DataType)]

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    capsule = tensor.__dlpack__()
    d = DLTensor.from_address(get(capsule, b"dltensor")).dtype
    return d.code, d.bits, d.lanes


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_names_in_torch_and_their_dlpack_codes(row):
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, dtype=torch.uint8).view(row.torch_dtype)
    assert row.torch_dtype is getattr(torch, row.torch_name) and t.element_size() == 1
    assert _dlpack_dtype(t) == (row.dlpack_code, row.bits, row.elements_per_byte)


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_names_in_jax(row):
    pytest.importorskip("jax")
    assert np.dtype(row.jax_dtype) == row.numpy_dtype


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_cublaslt_type_codes(row):
    nvmath = pytest.importorskip("nvmath")
    names = {"E4M3": "CUDA_R_8F_E4M3", "E5M2": "CUDA_R_8F_E5M2", "E8M0": "CUDA_R_8F_UE8M0", "E2M1": "CUDA_R_4F_E2M1"}
    known = getattr(nvmath.CudaDataType, names[row.name], None)
    if known is None:  # nvmath-python 1.0 lacks CUDA_R_8F_UE8M0 (30 in CUDA 12.8+'s library_types.h)
        pytest.skip(f"nvmath.CudaDataType has no {names[row.name]}")
    assert row.cuda_data_type == int(known)


def test_formats_are_recipe_choices_over_the_rows():
    assert (Format.E4M3.encoding, Format.E5M2.encoding) == (E4M3, E5M2)
    for f, fwd, bwd in ((Format.E4M3, E4M3, E4M3), (Format.E5M2, E5M2, E5M2), (Format.HYBRID, E4M3, E5M2)):
        assert (f.fwd.encoding, f.bwd.encoding) == (fwd, bwd)
    assert Format.E4M3.max_code == E4M3.max_code and Format.E5M2.torch_dtype is E5M2.torch_dtype
    with pytest.raises(ValueError, match="^fmt: HYBRID is a recipe"):
        Format.HYBRID.max_code  # noqa: B018


def test_the_oracle_states_the_same_formats():
    """fp8core._oracle keeps its own statement of E4M3 and E5M2 (a second implementation): it agrees with the rows."""
    for f, row in ENCODINGS.items():
        assert _oracle.SPECS[f.value] == (row.exponent_bits, row.mantissa_bits, row.bias, row.max, row.has_inf)
        assert _oracle.DTYPES[row.dtype_name] == f.value
        np.testing.assert_array_equal(_oracle.decode(f.value), row.values)
