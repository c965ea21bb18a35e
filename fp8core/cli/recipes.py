"""``fp8core inspect --recipes``'s argument. The recipes themselves are :mod:`fp8core.numerics_recipes`'s and
how one tensor fares in each (the statistics, and the winner and summary over them)
:mod:`fp8core.numerics_stats`'s, both shared with ``fp8core.torch.record_numerics``."""

from __future__ import annotations

from fp8core.numerics_recipes import BLOCK_RULE, RECIPES, select
from fp8core.numerics_stats import Recipe, as_rows, measure, summary, winner

from .common import CliError

__all__ = ["RECIPES", "BLOCK_RULE", "Recipe", "as_rows", "measure", "parse_recipes", "summary", "winner"]


def parse_recipes(text: str) -> list[Recipe]:
    """``all`` or a comma-separated list of names from :data:`RECIPES`, in the order given, repeats dropped."""
    try:
        return select(text, "--recipes")
    except ValueError as e:
        raise CliError(str(e)) from None
