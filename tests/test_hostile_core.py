"""The core API under hostile input (issue 28): one row per probe, so none comes back.

ERRORS: the call, the error type, the argument its message starts with and a fragment of what was expected.
RESULTS: a call that must give exactly (bit for bit) what its twin gives, the twin reached another way.
FLUSHING: a call run while the thread flushes subnormals (torch.set_flush_denormal), against the same call in
the default mode. Every check runs before dispatch (fp8core.args, used by ops/blocks/gemm/scaling), so the CPU
backend's errors are the GPU's.
"""

from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest

import fp8core
from fp8core import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, ScalingState, as_format,
                     compute_scale, quantize, quantize_blockwise, quantize_dynamic, quantize_mxfp8)
from producers import DLPackOnly
from test_fpenv import flush_denormal

pytestmark = pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix, on purpose

X = np.random.default_rng(28).standard_normal((64, 64)).astype(np.float32)
Q = quantize(X, 1.0)  # fp8 E4M3 [64, 64]
ONE = np.ones(1, np.float32)
F32_MAX = float(np.finfo(np.float32).max)


def _returning(value):
    """A reduce hook that returns the reduced amaxes (a functional all-reduce)."""
    return lambda a: np.full(np.shape(a), value, np.float32)


def _writing(value):
    """A reduce hook that reduces in place (torch.distributed.all_reduce's way)."""
    def reduce(a):
        a[...] = value
    return reduce


ERRORS = [
    # 1. booleans are booleans: 'False', 0, 1 and None are not read by their truthiness
    ("columnwise 'False'", lambda: quantize_mxfp8(X, columnwise="False"), TypeError, "columnwise", "a bool"),
    ("columnwise 1", lambda: quantize_mxfp8(X, columnwise=1), TypeError, "columnwise", "a bool"),
    ("columnwise None", lambda: quantize_mxfp8(X, columnwise=None), TypeError, "columnwise", "a bool"),
    ("quantize_dynamic power_of_2 'False'", lambda: quantize_dynamic(X, power_of_2="False"), TypeError,
     "power_of_2", "a bool"),
    ("compute_scale power_of_2 0", lambda: compute_scale(ONE, "e4m3", power_of_2=0), TypeError, "power_of_2",
     "a bool"),
    ("quantize_blockwise power_of_2 'True'", lambda: quantize_blockwise(X, power_of_2="True"), TypeError,
     "power_of_2", "a bool"),
    ("gemm use_fast_accum 'False'", lambda: fp8core.gemm(Q, Q, 1.0, 1.0, use_fast_accum="False"), TypeError,
     "use_fast_accum", "a bool"),
    ("gemm use_fast_accum None", lambda: fp8core.gemm(Q, Q, 1.0, 1.0, use_fast_accum=None), TypeError,
     "use_fast_accum", "a bool"),
    ("DelayedScaling power_of_2 'False'", lambda: DelayedScaling(power_of_2="False"), TypeError, "power_of_2",
     "a bool"),
    ("DelayedScaling reduce_amax 0", lambda: DelayedScaling(reduce_amax=0), TypeError, "reduce_amax", "a bool"),
    ("Float8CurrentScaling power_of_2 None", lambda: Float8CurrentScaling(power_of_2=None), TypeError,
     "power_of_2", "a bool"),
    ("Float8BlockScaling power_of_2 'yes'", lambda: Float8BlockScaling(power_of_2="yes"), TypeError,
     "power_of_2", "a bool"),
    ("as_format allow_hybrid 'no'", lambda: as_format("hybrid", allow_hybrid="no"), TypeError, "allow_hybrid",
     "a bool"),
    # 2. epsilon: a float >= 0 that is finite in float32, by one rule at every door
    ("DelayedScaling epsilon 1e300", lambda: DelayedScaling(epsilon=1e300), ValueError, "epsilon",
     "finite float32"),
    ("Float8CurrentScaling amax_epsilon 3.5e38", lambda: Float8CurrentScaling(amax_epsilon=3.5e38), ValueError,
     "amax_epsilon", "finite float32"),
    ("Float8BlockScaling epsilon inf", lambda: Float8BlockScaling(epsilon=math.inf), ValueError, "epsilon",
     "finite float32"),
    ("quantize_dynamic epsilon 1e300", lambda: quantize_dynamic(X, epsilon=1e300), ValueError, "epsilon",
     "finite float32"),
    ("quantize_dynamic epsilon 3.5e38", lambda: quantize_dynamic(X, epsilon=3.5e38), ValueError, "epsilon",
     "at most 3.4028235e+38"),
    ("quantize_dynamic epsilon 10**400", lambda: quantize_dynamic(X, epsilon=10 ** 400), ValueError, "epsilon",
     "too large for a float"),
    ("quantize_blockwise epsilon 3.5e38", lambda: quantize_blockwise(X, epsilon=3.5e38), ValueError, "epsilon",
     "finite float32"),
    ("compute_scale epsilon 3.5e38", lambda: compute_scale(ONE, "e4m3", epsilon=3.5e38), ValueError, "epsilon",
     "finite float32"),
    ("compute_scale epsilon NaN", lambda: compute_scale(ONE, "e4m3", epsilon=math.nan), ValueError, "epsilon",
     ">= 0"),
    ("compute_scale epsilon -1e-45", lambda: compute_scale(ONE, "e4m3", epsilon=-1e-45), ValueError, "epsilon",
     ">= 0"),
    ("DelayedScaling epsilon '0'", lambda: DelayedScaling(epsilon="0"), TypeError, "epsilon", "a float"),
    # 3. reduce: refused when it gives a negative (or malformed) amax, whichever way it gives it
    ("quantize_dynamic reduce returns -1", lambda: quantize_dynamic(X, reduce=_returning(-1.0)), ValueError,
     "reduce", "negative amax (-1.0)"),
    ("quantize_dynamic reduce writes -2", lambda: quantize_dynamic(X, reduce=_writing(-2.0)), ValueError,
     "reduce", "negative amax (-2.0)"),
    ("quantize_dynamic reduce returns -0.0", lambda: quantize_dynamic(X, reduce=_returning(-0.0)), ValueError,
     "reduce", "negative amax (-0.0)"),
    ("quantize_dynamic reduce returns -inf", lambda: quantize_dynamic(X, reduce=_returning(-np.inf)), ValueError,
     "reduce", "negative amax (-inf)"),
    ("quantize_dynamic reduce returns 2 values", lambda: quantize_dynamic(X, reduce=lambda a: np.ones(2, np.float32)),
     ValueError, "reduce", "returned 2 float32 values"),
    ("quantize_dynamic reduce returns float64", lambda: quantize_dynamic(X, reduce=lambda a: np.ones(1)),
     ValueError, "reduce", "returned 1 float64 values"),
    ("quantize_dynamic reduce returns a str", lambda: quantize_dynamic(X, reduce=lambda a: "max"), TypeError,
     "reduce", "returned str"),
    ("ScalingState.update reduce not callable", lambda: ScalingState(2).update(reduce=3), TypeError, "reduce",
     "a callable"),
    # 4. unclear errors, now naming the argument
    ("quantize scale 10**400", lambda: quantize(X, 10 ** 400), ValueError, "scale", "too large for a float"),
    ("cast_transpose scale -10**400", lambda: fp8core.cast_transpose(X, -10 ** 400), ValueError, "scale",
     "too large for a float"),
    ("dequantize scale_inv 10**400", lambda: fp8core.dequantize(Q, 10 ** 400), ValueError, "scale_inv",
     "too large for a float"),
    ("gemm a_scale_inv 10**400", lambda: fp8core.gemm(Q, Q, 10 ** 400, 1.0), ValueError, "a_scale_inv",
     "too large for a float"),
    ("compute_scale amax 10**400", lambda: compute_scale(10 ** 400, "e4m3"), ValueError, "amax",
     "too large for a float"),
    ("compute_scale previous 1e-46", lambda: compute_scale(ONE, "e4m3", previous=1e-46), ValueError, "previous",
     "is 0.0 in float32"),
    ("compute_scale previous 1e39", lambda: compute_scale(ONE, "e4m3", previous=1e39), ValueError, "previous",
     "is inf in float32"),
    ("compute_scale previous 10**400", lambda: compute_scale(ONE, "e4m3", previous=10 ** 400), ValueError,
     "previous", "too large for a float"),
    ("ScalingState 2**62 tensors", lambda: ScalingState(2 ** 62), ValueError, "num_tensors",
     "an int in [1, 2147483647]"),
    ("ScalingState 0 tensors", lambda: ScalingState(0), ValueError, "num_tensors", "an int in [1, "),
    ("DelayedScaling amax_history_len 2**62", lambda: DelayedScaling(amax_history_len=2 ** 62), ValueError,
     "amax_history_len", "an int in [1, 2147483647]"),
    # (L + 2) * N elements beyond what an array can index: refused by NumPy before any allocation is tried
    ("ScalingState too big to allocate",
     lambda: ScalingState(2 ** 31 - 1, DelayedScaling(amax_history_len=2 ** 31 - 1)), MemoryError,
     "num_tensors, amax_history_len", "could not be allocated"),
    ("ScalingState device 'gpu'", lambda: ScalingState(2, device="gpu"), ValueError, "device", "'cuda:N'"),
]


@pytest.mark.parametrize("case,call,exc,arg,fragment", ERRORS, ids=[r[0] for r in ERRORS])
def test_refused_by_name(case, call, exc, arg, fragment):
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{arg}: "), message
    assert fragment in message, message


def _bits(value) -> list:
    """Every array in a result (tuples and NamedTuples unpacked) as (dtype, shape, bytes)."""
    if isinstance(value, (tuple, list)):
        return [b for v in value for b in _bits(v)]
    a = np.asarray(value)
    assert type(value) is np.ndarray or np.isscalar(value), f"numpy in, numpy out: got {type(value).__name__}"
    return [(a.dtype.str, a.shape, a.tobytes())]


def _reduce_in_place(value):
    return quantize_dynamic(X, reduce=_writing(value))


with warnings.catch_warnings():
    warnings.simplefilter("ignore", PendingDeprecationWarning)
    M = np.matrix(X)
    QM = np.matrix(Q)

RESULTS = [
    # NumPy bools are bools
    ("columnwise np.bool_(True)", lambda: quantize_mxfp8(X, columnwise=np.bool_(True)),
     lambda: quantize_mxfp8(X, columnwise=True)),
    ("use_fast_accum np.bool_(False)", lambda: fp8core.gemm(Q, Q, 1.0, 1.0, use_fast_accum=np.bool_(False)),
     lambda: fp8core.gemm(Q, Q, 1.0, 1.0)),
    ("DelayedScaling power_of_2 np.bool_", lambda: DelayedScaling(power_of_2=np.bool_(True)).power_of_2,
     lambda: True),
    # epsilon at the float32 bound is taken (as float32's max, however it is spelled)
    ("epsilon 3.4028235e38", lambda: quantize_dynamic(X, epsilon=3.4028235e38),
     lambda: quantize_dynamic(X, epsilon=np.finfo(np.float32).max)),
    ("DelayedScaling epsilon np.float32", lambda: DelayedScaling(epsilon=np.float32(0.5)).epsilon, lambda: 0.5),
    # reduce: one rule. A returned array is taken, as an in-place reduce is; NaN is an amax (no scale: 1.0)
    ("quantize_dynamic reduce returns 1000", lambda: quantize_dynamic(X, reduce=_returning(1000.0)),
     lambda: _reduce_in_place(1000.0)),
    ("quantize_dynamic reduce returns its argument", lambda: quantize_dynamic(X, reduce=lambda a: a),
     lambda: quantize_dynamic(X)),
    ("quantize_dynamic reduce returns NaN", lambda: quantize_dynamic(X, reduce=_returning(np.nan))[:2],
     lambda: (quantize(X, 1.0), ONE)),
    ("quantize_dynamic reduce's scale", lambda: quantize_dynamic(X, reduce=_returning(1000.0))[1],
     lambda: compute_scale(np.float32([1000.0]), "e4m3")[1]),
    # np.matrix is read as the 2-D ndarray over its memory, and the results are ndarrays
    ("amax np.matrix", lambda: fp8core.amax(M), lambda: fp8core.amax(X)),
    ("quantize np.matrix", lambda: quantize(M, 2.0), lambda: quantize(X, 2.0)),
    ("quantize_dynamic np.matrix", lambda: quantize_dynamic(M), lambda: quantize_dynamic(X)),
    ("cast_transpose np.matrix", lambda: fp8core.cast_transpose(M, 2.0), lambda: fp8core.cast_transpose(X, 2.0)),
    ("dequantize np.matrix", lambda: fp8core.dequantize(QM, 0.5), lambda: fp8core.dequantize(Q, 0.5)),
    ("transpose np.matrix", lambda: fp8core.transpose(QM), lambda: fp8core.transpose(Q)),
    ("quantize_mxfp8 np.matrix", lambda: quantize_mxfp8(M, columnwise=True),
     lambda: quantize_mxfp8(X, columnwise=True)),
    ("quantize_blockwise np.matrix", lambda: quantize_blockwise(M), lambda: quantize_blockwise(X)),
    ("multi_amax np.matrix", lambda: fp8core.multi_amax([M, M[:3]]), lambda: fp8core.multi_amax([X, X[:3]])),
    ("amax masked array (read as np.asarray reads it)", lambda: fp8core.amax(np.ma.masked_array(X, mask=X > 1)),
     lambda: fp8core.amax(np.asarray(np.ma.masked_array(X, mask=X > 1)))),
    ("gemm np.matrix", lambda: fp8core.gemm(QM, QM, 1.0, 1.0), lambda: fp8core.gemm(Q, Q, 1.0, 1.0)),
    ("quantize out= np.matrix", lambda: _into_matrix(), lambda: quantize(X, 2.0)),
    # a Python int scale within float range is a float: 10**39 is inf in float32, as 1e39 is
    ("quantize scale 10**39", lambda: quantize(X, 10 ** 39), lambda: quantize(X, np.float32(np.inf))),
    ("ScalingState np.int64 tensors", lambda: ScalingState(np.int64(3)).state_dict()["scale"],
     lambda: ScalingState(3).state_dict()["scale"]),
]


def _into_matrix():
    out = np.matrix(np.zeros(X.shape, ml_dtypes.float8_e4m3fn))
    assert quantize(X, 2.0, out=out) is out
    return np.asarray(out)


@pytest.mark.parametrize("case,call,twin", RESULTS, ids=[r[0] for r in RESULTS])
def test_same_as_twin(case, call, twin):
    assert _bits(call()) == _bits(twin())


@pytest.mark.parametrize("read", [lambda a: a, DLPackOnly], ids=["NumPy reader", "DLPack reader"])
def test_ndarray_subclasses_alike_on_both_readers(read):
    assert _bits(quantize(read(M), 2.0)) == _bits(quantize(X, 2.0))
    assert _bits(fp8core.amax(read(M))) == _bits(fp8core.amax(X))
    assert _bits(fp8core.amax(read(np.ma.masked_array(X, mask=X > 1)))) == _bits(fp8core.amax(X))  # as np.asarray


# ---- reduce refused: nothing written --------------------------------------------------------------------------

def _stepped_state() -> ScalingState:
    s = ScalingState(3, DelayedScaling(amax_history_len=4))
    for i in range(3):
        s.quantize(X * (i + 1), i)
    s.update()
    s.quantize(X, 0)
    return s


@pytest.mark.parametrize("reduce", [_returning(-1.0), _writing(-1.0), _returning(-0.0),
                                    lambda a: np.array([5.0, -1e-39, 1.0], np.float32)],
                         ids=["returns -1", "writes -1", "returns -0.0", "returns a negative subnormal"])
def test_update_refuses_a_negative_reduced_amax_and_writes_nothing(reduce):
    s, twin = _stepped_state(), _stepped_state()
    with pytest.raises(ValueError, match=r"^reduce: gave a negative amax"):
        s.update(reduce=reduce)
    assert s.steps == twin.steps
    assert _bits(s.state_dict()["amax_history"]) == _bits(twin.state_dict()["amax_history"])
    assert _bits(s.buffer) == _bits(twin.buffer)
    s.load_state_dict(s.state_dict())  # the state's own state_dict still loads
    s.update()
    twin.update()
    assert _bits(s.buffer) == _bits(twin.buffer)


def test_update_takes_a_returned_array_as_it_takes_an_in_place_reduce():
    s, twin = _stepped_state(), _stepped_state()
    s.update(reduce=lambda a: np.array([7.0, 0.0, 3.0], np.float32))
    twin.update(reduce=_writing(np.array([7.0, 0.0, 3.0], np.float32)))
    assert _bits(s.buffer) == _bits(twin.buffer) and s.steps == twin.steps


class _Handle:
    """An async reduce's handle (torch.distributed's Work): the amaxes are reduced when it is waited on."""

    def __init__(self, a, value):
        self.a, self.value = a, value

    def wait(self):
        self.a[...] = self.value


@pytest.mark.parametrize("value", [1000.0, -1.0], ids=["1000", "-1 (refused)"])
def test_an_async_handle_is_waited_on_then_checked(value):
    def run(reduce):
        try:
            return quantize_dynamic(X, reduce=reduce)
        except ValueError as e:
            return str(e)

    assert _bits(run(lambda a: _Handle(a, value))) == _bits(run(_writing(value)))


def _torch_state():
    torch = pytest.importorskip("torch")
    s = ScalingState(3, DelayedScaling(amax_history_len=4), buffer=torch.zeros(4 * 3 + 2 * 3))
    for i in range(3):
        s.quantize(torch.from_numpy(X * (i + 1)), i)
    return s


def test_a_torch_state_takes_a_returned_tensor_and_refuses_a_negative_one():
    torch = pytest.importorskip("torch")
    s, twin = _torch_state(), _torch_state()
    s.update(reduce=lambda row0: torch.full_like(row0, 7.0))  # a functional all-reduce's result
    twin.update(reduce=lambda row0: row0.fill_(7.0))
    assert torch.equal(s.buffer.view(torch.int32), twin.buffer.view(torch.int32))
    before = s.buffer.clone()
    for reduce in (lambda row0: torch.full_like(row0, -7.0), lambda row0: row0.fill_(-7.0)):
        with pytest.raises(ValueError, match=r"^reduce: gave a negative amax \(-7.0\)"):
            s.update(reduce=reduce)
        assert torch.equal(s.buffer.view(torch.int32), before.view(torch.int32)) and s.steps == twin.steps


def test_quantize_dynamic_reduce_refused_leaves_out_amax_as_the_local_amax():
    q, s_inv, a = np.zeros(X.shape, ml_dtypes.float8_e4m3fn), np.full(1, 9.0, np.float32), np.zeros(1, np.float32)
    with pytest.raises(ValueError, match=r"^reduce: "):
        quantize_dynamic(X, reduce=_returning(-1.0), out=(q, s_inv, a))
    assert not q.view(np.uint8).any() and s_inv[0] == 9.0  # nothing made from the refused amax
    assert _bits(a) == _bits(fp8core.amax(X))


# ---- the device: a clear error where CUDA cannot run ----------------------------------------------------------

def test_state_on_a_cuda_device_without_a_driver_says_so(monkeypatch):
    cupy = pytest.importorskip("cupy")

    def no_driver():
        raise cupy.cuda.runtime.CUDARuntimeError(35)  # cudaErrorInsufficientDriver

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", no_driver)
    for device in ("cuda:0", "cuda"):
        with pytest.raises(RuntimeError, match=r"^device: '.*' has no usable CUDA GPU here"):
            ScalingState(2, device=device)


def test_state_on_a_missing_cuda_device_names_it(monkeypatch):
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 1)
    with pytest.raises(ValueError, match=r"^device: 'cuda:7', but this machine has 1 CUDA device"):
        ScalingState(2, device="cuda:7")


# ---- flush-to-zero changes no result, a refusal included ------------------------------------------------------

TINY = np.array([1e-39], np.float32)  # made here, in the default mode
NEG_TINY = np.array([-1e-39], np.float32)
ZEROS = np.zeros(3, np.float32)


def _updated_with_tiny_scales(algo=lambda a, s, m, r: np.full(3, TINY[0])):
    s = _stepped_state()
    s.recipe = DelayedScaling(amax_history_len=4, scaling_factor_compute_algo=algo)
    s.update()
    return s.buffer.copy()


def _tiny_amax_update():
    s = _stepped_state()
    s.recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=lambda h: np.full(3, TINY[0]))
    s.update()
    return s.buffer.copy()


def _load_tiny_scale():
    s = ScalingState(3, DelayedScaling(amax_history_len=2))
    state = s.state_dict()
    state["scale"] = np.full(3, TINY[0])
    state["scale_inv"] = np.full(3, TINY[0])
    s.load_state_dict(state)
    return s.buffer.copy()


FLUSHING = [
    ("compute_scale previous 1e-39", lambda: compute_scale(ZEROS, "e4m3", previous=TINY)),
    ("compute_scale previous 1e-39 as a Python float", lambda: compute_scale(ZEROS, "e4m3", previous=1e-39)),
    ("scaling_factor_compute_algo returns 1e-39", _updated_with_tiny_scales),
    ("scaling_factor_compute_algo returns Python floats 1e-39",
     lambda: _updated_with_tiny_scales(lambda a, s, m, r: [1e-39] * 3)),
    ("amax_compute_algo returns 1e-39", _tiny_amax_update),
    ("load_state_dict scale 1e-39", _load_tiny_scale),
    ("reduce returns 1e-39", lambda: quantize_dynamic(X, reduce=lambda a: TINY.copy())),
    ("quantize_dynamic epsilon 1e-39", lambda: quantize_dynamic(X * 0, epsilon=1e-39)),
]


@pytest.mark.parametrize("case,call", FLUSHING, ids=[r[0] for r in FLUSHING])
def test_flushing_changes_nothing(case, call):
    want = _bits(call())
    with flush_denormal():
        got = _bits(call())
    assert got == want


REFUSED_FLUSHING = [
    ("compute_scale previous -1e-39", lambda: compute_scale(ZEROS, "e4m3", previous=NEG_TINY), ValueError,
     "previous", "got -1e-39"),
    ("reduce returns -1e-39", lambda: quantize_dynamic(X, reduce=lambda a: NEG_TINY.copy()), ValueError, "reduce",
     "negative amax (-1e-39)"),
]


@pytest.mark.parametrize("case,call,exc,arg,fragment", REFUSED_FLUSHING, ids=[r[0] for r in REFUSED_FLUSHING])
def test_refused_the_same_while_flushing(case, call, exc, arg, fragment):
    test_refused_by_name(case, call, exc, arg, fragment)
    with flush_denormal():
        test_refused_by_name(case, call, exc, arg, fragment)
