"""The torch front-end under hostile input (issue 28; issue 27 item 10), one row per probe so none comes back:
custom ops with an argument on the meta device, eager against fake (torch.compile) over 0-d, 1-d and empty
inputs, half-written loads, distributed-checkpoint state dicts, unclear errors, flush-to-zero. Each row names
the call and either the error (type and words) or a twin the result must equal. Two processes (FSDP2, DCP):
test_torch_distributed.py."""

import io

import pytest

torch = pytest.importorskip("torch")

import fp8core  # noqa: E402
from fp8core.torch import Float8Linear, autocast, convert_to_float8, enable_fsdp_float8_all_gather  # noqa: E402
from fp8core.torch.fsdp import Float8AllGatherWeight  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

O = torch.ops.fp8core
RECIPE = fp8core.DelayedScaling(amax_history_len=4)


def outcome(fn, args):
    """What a call gives: [(shape, dtype), ...] of its tensors, or (error type, message)."""
    try:
        r = fn(*args)
    except Exception as e:  # noqa: BLE001 (the outcome is what is compared)
        return type(e).__name__, str(e)
    r = r if isinstance(r, (tuple, list)) else (r,)
    return [(tuple(t.shape), t.dtype, t.device.type) for t in r if isinstance(t, torch.Tensor)]


def fake_outcome(fn, args):
    """The same call on fake tensors (what torch.compile traces with)."""
    with FakeTensorMode() as mode:
        return outcome(fn, [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])


def bits(t):
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# ---- custom ops: eager and fake agree, for every op, over 0-d, 1-d and empty inputs -------------------------

SHAPES = [(), (5,), (0,), (32,), (0, 4), (4, 0), (2, 0, 3), (3, 32), (16, 16), (32, 32), (128, 128), (2, 16, 32)]


def _cdiv(a, b):
    return -(-a // b)


def op_calls(shape):
    x = torch.ones(shape)
    q = x.to(torch.float8_e4m3fn)
    s = torch.ones(1)
    e8m0 = torch.ones((shape[0] if len(shape) > 1 else 1, 1) if shape else ()).to(torch.float8_e8m0fnu)
    rows, cols = (torch.ones(shape[:-1]).numel(), shape[-1]) if shape else (1, 1)
    mx_scale = torch.ones((rows, _cdiv(cols, 32)) if shape else ()).to(torch.float8_e8m0fnu)
    tiles = torch.ones((_cdiv(rows, 128), _cdiv(cols, 128)) if shape else ())
    blocks = torch.ones((rows, _cdiv(cols, 128)) if shape else ())
    return {
        "amax": (O.amax, (x,)),
        "quantize": (O.quantize, (x, s, "e4m3")),
        "quantize_amax": (O.quantize_amax, (x, s, "e4m3", torch.zeros(1))),
        "quantize_dynamic": (O.quantize_dynamic, (x, "e4m3", 0, False, 0.0)),
        "dequantize": (O.dequantize, (q, s, torch.float32)),
        "transpose": (O.transpose, (q,)),
        "cast_transpose": (O.cast_transpose, (x, s, "e4m3")),
        "cast_transpose_amax": (O.cast_transpose_amax, (x, s, "e4m3", torch.zeros(1))),
        "compute_scale": (O.compute_scale, (x, "e4m3", 0, False, 0.0)),
        "gemm": (O.gemm, (q, q, s, s, torch.float32, None, None, False)),
        "gemm_amax": (O.gemm_amax, (q, q, s, s, torch.float8_e4m3fn, None, s, torch.zeros(1), False)),
        "quantize_mxfp8": (O.quantize_mxfp8, (x, "e4m3", "rceil", False)),
        "quantize_mxfp8_columnwise": (O.quantize_mxfp8, (x, "e4m3", "rceil", True)),
        "quantize_mxfp8_both": (O.quantize_mxfp8_both, (x, "e4m3", "rceil")),
        "quantize_blockwise_1x128": (O.quantize_blockwise, (x, "e4m3", "1x128", True, 0.0)),
        "quantize_blockwise_128x128": (O.quantize_blockwise, (x, "e4m3", "128x128", True, 0.0)),
        "dequantize_mxfp8": (O.dequantize_mxfp8, (q, e8m0, torch.float32)),
        "dequantize_blockwise": (O.dequantize_blockwise, (q, e8m0.float(), torch.float32)),
        "dequantize_mxfp8_rowwise": (O.dequantize_mxfp8, (q, mx_scale, torch.float32)),
        "dequantize_blockwise_tiles": (O.dequantize_blockwise, (q, tiles, torch.float32)),
        "transpose_blocks_mx": (O.transpose_blocks, (q, mx_scale, "1x32")),
        "transpose_blocks_tiles": (O.transpose_blocks, (q, tiles, "128x128")),
        "transpose_blocks_1x128": (O.transpose_blocks, (q, blocks, "1x128")),
        "block_gemm_mx": (O.block_gemm, (q, mx_scale, q, mx_scale, "1x32", "1x32", torch.float32)),
        "block_gemm_1x128": (O.block_gemm, (q, blocks, q, blocks, "1x128", "1x128", torch.bfloat16)),
        "block_gemm_tiles": (O.block_gemm, (q, tiles, q, tiles, "128x128", "128x128", torch.float32)),
        "block_gemm_1x128_tiles": (O.block_gemm, (q, blocks, q, tiles, "1x128", "128x128", torch.float32)),
        "block_gemm_mixed_kinds": (O.block_gemm, (q, mx_scale, q, blocks, "1x32", "1x128", torch.float32)),
    }


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("op", list(op_calls((1,))))
def test_eager_and_fake_agree(op, shape):
    fn, args = op_calls(shape)[op]
    eager = outcome(fn, args)
    assert fake_outcome(fn, args) == eager
    assert "IndexError" not in str(eager)


def update_call(history=(4, 3), n=3, margin=0, algo="max", epsilon=0.0, dtype=torch.float32, flags=torch.bool):
    h = torch.rand(history, dtype=dtype) if history else torch.tensor(1.0, dtype=dtype)
    return O.update, (h, torch.ones(n), torch.ones(n), torch.full((n,), 448.0), torch.zeros(n, dtype=flags),
                      margin, algo, False, epsilon, True)


UPDATES = {"valid": update_call(), "history_0d": update_call(()), "history_1d": update_call((3,)),
           "history_no_rows": update_call((0, 3)), "history_no_tensors": update_call((4, 0), 0),
           "history_3d": update_call((2, 2, 3)), "history_f64": update_call(dtype=torch.float64),
           "scale_length": update_call(n=2), "non_finite_dtype": update_call(flags=torch.uint8),
           "algo": update_call(algo="mean"), "margin": update_call(margin=600), "epsilon": update_call(epsilon=-1.0)}


@pytest.mark.parametrize("case", list(UPDATES))
def test_update_eager_and_fake_agree(case):
    fn, args = UPDATES[case]
    eager = outcome(fn, args)
    assert fake_outcome(fn, args) == eager
    assert (eager == []) == (case == "valid")


# the probes of issue 28 by name: the core's error (or result) where a bare IndexError or a mismatch was
ZERO_D = [
    ("transpose", ("ValueError", "q: expected at least 1 dimension, got a scalar")),
    ("cast_transpose", ("ValueError", "x: expected at least 1 dimension, got a scalar")),
    ("quantize_mxfp8", ("ValueError", "x: expected at least 1 dimension, got a scalar")),
    ("quantize_mxfp8_columnwise", ("ValueError", "x: expected at least 1 dimension, got a scalar")),
    ("gemm", ("ValueError", "a: expected a 2-D [M, K] array, got shape ()")),
    ("compute_scale", [((1,), torch.float32, "cpu")] * 2),  # a 0-d amax gives [1] scales, as the core's
]


@pytest.mark.parametrize("op,expected", ZERO_D, ids=[r[0] for r in ZERO_D])
def test_zero_d_probes(op, expected):
    fn, args = op_calls(())[op]
    assert outcome(fn, args) == expected and fake_outcome(fn, args) == expected


def test_compiled_zero_d_gives_the_core_error_and_compute_scale_the_eager_result():
    for op in ("transpose", "cast_transpose", "quantize_mxfp8"):
        fn, args = op_calls(())[op]
        compiled = torch.compile(lambda *a, fn=fn: fn(*a), backend="aot_eager", fullgraph=True)
        with pytest.raises(Exception) as info:
            compiled(*args)
        assert "expected at least 1 dimension, got a scalar" in str(info.value)
        assert "IndexError" not in str(info.value)
    amax = torch.tensor(3.0)
    compiled = torch.compile(lambda a: O.compute_scale(a, "e4m3", 0, False, 0.0), fullgraph=True)  # Inductor
    for got, want in zip(compiled(amax), O.compute_scale(amax, "e4m3", 0, False, 0.0)):
        assert got.shape == want.shape == (1,) and torch.equal(bits(got), bits(want))


# ---- custom ops: one argument on the meta device is refused, eager and fake, before anything is written ------

def meta_calls():
    x, s = torch.randn(32, 32), torch.tensor([2.0])
    q = fp8core.quantize(x, 1.0, "e4m3")
    e8m0 = torch.ones(32, 1).to(torch.float8_e8m0fnu)
    h = torch.rand(4, 3)
    return {
        "quantize": (O.quantize, [x, s, "e4m3"], ["x", "scale"]),
        "quantize_amax": (O.quantize_amax, [x, s, "e4m3", torch.zeros(1)], ["x", "scale", None, "amax_out"]),
        "dequantize": (O.dequantize, [q, s, torch.float32], ["q", "scale_inv"]),
        "cast_transpose": (O.cast_transpose, [x, s, "e4m3"], ["x", "scale"]),
        "cast_transpose_amax": (O.cast_transpose_amax, [x, s, "e4m3", torch.zeros(1)],
                                ["x", "scale", None, "amax_out"]),
        "dequantize_mxfp8": (O.dequantize_mxfp8, [q, e8m0, torch.float32], ["t.data", "t.scale"]),
        "dequantize_blockwise": (O.dequantize_blockwise, [q, torch.ones(32, 1), torch.float32],
                                 ["t.data", "t.scale_inv"]),
        "gemm": (O.gemm, [q, q, s, s, torch.float32, None, None, False], ["a", "b", "a_scale_inv", "b_scale_inv"]),
        "gemm_amax": (O.gemm_amax, [q, q, s, s, torch.float8_e4m3fn, None, s.clone(), torch.zeros(1), False],
                      ["a", "b", "a_scale_inv", "b_scale_inv", None, None, "out_scale", "out_amax"]),
        "update": (O.update, [h, torch.ones(3), torch.ones(3), torch.full((3,), 448.0),
                              torch.zeros(3, dtype=torch.bool), 0, "max", False, 0.0, True],
                   ["history", "scale", "scale_inv", "fp8_max", "non_finite"]),
    }


META_ROWS = [(op, i, arg) for op, (_, _, names) in meta_calls().items() for i, arg in enumerate(names) if arg]


@pytest.mark.parametrize("op,index,arg", META_ROWS, ids=[f"{r[0]}-{r[2]}" for r in META_ROWS])
def test_one_argument_on_meta_is_refused_by_name(op, index, arg):
    fn, args, _ = meta_calls()[op]
    args[index] = args[index].to("meta")
    real = [a for a in args if isinstance(a, torch.Tensor) and not a.is_meta]
    before = [bits(a).clone() for a in real]
    expected = ("ValueError", f"{arg}: torch device 'meta' is neither CPU nor CUDA")
    assert outcome(fn, args) == expected and fake_outcome(fn, args) == expected
    assert all(torch.equal(bits(a), b) for a, b in zip(real, before))  # nothing written (slots, the history)


@pytest.mark.parametrize("op", list(meta_calls()))
def test_every_argument_on_meta_infers_shapes_only(op):
    fn, args, _ = meta_calls()[op]
    on_cpu = outcome(fn, [a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    on_meta = outcome(fn, [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
    assert on_meta == [(shape, dtype, "meta") for shape, dtype, _ in on_cpu]


# ---- loads: a failed load writes nothing (the model's outermost module given to convert_to_float8, or nothing
# before its first Float8Linear); torch's RuntimeError --------------------------------------------------------

def trained(model, seed=0, steps=2):
    g = torch.Generator().manual_seed(seed)
    d = next(m for m in model.modules() if isinstance(m, Float8Linear)).in_features
    for _ in range(steps):
        with autocast():
            model(torch.randn(8, d, generator=g)).square().sum().backward()
    return model


def snapshot(model):
    out = {k: bits(v).clone() for k, v in model.state_dict().items()}
    return out


def hand_built(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(Float8Linear(16, 32, recipe=RECIPE), Float8Linear(32, 16, recipe=RECIPE))


class Outer(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(4))
        self.inner = inner
        self.register_buffer("count", torch.zeros(2))

    def forward(self, x):
        return self.inner(x) * self.scale.sum()


def converted(seed=0):
    torch.manual_seed(seed)
    return convert_to_float8(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)),
                             RECIPE)


def nested(seed=0):
    """A module with entries of its own built around a converted model afterwards: nothing marks it."""
    return Outer(converted(seed))


def nested_then_converted(seed=0):
    """The outer module first, then its inner part converted in place: nothing marks the outer module."""
    torch.manual_seed(seed)
    outer = Outer(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)))
    convert_to_float8(outer.inner, RECIPE)
    return outer


def after_a_plain_module(seed=0):
    """Float8Linears made by hand, after a module with entries, in a container nothing marks."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.LayerNorm(16), hand_built(seed))


def marked(build):
    """``build``'s model given to convert_to_float8 (nothing left to convert): its outermost module is marked."""
    def build_marked(seed=0):
        return convert_to_float8(build(seed), RECIPE)
    build_marked.__name__ = f"marked_{build.__name__}"
    return build_marked


def _set(key, value):
    def edit(sd):
        sd[key] = value(sd[key]) if callable(value) else value
    return edit


def _all(*edits):
    def edit(sd):
        for e in edits:
            e(sd)
    return edit


LOADS = {  # (model builder, checkpoint edit, the words of every mismatch the RuntimeError lists)
    "hand_built_bad_history_of_layer_1": (hand_built, _set("1.fp8_amax_history", torch.zeros(3, 3)),
                                          ["1.fp8_amax_history: expected shape (4, 3), got (3, 3)"]),
    "hand_built_two_layers_bad": (hand_built, _all(_set("0.fp8_scale", lambda t: -t),
                                                   _set("1.fp8_steps", torch.tensor(-1))),
                                  ["0.fp8_scale: expected finite values > 0", "1.fp8_steps: expected an int >= 0"]),
    "hand_built_weight_size": (hand_built, _set("1.weight", torch.zeros(16, 16)),
                               ["size mismatch for 1.weight: copying a param with shape torch.Size([16, 16])"]),
    "nested_bad_scale": (marked(nested), _set("inner.2.fp8_scale_inv", lambda t: t * 0),
                         ["inner.2.fp8_scale_inv: expected finite values > 0"]),
    "nested_bad_dtype_and_missing": (marked(nested),
                                     _all(_set("inner.0.fp8_amax_history", lambda t: t.double()),
                                          lambda sd: sd.pop("inner.2.fp8_scale")),
                                     ["inner.0.fp8_amax_history: expected float32, got float64",
                                      "missing inner.2.fp8_scale"]),
    "nested_not_a_tensor": (marked(nested),
                            _all(_set("scale", [1.0, 2.0, 3.0, 4.0]), _set("inner.2.fp8_scale", lambda t: -t)),
                            ['While copying the parameter named "scale", expected torch.Tensor',
                             "inner.2.fp8_scale: expected finite values > 0"]),
    "nested_then_converted_bad_history": (marked(nested_then_converted),
                                          _set("inner.0.fp8_amax_history", lambda t: -t - 1),
                                          ["inner.0.fp8_amax_history: holds a negative amax"]),
    "nested_bias_size": (marked(nested), _set("inner.2.bias", torch.zeros(3)), ["size mismatch for inner.2.bias"]),
    "every_entry_of_one_layer": (hand_built, _all(_set("1.fp8_amax_history", lambda t: -t - 1),
                                                  _set("1.fp8_scale", lambda t: t.half()),
                                                  _set("1.fp8_scale_inv", torch.ones(4)),
                                                  _set("1.fp8_steps", torch.tensor(0.5))),
                                 ["1.fp8_amax_history: holds a negative amax", "1.fp8_scale: expected float32, got "
                                  "float16", "1.fp8_scale_inv: expected shape (3,), got (4,)",
                                  "1.fp8_steps: expected an integer"]),
    "layer_alone": (lambda seed=0: hand_built(seed)[1], _set("fp8_scale", torch.ones(2)),
                    ["fp8_scale: expected shape (3,), got (2,)"]),
    "after_a_plain_module_marked": (marked(after_a_plain_module), _set("1.1.fp8_scale", lambda t: -t),
                                    ["1.1.fp8_scale: expected finite values > 0"]),
}


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("case", list(LOADS))
def test_a_failed_load_writes_nothing_and_lists_every_mismatch(case, strict):
    build, edit, words = LOADS[case]
    model, source = trained(build(0), 0), trained(build(1), 1, steps=3)
    sd = {k: v.clone() for k, v in source.state_dict().items()}
    edit(sd)
    before = snapshot(model)
    with pytest.raises(RuntimeError, match=f"Error\\(s\\) in loading state_dict for {type(model).__name__}:") as info:
        model.load_state_dict(sd, strict=strict)
    for w in words:
        assert w in str(info.value)
    after = snapshot(model)
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    steps = {m._fp8_group.steps for m in model.modules() if isinstance(m, Float8Linear)}
    assert steps == {2}


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("build,first", [(nested, "inner.0."), (nested_then_converted, "inner.0."),
                                         (after_a_plain_module, "1.0.")])
def test_a_module_built_around_later_writes_only_what_comes_before_the_first_layer(build, first, strict):
    """What fp8core cannot promise without a process-wide hook: a module built around Float8Linears afterwards, and
    not given to convert_to_float8, is not marked; load_state_dict from it writes the entries it visits before the
    first Float8Linear (``first``: its prefix) before the checkpoint is refused, as torch writes them. Every later
    entry is untouched, the error is the one a marked model gives, and once marked nothing is written."""
    model, source = trained(build(0), 0), trained(build(1), 1, steps=3)
    sd = {k: v.clone() for k, v in source.state_dict().items()}
    last = [k for k in sd if k.endswith("fp8_scale")][-1]
    sd[last] = -sd[last]
    keys = list(sd)
    early = keys[:next(i for i, k in enumerate(keys) if k.startswith(first))]
    before = snapshot(model)
    for k in early:  # a value the model does not hold, so that a write shows
        sd[k] = sd[k] + 1
    assert early and all(not torch.equal(bits(sd[k]), before[k]) for k in early)
    words = f"Error\\(s\\) in loading state_dict for {type(model).__name__}:\n\t{last}: expected finite values > 0"
    with pytest.raises(RuntimeError, match=words):
        model.load_state_dict(sd, strict=strict)
    after = snapshot(model)
    assert all(torch.equal(after[k], bits(sd[k])) for k in early)
    assert all(torch.equal(after[k], before[k]) for k in keys[len(early):])
    convert_to_float8(model, module_filter_fn=lambda m, fqn: False)  # converts nothing, marks (README)
    for k in early:
        sd[k] = sd[k] + 1
    with pytest.raises(RuntimeError, match=words):
        model.load_state_dict(sd, strict=strict)
    assert all(torch.equal(v, after[k]) for k, v in snapshot(model).items())


def test_a_compiled_wrapper_refuses_a_bad_checkpoint_and_writes_nothing():
    model = trained(converted(0))
    compiled = torch.compile(model)  # OptimizedModule holds nothing before the model, which checks the load
    sd = {k: v.clone() for k, v in trained(converted(1), 1).state_dict().items()}
    sd = {f"_orig_mod.{k}": v for k, v in sd.items()}
    sd["_orig_mod.2.fp8_scale"] = -sd["_orig_mod.2.fp8_scale"]
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="for OptimizedModule:\n\t_orig_mod.2.fp8_scale: expected finite"):
        compiled.load_state_dict(sd)
    after = snapshot(model)
    assert all(torch.equal(after[k], before[k]) for k in before)


class Unhashable(torch.nn.Module):
    """A module class that defines __eq__ alone (so __hash__ is None): registering it must still work."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __eq__(self, other):
        return self is other

    def forward(self, x):
        return self.inner(x)


def test_unhashable_modules_around_float8_linear_still_register_and_check_loads():
    model = torch.nn.Sequential(Unhashable(hand_built(0)))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["0.inner.1.fp8_scale"] = -sd["0.inner.1.fp8_scale"]
    sd["0.inner.0.weight"] += 1
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="0.inner.1.fp8_scale: expected finite values > 0"):
        model.load_state_dict(sd)
    after = snapshot(model)
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("build", [hand_built, nested, converted, nested_then_converted, after_a_plain_module,
                                   marked(nested)])
def test_a_good_load_gives_the_twin(build):
    model, source = trained(build(0), 0), trained(build(1), 1, steps=3)
    model.load_state_dict(source.state_dict())
    a, b = snapshot(model), snapshot(source)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randn(8, 16)
    with autocast():
        assert torch.equal(bits(model(x)), bits(source(x)))


# ---- distributed-checkpoint state dicts (one process here; FSDP2 on two: test_torch_distributed.py) --------------

@pytest.mark.parametrize("build", [hand_built, converted, nested])
def test_get_and_set_model_state_dict_round_trip_into_a_twin(build, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model, twin = trained(build(0), 0, steps=3), trained(build(1), 1)
    sd = get_model_state_dict(model)  # was: AttributeError 'Float8Linear' object has no attribute 'fp8_steps'
    assert sorted(sd) == sorted(model.state_dict())
    with pytest.warns(UserWarning):  # no process group: DCP says it runs on one process
        dcp.save(sd, checkpoint_id=tmp_path)
    loaded = get_model_state_dict(twin)
    with pytest.warns(UserWarning):
        dcp.load(loaded, checkpoint_id=tmp_path)
    set_model_state_dict(twin, loaded)
    a, b = snapshot(model), snapshot(twin)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert {m._fp8_group.steps for m in twin.modules() if isinstance(m, Float8Linear)} == {3}


def test_fp8_all_gather_checkpoints_hold_plain_tensors():
    model = enable_fsdp_float8_all_gather(trained(converted(0)))
    sd = model.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())  # was Float8AllGatherWeight
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)  # refused before: "Unsupported global"
    twin = enable_fsdp_float8_all_gather(converted(1))
    twin.load_state_dict(back)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(twin.state_dict().values(), sd.values()))
    twin.load_state_dict(back, assign=True)  # the checkpoint's plain tensor takes the weight's place: rewrapped
    assert isinstance(twin[0].weight, Float8AllGatherWeight) and isinstance(twin[2].weight, Float8AllGatherWeight)


# ---- unclear errors ------------------------------------------------------------------------------------------

ERRORS = [
    ("convert_to_float8(None)", lambda: convert_to_float8(None), TypeError,
     "module: expected a torch.nn.Module, got NoneType"),
    ("convert_to_float8(filter=1)", lambda: convert_to_float8(torch.nn.Linear(16, 16), module_filter_fn=1),
     TypeError, "module_filter_fn: expected a callable"),
    ("Float8Linear(16.0, 16)", lambda: Float8Linear(16.0, 16), TypeError, "in_features: expected an int, got float"),
    ("Float8Linear(16, True)", lambda: Float8Linear(16, True), TypeError, "out_features: expected an int, got bool"),
    ("Float8Linear(0, 16)", lambda: Float8Linear(0, 16), ValueError,
     "in_features: 0 is not a positive multiple of 16"),
    ("from_linear(Conv1d)", lambda: Float8Linear.from_linear(torch.nn.Conv1d(16, 16, 1)), TypeError,
     "linear: expected a torch.nn.Linear, got Conv1d"),
]


@pytest.mark.parametrize("call,fn,err,words", ERRORS, ids=[r[0] for r in ERRORS])
def test_clear_errors(call, fn, err, words):
    with pytest.raises(err) as info:
        fn()
    assert words in str(info.value)


def test_a_zero_feature_linear_is_kept_by_convert_to_float8():
    model = torch.nn.Sequential(torch.nn.Linear(0, 16), torch.nn.Linear(16, 16))
    with pytest.warns(UserWarning, match="0 -> 16"):
        convert_to_float8(model)
    assert type(model[0]) is torch.nn.Linear and type(model[1]) is Float8Linear


# ---- flush-to-zero never changes what is accepted (validated by the values' bits) --------------------------------

TINY = 0x000AE398  # the float32 bits of 1e-39, a subnormal


def test_a_subnormal_scale_loads_under_flush_to_zero():
    source, model = trained(converted(1)), converted(0)
    sd = {k: v.clone() for k, v in source.state_dict().items()}
    sd["2.fp8_scale"].view(torch.int32)[0] = TINY
    torch.set_flush_denormal(True)
    try:
        model.load_state_dict(sd)  # was refused: "got ...1e-39"
    finally:
        torch.set_flush_denormal(False)
    assert bits(model[2].fp8_scale)[0] == TINY


def test_scaling_state_takes_a_subnormal_scale_under_flush_to_zero():
    st = fp8core.ScalingState(3, fp8core.DelayedScaling(amax_history_len=2))
    sd = st.state_dict()
    sd["scale"] = sd["scale"].copy()
    sd["scale"].view("uint32")[1] = TINY
    torch.set_flush_denormal(True)
    try:
        st.load_state_dict(sd)
    finally:
        torch.set_flush_denormal(False)
    assert st.scale.view("uint32")[1] == TINY


# ---- issue 39: te.Linear resume, record_numerics with threads, torch.compile and block recipes, params_dtype ------

import threading  # noqa: E402

import fp8core.torch as te  # noqa: E402
from fp8core.torch import NumericsRecord, record_numerics  # noqa: E402

TE_RECIPE = fp8core.DelayedScaling(margin=1, fp8_format=fp8core.Format.HYBRID)  # not te.Linear's default


def te_trained(seed=0, steps=3, recipe=TE_RECIPE):
    torch.manual_seed(seed)
    layer = te.Linear(32, 32)
    g = torch.Generator().manual_seed(seed + 100)
    for _ in range(steps):
        with te.autocast(recipe=recipe):
            layer(torch.randn(16, 32, generator=g)).square().sum().backward()
    return layer


@pytest.mark.parametrize("recipe", [TE_RECIPE, fp8core.DelayedScaling(amax_history_len=16)],
                         ids=["margin-hybrid", "history-16"])
@pytest.mark.parametrize("wrapped", [False, True])
def test_a_te_resume_keeps_the_loaded_fp8_state(recipe, wrapped):
    """TE's resume: b = te.Linear(...); b.load_state_dict(a.state_dict()); b's first autocast took fresh state
    (2 nonzero history entries against a's 11) and b's outputs differed from a's. A checkpoint of another
    amax_history_len (16, TE's examples' value) loads at its length, inside a model too."""
    a = te_trained(recipe=recipe)
    b = te.Linear(32, 32)
    if wrapped:
        torch.nn.Sequential(b).load_state_dict(torch.nn.Sequential(a).state_dict())
    else:
        b.load_state_dict(a.state_dict())
    x = torch.randn(16, 32)
    with te.autocast(recipe=recipe):
        ya, yb = a(x), b(x)
        ya.square().sum().backward()
        yb.square().sum().backward()
    assert torch.equal(bits(ya), bits(yb))
    sa, sb = snapshot(a), snapshot(b)
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert int(sb["fp8_steps"]) == 4 and b.recipe == recipe
    assert torch.count_nonzero(b.fp8_amax_history) == torch.count_nonzero(a.fp8_amax_history) > 6


def test_a_te_resume_of_a_bad_checkpoint_writes_nothing():
    b = te.Linear(32, 32)
    sd = te_trained(recipe=fp8core.DelayedScaling(amax_history_len=16)).state_dict()
    sd["fp8_scale"] = -sd["fp8_scale"]
    before = snapshot(b)
    with pytest.raises(RuntimeError, match="fp8_scale: expected finite values > 0"):
        torch.nn.Sequential(b).load_state_dict({f"0.{k}": v for k, v in sd.items()})
    after = snapshot(b)
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert b.fp8_amax_history.shape == (1024, 3) and not b.loaded


def test_a_te_resume_under_another_history_length_is_refused_by_name():
    b = te.Linear(32, 32)
    b.load_state_dict(te_trained(recipe=fp8core.DelayedScaling()).state_dict())
    before = snapshot(b)
    with pytest.raises(ValueError, match="recipe: this Linear holds the fp8 state of a checkpoint \\(an amax history "
                                         "of 1024\\); the autocast's .* keeps 16"):
        with te.autocast(recipe=fp8core.DelayedScaling(amax_history_len=16)):
            b(torch.randn(16, 32))
    after = snapshot(b)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_a_te_linear_without_a_load_still_starts_fresh_under_its_first_recipe():
    a = te.Linear(32, 32)
    with te.autocast(recipe=TE_RECIPE):
        a(torch.randn(16, 32))
    assert a.recipe == TE_RECIPE and a.fp8_amax_history.shape == (1024, 3) and int(a.fp8_steps) == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float8_e4m3fn, torch.float8_e5m2])
def test_te_linear_params_dtype_is_checked_at_construction(dtype):
    """float64 was accepted (the forward then blamed x); float8 raised torch's check_uniform_bounds error."""
    with pytest.raises(TypeError, match="params_dtype: expected torch.float32, torch.bfloat16 or torch.float16 "
                                        rf"\(what the fp8 casts take, as in TE\), got {dtype}"):
        te.Linear(32, 32, params_dtype=dtype)


def recorded_net(seed=0):
    torch.manual_seed(seed)
    return convert_to_float8(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)),
                             fp8core.Float8CurrentScaling())


def run_steps(net, n=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        with autocast():
            net(torch.randn(16, 32, generator=g)).square().sum().backward()


def test_record_numerics_counts_steps_per_layer_across_threads():
    """Four threads through one model: duplicate (module, operand, step) keys, and by_tensor() dropped 16 of
    1,600 rows."""
    import time
    from fp8core.torch.linear import RECORDERS

    class Slow(dict):
        """The step counter, its read slowed (a thread switch between the read and the write shows)."""

        def get(self, *args):
            found = super().get(*args)
            time.sleep(1e-4)
            return found

    net = recorded_net()
    with record_numerics(net) as rec:
        recorder, = net[0].__dict__[RECORDERS]
        recorder.steps = Slow()
        threads = [threading.Thread(target=run_steps, args=(net, 10, i)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    keys = [(r["module"], r["operand"], r["step"]) for r in rec.rows]
    assert len(rec.rows) == 4 * 10 * 2 * 3 and len(set(keys)) == len(keys) == len(rec.by_tensor())
    for m in ("0", "2"):
        for operand in ("input", "weight", "grad_output"):
            assert sorted(s for mod, op, s in keys if (mod, op) == (m, operand)) == list(range(40))


@pytest.mark.parametrize("when", ["before", "inside"])
def test_record_numerics_under_torch_compile_gives_the_eager_rows(when):
    """A model compiled before the context recorded nothing; compiling inside failed in dynamo's trace of the
    hook."""
    eager, net = recorded_net(), recorded_net()
    with record_numerics(eager, recipes="e4m3") as want:
        run_steps(eager)
    compiled = torch.compile(net, backend="aot_eager") if when == "before" else None
    if compiled is not None:
        run_steps(compiled, 1, seed=9)  # compiled, and run, with no recorder
    with record_numerics(net, recipes="e4m3") as got:
        run_steps(compiled if compiled is not None else torch.compile(net, backend="aot_eager"))
    assert len(want.rows) == 12 and got.rows == want.rows
    with record_numerics(net) as after:
        pass
    run_steps(compiled if compiled is not None else net, 1)  # closed: the compiled model records nothing
    assert after.rows == [] and not any(m._fp8_recording for m in net.modules() if isinstance(m, Float8Linear))


class FullGraph(torch.nn.Module):
    """A model whose forward no other test compiles: dynamo reuses a frame compiled (with the graph break) for
    another model of the same code, and would not meet fullgraph=True's check again."""

    def __init__(self):
        super().__init__()
        self.inner = recorded_net()

    def forward(self, x):
        return self.inner(x) + 0.0


def test_record_numerics_under_a_fullgraph_compile_is_a_clear_refusal():
    net = FullGraph()
    with record_numerics(net) as rec:
        compiled = torch.compile(net, backend="aot_eager", fullgraph=True)
        with pytest.raises(Exception, match="fp8core.torch.record_numerics measures a layer's casts on the host, "
                                            "outside the graph: compile without fullgraph=True to record"):
            run_steps(compiled, 1)
    assert rec.rows == []


@pytest.mark.parametrize("recipe", [fp8core.MXFP8BlockScaling(), fp8core.Float8BlockScaling(),
                                    fp8core.NVFP4BlockScaling()], ids=["mxfp8", "block", "nvfp4"])
def test_record_numerics_records_a_block_recipe_a_te_linear_takes_at_its_first_call(recipe):
    """AttributeError: 'MXFP8BlockScaling' object has no attribute 'margin' in the training step (then a refusal by
    name; now the block recipes' layers record)."""
    layer = te.Linear(128, 128)
    with record_numerics(layer) as rec:
        with te.autocast(recipe=recipe):
            layer(torch.randn(16, 128))
    assert [(r["operand"], r["recipe"], r["scale"]) for r in rec.rows] == \
        [("input", type(recipe).__name__, None), ("weight", type(recipe).__name__, None)]


def test_print_record_shows_whole_layer_names():
    """print(record) cut names to their last 14-20 characters: layers 0 and 1 printed alike."""
    stats = {"sqnr_db": 30.0, "underflow": 0.0, "clipped": 0.0, "at_max": 0.0, "max_rel_error": 0.1, "lost": 0.0}
    rows = [{"module": f"model.layers.{i}.self_attn.q_proj", "operand": "input", "step": 0,
             "recipe": "DelayedScaling", "format": "E4M3", "amax": 1.0, "scale": 2.0, "scale_inv": 0.5, **stats,
             "recipes": {"e4m3": dict(stats)}, "winner": "DelayedScaling"} for i in range(2)]
    text = str(NumericsRecord(rows))
    lines = text.splitlines()
    for i in range(2):
        name = f"model.layers.{i}.self_attn.q_proj"
        assert sum(line.split()[0] == name for line in lines if line.strip()) == 2, text  # both tables
