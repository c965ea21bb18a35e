"""bench/gpu_run.py without a GPU: its plan, its no-GPU path, its time caps, and the goals table it builds
from the benchmarks' JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8core._kernels import cuda_sha256

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import gpu_run  # noqa: E402


def _script(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_run.py"), *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=300)


def test_phase1_plan(tmp_path):
    p = _script("phase1", str(tmp_path), "--dry-run")
    assert p.returncode == 0, p.stderr
    summary = (tmp_path / "summary.md").read_text()
    order = ["fp8core selftest", "test suite", "compute-sanitizer memcheck", "compute-sanitizer racecheck", "stamp"]
    positions = [summary.index(f"| {name}") for name in order]
    assert positions == sorted(positions)
    assert "--stamp" in summary and "--junitxml" in summary and "tests/test_gpu.py -k" in summary
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["cuda_sha256"] == cuda_sha256()
    assert not (tmp_path / "junit.xml").exists()


def test_phase2_plan_discovers_every_benchmark(tmp_path):
    p = _script("phase2", str(tmp_path), "--dry-run")
    assert p.returncode == 0, p.stderr
    summary = (tmp_path / "summary.md").read_text()
    names = [s.name for s in gpu_run.benchmarks()]
    assert names[:3] == ["bench_gpu.py", "bench_gemm.py", "bench_mlp.py"] and names[-1] == "bench_cpu.py"
    assert set(names) == {p.name for p in (ROOT / "bench").glob("bench_*.py")}
    for name in names:
        assert f"| {name} | planned" in summary
    assert f"bench/bench_gpu.py --json {tmp_path / 'bench_gpu.json'}" in summary


@pytest.mark.parametrize("phase", ["phase1", "phase2"])
def test_without_a_gpu_it_says_so_and_exits_3(tmp_path, phase):
    p = _script(phase, str(tmp_path), env={"CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 3, p.stdout + p.stderr
    summary = (tmp_path / "summary.md").read_text()
    assert "no usable GPU" in summary and "Traceback" not in summary
    assert not (tmp_path / "gpu-verified.json").exists()
    if phase == "phase1":
        log = (tmp_path / "selftest.txt").read_text()
        assert "fp8core selftest: no GPU to check" in log and "Traceback" not in log
        assert "| fp8core selftest | no GPU" in summary


def test_a_step_keeps_to_its_cap_and_one_that_cannot_fit_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_run, "RESERVE_S", 0)
    monkeypatch.setattr(gpu_run, "MIN_STEP_S", 1)
    run = gpu_run.Run("phase1", tmp_path, budget_s=30, dry_run=False)
    slow = run.execute(gpu_run.Step("slow", [sys.executable, "-c", "print('started', flush=True); "
                                             "import time; time.sleep(60)"], 2, "slow.log"))
    assert slow.status == "timed out" and slow.seconds < 20
    log = (tmp_path / "slow.log").read_text()
    assert "started" in log and "stopped at its cap" in log
    run.deadline = 0
    late = run.execute(gpu_run.Step("late", [sys.executable, "-c", "pass"], 5, "late.log"))
    assert late.status == "skipped" and not (tmp_path / "late.log").exists()
    summary = (tmp_path / "summary.md").read_text()
    assert "| slow | timed out" in summary and "| late | skipped" in summary


def _goal(goal_id, figure, target, higher=True):
    met = None if figure is None else (figure >= target if higher else figure <= target)
    return {"issue": 11, "id": goal_id, "goal": f"goal {goal_id}", "figure": figure, "target": target, "unit": "x",
            "higher_is_better": higher, "met": met, "profile": ["bench/bench_gpu.py", "--profile", goal_id]}


def test_goals_table_from_the_benchmarks_json(tmp_path):
    (tmp_path / "bench_gpu.json").write_text(json.dumps({"rows": [], "goals": [_goal("a", 0.95, 0.9),
                                                                             _goal("b", 20.0, 15.0, False)]}))
    (tmp_path / "bench_mlp.json").write_text(json.dumps({"rows": [], "goals": [_goal("c", None, 1.0)]}))
    (tmp_path / "bench_other.json").write_text(json.dumps([{"no": "goals"}]))
    (tmp_path / "bench_broken.json").write_text("{")
    goals = gpu_run.collect_goals(tmp_path)
    assert [g["id"] for g in goals] == ["a", "b", "c"]
    table = gpu_run.goals_table(goals)
    assert "| goal a | 0.95 x | >= 0.9 x | met | bench_gpu.json |" in table
    assert "| goal b | 20 x | <= 15 x | MISSED |" in table
    assert "| goal c | not measured | >= 1 x | not measured |" in table


def test_bench_gpu_goals_from_rows():
    pytest.importorskip("cupy")
    pytest.importorskip("torch")
    import bench_gpu

    rows = [{"op": "fp8core quantize+amax (delayed)", "mib": 64, "fraction_of_copy": 0.93, "vs_torch_compile": 1.4,
             "vs_torch_eager": 3.5},
            {"op": "fp8core quantize+amax (delayed)", "mib": 256, "fraction_of_copy": 0.88, "vs_torch_compile": 1.5,
             "vs_torch_eager": 3.1},
            {"op": "fp8core quantize_dynamic (current)", "mib": 32, "vs_delayed": 0.9},
            {"op": "fp8core cast_transpose+amax", "fraction_of_copy": 0.86},
            {"op": "update N=1000 L=1024", "launches": 1.0, "kernel_us": 16.0}]
    goals = {g["id"]: g for g in bench_gpu.goals_of(rows)}
    assert goals["quantize_copy"]["figure"] == 0.88 and goals["quantize_copy"]["met"] is False
    assert goals["quantize_vs_compile"]["met"] and goals["quantize_vs_eager"]["met"]
    assert goals["cast_transpose_copy"]["met"] and goals["dynamic_vs_delayed"]["met"]
    assert goals["update_launches"]["met"] and goals["update_us"]["met"] is False
    assert goals["host_small_quantize"]["met"] is None and goals["host_small_quantize"]["figure"] is None
    assert goals["quantize_copy"]["profile"] == ["bench/bench_gpu.py", "--profile", "quantize"]
