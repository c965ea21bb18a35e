"""Text from files made safe for a terminal: names read from a checkpoint or a record reach ``print`` through
here (``fp8core inspect``'s tables, ``print(record)``)."""

from __future__ import annotations

__all__ = ["printable"]


def printable(text: str) -> str:
    """``text`` with every non-printable character (terminal escapes, carriage returns, bidi overrides) written
    as its Python escape: names come from the files, and a terminal would act on them."""
    return text if text.isprintable() else "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
