"""Recipes refuse bad fields at construction, naming the field; good values are stored as plain Python types."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import fp8core
from fp8core import DelayedScaling, Float8CurrentScaling, Format
from fp8core.args import MAX_MARGIN

NAN, INF = float("nan"), float("inf")

DELAYED_BAD = [
    (dict(epsilon=INF), ValueError, "epsilon"),
    (dict(epsilon=NAN), ValueError, "epsilon"),
    (dict(epsilon=-1e-12), ValueError, "epsilon"),
    (dict(epsilon="0"), TypeError, "epsilon"),
    (dict(epsilon=True), TypeError, "epsilon"),
    (dict(amax_history_len=True), TypeError, "amax_history_len"),
    (dict(amax_history_len=0), ValueError, "amax_history_len"),
    (dict(amax_history_len=16.0), TypeError, "amax_history_len"),
    (dict(amax_history_len="16"), TypeError, "amax_history_len"),
    (dict(interval=True), TypeError, "interval"),
    (dict(interval=0), ValueError, "interval"),
    (dict(interval=-3), ValueError, "interval"),
    (dict(interval=2.5), TypeError, "interval"),
    (dict(margin=True), TypeError, "margin"),
    (dict(margin=1.0), TypeError, "margin"),
    (dict(margin="1"), TypeError, "margin"),
    (dict(margin=MAX_MARGIN + 1), ValueError, "margin"),
    (dict(margin=-MAX_MARGIN - 1), ValueError, "margin"),
    (dict(margin=10 ** 6), ValueError, "margin"),
    (dict(power_of_2="False"), TypeError, "power_of_2"),
    (dict(power_of_2=1), TypeError, "power_of_2"),
    (dict(power_of_2=None), TypeError, "power_of_2"),
    (dict(reduce_amax="False"), TypeError, "reduce_amax"),
    (dict(reduce_amax=0), TypeError, "reduce_amax"),
    (dict(amax_compute_algo="mean"), ValueError, "amax_compute_algo"),
    (dict(amax_compute_algo=np.array([1, 2])), ValueError, "amax_compute_algo"),
    (dict(scaling_factor_compute_algo="max"), TypeError, "scaling_factor_compute_algo"),
    (dict(fp8_format="e3m4"), ValueError, "fp8_format"),
]


@pytest.mark.parametrize("kwargs,error,field", DELAYED_BAD, ids=[repr(k) for k, _, _ in DELAYED_BAD])
def test_delayed_scaling_refuses_bad_fields(kwargs, error, field):
    with pytest.raises(error) as e:
        DelayedScaling(**kwargs)
    assert str(e.value).startswith(field)


CURRENT_BAD = [
    (dict(amax_epsilon=INF), ValueError), (dict(amax_epsilon=NAN), ValueError), (dict(amax_epsilon=-1.0), ValueError),
    (dict(amax_epsilon="1e-12"), TypeError), (dict(power_of_2="True"), TypeError), (dict(margin=True), TypeError),
    (dict(margin=MAX_MARGIN + 1), ValueError), (dict(margin=0.5), TypeError),
]


@pytest.mark.parametrize("kwargs,error", CURRENT_BAD, ids=[repr(k) for k, _ in CURRENT_BAD])
def test_current_scaling_refuses_bad_fields(kwargs, error):
    with pytest.raises(error) as e:
        Float8CurrentScaling(**kwargs)
    assert str(e.value).startswith(next(iter(kwargs)))


def test_good_values_are_stored_as_python_types():
    r = DelayedScaling(margin=np.int64(-3), interval=np.int32(2), amax_history_len=np.uint16(8),
                       power_of_2=np.bool_(True), reduce_amax=np.bool_(False), epsilon=np.float32(0.5),
                       fp8_format="e4m3")
    assert (r.margin, r.interval, r.amax_history_len, r.power_of_2, r.reduce_amax, r.epsilon) == (-3, 2, 8, True,
                                                                                                   False, 0.5)
    assert type(r.margin) is int and type(r.power_of_2) is bool and type(r.epsilon) is float
    assert r.fp8_format is Format.E4M3
    c = Float8CurrentScaling(amax_epsilon=1, margin=MAX_MARGIN, power_of_2=np.bool_(True))
    assert type(c.amax_epsilon) is float and c.margin == MAX_MARGIN and c.power_of_2 is True


def test_margin_at_the_bound_is_accepted_and_runs():
    """The bound checked at construction is the one the update uses, so no update fails later on margin."""
    state = fp8core.ScalingState(1, DelayedScaling(margin=MAX_MARGIN, amax_history_len=2))
    state.quantize(np.ones(4, np.float32), 0)
    state.update()


def test_repr_reads_well_and_recipes_copy_and_pickle():
    r = DelayedScaling(amax_history_len=16, power_of_2=True)
    assert repr(r) == ("DelayedScaling(margin=0, interval=1, fp8_format=Format.HYBRID, amax_history_len=16, "
                       "amax_compute_algo='max', scaling_factor_compute_algo=None, power_of_2=True, reduce_amax=True, "
                       "epsilon=0.0)")
    assert repr(Float8CurrentScaling(fp8_format="e5m2")) == ("Float8CurrentScaling(fp8_format=Format.E5M2, "
                                                             "power_of_2=False, amax_epsilon=0.0, margin=0)")
    assert "amax_compute_algo=max" in repr(DelayedScaling(amax_compute_algo=max))
    assert pickle.loads(pickle.dumps(r)) == r and copy.deepcopy(r) == r
    wgrad_high = Float8CurrentScaling(override_linear_precision=(False, False, True))
    assert repr(wgrad_high).endswith(", override_linear_precision=OverrideLinearPrecision(fprop=False, dgrad=False, "
                                     "wgrad=True))")
    assert pickle.loads(pickle.dumps(wgrad_high)) == wgrad_high


def test_format_rows():
    """Each encoding's constants come from its one row; emax and the dtype agree with ml_dtypes (a twin that did
    not read the row); HYBRID has no constants and says why."""
    import ml_dtypes

    from fp8core.formats import ENCODINGS, FORMAT_NAMES, FP8_DTYPES

    assert list(ENCODINGS) == [Format.E4M3, Format.E5M2] and FP8_DTYPES == ("float8_e4m3fn", "float8_e5m2")
    for f, row in ENCODINGS.items():
        info = ml_dtypes.finfo(getattr(ml_dtypes, row.dtype_name))
        assert f.max == float(info.max) == row.max and f.emax == int(np.log2(float(info.max)))
        assert f.numpy_dtype == np.dtype(getattr(ml_dtypes, f.dtype_name)) and f.encoding is row
        assert all(FORMAT_NAMES[name] is f for name in (f.value, f.dtype_name, *row.aliases))
        assert fp8core.as_format(f.dtype_name.upper()) is f and pickle.loads(pickle.dumps(f)) is f
    assert (Format.E4M3.emax, Format.E5M2.emax, Format.E4M3.index, Format.E5M2.index) == (8, 15, 0, 1)
    for attr in ("max", "emax", "dtype_name", "numpy_dtype", "index", "dlpack_code", "encoding"):
        with pytest.raises(ValueError, match="^fmt: HYBRID is a recipe"):
            getattr(Format.HYBRID, attr)
    with pytest.raises(AttributeError):
        Format.E4M3.no_such_constant  # noqa: B018


@pytest.mark.parametrize("kwargs, error, field", [
    (dict(disable_rht=1), TypeError, "disable_rht"),
    (dict(disable_stochastic_rounding="no"), TypeError, "disable_stochastic_rounding"),
    (dict(disable_2d_quantization=None), TypeError, "disable_2d_quantization"),
    (dict(fp4_format="e4m3"), ValueError, "fp4_format"),
    (dict(fp4_format=fp8core.formats.E8M0), ValueError, "fp4_format"),
    (dict(fp8_format=Format.E5M2), ValueError, "fp8_format"),
    (dict(fp8_format=Format.HYBRID), ValueError, "fp8_format"),
])
def test_nvfp4_block_scaling_refuses_bad_fields(kwargs, error, field):
    with pytest.raises(error, match=f"^{field}: "):
        fp8core.NVFP4BlockScaling(**kwargs)


def test_nvfp4_block_scaling_has_transformer_engines_fields_and_defaults():
    r = fp8core.NVFP4BlockScaling()
    assert (r.disable_rht, r.disable_stochastic_rounding, r.disable_2d_quantization) == (False, False, False)
    assert r.fp4_format is fp8core.formats.E2M1 and r.fp8_format is Format.E4M3
    assert fp8core.NVFP4BlockScaling(fp4_format="E2M1") == r
    assert pickle.loads(pickle.dumps(r)) == r and copy.deepcopy(r) == r
    assert repr(r).startswith("NVFP4BlockScaling(disable_rht=False, ") and "fp8_format=Format.E4M3" in repr(r)
    assert fp8core.recipe.NVFP4BlockScaling is fp8core.NVFP4BlockScaling
