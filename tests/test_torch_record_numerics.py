"""fp8core.torch.record_numerics on the CPU: the rows against the casts the layers ran (amax, scale, SQNR computed
here), a twin trained without recording (the same bits), no_grad, nothing reached once the context is closed,
the refusals, and the record's JSON, summary and inspect-shaped rows."""

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fp8core  # noqa: E402
import fp8core.torch as ft  # noqa: E402
from fp8core.torch import Float8Linear, autocast, convert_to_float8, record_numerics  # noqa: E402
from fp8core.torch import numerics  # noqa: E402
from test_cli import inspect, strict_json  # noqa: E402
from test_inspect_recipes import ALL, expected  # noqa: E402

DELAYED, CURRENT = fp8core.DelayedScaling(amax_history_len=4), fp8core.Float8CurrentScaling()
TOKENS = 16  # a multiple of 16: the layers cast the operands themselves, unpadded


class Net(torch.nn.Module):
    """Two Float8Linear layers under nested names."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU())
        self.head = torch.nn.Linear(48, 16)

    def forward(self, x):
        return self.head(self.body(x))


def model(recipe, seed=0, dtype=torch.float32):
    return convert_to_float8(Net(seed).to(dtype), recipe)


def batches(n, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(TOKENS, 32, generator=g).to(dtype), torch.randn(TOKENS, 16, generator=g).to(dtype))
            for _ in range(n)]


def step(net, x, g, opt=None):
    """One forward and backward under autocast; the loss's gradient at the output is ``g``."""
    with autocast():
        y = net(x)
        (y * g).sum().backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()
    return y


def bits(t):
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def fp8_state(net):
    return [t for m in net.modules() if isinstance(m, Float8Linear) and isinstance(m.recipe, fp8core.DelayedScaling)
            for t in (m.fp8_amax_history, m.fp8_scale, m.fp8_scale_inv)]


@pytest.fixture
def casts(monkeypatch):
    """Every cast_transpose a layer runs, in order: (x, scale, q)."""
    seen = []
    real = ft.ops.cast_transpose

    def spy(x, scale, fmt, amax_out=None):
        q, qt = real(x, scale, fmt, amax_out)
        seen.append((x.detach().clone(), scale.detach().clone(), q.clone()))
        return q, qt

    monkeypatch.setattr(ft.ops, "cast_transpose", spy)
    return seen


def test_rows_name_every_layer_operand_and_step():
    net = model(DELAYED)
    with record_numerics(net) as rec:
        for x, g in batches(2):
            step(net, x, g)
    got = [(r["module"], r["operand"], r["step"]) for r in rec.rows]
    want = [(m, op, s) for s in range(2) for m, op in (
        ("body.0", "input"), ("body.0", "weight"), ("head", "input"), ("head", "weight"),
        ("head", "grad_output"), ("body.0", "grad_output"))]
    assert got == want
    assert {(r["recipe"], r["operand"], r["format"]) for r in rec.rows} == {
        ("DelayedScaling", "input", "E4M3"), ("DelayedScaling", "weight", "E4M3"),
        ("DelayedScaling", "grad_output", "E5M2")}  # HYBRID: E5M2 for gradients


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_each_row_is_the_cast_the_layer_ran(casts, recipe):
    """amax, scale and the statistics of each row, computed here from the operand and the cast's own bytes."""
    net = model(recipe)
    data = batches(3)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with record_numerics(net) as rec:
        for x, g in data:
            step(net, x, g, opt)
    assert len(rec.rows) == len(casts) == 3 * 6
    # the layers cast weight then input; the rows list input then weight
    order = [1, 0, 3, 2, 4, 5]
    pairs = [(rec.rows[6 * s + i], casts[6 * s + order[i]]) for s in range(3) for i in range(6)]
    for s, (x, g) in enumerate(data):
        first = [r for r, _ in pairs if r["step"] == s]
        assert first[0]["amax"] == x.abs().max().item()  # body.0's input: the batch
        assert first[4]["amax"] == g.abs().max().item()  # head's grad_output: the loss's gradient
    for row, (x, scale, q) in pairs:
        assert row["amax"] == x.abs().max().item()
        assert row["scale"] == scale.item()
        fmt = fp8core.Format[row["format"]]
        if recipe is CURRENT:
            want = fp8core.compute_scale(np.float32([row["amax"]]), fmt)
            assert (row["scale"], row["scale_inv"]) == (float(want[0][0]), float(want[1][0]))
        x_np = x.numpy()
        q2 = fp8core.quantize(x_np, np.float32([row["scale"]]), fmt)
        assert np.array_equal(q2.view(np.uint8), q.view(torch.uint8).numpy())  # the recorded scale is the cast's
        y = fp8core.dequantize(q2, np.float32([row["scale_inv"]])).astype(np.float64)
        v = x_np.astype(np.float64)
        want_sqnr = 10 * math.log10(np.sum(v ** 2) / np.sum((y - v) ** 2))
        assert row["sqnr_db"] == pytest.approx(want_sqnr, rel=1e-12)
        assert row["underflow"] == np.sum((v != 0) & (y == 0)) / np.count_nonzero(v)
        assert row["at_max"] == np.sum(np.abs(q2.astype(np.float32)) == fmt.max) / v.size
        assert row["max_rel_error"] == pytest.approx(np.max(np.abs(y - v)[v != 0] / np.abs(v[v != 0])), rel=1e-15)
    if recipe is DELAYED:  # the first step casts with the initial scales, the next ones with updated ones
        assert {r["scale"] for r in rec.rows if r["step"] == 0} == {1.0}
        assert all(r["scale"] != 1.0 for r in rec.rows if r["step"] == 1)


@pytest.mark.parametrize("compare", [None, "all"], ids=["casts", "all-recipes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_recording_changes_no_bit_against_a_twin(recipe, dtype, compare):
    nets = [model(recipe, dtype=dtype), model(recipe, dtype=dtype)]
    opts = [torch.optim.SGD(n.parameters(), lr=0.05) for n in nets]
    data = batches(4, dtype)
    with record_numerics(nets[0], recipes=compare) as rec:
        for x, g in data:
            ys, grads = [], []
            for net, opt in zip(nets, opts):
                with autocast():
                    y = net(x)
                    (y * g).sum().backward()
                ys.append(y)
                grads.append([p.grad.clone() for p in net.parameters()])
                opt.step()
                opt.zero_grad()
            assert torch.equal(bits(ys[0]), bits(ys[1]))
            for a, b in zip(*grads):
                assert torch.equal(bits(a), bits(b))
            for a, b in zip(fp8_state(nets[0]), fp8_state(nets[1])):
                assert torch.equal(bits(a), bits(b))
            for a, b in zip(nets[0].parameters(), nets[1].parameters()):
                assert torch.equal(bits(a), bits(b))
    assert len(rec.rows) == 4 * 6
    assert len(fp8_state(nets[0])) == (6 if recipe is DELAYED else 0)
    assert all(len(r.get("recipes", ())) == (10 if compare else 0) for r in rec.rows)  # FP8 seven, FP4 three


def test_under_no_grad_only_the_forward_rows():
    net = model(DELAYED)
    x, _ = batches(1)[0]
    with record_numerics(net) as rec, torch.no_grad(), autocast():
        net(x)
    assert [(r["module"], r["operand"]) for r in rec.rows] == [
        ("body.0", "input"), ("body.0", "weight"), ("head", "input"), ("head", "weight")]


def test_outside_autocast_the_layers_run_in_high_precision_and_nothing_is_recorded():
    net = model(DELAYED)
    x, g = batches(1)[0]
    with record_numerics(net) as rec, autocast(enabled=False):  # convert_to_float8's layers: fp8 but here
        (net(x) * g).sum().backward()
    assert rec.rows == []
    te_rule = Float8Linear(32, 16, recipe=DELAYED)  # a Float8Linear made directly: fp8 inside autocast only
    with record_numerics(te_rule) as rec:
        (te_rule(x) * g).sum().backward()
    assert rec.rows == []


def test_a_converted_model_records_without_autocast():
    """convert_to_float8's layers run in fp8 with no context (torchao's loop): recorded as they run."""
    net = model(DELAYED)
    x, g = batches(1)[0]
    with record_numerics(net) as rec:
        (net(x) * g).sum().backward()
    assert [(r["module"], r["operand"]) for r in rec.rows] == [
        ("body.0", "input"), ("body.0", "weight"), ("head", "input"), ("head", "weight"), ("head", "grad_output"),
        ("body.0", "grad_output")]
    assert rec.rows[0]["amax"] == x.abs().max().item()


def test_closed_it_reaches_nothing(monkeypatch):
    calls = []
    real = numerics.measure
    monkeypatch.setattr(numerics, "measure", lambda *a: calls.append(1) or real(*a))
    net = model(DELAYED)
    hooks = [dict(m._forward_hooks) for m in net.modules()]
    (x, g), (x2, g2) = batches(2)
    with record_numerics(net) as rec:
        step(net, x, g)
    assert len(calls) == len(rec.rows) == 6
    assert [dict(m._forward_hooks) for m in net.modules()] == hooks  # every hook gone
    step(net, x2, g2)
    with torch.no_grad(), autocast():
        net(x2)
    assert len(calls) == len(rec.rows) == 6


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_the_backward_of_a_recorded_forward_is_recorded_after_the_exit(casts, recipe):
    """The backward outside both contexts (delayed scaling's update ran between forward and backward): the
    grad_output rows carry the scales the backward's casts read."""
    net = model(recipe)
    x, g = batches(1)[0]
    with record_numerics(net) as rec, autocast():
        y = net(x)
    (y * g).sum().backward()
    assert [(r["module"], r["operand"]) for r in rec.rows[-2:]] == [("head", "grad_output"), ("body.0", "grad_output")]
    assert rec.rows[-2]["amax"] == g.abs().max().item()
    assert [r["scale"] for r in rec.rows[-2:]] == [scale.item() for _, scale, _ in casts[-2:]]

def test_a_keyword_input_and_a_hook_that_replaces_the_output(casts):
    """The grad_output row is the gradient the layer's backward casts, not the one of a replaced output."""
    layer = Float8Linear(32, 16, recipe=CURRENT)
    layer.register_forward_hook(lambda m, a, out: out * 3.0)
    x, g = batches(1)[0]
    with record_numerics(layer) as rec, autocast():
        (layer(x=x) * g).sum().backward()
    assert [r["operand"] for r in rec.rows] == ["input", "weight", "grad_output"]
    assert rec.rows[0]["amax"] == x.abs().max().item()
    assert rec.rows[2]["amax"] == (3.0 * g).abs().max().item() == casts[2][0].abs().max().item()


def test_the_hooks_go_when_the_body_raises():
    net = model(DELAYED)
    hooks = [dict(m._forward_hooks) for m in net.modules()]
    with pytest.raises(KeyError), record_numerics(net):
        raise KeyError("boom")
    assert [dict(m._forward_hooks) for m in net.modules()] == hooks


def test_refusals_name_the_argument():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got list"):
        with record_numerics([]):
            pass
    with pytest.raises(ValueError, match="model: no Float8Linear in this Net"):
        with record_numerics(Net()):
            pass


def test_a_layer_alone_is_named_empty_and_a_shared_layer_steps_per_call():
    layer = Float8Linear(32, 32, recipe=CURRENT)
    x = torch.randn(TOKENS, 32)
    with record_numerics(layer) as rec, torch.no_grad(), autocast():
        layer(layer(x))
    assert [(r["module"], r["operand"], r["step"]) for r in rec.rows] == [
        ("", "input", 0), ("", "weight", 0), ("", "input", 1), ("", "weight", 1)]
    assert "<model>" in str(rec)


def test_json_summary_and_the_inspect_chart(tmp_path):
    from fp8core.cli.compare import plot_recipes, recipe_lines

    net = model(DELAYED)
    x, g = batches(1)[0]
    x.zero_()  # no signal: SQNR None (null), and "n/a" in the summary
    with record_numerics(net) as rec:
        step(net, x, g)
    loaded = json.loads(rec.to_json())
    assert loaded[0]["module"] == "body.0" and loaded[0]["sqnr_db"] is None  # all zeros: no signal
    assert [r["operand"] for r in loaded] == [r["operand"] for r in rec.rows]
    text = str(rec)
    assert text.splitlines()[1].split()[:4] == ["body.0", "input", "E4M3", "1"]
    assert "grad_output" in text and "n/a" in text
    tensors = rec.by_tensor()
    assert list(tensors)[:2] == ["body.0.input@0", "body.0.weight@0"]
    line = next(recipe_lines(tensors["head.grad_output@0"]))
    assert line.split()[:2] == ["*DelayedScaling", f"{rec.rows[4]['sqnr_db']:.2f}"]
    assert rec.recipes() == ["DelayedScaling"]
    chart = plot_recipes(tensors, rec.recipes(), str(tmp_path / "run.png"))
    assert chart.exists() and chart.stat().st_size > 0


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_each_compared_recipe_is_the_public_apis_round_trip_of_the_operand(casts, recipe):
    """Per row and recipe, the statistics of dequantize(quantize(x)) by the public API, x the operand the layer
    cast (its cast_transpose's input); the winner the best SQNR among the layer's cast and the recipes."""
    net = model(recipe)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with record_numerics(net, recipes="all") as rec:
        for x, g in batches(2):
            step(net, x, g, opt)
    order = [1, 0, 3, 2, 4, 5]  # the layers cast weight then input; the rows list input then weight
    pairs = [(rec.rows[6 * s + i], casts[6 * s + order[i]]) for s in range(2) for i in range(6)]
    for row, (x, _, _) in pairs:
        assert list(row["recipes"]) == ALL
        for name in ALL:
            want, have = expected(x.numpy(), name), row["recipes"][name]
            assert have["sqnr_db"] == pytest.approx(want["sqnr_db"], rel=1e-9), (row["operand"], name)
            for field in ("underflow", "clipped", "at_max", "max_rel_error"):
                assert have[field] == want[field], (row["operand"], name, field)
        best = max([row["recipe"], *ALL], key=lambda n: row["sqnr_db"] if n == row["recipe"]
                   else row["recipes"][n]["sqnr_db"])  # max keeps the first of equals: the layer's cast on a tie
        assert row["winner"] == best


def test_off_by_default_one_measure_per_cast(monkeypatch):
    calls = []
    real = numerics.measure
    monkeypatch.setattr(numerics, "measure", lambda x, r: calls.append(r.name) or real(x, r))
    x, g = batches(1)[0]
    net = model(CURRENT)
    with record_numerics(net) as rec:
        step(net, x, g)
    assert calls == ["given"] * 6 and not any("recipes" in r or "winner" in r for r in rec.rows)
    calls.clear()
    with record_numerics(net, recipes=["block_1x128", "e5m2", "block_1x128"]) as rec:
        step(net, x, g)
    assert calls == ["given", "block_1x128", "e5m2"] * 6  # in the order given, repeats dropped
    assert [list(r["recipes"]) for r in rec.rows] == [["block_1x128", "e5m2"]] * 6


def test_recipes_refusals_name_the_argument_and_install_nothing():
    net = model(DELAYED)
    hooks = [dict(m._forward_hooks) for m in net.modules()]
    for bad, err, says in [("e4m3,bogus", ValueError, "recipes: unknown recipe 'bogus'; expected 'all' or a "
                            "comma-separated list of e4m3, e5m2, rowwise, mxfp8_rceil"),
                           (["e4m3", ""], ValueError, "recipes: an empty name"),
                           (3, TypeError, "recipes: expected 'all', a comma-separated string or a list"),
                           ([fp8core.Format.E4M3], TypeError, "recipes: expected recipe names")]:
        with pytest.raises(err, match=says):
            with record_numerics(net, recipes=bad):
                pass
    assert [dict(m._forward_hooks) for m in net.modules()] == hooks


def test_a_saved_record_loads_back_and_inspect_prints_it(tmp_path, capsys):
    net = model(DELAYED)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    data = batches(3)
    data[0] = (torch.randint(-8, 9, (TOKENS, 32)).float(), data[0][1])  # small integers: exact at scale 1.0
    with record_numerics(net, recipes="e4m3,mxfp8_rceil") as rec:
        for x, g in data:
            step(net, x, g, opt)
    assert rec.rows[0]["sqnr_db"] == math.inf  # step 0's input: strict JSON's "inf", a float again on loading
    path = rec.save(tmp_path / "run.json")
    assert ft.NumericsRecord.load(path).rows == rec.rows
    assert "least SQNR dB over the steps in each recipe" in str(rec)
    code, out, err = inspect(capsys, path, "--json")
    assert code == 0, err
    assert strict_json(out)["tensors"] == strict_json(json.dumps(numerics.strict_json(rec.by_operand())))
    by = rec.by_operand()
    assert list(by) == ["body.0.input", "body.0.weight", "head.input", "head.weight", "head.grad_output",
                        "body.0.grad_output"]
    inputs = [r for r in rec.rows if (r["module"], r["operand"]) == ("body.0", "input")]
    assert by["body.0.input"]["recipes"]["e4m3"]["sqnr_db"] == min(r["recipes"]["e4m3"]["sqnr_db"] for r in inputs)
    assert by["body.0.input"]["recipes"]["DelayedScaling"]["sqnr_db"] == min(r["sqnr_db"] for r in inputs)
    code, out, err = inspect(capsys, path, "--plot", tmp_path / "run.png")
    assert code == 0, err
    assert "body.0.input  DelayedScaling E4M3  3 step(s)" in out and (tmp_path / "run.png").stat().st_size > 0
    (tmp_path / "bad.json").write_text(json.dumps({"rows": rec.to_json()}))
    with pytest.raises(ValueError, match=f"{tmp_path / 'bad.json'}: not a record: its top level is a JSON object"):
        ft.NumericsRecord.load(tmp_path / "bad.json")
    (tmp_path / "deep.json").write_text("[" * 100_000)
    with pytest.raises(ValueError, match=f"{tmp_path / 'deep.json'}: JSON nested too deeply to be a record"):
        ft.NumericsRecord.load(tmp_path / "deep.json")


def test_an_expanded_gradient_is_measured():
    """The backward of a sum hands the layer a gradient of stride 0 (expanded ones): measured as its values."""
    layer = Float8Linear(32, 16, recipe=CURRENT)
    x, _ = batches(1)[0]
    with record_numerics(layer, recipes="e4m3") as rec, autocast():
        layer(x).sum().backward()
    g = rec.rows[2]
    assert (g["operand"], g["amax"], g["sqnr_db"], g["recipes"]["e4m3"]["sqnr_db"]) == ("grad_output", 1.0, math.inf,
                                                                                       math.inf)
