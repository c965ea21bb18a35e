"""``fp8core demo``: a small MLP trained with Float8Linear next to an fp32 twin."""

from __future__ import annotations

import argparse

import numpy as np

import fp8core
from fp8core import Format
from fp8core.extras import install_hint

from .common import CliError, progress
from .info import gpu_report


def _device(requested: str | None) -> str:
    report = gpu_report()
    if requested == "cuda":
        if report["backend"] != "cuda":
            raise CliError(f"--device cuda: no usable GPU ({report['why']})")
        if not report["fp8_gemm"]:
            raise CliError(f"--device cuda: the FP8 GEMM is unavailable here ({report['fp8_gemm_why']})")
        return "cuda"
    if requested is None and report["backend"] == "cuda" and report.get("fp8_gemm"):
        return "cuda"
    return "cpu"


def cmd_demo(args: argparse.Namespace) -> None:
    try:
        import torch
    except ImportError:
        raise CliError(f"demo needs torch ({install_hint('torch')})") from None
    import copy

    from fp8core.torch import autocast, convert_to_float8

    device = _device(args.device)
    torch.manual_seed(0)
    recipe = fp8core.DelayedScaling(amax_history_len=16, fp8_format=Format.HYBRID)

    def net(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                                   torch.nn.GELU(), torch.nn.Linear(64, 16)).to(device)

    teacher, fp32 = net(1), net(2)
    fp8 = convert_to_float8(copy.deepcopy(fp32), recipe)
    opts = [torch.optim.Adam(m.parameters(), lr=2e-3) for m in (fp32, fp8)]
    layer = fp8[0]
    L = layer.recipe.amax_history_len
    print(f"fp8core {fp8core.__version__} demo on {device}: a 64-256-64-16 MLP learns a random teacher; "
          f"Float8Linear under DelayedScaling(HYBRID, amax_history_len={L}) next to an fp32 twin.")
    curve, track = [], []
    for step in range(1, args.steps + 1):
        x = torch.randn(128, 64, device=device)
        with torch.no_grad():
            target = teacher(x)
        losses = []
        for model, opt in zip((fp32, fp8), opts):
            with autocast():
                loss = torch.nn.functional.mse_loss(model(x), target)
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        curve.append(losses)
        h, s = layer.fp8_amax_history, layer.fp8_scale
        track.append((step, h[L - 1, 0].item(), s[0].item(), h[L - 1, 2].item(), s[2].item()))
        progress(step, args.steps, f"loss fp32 {losses[0]:.4f} fp8 {losses[1]:.4f}")
    every = max(1, args.steps // 10)
    print(f"\n{'step':>6} {'fp32 loss':>12} {'fp8 loss':>12} {'ratio':>7}")
    for i in range(every - 1, args.steps, every):
        a, b = curve[i]
        print(f"{i + 1:>6} {a:>12.5f} {b:>12.5f} {b / a if a else float('nan'):>7.3f}")
    print("\nlayer 0 of the fp8 model, over the steps (newest amax in the history; the scale after the update):")
    print(f"{'step':>6} {'input amax':>11} {'input scale':>12} {'grad amax':>11} {'grad scale':>11}")
    for row in track[every - 1::every]:
        print(f"{row[0]:>6} {row[1]:>11.4g} {row[2]:>12.4g} {row[3]:>11.4g} {row[4]:>11.4g}")
    a, b = np.mean(curve[-max(1, args.steps // 10):], axis=0)
    print(f"\nfinal loss (mean of the last tenth): fp32 {a:.5f}, fp8 {b:.5f} ({(b - a) / a:+.1%})")
