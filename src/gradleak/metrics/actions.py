"""Action accuracy, overall and broken down by the victim's confidence and |A|."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

MAX_PI_BINS = (0.0, 0.5, 0.8, 0.95, 0.99, 1.0 + 1e-9)
ABS_ADVANTAGE_BINS = (0.0, 0.1, 0.5, 1.0, 2.0, np.inf)


def _breakdown(name: str, values: np.ndarray, correct: np.ndarray, edges: tuple[float, ...]
               ) -> list[dict[str, Any]]:
    rows = []
    for low, high in itertools.pairwise(edges):
        inside = (values >= low) & (values < high)
        n = int(inside.sum())
        rows.append({"by": name, "low": float(low), "high": float(min(high, 1.0)
                                                                if name == "max_pi" else high),
                     "n": n, "accuracy": float(correct[inside].mean()) if n else None})
    return rows


def action_accuracy(predicted: np.ndarray, actual: np.ndarray, probs: np.ndarray,
                    advantages: np.ndarray) -> dict[str, Any]:
    """{"accuracy", "n", "by_confidence": [...]}; probs and advantages are for scoring only."""
    correct = np.asarray(predicted) == np.asarray(actual)
    return {"accuracy": float(correct.mean()) if len(correct) else None, "n": len(correct),
            "by_confidence": _breakdown("max_pi", probs.max(axis=1), correct, MAX_PI_BINS)
            + _breakdown("abs_advantage", np.abs(advantages), correct, ABS_ADVANTAGE_BINS)}
