"""How to install what an optional feature needs, worded so that it works before fp8core is on a package index."""

from __future__ import annotations

__all__ = ["install_hint"]


def install_hint(extra: str, *alternatives: str) -> str:
    """``pip install 'fp8core[extra]'`` with its form in a source checkout, naming alternative extras if any.

    >>> install_hint("cuda13", "cuda12")
    "pip install 'fp8core[cuda13]' (or [cuda12]; in a checkout: pip install -e '.[cuda13]')"
    """
    also = "".join(f"or [{a}]; " for a in alternatives)
    return f"pip install 'fp8core[{extra}]' ({also}in a checkout: pip install -e '.[{extra}]')"
