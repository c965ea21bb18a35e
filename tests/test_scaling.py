"""The scale rule and the batched delayed-scaling update."""

import copy
import pickle

import numpy as np
import pytest

import fp8core
from fp8core import DelayedScaling, Format, ScalingState

F = np.float32
FLT_MAX = F(3.4028235e38)


def cs(amax, fmt="e4m3", **kw):
    s, si = fp8core.compute_scale(np.array([amax], F), fmt, **kw)
    return s[0], si[0]


def test_scale_rule_cases():
    assert cs(0.0) == (1.0, 1.0)  # current scaling: 1.0 when there is no scale
    assert cs(np.inf) == (1.0, 1.0)
    assert cs(np.nan) == (1.0, 1.0)
    assert cs(0.0, previous=F(8.0)) == (8.0, 0.125)  # delayed: the previous scale stays
    assert cs(np.nan, previous=F(8.0)) == (8.0, 0.125)
    assert cs(2.0) == (224.0, F(1) / F(224))
    assert cs(2.0, margin=2) == (56.0, F(1) / F(56))
    assert cs(3.0) == (F(448) / F(3), F(1) / (F(448) / F(3)))
    assert cs(3.0, power_of_2=True) == (128.0, 1 / 128.0)
    assert cs(2.0, fmt="e5m2") == (28672.0, F(1) / F(28672))
    s, si = cs(1e-45)  # a subnormal amax: the quotient overflows, the scale is FLT_MAX
    assert s == FLT_MAX and si == F(1) / FLT_MAX and si != 0
    assert cs(1e-45, power_of_2=True)[0] == 2.0 ** 127
    assert cs(1e-35)[0] == F(448) / F(1e-35)  # tiny but the quotient fits
    assert cs(0.0, epsilon=1e-3)[0] == F(448) / F(1e-3)  # epsilon floors amax
    assert cs(2.0, epsilon=4.0)[0] == 112.0
    assert cs(0.0, epsilon=0.0) == (1.0, 1.0)
    assert cs(1.0, margin=-2)[0] == 1792.0
    s = cs(1e-30, margin=-200)[0]
    assert s == FLT_MAX  # overflow after the margin saturates too


def test_scale_rule_power_of_2_subnormal_scale():
    s, si = cs(1e10, margin=108)  # 448/1e10 * 2^-108 is subnormal
    exact = np.ldexp(F(448) / F(1e10), -108).astype(F)
    assert s == exact and exact != 0
    p2 = cs(1e10, margin=108, power_of_2=True)[0]
    assert p2 == 2.0 ** np.floor(np.log2(float(exact)))


def history_state(n=3, L=4, **kw):
    return ScalingState(n, DelayedScaling(amax_history_len=L, **kw), formats=[Format.E4M3] * n)


@pytest.mark.parametrize("L", [1, 2, 31, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_roll_and_scale(L, algo, rng):
    st = history_state(n=5, L=L, amax_compute_algo=algo)
    H = rng.uniform(0.5, 8, size=(L, 5)).astype(F)
    H[0, 2] = 0  # tensor 2 did not run this step
    st.amax_history[...] = H
    st.scale[...] = 7.0
    st.scale_inv[...] = F(1) / F(7)
    st.update()
    cur = H[0]
    for j in range(5):
        if j == 2:
            np.testing.assert_array_equal(st.amax_history[:, j], H[:, j])
            assert st.scale[j] == 7.0
            continue
        expected = np.concatenate([[0], H[2:, j], [cur[j]]]) if L > 1 else np.array([0])
        np.testing.assert_array_equal(st.amax_history[:, j], expected.astype(F))
        a = H[:, j].max() if algo == "max" else cur[j]
        assert st.scale[j] == F(448) / F(a)
        assert st.scale_inv[j] == F(1) / (F(448) / F(a))


def test_nan_amax_keeps_scale_and_flags(rng):
    st = history_state()
    st.amax_history[0] = [np.nan, 2.0, np.inf]
    st.scale[...] = 5.0
    st.update()
    assert st.scale[0] == 5.0 and st.scale[2] == 5.0 and st.scale[1] == 224.0
    np.testing.assert_array_equal(st.non_finite, [True, False, True])
    assert np.isnan(st.amax_history[3, 0])  # the roll still records it
    assert st.amax_history[0, 0] == 0


def test_interval_rolls_every_step_and_scales_every_interval():
    st = history_state(n=1, L=3, interval=2)
    scales = []
    for step, a in enumerate([1.0, 2.0, 4.0, 8.0]):
        st.amax_history[0, 0] = a
        st.update()
        scales.append(float(st.scale[0]))
    assert scales == [448.0, 448.0, 448.0 / 4, 448.0 / 4]  # "max" over the history at steps 0 and 2
    np.testing.assert_array_equal(st.amax_history[:, 0], [0, 4.0, 8.0])


def test_callable_algorithms():
    calls = []

    def second_newest(history):
        calls.append(history.shape)
        return history[-1]

    def halve(amax, scale, fp8_max, recipe):
        return fp8_max / amax / 2

    st = history_state(n=2, L=3, amax_compute_algo=second_newest, scaling_factor_compute_algo=halve)
    st.amax_history[...] = [[2.0, 0.0], [1.0, 1.0], [4.0, 4.0]]
    st.update()
    assert calls == [(3, 2)]
    assert st.scale[0] == 448 / 4 / 2 and st.scale[1] == 1.0  # tensor 1 did not run
    np.testing.assert_array_equal(st.amax_history, [[0, 0], [4.0, 1.0], [2.0, 4.0]])


@pytest.mark.parametrize("L", [1, 2, 5])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_callable_algorithm_path_twins_the_built_in_update(rng, L, algo):
    """The array path for callables (its own roll) against the backend's update, bit for bit, over steps where
    only some tensors ran (an amax of 0 leaves a column's history and scale as they were)."""
    same = (lambda h: h.max(axis=0)) if algo == "max" else (lambda h: h[0])
    built_in, array_path = history_state(n=6, L=L, amax_compute_algo=algo), history_state(
        n=6, L=L, amax_compute_algo=same)
    for step in range(2 * L + 3):
        row0 = rng.uniform(0.5, 900.0, 6).astype(F) * (rng.random(6) < 0.6)
        for st in (built_in, array_path):
            st.amax_history[0] = row0
            st.update()
        np.testing.assert_array_equal(array_path.buffer.view(np.uint32), built_in.buffer.view(np.uint32))
    assert array_path.steps == built_in.steps == 2 * L + 3


def test_reduce_and_quantize_into_row0(rng):
    st = history_state(n=2, L=2)
    x = rng.standard_normal(100).astype(F)
    st.quantize(x, 1)
    assert st.amax_history[0, 1] == np.abs(x).max()
    st.update(reduce=lambda row0: row0.__setitem__(slice(None), np.maximum(row0, 3.0)))
    assert st.scale[0] == F(448) / F(3) and st.scale[1] == F(448) / F(max(3.0, np.abs(x).max()))


def test_state_dict_round_trip():
    st = history_state()
    st.amax_history[0] = [1, 2, 3]
    st.update()
    other = history_state()
    other.load_state_dict(st.state_dict())
    np.testing.assert_array_equal(other.buffer, st.buffer)
    assert other.steps == 1


@pytest.mark.parametrize("kw,arg", [({"amax_history_len": 0}, "amax_history_len"),
                                    ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
                                    ({"interval": 0}, "interval"), ({"epsilon": -1.0}, "epsilon")])
def test_delayed_scaling_validates(kw, arg):
    with pytest.raises(ValueError, match=arg):
        DelayedScaling(**kw)


def test_current_scaling_validates():
    with pytest.raises(ValueError, match="amax_epsilon"):
        fp8core.Float8CurrentScaling(amax_epsilon=-1e-12)
    r = fp8core.Float8CurrentScaling()
    assert r.fp8_format is Format.HYBRID and r.fp8_format.bwd is Format.E5M2


def test_one_contiguous_allocation():
    st = history_state(n=4, L=8)
    assert st.amax_history.base is st.buffer or np.shares_memory(st.amax_history, st.buffer)
    assert np.shares_memory(st.scale, st.buffer) and np.shares_memory(st.scale_inv, st.buffer)
    assert st.amax_history[0].flags.c_contiguous


# ---- bad input: refused before anything is written ----------------------------------------------------------

@pytest.mark.parametrize("index", [3, -1, 1.7, "0", True, None])
def test_quantize_index_is_checked_before_anything_is_written(index):
    st = history_state(n=3)
    before = st.buffer.copy()
    with pytest.raises(IndexError, match=r"index: expected an int in \[0, 3\)"):
        st.quantize(np.ones(8, F), index)
    np.testing.assert_array_equal(st.buffer, before)


def test_quantize_accepts_numpy_integers():
    st = history_state(n=3)
    st.quantize(np.full(8, 2.0, F), np.int64(2))
    assert st.amax_history[0, 2] == 2.0


def _state_with_history():
    st = history_state(n=2, L=3)
    st.amax_history[0] = [2.0, 4.0]
    st.update()
    st.amax_history[0] = [1.0, 8.0]
    return st, st.buffer.copy()


@pytest.mark.parametrize("amax_algo,scale_algo,err,match", [
    (lambda h: None, None, TypeError, "amax_compute_algo: returned None"),
    (lambda h: np.zeros(0, F), None, ValueError, r"amax_compute_algo: returned 0 .* expected 2"),
    (lambda h: h, None, ValueError, r"amax_compute_algo: returned 6 .* shape \(3, 2\)"),
    (lambda h: -h[0], None, ValueError, "amax_compute_algo: returned a negative amax"),
    ("max", lambda a, s, m, r: None, TypeError, "scaling_factor_compute_algo: returned None"),
    ("max", lambda a, s, m, r: -m / a, ValueError, "scaling_factor_compute_algo: returned scale -"),
    ("max", lambda a, s, m, r: a * np.nan, ValueError, "returned scale nan"),
    ("max", lambda a, s, m, r: m / a * 0, ValueError, "returned scale 0.0"),
    ("max", lambda a, s, m, r: np.ones(3, F), ValueError, "returned 3 float32 values"),
])
def test_callable_results_are_checked_before_anything_is_written(amax_algo, scale_algo, err, match):
    st, _ = _state_with_history()
    st.recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=amax_algo,
                               scaling_factor_compute_algo=scale_algo)
    before = st.buffer.copy()
    with pytest.raises(err, match=match):
        st.update()
    np.testing.assert_array_equal(st.buffer, before)
    assert st.steps == 1


def test_reduce_in_place_or_by_return_value():
    expected, _ = _state_with_history()
    expected.amax_history[0] = [3.0, 9.0]
    expected.update()
    in_place, _ = _state_with_history()
    in_place.update(reduce=lambda row0: np.maximum(row0, [3.0, 9.0], out=row0))  # returns row0 itself: fine
    returned, _ = _state_with_history()
    returned.update(reduce=lambda row0: np.maximum(row0, np.array([3.0, 9.0], F)))  # a new array: taken
    for st in (in_place, returned):
        np.testing.assert_array_equal(st.buffer, expected.buffer)


@pytest.mark.parametrize("result,match", [(np.ones(3, F), "returned 3 float32"), (np.ones(2), "float64"),
                                          ([1.0, 2.0], "expected None")])
def test_reduce_returning_a_wrong_value_is_an_error_and_writes_nothing(result, match):
    st, before = _state_with_history()
    with pytest.raises((ValueError, TypeError), match=match):
        st.update(reduce=lambda row0: result)
    np.testing.assert_array_equal(st.buffer, before)
    assert st.steps == 1


def test_reduce_receives_the_buffers_own_array_type():
    torch = pytest.importorskip("torch")
    buf = torch.zeros(3 * 2 + 2 * 2)
    st = ScalingState(2, DelayedScaling(amax_history_len=3), buffer=buf)
    st.amax_history[0] = torch.tensor([2.0, 0.5])
    seen = []

    def reduce(row0):
        seen.append(type(row0))
        row0.clamp_(min=1.0)  # what torch.distributed.all_reduce(row0, op=MAX) does: in place

    st.update(reduce)
    assert seen == [torch.Tensor] and isinstance(st.scale, torch.Tensor)
    assert st.scale.tolist() == [224.0, 448.0]


def test_the_buffer_is_read_afresh_at_every_call():
    torch = pytest.importorskip("torch")
    buf = torch.zeros(1 * 2 + 2 * 2)
    st = ScalingState(2, DelayedScaling(amax_history_len=1), buffer=buf)
    buf.share_memory_()  # the storage moves under the same tensor object: nothing stale is read
    st.quantize(torch.full((4,), 4.0), 1)
    st.update()
    assert buf[1].item() == 0.0 and buf[3].item() == 112.0 and buf[2].item() == 1.0  # tensor 0 did not run


def test_a_recipe_margin_out_of_range_is_refused_at_construction():
    with pytest.raises(ValueError, match="margin"):
        ScalingState(2, DelayedScaling(margin=10 ** 6))


def test_scaling_state_pickles_and_deep_copies():
    st = ScalingState(3, DelayedScaling(amax_history_len=8))
    st.amax_history[0] = [1.0, 2.0, 4.0]
    st.update()
    for other in (pickle.loads(pickle.dumps(st)), copy.deepcopy(st)):
        np.testing.assert_array_equal(other.buffer, st.buffer)
        assert other.steps == 1
        assert other.buffer is not st.buffer
        other.amax_history[0] = [8.0, 8.0, 8.0]
        other.update()
        assert st.scale[2] == 448.0 / 4 and st.steps == 1  # the original is untouched
    assert "ScalingState(num_tensors=3, history_len=8" in repr(st)


def test_scaling_state_load_state_dict_validates_first():
    st = ScalingState(3, DelayedScaling(amax_history_len=8))
    st.amax_history[0] = [1.0, 2.0, 4.0]
    st.update()
    before = st.buffer.copy()
    good = ScalingState(3, DelayedScaling(amax_history_len=8)).state_dict()
    for key, value, err in [("scale", good["scale"].astype("float64"), TypeError),
                            ("scale", -good["scale"], ValueError),
                            ("amax_history", good["amax_history"][:4], ValueError),
                            ("steps", 1.0, ValueError), ("steps", True, ValueError)]:
        bad = dict(good, **{key: value})
        with pytest.raises(err, match=key):
            st.load_state_dict(bad)
        assert (st.buffer == before).all() and st.steps == 1
    with pytest.raises(KeyError, match="'scale_inv'"):
        st.load_state_dict({k: v for k, v in good.items() if k != "scale_inv"})
