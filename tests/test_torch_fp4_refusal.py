"""FP4 training is not yet supported: NVFP4BlockScaling, which is Transformer Engine's recipe and fp8core's as data, is
refused by name wherever a torch front-end takes a recipe (autocast, convert_to_float8, Float8Linear, te.Linear)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fp8core  # noqa: E402
import fp8core.torch as te  # noqa: E402

REFUSAL = r"recipe: NVFP4BlockScaling\(disable_rht=False, .*FP4 training is not yet supported"


def test_autocast_refuses_nvfp4_by_name():
    with pytest.raises(NotImplementedError, match=REFUSAL):
        with te.autocast(enabled=True, recipe=te.recipe.NVFP4BlockScaling()):
            pass


def test_convert_to_float8_and_float8_linear_refuse_nvfp4_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with pytest.raises(NotImplementedError, match=REFUSAL):
        te.convert_to_float8(model, fp8core.NVFP4BlockScaling())
    assert type(model[0]) is torch.nn.Linear  # nothing swapped
    with pytest.raises(NotImplementedError, match=REFUSAL):
        te.Float8Linear(32, 32, recipe=fp8core.NVFP4BlockScaling())


def test_te_linear_refuses_nvfp4_at_its_autocast():
    layer = te.Linear(32, 32)
    with pytest.raises(NotImplementedError, match=REFUSAL):
        with te.autocast(enabled=True, recipe=fp8core.NVFP4BlockScaling(disable_2d_quantization=True)):
            layer(torch.ones(2, 32))
