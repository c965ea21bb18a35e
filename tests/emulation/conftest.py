"""The emulated-GPU suite (run by tests/test_emulation.py in a child process with AddressSanitizer preloaded).

The stand-in CuPy and driver (device.py) are installed before fp8core is imported, so every test here drives
fp8core's real CUDA path: the public API, the backend's launch plans, the loader, the kernels of cuda/.
"""

import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(__file__))

import device  # noqa: E402

device.install()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# sm_80 (software conversions) and sm_90 (hardware conversions) run every test; sm_100 adds only the
# family-specific E8M0 conversion of block_quantize.cu, so only the block-scaling tests run there, and FP4's
# kernels (fp4_quantize.cu: the family-specific E2M1 and E8M0 conversions of its plain path, software E2M1 on
# sm_80/90; fp4_gemm.cu: the FP4 GEMM's alpha, which only sm_100+ uses).
PER_FILE = {"block_quantize.cu": (0, 1, 2), "fp4_quantize.cu": (0, 1, 2), "fp4_gemm.cu": (0, 1, 2)}
EMULATED = [pytest.param(i, id=f"sm_{device.DEVICES[i].cc}") for i in (0, 1)]
BLOCK_EMULATED = [pytest.param(i, id=f"sm_{device.DEVICES[i].cc}") for i in PER_FILE["block_quantize.cu"]]


def _current(request):
    with device._DeviceObj(request.param):
        yield request.param


@pytest.fixture(params=EMULATED)
def dev(request):
    """sm_80 and sm_90 in turn, current for the test."""
    yield from _current(request)


@pytest.fixture(params=BLOCK_EMULATED)
def block_dev(request):
    """sm_80, sm_90 and sm_100 in turn, current for the test (block scaling)."""
    yield from _current(request)


def _session_seed() -> int:
    """$FP8EMU_SEED, else a fresh one per run: the thread orders of this run, printed to reproduce them."""
    given = os.environ.get("FP8EMU_SEED")
    return int(given) if given else int.from_bytes(os.urandom(4), "little") or 1


SEED = _session_seed()


def seed_of(nodeid: str) -> int:
    """The thread-order seed of one test: the same for the same session seed whatever else runs."""
    return device.launch_seed(SEED, zlib.crc32(nodeid.encode()))


def pytest_report_header(config):
    return f"fp8emu thread orders: FP8EMU_SEED={SEED}"


@pytest.fixture(autouse=True)
def thread_orders(request):
    """Each test's launches run their threads in seeded random orders (runtime.cpp, round_order)."""
    device.set_seed(seed_of(request.node.nodeid))
    yield
    device.set_seed(0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("fp8emu thread orders", f"rerun this test with FP8EMU_SEED={SEED} to repeat its "
                                                        f"thread orders (its seed: {seed_of(item.nodeid)})"))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session", autouse=True)
def modules():
    """Every module of cuda/ built for every emulated device up front, in parallel (the tests then only load)."""
    from concurrent.futures import ThreadPoolExecutor

    from fp8core import _kernels

    def load(job):
        dev, filename = job
        _kernels.get_function(filename, _kernels.KERNELS[filename][0], dev)

    jobs = [(d, f) for f in _kernels.KERNELS for d in PER_FILE.get(f, (0, 1))]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(load, jobs))


def pytest_collection_modifyitems(items):
    # The coverage check reads what every other test launched: it runs last.
    items.sort(key=lambda item: item.name == "test_every_kernel_emulated")
