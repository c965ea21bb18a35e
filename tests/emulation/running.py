"""A pytest plugin of the emulated suite's child (``-p running``, tests/test_emulation.py): the id of the test now
running in the file $FP8EMU_RUNNING names, emptied after it. A sanitizer that ends the process on a bad access
names no test; the parent reads it here."""

import os


def _running(text: str) -> None:
    path = os.environ.get("FP8EMU_RUNNING")
    if path:
        with open(path, "w") as f:
            f.write(text)


def pytest_runtest_logstart(nodeid, location):
    # a file outside the rootdir has an id without its path ("::test_x"): location names it
    _running(nodeid if not nodeid.startswith("::") else f"{location[0]}{nodeid}")


def pytest_runtest_logfinish(nodeid, location):
    _running("")
