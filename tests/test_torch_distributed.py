"""fp8core.torch under DDP and FSDP2 (``fully_shard``), 2 processes with gloo on the CPU: delayed and current
scaling. Every rank ends with the same fp8 state, and outputs, gradients and weights equal, bit for bit, a
single-process run over the same global batch taken as the ranks' micro-batches (gradient accumulation).
Current scaling scales each tensor by its own amax on its own rank, as Transformer Engine and torchao do;
delayed scaling's amaxes are MAX-reduced across ranks, so its scales are those of the global batch."""

import os

import pytest

torch = pytest.importorskip("torch")

import fp8core  # noqa: E402
from fp8core.torch import Float8Linear, autocast, convert_to_float8  # noqa: E402
from ranks import WORLD, init_group, spawn  # noqa: E402

STEPS, ROWS = 3, 8
RECIPES = {"delayed": fp8core.DelayedScaling(amax_history_len=4), "current": fp8core.Float8CurrentScaling()}


def make(recipe):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    return convert_to_float8(model, recipe)


def batch(step, rank):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(WORLD * ROWS, 32, generator=g) * (1 + 3 * step)
    x[ROWS:] *= 5  # the ranks see different amaxes
    return x[rank * ROWS:(rank + 1) * ROWS]


def fp8_state(model):
    return [t.detach().clone() for m in model.modules() if isinstance(m, Float8Linear) and m._fp8_group
            for t in (m.fp8_amax_history, m.fp8_scale, m.fp8_scale_inv)]


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def cpu_mesh():
    """The ranks' CPU mesh, for every fully_shard here: without one FSDP2 takes the accelerator's, so on a machine
    with a GPU it moves the model to CUDA and runs the gloo group's collectives on CUDA tensors, where the ranks
    die with SIGSEGV (pytorch/pytorch#132471)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,))


def _rank_main(rank, out_dir, wrapper):
    import torch.distributed as dist

    init_group(rank, out_dir)
    calls = []
    all_reduce, update = dist.all_reduce, fp8core.ScalingState.update

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(("all_reduce", tensor.numel()))
        return all_reduce(tensor, *args, **kwargs)

    def counting_update(self, *args, **kwargs):
        calls.append(("update", self.num_tensors))
        return update(self, *args, **kwargs)

    dist.all_reduce, fp8core.ScalingState.update = counting_all_reduce, counting_update
    results = {}
    for name, recipe in RECIPES.items():
        calls.clear()
        model = make(recipe)
        assert not list(model.buffers())  # nothing for DDP to broadcast over the amaxes a rank accumulated
        if wrapper == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            mesh = cpu_mesh()
            fully_shard(model[0], mesh=mesh)
            fully_shard(model[2], mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
        outs = []
        for step in range(STEPS):
            with autocast():
                y = wrapped(batch(step, rank))
                y.square().sum().backward()
            opt.step()
            opt.zero_grad()
            outs.append(y.detach())
        results[name] = {"outs": outs, "state": fp8_state(model), "calls": [c for c in calls if c[1] == 6],
                         "params": [full(p.detach()).clone() for p in model.parameters()]}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def reference(recipe):
    """One process: each step, the ranks' micro-batches one after the other under one autocast."""
    model = make(recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outs = [[] for _ in range(WORLD)]
    for step in range(STEPS):
        with autocast():
            for r in range(WORLD):
                y = model(batch(step, r))
                y.square().sum().backward()
                outs[r].append(y.detach())
        for p in model.parameters():
            p.grad /= WORLD  # DDP and FSDP average over the ranks
        opt.step()
        opt.zero_grad()
    return {"outs": outs, "state": fp8_state(model), "params": [p.detach() for p in model.parameters()]}


def bits_equal(a, b):
    return all(x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b)) \
        and len(a) == len(b)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_two_ranks_match_one_process_on_the_global_batch(wrapper, tmp_path):
    spawn(_rank_main, tmp_path, wrapper)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for name, recipe in RECIPES.items():
        ref = reference(recipe)
        for r, got in enumerate(ranks):
            got = got[name]
            assert bits_equal(got["outs"], ref["outs"][r]), f"{name}: rank {r}'s outputs"
            assert bits_equal(got["state"], ref["state"]), f"{name}: rank {r}'s fp8 state"
            assert bits_equal(got["params"], ref["params"]), f"{name}: rank {r}'s weights after {STEPS} steps"
        if name == "delayed":
            assert ranks[0][name]["state"][1][0] != 1.0  # the scales moved
            # per step, for the whole model (2 layers, 6 tensors): one batched update, its one all-reduce of row 0
            assert all(got[name]["calls"] == [("update", 6), ("all_reduce", 6)] * STEPS for got in ranks)
        else:
            assert all(got[name]["calls"] == [] for got in ranks)


# ---- FP8 weight all-gather under FSDP2 -----------------------------------------------------------------------

def _fp8_all_gather_main(rank, out_dir):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from fp8core.torch import enable_fsdp_float8_all_gather

    init_group(rank, out_dir)
    sent = []
    # FSDP2 all-gathers through all_gather_single from torch 2.13 (all_gather_into_tensor then calls it), through
    # all_gather_into_tensor before
    collective = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    gather = getattr(dist, collective)

    def counting(output, input, *args, **kwargs):  # the bytes this rank puts on the wire
        sent.append(input.numel() * input.element_size())
        return gather(output, input, *args, **kwargs)

    setattr(dist, collective, counting)
    mesh = cpu_mesh()
    results = {}
    for name, recipe in RECIPES.items():
        for fp8_gather in (False, True):
            model = make(recipe).bfloat16()
            if fp8_gather:
                enable_fsdp_float8_all_gather(model)
            fully_shard(model[0], mesh=mesh)
            fully_shard(model[2], mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            sent.clear()
            outs, grads = [], []
            for step in range(STEPS):
                with autocast():
                    y = model(batch(step, rank).bfloat16())
                    y.float().square().sum().backward()
                grads += [p.grad.to_local().clone() for p in model.parameters()]
                opt.step()
                opt.zero_grad()
                outs.append(y.detach())
            shards = [getattr(p.to_local(), "high_precision", p.to_local()).detach().clone() for p in model.parameters()]
            results[name, fp8_gather] = {"outs": outs, "grads": grads, "shards": shards, "state": fp8_state(model),
                                         "bytes": sum(sent)}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_fsdp2_fp8_all_gather_equals_the_bf16_all_gather_on_half_the_weight_bytes(tmp_path):
    spawn(_fp8_all_gather_main, tmp_path)
    model = make(RECIPES["delayed"])
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, Float8Linear)) // WORLD
    biases = sum(m.bias.numel() for m in model.modules() if isinstance(m, Float8Linear)) // WORLD
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name in RECIPES:
            bf16, fp8 = got[name, False], got[name, True]
            for key in ("outs", "grads", "shards", "state"):
                assert len(bf16[key]) == len(fp8[key]) and (bf16[key] or (key, name) == ("state", "current"))
                assert all(torch.equal(a, b) for a, b in zip(bf16[key], fp8[key])), f"{name}: rank {rank}'s {key}"
            rounds, rest = divmod(bf16["bytes"], 2 * (weights + biases))  # all-gathers of both layers
            assert rest == 0 and rounds >= STEPS
            assert fp8["bytes"] == rounds * (weights + 2 * biases)  # the weights' bytes halve; biases stay bf16


# ---- fp32 master weights with a bf16 param_dtype; distributed checkpoints (issue 28) ------------------------

def _shard(model, fp8_gather, policy=None):
    from torch.distributed.fsdp import fully_shard

    from fp8core.torch import enable_fsdp_float8_all_gather

    if fp8_gather:
        enable_fsdp_float8_all_gather(model)
    kw = {"mesh": cpu_mesh()}
    if policy is not None:
        kw["mp_policy"] = policy
    fully_shard(model[0], **kw)
    fully_shard(model[2], **kw)
    return fully_shard(model, **kw)


def _steps(model, steps, rank, dtype=torch.float32, first=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outs, grads = [], []
    for step in range(first, first + steps):
        with autocast():
            y = model(batch(step, rank).to(dtype))
            y.float().square().sum().backward()
        grads += [p.grad.to_local().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        outs.append(y.detach())
    return outs, grads


def _plain_state(model):
    """Every entry of the model's state_dict as full plain tensors (weights gathered from their shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: full(v).detach().clone() for k, v in get_model_state_dict(model).items()}


def _checkpoint_main(rank, out_dir):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fp8core.torch.fsdp import Float8AllGatherWeight

    init_group(rank, out_dir)
    results = {}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for name, recipe in RECIPES.items():
        for fp8_gather in (False, True):  # fp32 master weights gathered in bf16, or in fp8 from bf16-rounded shards
            model = _shard(make(recipe), fp8_gather, policy)
            outs, grads = _steps(model, STEPS, rank, torch.bfloat16)
            shards = [getattr(p.to_local(), "high_precision", p.to_local()).detach().clone() for p in model.parameters()]
            results["mp", name, fp8_gather] = {"outs": outs, "grads": grads, "shards": shards,
                                               "state": fp8_state(model)}
        # a checkpoint of a trained model, loaded into a differently trained twin, then both train on
        model, twin = _shard(make(recipe), True), _shard(make(recipe), True)
        _steps(model, 2, rank), _steps(twin, 1, rank, first=5)
        sd = get_model_state_dict(model)
        leaked = [k for k, v in sd.items() if isinstance(getattr(v, "_local_tensor", v), Float8AllGatherWeight)]
        dcp.save(sd, checkpoint_id=os.path.join(out_dir, f"ckpt_{name}"))
        loaded = get_model_state_dict(twin)
        dcp.load(loaded, checkpoint_id=os.path.join(out_dir, f"ckpt_{name}"))
        set_model_state_dict(twin, loaded)
        same_after_load = _plain_state(model), _plain_state(twin)
        refused = None
        if name == "delayed":  # a bad checkpoint: refused, nothing written (the doubled weight neither)
            bad = {**loaded, "0.weight": loaded["0.weight"] * 2, "2.fp8_scale": -loaded["2.fp8_scale"]}
            try:
                set_model_state_dict(twin, bad)
            except RuntimeError as e:
                refused = str(e)
            after = _plain_state(twin)
            refused = refused, all(torch.equal(after[k], same_after_load[1][k]) for k in after)
        wrapped = all(isinstance(p.to_local(), Float8AllGatherWeight) for p in twin.parameters() if p.dim() == 2)
        a, b = _steps(model, 2, rank, first=2), _steps(twin, 2, rank, first=2)
        results["dcp", name] = {"leaked": leaked, "loaded": same_after_load, "wrapped": wrapped, "next": (a, b),
                                "refused": refused}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_fsdp2_param_dtype_and_distributed_checkpoints(tmp_path):
    """fp32 master weights with MixedPrecisionPolicy(param_dtype=bfloat16): the fp8 all-gather gives the bf16
    all-gather's bits. get_model_state_dict / dcp.save / dcp.load / set_model_state_dict round-trip a sharded,
    fp8-gathered model into a twin: plain tensors in the checkpoint, every entry equal, the same next steps."""
    spawn(_checkpoint_main, tmp_path)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name in RECIPES:
            bf16, fp8 = got["mp", name, False], got["mp", name, True]
            for key in ("outs", "grads", "shards", "state"):
                assert len(bf16[key]) == len(fp8[key]) and (bf16[key] or (key, name) == ("state", "current"))
                assert all(torch.equal(a, b) for a, b in zip(bf16[key], fp8[key])), f"{name}: rank {rank}'s {key}"
            assert all(p.dtype == torch.float32 for p in bf16["shards"])  # the master weights stay fp32
            r = got["dcp", name]
            assert r["leaked"] == [] and r["wrapped"]
            src, dst = r["loaded"]
            assert list(src) == list(dst) and all(torch.equal(src[k], dst[k]) for k in src), name
            assert name == "current" or any(k.endswith("fp8_steps") and src[k] == 2 for k in src)
            if name == "delayed":
                message, unchanged = r["refused"]
                assert "Error(s) in loading state_dict" in message and "2.fp8_scale: expected finite" in message
                assert unchanged
            (outs_a, grads_a), (outs_b, grads_b) = r["next"]
            assert all(torch.equal(a, b) for a, b in zip(outs_a + grads_a, outs_b + grads_b)), name


# ---- the harness itself ------------------------------------------------------------------------------------------

def _hangs_on_rank_0(rank, out_dir):
    import time

    if rank == 0:
        time.sleep(3600)


def test_a_hung_rank_fails_its_test_at_the_deadline_instead_of_hanging_the_suite(tmp_path, monkeypatch):
    import time

    import ranks

    monkeypatch.setattr(ranks, "DEADLINE_S", 10.0)
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"_hangs_on_rank_0: ranks \[0\] still running after 10 s"):
        spawn(_hangs_on_rank_0, tmp_path)
    assert time.monotonic() - start < 60
