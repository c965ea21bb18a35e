"""Every CUDA kernel executed on the CPU: tests/emulation/ runs under an emulated device (tests/emulation/device.py),
in a child process with AddressSanitizer and UndefinedBehaviorSanitizer, and compares with the CPU backend by bits.

What it sees: indexing, tails, misaligned heads and vector accesses (UBSan's alignment check on uint2/uint4/float4),
out-of-bounds reads and writes of device memory (ASan, exact-size allocations), barrier and shuffle protocol
errors, grid-barrier deadlock when too few blocks are resident, the argument layouts the launch layer packs, and
the exact numerics of both conversion paths (the hardware instructions as the PTX ISA defines them; a NaN's code,
which the ISA leaves open, as one the contract does not want), and the -ftz=true flush of plain fp32 arithmetic
(the host's FTZ/DAZ modes, stricter: they flush fp64 too), reads of shared memory no thread of the block wrote
(poisoned per block), and missing barriers under seeded random thread orders (FP8EMU_SEED, printed with a failure).
What it cannot see (the GPU verification's to settle): the hardware's own conversion results, the weak memory
model (tests/test_sass.py reads the grid barrier's fences and strong loads from the machine code instead) and
independent thread scheduling within a warp (fibers of a block run one at a time to their next barrier or
shuffle), streams (launches run synchronously), the driver (cooperative launch limits, graph capture), cuBLASLt,
and speed. A sanitizer ends the child at once; the test it ran is named from tests/emulation/running.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "emulation"))
import build  # noqa: E402


def _suite_command(path: Path) -> list[str]:
    # --capture=sys: a sanitizer writes its report to fd 2 and ends the process at once; pytest's default fd
    # capture would lose the report with the test's captured output, leaving only an exit status.
    # -p running: the plugin naming the running test (tests/emulation/running.py, on the child's PYTHONPATH).
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "running", "--capture=sys",
            f"--confcutdir={HERE / 'emulation'}", "--rootdir", str(HERE / "emulation"), str(path)]


def _child_env(**extra: str) -> dict[str, str]:
    """The child's environment: the parent's, less what configures the parent's own pytest run. No third-party
    plugin loads in the child (its command line is all its configuration; pytest-benchmark, loaded there from
    a parent run under xdist, warned about the parent's workers), and no real CUDA device is visible (the child's
    CuPy and driver are stand-ins)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST") and k != "PYTEST_ADDOPTS"}
    path = os.pathsep.join(p for p in (str(HERE / "emulation"), env.get("PYTHONPATH", "")) if p)
    env.update(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path, **extra)
    return env


def _run_suite(path: Path, tmp_path: Path, timeout: float, **env: str) -> tuple[int, str, str]:
    """Run the suite at ``path`` in a child: its exit status, output, and the test it died in ("" if it ended
    between tests, as a finished run does). The child's conftest writes the running test's id to
    $FP8EMU_RUNNING before each test and empties it after (the plugin tests/emulation/running.py)."""
    running = tmp_path / "fp8emu-running"
    running.write_text("")
    done = subprocess.run(_suite_command(path), env=_child_env(FP8EMU_RUNNING=str(running), **env),
                          capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr, running.read_text()


def test_a_report_written_as_the_child_dies_reaches_the_output(tmp_path):
    """What a sanitizer does on a bad access (report to fd 2, then exit) shows in the suite's output, and the test
    it happened in is named."""
    probe = tmp_path / "test_dies.py"
    probe.write_text("import os\n\ndef test_lives():\n    pass\n\n\ndef test_dies():\n"
                     "    os.write(2, b'fp8emu-probe: runtime error\\n')\n    os._exit(1)\n\n\n"
                     "def test_never_runs():\n    pass\n")
    rc, out, died_in = _run_suite(probe, tmp_path, 300)
    assert rc == 1
    assert "fp8emu-probe: runtime error" in out
    assert died_in.endswith("test_dies.py::test_dies"), died_in


@pytest.mark.skipif(build.compiler() is None, reason="no host C++ compiler (g++ or clang++): the CUDA emulator "
                                                     "cannot build the kernels")
def test_kernels_under_emulation(capsys, tmp_path):
    env = dict(LD_PRELOAD=build.sanitizer_runtime(),
                     ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:halt_on_error=1",
                     UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", PYTHONDONTWRITEBYTECODE="1")
    rc, out, died_in = _run_suite(HERE / "emulation", tmp_path, 1500, **env)
    summary = [line for line in out.splitlines() if line.strip()][-1:] or ["(no output)"]
    with capsys.disabled():
        print(f"\n[emulated GPU suite] {summary[0]}")
    where = f" inside {died_in} (the process ended there: a sanitizer report or an abort)" if died_in else ""
    assert rc == 0, f"the emulated-GPU suite failed (exit {rc}){where}:\n{out[-20000:]}"
