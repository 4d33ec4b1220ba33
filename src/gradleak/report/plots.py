"""Figures, written atomically as PNG (matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from gradleak.io import atomic_path


def _save(figure: Any, path: Path) -> None:
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    plt.close(figure)


def plot_learning_curve(history: list[Any], path: Path) -> None:
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    steps = [h.env_steps for h in history]
    left.plot(steps, [h.mean_return for h in history], marker=".")
    left.set_xlabel("environment steps")
    left.set_ylabel("mean episode return")
    right.plot(steps, [h.success_rate for h in history], marker=".", color="tab:green")
    right.set_xlabel("environment steps")
    right.set_ylabel("success rate")
    right.set_ylim(-0.02, 1.02)
    figure.suptitle("victim training")
    _save(figure, path)


def plot_action_recovery(frames: Any, true_actions: Any, recovered: Any,
                         action_names: list[str], path: Path, title: str) -> None:
    """A strip of private frames; under each, the true action and the one read off the gradient."""
    count = len(frames)
    figure, axes = plt.subplots(1, count, figsize=(1.45 * count, 2.1))
    for axis, frame, truth, guess in zip(axes, frames, true_actions, recovered, strict=True):
        axis.imshow(frame, interpolation="nearest")
        axis.set_xticks([])
        axis.set_yticks([])
        axis.set_title(f"{action_names[truth]}\n→ {action_names[guess]}", fontsize=7,
                       color="tab:green" if truth == guess else "tab:red")
    figure.suptitle(title, fontsize=8)
    _save(figure, path)
