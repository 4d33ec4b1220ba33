"""Defenses: composable, seeded transforms of the per-step gradient stream."""

from gradleak.defenses import transforms as _transforms  # noqa: F401  (registers them)
from gradleak.defenses.base import DEFENSES, Chain, Defense, Stream, parse_defense

__all__ = ["DEFENSES", "Chain", "Defense", "Stream", "parse_defense"]
