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
    order = ["fp8core selftest", "test suite", "compute-sanitizer memcheck", "compute-sanitizer racecheck",
             "compute-sanitizer memcheck-selftest", "compute-sanitizer racecheck-selftest", "stamp"]
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
    # bench_ab.py compares two commits, given one: not a benchmark of this checkout
    assert set(names) == {p.name for p in (ROOT / "bench").glob("bench_*.py")} - {"bench_ab.py"}
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


def _fake_execute(outcomes):
    """Run.execute that runs nothing: each step 'ends' as ``outcomes[name](run, step)`` says (files it leaves)."""
    def execute(self, step):
        self.steps.append(step)
        for key, act in outcomes.items():
            if step.name.startswith(key):
                step.rc = act(self, step)
                step.status = "passed" if step.rc == 0 else "failed"
        self.summary()
        return step
    return execute


def _junit(failures):
    return (f'<testsuites><testsuite name="pytest" tests="10" failures="{failures}" errors="0" skipped="2">'
            '</testsuite></testsuites>')


def _phase1_outcomes(failures=0, sanitizer_errors=0):
    def selftest_ok(run, step):
        (run.results / "selftest-stamp.json").write_text(json.dumps({"cuda_sha256": cuda_sha256(), "commit": "c",
                                                                     "device": "cuda:0 (GPU)", "passed": 99,
                                                                     "failed": 0, "versions": {}}))
        return 0

    def suite(run, step):
        (run.results / "junit.xml").write_text(_junit(failures))
        return 1 if failures else 0

    def sanitizer(run, step):
        (run.results / step.log).write_text(f"========= ERROR SUMMARY: {sanitizer_errors} errors\n")
        return 86 if sanitizer_errors else 0

    return {"fp8core selftest": selftest_ok, "test suite": suite, "compute-sanitizer": sanitizer}


def test_phase1_writes_the_stamp_when_everything_passed(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_run.Run, "execute", _fake_execute(_phase1_outcomes()))
    monkeypatch.setattr(gpu_run, "STAMP", tmp_path / "repo" / "gpu-verified.json")
    run = gpu_run.Run("phase1", tmp_path / "r", 500, dry_run=False)
    assert gpu_run.phase1(run) == 0
    stamp = json.loads((tmp_path / "repo" / "gpu-verified.json").read_text())
    assert stamp == json.loads((tmp_path / "r" / "gpu-verified.json").read_text())
    assert stamp["cuda_sha256"] == cuda_sha256() and stamp["passed"] == 8 and stamp["failed"] == 0
    assert stamp["selftest"] == {"passed": 99, "failed": 0}
    assert stamp["sanitizer"]["memcheck"]["errors"] == 0 and stamp["sanitizer"]["racecheck"]["complete"]
    assert stamp["sanitizer"]["racecheck-selftest"]["errors"] == 0, "every kernel under the sanitizers"
    assert "| stamp | written" in (tmp_path / "r" / "summary.md").read_text()


@pytest.mark.parametrize("failures,sanitizer_errors", [(1, 0), (0, 3)])
def test_phase1_refuses_the_stamp_after_a_failure(tmp_path, monkeypatch, failures, sanitizer_errors):
    monkeypatch.setattr(gpu_run.Run, "execute", _fake_execute(_phase1_outcomes(failures, sanitizer_errors)))
    monkeypatch.setattr(gpu_run, "STAMP", tmp_path / "repo" / "gpu-verified.json")
    run = gpu_run.Run("phase1", tmp_path / "r", 500, dry_run=False)
    assert gpu_run.phase1(run) == 1
    assert not (tmp_path / "repo" / "gpu-verified.json").exists()
    assert not (tmp_path / "r" / "gpu-verified.json").exists()
    why = (tmp_path / "r" / "stamp-refused.txt").read_text()
    assert ("test suite" in why) == bool(failures) and ("memcheck" in why) == bool(sanitizer_errors)
    assert "| stamp | refused" in (tmp_path / "r" / "summary.md").read_text()


def test_phase2_profiles_the_missed_goals_once_each(tmp_path, monkeypatch):
    def bench(run, step):
        if step.name == "bench_gpu.py":
            goals = [_goal("a", 0.5, 0.9), _goal("a2", 0.5, 0.9), _goal("b", 0.95, 0.9)]
            goals[1]["profile"] = goals[0]["profile"]
            (run.results / "bench_gpu.json").write_text(json.dumps({"rows": [], "goals": goals}))
        return 0

    monkeypatch.setattr(gpu_run.Run, "execute", _fake_execute({"bench_": bench}))
    monkeypatch.setattr(gpu_run, "gpu_reason", lambda: None)
    run = gpu_run.Run("phase2", tmp_path, 500, dry_run=False)
    assert gpu_run.phase2(run) == 0
    ncu = [s for s in run.steps if s.name.startswith("ncu")]
    assert [s.name for s in ncu] == ["ncu a"]
    assert ncu[0].cmd[0] == "ncu" and ncu[0].cmd[-3:] == ["bench/bench_gpu.py", "--profile", "a"]
    summary = (tmp_path / "summary.md").read_text()
    assert "## Goals" in summary and "| goal a | 0.5 x | >= 0.9 x | MISSED | bench_gpu.json |" in summary


def test_a_missing_tool_fails_its_step_not_the_run(tmp_path):
    run = gpu_run.Run("phase1", tmp_path, budget_s=100, dry_run=False)
    step = run.execute(gpu_run.Step("sanitizer", ["no-such-tool-fp8core", "--x"], 30, "s.log"))
    assert step.status == "failed" and "could not start no-such-tool-fp8core" in step.note
    assert "could not start" in (tmp_path / "s.log").read_text()


def test_profiled_kernels_name_every_kernel_under_cuda():
    """ncu's filter must match fp8core's kernels by their real names (the first GPU run matched none)."""
    names = gpu_run.profiled_kernels().removeprefix("regex:").split("|")
    for kernel in ("quantize_kernel", "cast_transpose_kernel", "quantize_dynamic_kernel", "mx_quantize_kernel",
                   "update_kernel", "nvjet"):
        assert kernel in names
    assert not any("launch_bounds" in n for n in names)


@pytest.mark.parametrize("text,errors", [
    ("========= ERROR SUMMARY: 0 errors\n", 0),
    ("========= ERROR SUMMARY: 3 errors\n", 3),
    # racecheck's own last line (the H200 run of 2026-11-27 read it as "no error summary")
    ("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n", 0),
    ("========= RACECHECK SUMMARY: 4 hazards displayed (2 errors, 2 warnings)\n", 2),
    ("32 passed in 7.44s\n", None),
])
def test_sanitizer_summaries_are_read(tmp_path, text, errors):
    log = tmp_path / "sanitizer.log"
    log.write_text(text)
    assert gpu_run._sanitizer_errors(log) == errors
