"""Fitting learned attackers on auxiliary captures (the only place they see ground truth)."""
