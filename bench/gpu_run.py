"""The whole GPU run (shared/GPU.md, issue 11) in two phases of at most 10 minutes each, into a results folder.

    python bench/gpu_run.py phase1 RESULTS [--budget 540]   selftest, the test suite with the GPU tests,
                                                            compute-sanitizer memcheck and racecheck over the
                                                            kernel tests and over selftest --quick, the stamp
    python bench/gpu_run.py phase2 RESULTS [--budget 540]   every bench/bench_*.py, the goals table, ncu
                                                            summaries of the kernels whose goals are missed
    python bench/gpu_run.py all RESULTS                     both, one after the other
    python bench/gpu_run.py phase1 RESULTS --dry-run        the plan only: steps, commands, time caps

Each phase keeps to its --budget (seconds) by itself: every step runs under a cap cut to the time left, and a
step that would not fit is skipped and says so. Every step writes its log into RESULTS as it runs and
RESULTS/summary.md is rewritten after each step, so a run cut short still leaves what it measured.
The stamp (bench/results/gpu-verified.json, a copy in RESULTS) is written only when the selftest and the
whole suite passed and the sanitizers reported no error. Exit status: 0 all steps passed (phase 2: all
benchmarks ran; missed goals are figures, not failures), 1 something failed, 3 no usable GPU.

On the lent GPU machine (the `device` tool's `run`; Python 3.12, torch 2.11 cu130, jax 0.11.2, cupy-cuda13x
14.2, no network, neither nvmath-python nor torchao). Once, here, in the repository root, fetch their wheels
into the ignored folder .whl (nvmath-python's needs, cuda-bindings, cuda-core, cuda-pathfinder and numpy,
are on the machine):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl nvmath-python==1.0.0 torchao==0.17.0

Then each phase is one `run` call with carry [".whl"] and timeout_s 600 (a machine stays warm for 30 s only,
so each command sets itself up):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site || exit; python3 -m pip install -q --no-deps \
      --no-build-isolation -e . || exit; export PYTHONUNBUFFERED=1; python3 bench/gpu_run.py phase1 /tmp/r \
      --budget 540; tar czf $OUT/phase1.tgz -C /tmp/r .; cp /tmp/r/summary.md $OUT/

(phase2 alike, into $OUT/phase2.tgz.) At most 8 files come back from $OUT, hence the archive. Unpack it into
bench/results/gpu-<date>/, copy gpu-verified.json to bench/results/, and commit both.
"""

# ---- What only a GPU can settle (gpureview, 2026-11-22): read before phase 1, check these rows after it -------
# Every item below was read against cuBLAS/TE/torch and is coded to the documented answer; none has run.
# 1. nvmath loads cuBLASLt: env.json "cublasLt" must be a version (>= 120900 for 1x128/128x128), not an error.
# 2. Block-scale layouts (torch PR #166752 quotes cuBLAS's "scaling factors layouts": 1x128 scales [KB, rows]
#    unpadded, stride M; 128x128 [row tiles, round4(KB)] zero-padded): tests/test_gpu_blocks.py -k "rows_not_a or
#    small_and_odd_m or torch_scaled_mm". Wrong values = a layout bug (cuda_blocks.layout_for_cublaslt and
#    cpu_blocks.gemm_scale together); wrong values only where M % 4 != 0 (M = 1, 130) = cuBLASLt reads the 1x128
#    scales with leading dimension round4(M) (Transformer Engine's "GEMM-ready" layout pads M to 4): pad there.
#    "found no FP8 GEMM algorithm" only for M = 1, 20, 130 with a 1x128 a = Transformer Engine's n % 8 rule
#    (cublaslt_gemm.cu: "Outer dimension requirement ... Caller must pad"): then refuse M % 8 in
#    blocks.gemm_scales on both backends (or pad), not in the test.
# 3. AMAX_D is set, not max-accumulated, by cuBLASLt: test_gpu_gemm.py::test_amax_word_is_set_by_each_gemm_not_
#    accumulated (else zero the scratch word before each call: cuda.py _fill on the launch stream).
# 4. BIAS epilogue with block scale modes: test_gpu_blocks.py::test_block_gemm_with_bias (a failure: refuse bias
#    with blocks in blocks.gemm_scales); a bias 2 bytes off: test_gpu_gemm.py::test_bias_at_an_odd_address (a
#    failure: refuse a bias not 16-byte aligned in gemm._bias, both backends).
# 5. Graph capture: test_gpu_gemm.py::test_cuda_graph_capture_of_a_threads_first_gemm makes cublasLtCreate, the
#    plan and the workspace inside torch's global-mode capture; also run `-k 10_replays` alone (a fresh process).
#    test_gpu.py::test_first_kernel_launch_inside_torch_graph_capture_in_a_fresh_process: an fp8core kernel's
#    module loaded and its function fetched inside capture (lazy loading); a failure: load a device's modules
#    at its first use, or document warm-up before capture.
# 6. JAX on a GPU: tests/test_jax_frontend.py under jit (buffer_callback is made with command_buffer_compatible
#    False, its default, so XLA keeps it out of CUDA graphs and CuPy's pool may allocate inside it). The generic
#    API reads a JAX GPU array through DLPack naming CuPy's current stream (_tensor._consumer_stream), so XLA
#    orders it on the GPU instead of blocking the host: tests/test_interop.py's JAX GPU rows must pass with it.
#    fp8core.jax's callback buffers are read naming no stream (_tensor._from_jax_buffer), as before.
# 7. Not on Hopper: MXFP8 GEMM and the sm_100f/sm_120f kernels (the "mx" rows skip or check the refusal); on a
#    Blackwell GPU, that 1x128/128x128 GEMMs are refused by name (cublaslt._block_scales: sm_90 only, from
#    torch PR #188996 and TE's MXFP8 emulation) rather than supported by a newer cuBLASLt.
# 8. CuPy's own capture: tests/test_cupy_capture.py -k gpu (replays equal eager, arrays allocated after the capture
#    stay untouched; quantize_dynamic's two-pass path, taken there with out=, must equal its cooperative kernel).

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
STAMP = BENCH / "results" / "gpu-verified.json"
EXIT_OK, EXIT_FAIL, EXIT_NO_GPU = 0, 1, 3
RESERVE_S = 15  # kept back from every cap for writing the summary and the archive
MIN_STEP_S = 10  # a step with less time than this left is skipped, not started
# The kernel tests under the sanitizers: small shapes, every kernel family; racecheck is the slower tool.
# Capture tests stay out of memcheck: without torch's caching allocator (which memcheck needs to see bounds) a
# capture's first allocation is a cudaMalloc inside capture, an API error of the setting, not of fp8core.
MEMCHECK_K = "not over_2_31 and not cuda_graph and not capture"
RACECHECK_K = "(quantize_amax_cast_transpose and float32) or update_matches_cpu or multi_tensor or " \
              "(quantize_dynamic and (1000 or 1048576))"
# fp8core selftest with CuPy allocating by cudaMalloc, as the pytest plugin below arranges for the tests
SELFTEST_RAW_ALLOCATIONS = ("import runpy, sys, cupy; cupy.cuda.set_allocator(None); "
                            "cupy.cuda.set_pinned_memory_allocator(None); sys.argv = ['fp8core', 'selftest', '--quick']; "
                            "runpy.run_module('fp8core', run_name='__main__')")
FIRST_BENCHES = ("bench_gpu.py", "bench_gemm.py", "bench_mlp.py")
# cuBLASLt's GEMM kernels (Hopper's are named nvjet_*, sm90_xmma_*, cutlass_*); fp8core's are read from cuda/.
CUBLASLT_KERNELS = ("gemm", "nvjet", "xmma", "cutlass")


@dataclass
class Step:
    name: str
    cmd: list[str]
    cap_s: float
    log: str
    env: dict[str, str] = field(default_factory=dict)
    status: str = "planned"
    rc: int | None = None
    seconds: float = 0.0
    note: str = ""


class Run:
    def __init__(self, phase: str, results: Path, budget_s: float, dry_run: bool) -> None:
        self.phase, self.results, self.dry_run = phase, results, dry_run
        self.deadline = time.monotonic() + budget_s
        self.budget_s = budget_s
        self.steps: list[Step] = []
        self.facts: dict[str, Any] = {}
        results.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def execute(self, step: Step) -> Step:
        """Run ``step`` with its output into its log, under min(cap, time left); record how it ended."""
        self.steps.append(step)
        cap = min(step.cap_s, self.left() - RESERVE_S)
        if self.dry_run:
            step.note = f"cap {step.cap_s:.0f} s"
            self.summary()
            return step
        if cap < MIN_STEP_S:
            step.status, step.note = "skipped", f"no time left in the phase's budget ({self.left():.0f} s)"
            self.summary()
            return step
        step.status = "running"
        self.summary()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **step.env}
        # JAX takes 75% of the GPU at its first use by default: pytest-xdist's workers would starve each other.
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), env.get("PYTHONPATH", "")) if p)
        t0 = time.monotonic()
        with open(self.results / step.log, "ab") as log:
            log.write(f"$ {shlex.join(step.cmd)}   (cap {cap:.0f} s)\n".encode())
            log.flush()
            try:
                proc = subprocess.Popen(step.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
            except OSError as e:  # the tool is not installed here
                step.status, step.note = "failed", f"could not start {step.cmd[0]}: {e.strerror or e}"
                log.write(f"[gpu_run: {step.note}]\n".encode())
                self.summary()
                return step
            try:
                step.rc = proc.wait(timeout=cap)
                step.status = "passed" if step.rc == 0 else "failed"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                step.status, step.note = "timed out", f"stopped at its cap of {cap:.0f} s"
                log.write(f"\n[gpu_run: stopped at its cap of {cap:.0f} s]\n".encode())
        step.seconds = time.monotonic() - t0
        self.summary()
        return step

    def write_json(self, name: str, data: Any) -> None:
        (self.results / name).write_text(json.dumps(data, indent=1, default=str) + "\n")

    def summary(self) -> None:
        lines = [f"# fp8core GPU run, {self.phase}", ""]
        for k, v in self.facts.items():
            lines.append(f"- {k}: {v}")
        lines += ["", "| step | status | seconds | log | note |", "|---|---|---|---|---|"]
        for s in self.steps:
            lines.append(f"| {s.name} | {s.status}{'' if s.rc in (None, 0) else f' (exit {s.rc})'} | "
                         f"{s.seconds:.0f} | {s.log} | {s.note} |")
        if self.dry_run:
            lines += ["", "Commands (dry run, nothing was run):", ""]
            lines += [f"    {s.name}: {shlex.join(s.cmd)}" for s in self.steps]
        goals = self.results / "goals.md"
        if goals.is_file():
            lines += ["", goals.read_text()]
        (self.results / "summary.md").write_text("\n".join(lines) + "\n")


# ---- the environment ---------------------------------------------------------------------------------------

def environment(run: Run) -> dict[str, Any]:
    from fp8core._kernels import cuda_sha256
    from fp8core.selftest import commit_of_checkout, versions

    env: dict[str, Any] = {"phase": run.phase, "commit": commit_of_checkout(), "cuda_sha256": cuda_sha256(),
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "versions": versions(),
                           "tools": {t: shutil.which(t) for t in ("nvidia-smi", "compute-sanitizer", "ncu", "nvcc")}}
    try:  # nvmath's cuBLASLt: the library the GEMM will load, or why it cannot
        from nvmath.bindings import cublasLt

        env["cublasLt"] = int(cublasLt.get_version())
    except Exception as e:  # noqa: BLE001 - recorded, not raised: the GEMM tests then say the same
        env["cublasLt"] = f"unavailable: {type(e).__name__}: {e}"
    if env["tools"]["nvidia-smi"] and not run.dry_run:
        try:
            env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                                                "clocks.max.sm", "--format=csv,noheader"], capture_output=True,
                                               text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            env["nvidia_smi"] = f"failed: {e}"
    run.write_json("env.json", env)
    run.facts.update({"commit": env["commit"], "cuda/ sha256": env["cuda_sha256"][:16], "date": env["date"],
                      "cuBLASLt": env["cublasLt"]})
    return env


def gpu_reason() -> str | None:
    from fp8core.selftest.gpu import gpu_reason as reason

    return reason(0)


# ---- phase 1 -----------------------------------------------------------------------------------------------

def _junit_counts(path: Path) -> dict[str, int] | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root)
    c = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    c["passed"] = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
    return c


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _xdist_mode() -> str:
    """worksteal (pytest-xdist 3.2+) balances tests of very different lengths; loadfile before it."""
    from importlib.metadata import version

    major, minor = (int(p) for p in version("pytest-xdist").split(".")[:2])
    return "worksteal" if (major, minor) >= (3, 2) else "loadfile"


def _sanitizer_step(tool: str, selection: str | None, cap: float) -> Step:
    """The sanitizer over tests/test_gpu.py's ``selection``, or (None) over ``fp8core selftest --quick``: the one
    run that reaches every kernel, the block and FP4 quantizers' shared-memory transposes included."""
    target = (["-m", "pytest", "-q", "-p", "gpu_run", "-p", "no:cacheprovider", "tests/test_gpu.py", "-k", selection]
              if selection is not None else ["-c", SELFTEST_RAW_ALLOCATIONS])
    name = f"{tool}{'' if selection is not None else '-selftest'}"
    cmd = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "86", "--print-limit", "30",
           sys.executable, *target]
    return Step(f"compute-sanitizer {name}", cmd, cap, f"sanitizer-{name}.log",
                env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1", "FP8CORE_GPU_RUN_SANITIZER": "1"})


def _sanitizer_errors(path: Path) -> int | None:
    text = path.read_text(errors="replace") if path.is_file() else ""
    # memcheck ends "ERROR SUMMARY: N errors", racecheck "RACECHECK SUMMARY: H hazards displayed (N errors, ...)"
    m = re.findall(r"(?:ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error)", text)
    return sum(int(a or b) for a, b in m) if m else None


def phase1(run: Run) -> int:
    environment(run)
    selftest = run.execute(Step("fp8core selftest", [sys.executable, "-m", "fp8core", "selftest", "--stamp",
                                                     str(run.results / "selftest-stamp.json")], 150,
                                "selftest.txt"))
    if selftest.rc == EXIT_NO_GPU:
        selftest.status = "no GPU"
        run.facts["verdict"] = f"no usable GPU ({gpu_reason()}); nothing else was run"
        run.summary()
        return EXIT_NO_GPU
    # 2026-11-27 (H200): 4,341 tests on 12 workers by file did not end in 330 s; test_sass alone holds minutes of
    # compiles. Work stealing evens the workers; -v names every test as it ends, so a run stopped at its cap (no
    # junit then) still says what failed and what was running; a test over 150 s is stopped and named.
    parallel = ["-n", "15", "--dist", _xdist_mode()] if _has_module("xdist") else []
    timeout = ["--timeout", "150"] if _has_module("pytest_timeout") else []
    tests = run.execute(Step("test suite (GPU tests included)",
                             [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", *parallel,
                              *timeout, "--durations", "40", "--junitxml", str(run.results / "junit.xml")], 380,
                             "tests.log"))
    counts = _junit_counts(run.results / "junit.xml") if not run.dry_run else None
    run.facts["test suite"] = counts or "no junit report"
    sanitizers = {}
    for tool, selection, cap in (("memcheck", MEMCHECK_K, 120), ("racecheck", RACECHECK_K, 120),
                                 ("memcheck", None, 90), ("racecheck", None, 90)):
        step = run.execute(_sanitizer_step(tool, selection, cap))
        tool = step.name.removeprefix("compute-sanitizer ")
        errors = _sanitizer_errors(run.results / step.log) if not run.dry_run else None
        sanitizers[tool] = {"status": step.status, "errors": errors,
                            "complete": step.status in ("passed", "failed")}
        run.facts[f"sanitizer {tool}"] = f"{step.status}, {errors if errors is not None else 'no'} error summary"
    if run.dry_run:
        run.steps.append(Step("stamp", ["(written when everything above passed)"], 0, os.path.relpath(STAMP, ROOT)))
        run.summary()
        return EXIT_OK
    refused = []
    if selftest.rc != 0:
        refused.append(f"selftest exit {selftest.rc}")
    if counts is None or counts["failures"] or counts["errors"] or tests.status != "passed":
        refused.append(f"test suite {tests.status} ({counts})")
    for tool, s in sanitizers.items():
        if s["errors"] or s["status"] == "failed" or s["status"] == "skipped":
            refused.append(f"{tool} {s['status']} ({s['errors']} errors)")
    stamp_step = Step("stamp", [], 0, "gpu-verified.json")
    run.steps.append(stamp_step)
    if refused:
        stamp_step.status, stamp_step.note = "refused", "; ".join(refused)
        (run.results / "stamp-refused.txt").write_text("\n".join(refused) + "\n")
        run.summary()
        return EXIT_FAIL
    record = json.loads((run.results / "selftest-stamp.json").read_text())
    record["selftest"] = {"passed": record["passed"], "failed": record["failed"]}
    record.update(passed=counts["passed"], failed=counts["failures"] + counts["errors"], skipped=counts["skipped"],
                  sanitizer=sanitizers, by="bench/gpu_run.py phase1")
    run.write_json("gpu-verified.json", record)
    STAMP.parent.mkdir(parents=True, exist_ok=True)
    STAMP.write_text(json.dumps(record, indent=1) + "\n")
    stamp_step.status, stamp_step.note = "written", f"{os.path.relpath(STAMP, ROOT)} and RESULTS/gpu-verified.json"
    run.summary()
    return EXIT_OK


def pytest_configure(config: Any) -> None:
    """As a pytest plugin (-p gpu_run) under compute-sanitizer: CuPy allocates with cudaMalloc directly, so
    an access past an array's end is past an allocation's end, which memcheck sees (torch: the env var)."""
    if os.environ.get("FP8CORE_GPU_RUN_SANITIZER"):
        import cupy

        cupy.cuda.set_allocator(None)
        cupy.cuda.set_pinned_memory_allocator(None)


# ---- phase 2 -----------------------------------------------------------------------------------------------

def profiled_kernels() -> str:
    """ncu's --kernel-name regex: every __global__ function under cuda/ and cuBLASLt's GEMM kernels."""
    names = set()
    for path in sorted((ROOT / "cuda").glob("*.cu*")):
        names.update(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)", path.read_text()))
    return "regex:" + "|".join(sorted(names) + list(CUBLASLT_KERNELS))


def benchmarks() -> list[Path]:
    """Every bench/bench_*.py but bench_ab.py (an A/B of two commits, given one), those deciding issue 11's goals
    first, the CPU reference's last."""
    found = sorted(p for p in BENCH.glob("bench_*.py") if p.name != "bench_ab.py")
    first = [BENCH / n for n in FIRST_BENCHES if (BENCH / n).is_file()]
    rest = [p for p in found if p not in first and p.name != "bench_cpu.py"]
    return first + rest + [p for p in found if p.name == "bench_cpu.py"]


def _takes_json(script: Path) -> bool:
    return "--json" in script.read_text()


def collect_goals(results: Path) -> list[dict[str, Any]]:
    """Every goal from the benchmarks' JSON files in ``results`` (key "goals"), in file order."""
    goals = []
    for path in sorted(results.glob("bench_*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for g in data.get("goals", []) if isinstance(data, dict) else []:
            goals.append({**g, "source": path.name})
    return goals


def goals_table(goals: list[dict[str, Any]]) -> str:
    lines = ["## Goals", "", "| goal | figure | target | verdict | from |", "|---|---|---|---|---|"]
    for g in goals:
        fig = "not measured" if g.get("figure") is None else f"{g['figure']:.3g} {g['unit']}"
        op = ">=" if g.get("higher_is_better", True) else "<="
        verdict = {True: "met", False: "MISSED", None: "not measured"}[g.get("met")]
        lines.append(f"| {g['goal']} | {fig} | {op} {g['target']:g} {g['unit']} | {verdict} | {g['source']} |")
    return "\n".join(lines) + "\n"


def phase2(run: Run) -> int:
    environment(run)
    if not run.dry_run and gpu_reason():
        run.facts["verdict"] = f"no usable GPU ({gpu_reason()}); nothing was run"
        run.summary()
        return EXIT_NO_GPU
    failed = 0
    caps = {"bench_gpu.py": 150, "bench_gemm.py": 150, "bench_mlp.py": 90}
    for script in benchmarks():
        out = run.results / f"{script.stem}.json"
        cmd = [sys.executable, str(script.relative_to(ROOT))] + (["--json", str(out)] if _takes_json(script) else [])
        if script.name == "bench_cpu.py":
            cmd.append("--quick")
        elif '"--gpu"' in script.read_text():  # a benchmark of both kinds: here, its GPU half
            cmd.append("--gpu")
        step = run.execute(Step(script.name, cmd, caps.get(script.name, 60), f"{script.stem}.log"))
        failed += step.status in ("failed", "timed out")
    goals = collect_goals(run.results)
    run.write_json("goals.json", goals)
    (run.results / "goals.md").write_text(goals_table(goals))
    run.summary()
    profiled = set()
    for g in goals:
        prof = g.get("profile")
        if g.get("met") is not False or not prof or tuple(prof) in profiled:
            continue
        profiled.add(tuple(prof))
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", g["id"])
        cmd = ["ncu", "--target-processes", "all", "--clock-control", "none", "--kernel-name", profiled_kernels(),
               "--launch-skip", "1", "--launch-count", "3", "--section", "SpeedOfLight", "--section", "MemoryWorkloadAnalysis", "--section", "Occupancy",
               "--section", "LaunchStats", sys.executable, *prof]
        run.execute(Step(f"ncu {g['id']}", cmd, 60, f"ncu-{name}.txt"))
    return EXIT_FAIL if failed else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="see the module's docstring for "
                                 "running it through the device tool", formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("phase", choices=["phase1", "phase2", "all"])
    ap.add_argument("results", type=Path, help="folder for the logs and results (created)")
    ap.add_argument("--budget", type=float, default=540, help="seconds per phase (default 540)")
    ap.add_argument("--dry-run", action="store_true", help="write the plan, run nothing")
    args = ap.parse_args(argv)
    rc = EXIT_OK
    for phase in (["phase1", "phase2"] if args.phase == "all" else [args.phase]):
        run = Run(phase, args.results / phase if args.phase == "all" else args.results, args.budget, args.dry_run)
        rc = max(rc, phase1(run) if phase == "phase1" else phase2(run))
        print(f"gpu_run {phase}: exit {rc}; summary in {run.results / 'summary.md'}", flush=True)
        if rc == EXIT_NO_GPU:
            break
    return rc


if __name__ == "__main__":
    sys.exit(main())
