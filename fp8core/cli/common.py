"""What the commands share: the one-line error, the progress bar, versions of what is installed, text made safe
to print, table cells, where a plot lands."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from fp8core.text import printable

__all__ = ["TABLE_WIDTH", "CliError", "cell", "installed_version", "label", "plot_target", "printable",
           "progress", "status"]

TABLE_WIDTH = 100  # columns of every table the commands print


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


def progress(done: int, total: int, text: str = "") -> None:
    """A bar redrawn in place on a terminal; in a log (stderr not a terminal), plain lines, every tenth step."""
    width = 30
    filled = width * done // max(total, 1)
    bar = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {text}"
    if sys.stderr.isatty():  # one terminal line, padded: it overwrites a longer status line
        sys.stderr.write("\r" + bar[:_columns()].ljust(_columns()) + ("\n" if done == total else ""))
    elif done == total or done % max(1, total // 10) == 0:
        sys.stderr.write(bar.rstrip() + "\n")
    else:
        return
    sys.stderr.flush()


def _columns() -> int:
    return max(20, shutil.get_terminal_size().columns - 1)


def status(text: str) -> None:
    """On a terminal, ``text`` (made printable, cut to the width) in place of the bar's line until the bar is
    redrawn: what a long step is working on. Nothing in a log."""
    if not sys.stderr.isatty():
        return
    sys.stderr.write("\r" + printable(text)[:_columns()].ljust(_columns()))
    sys.stderr.flush()


def installed_version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:
        return None
    return getattr(mod, "__version__", "installed")


def label(text: str) -> str:
    """``text`` as a matplotlib label draws it: :func:`printable` (no font draws control characters), and ``$``
    escaped (mathtext would read a name between two as a formula, and fail on most)."""
    return printable(text).replace("$", r"\$")


def cell(v: Any, spec: str, width: int) -> str:
    """v right-aligned in width columns by spec; None (no value) as n/a."""
    if v is None:
        return f"{'n/a':>{width}}"
    return f"{v:>{width}{spec}}"


def plot_target(out: str) -> Path:
    """The file matplotlib will write: it adds ".png" to a name without a known image extension."""
    import matplotlib.pyplot as plt

    p = Path(out)
    known = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    return p if p.suffix[1:].lower() in known else p.with_name(p.name + ".png")
