"""Fitting learned attackers on auxiliary captures (the only place they see ground truth)."""

# the window attackers (TRACE, LtI) register with their objectives: a checkpoint of either can
# be rebuilt whichever module of this package is imported first
from gradleak.training import objectives as _objectives  # noqa: F401
