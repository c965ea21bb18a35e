"""Whole models under torch.compile(fullgraph=True), as models are written: a forward that slices its ModuleList
(``self.layers[:n]``, as transformers does: each slice registers the layers in a new ModuleList), a model
deep-copied before conversion, a small HF Llama; and importing fp8core.torch installs no process-wide hook (it
once installed a module registration hook, which fired on every such slice and broke the fullgraph compile)."""

import copy
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import fp8core  # noqa: E402
from fp8core.torch import Float8Linear, autocast, convert_to_float8  # noqa: E402

RECIPES = [fp8core.DelayedScaling(amax_history_len=4), fp8core.Float8CurrentScaling(), fp8core.MXFP8BlockScaling(),
           fp8core.Float8BlockScaling()]
IDS = ["delayed", "current", "mxfp8", "blocks"]


def bits(t):
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_importing_fp8core_torch_installs_no_global_hook():
    code = """
import torch.nn.modules.module as m
def hooks():
    return {k: len(v) for k, v in vars(m).items() if k.startswith("_global_") and isinstance(v, dict)}
before = hooks()
import fp8core.torch
assert before and hooks() == before, (before, hooks())
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


class Sliced(torch.nn.Module):
    """Runs its first ``depth`` layers through a slice of its ModuleList, as transformers' models do."""

    def __init__(self, d=128, layers=3, depth=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.depth = depth

    def forward(self, x):
        for layer in self.layers[:self.depth]:
            x = torch.relu(layer(x))  # ReLU and a sum loss: torch's own ops are then exact, any difference fp8core's
        return x


@pytest.mark.parametrize("copied_first", [False, True], ids=["converted", "copied_then_converted"])
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_a_model_slicing_its_layers_compiles_fullgraph_and_equals_eager(recipe, copied_first):
    torch.manual_seed(0)
    base = Sliced()
    if copied_first:
        eager, twin = (convert_to_float8(copy.deepcopy(base), recipe) for _ in range(2))
    else:
        eager = convert_to_float8(base, recipe)
        twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True)
    x = torch.randn(48, 128)
    for _ in range(2):  # the second step runs on the scales the first one learned (delayed scaling)
        with autocast(recipe=recipe):
            ye, yc = eager(x), compiled(x)
            ye.sum().backward()
            yc.sum().backward()
        assert torch.equal(bits(ye), bits(yc))
        for pe, pc in zip(eager.parameters(), twin.parameters()):  # the layer past the slice has no gradient
            assert (pe.grad is None and pc.grad is None) or torch.equal(bits(pe.grad), bits(pc.grad))
    states = [(a, b) for a, b in zip(eager.modules(), twin.modules()) if isinstance(a, Float8Linear)]
    assert len(states) == 3
    for a, b in states:
        if a._fp8_group is not None:
            assert torch.equal(bits(a.fp8_amax_history), bits(b.fp8_amax_history))


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_a_small_hf_llama_compiles_fullgraph_and_equals_eager(recipe):
    """transformers' LlamaForCausalLM built from a config (no download; skipped where transformers is not
    installed: it is not among fp8core's test dependencies). Compiled with AOT autograd and no code generation
    ("aot_eager": dynamo's trace, where the module registration hook failed, forward and backward, in seconds;
    inductor's code for Llama's own fp32 ops would differ from eager in the last bits)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    eager = convert_to_float8(transformers.LlamaForCausalLM(config), recipe)
    assert sum(isinstance(m, Float8Linear) for m in eager.modules()) == 8  # q, k, v, o, gate, up, down, lm_head
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with autocast(recipe=recipe):
        ye, yc = eager(ids).logits, compiled(ids).logits
        ye.sum().backward()
        yc.sum().backward()
    assert torch.equal(bits(ye), bits(yc))
    for pe, pc in zip(eager.parameters(), twin.parameters()):
        assert torch.equal(bits(pe.grad), bits(pc.grad))
