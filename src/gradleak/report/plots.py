"""Figures, written atomically as PNG (matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from gradleak.io import atomic_path
from gradleak.metrics.images import frame_count


def picture(image: Any) -> tuple[np.ndarray, str | None]:
    """(what imshow draws, its colour map) for one frame as stored, (H, W, C) uint8 or float in
    [0, 1], any C: RGB as it is, a grey frame in grey, a stack of frames side by side (oldest
    first, a dark column between them)."""
    array = np.asarray(image)
    if array.dtype != np.uint8:
        array = (np.clip(array, 0.0, 1.0) * 255).round().astype(np.uint8)
    frames, per = frame_count(array.shape[-1])
    parts = [array[..., f * per:(f + 1) * per] for f in range(frames)]
    gap = np.zeros((array.shape[0], max(1, array.shape[1] // 32), per), np.uint8)
    tiled = np.concatenate([p for part in parts for p in (part, gap)][:-1], axis=1)
    return (tiled[..., 0], "gray") if per == 1 else (tiled, None)


def show(axis: Any, image: Any) -> None:
    """One frame (any channel count) on an axis, without ticks."""
    drawn, cmap = picture(image)
    axis.imshow(drawn, cmap=cmap, vmin=0, vmax=255, interpolation="nearest")
    axis.set_xticks([])
    axis.set_yticks([])


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
        show(axis, frame)
        axis.set_title(f"{action_names[truth]}\n→ {action_names[guess]}", fontsize=7,
                       color="tab:green" if truth == guess else "tab:red")
    figure.suptitle(title, fontsize=8)
    _save(figure, path)


def plot_optimisation_history(truth: Any, snapshots: list[tuple[int, Any]], losses: Any,
                              restart: Any, restarts: int, path: Path, title: str) -> None:
    """Per frame: the private frame, the kept restart's image at a few iterations, and the
    matching loss of every problem over the iterations (log scale)."""
    frames = len(truth)
    columns = len(snapshots) + 2
    figure, axes = plt.subplots(frames, columns, figsize=(1.3 * columns + 1.5, 1.4 * frames),
                                squeeze=False)
    for f in range(frames):
        row = f * restarts + int(restart[f])
        panels = [("private", truth[f])] + [(f"it {i + 1}", images[row])
                                            for i, images in snapshots]
        for axis, (label, image) in zip(axes[f], panels, strict=False):
            show(axis, image)
            axis.set_title(label, fontsize=7)
        curve = axes[f, -1]
        curve.semilogy(range(1, len(losses) + 1), losses[:, row])
        curve.set_xlabel("iteration", fontsize=7)
        curve.set_ylabel("matching loss", fontsize=7)
        curve.tick_params(labelsize=6)
    figure.suptitle(title, fontsize=8)
    _save(figure, path)


def plot_private_vs_reconstructed(private: Any, recovered: Any, path: Path, title: str,
                                  most: int = 16) -> None:
    """Two rows: the client's images, and the reconstruction matched to each ((N, C, H, W)
    tensors in [0, 1], any C)."""
    count = min(most, len(private))
    frames = frame_count(private.shape[1])[0]
    figure, axes = plt.subplots(2, count, figsize=((0.9 * frames) * count + 0.6, 2.2),
                                squeeze=False)
    for row, (label, images) in enumerate((("private", private), ("recovered", recovered))):
        for i in range(count):
            show(axes[row, i], images[i].permute(1, 2, 0).numpy())
        axes[row, 0].set_ylabel(label, fontsize=7)
    figure.suptitle(title, fontsize=8)
    _save(figure, path)


def plot_privacy_utility(outcomes: list[dict[str, Any]], clean: dict[str, Any],
                         margin_db: float, path: Path) -> None:
    """Each attack's PSNR gain over the mean image against what the defense costs the update
    (1 − its cosine to the clean update, on a log scale: light defenses sit within 1e-2 of
    it, DP-SGD near 1): one point per defense (the clean stream at 0), one series per attack."""
    figure, axis = plt.subplots(figsize=(7.5, 4.2))
    series: dict[str, list[tuple[float, float, str]]] = {}
    for name, row in clean.items():
        if row.get("psnr_gain_over_mean_image") is not None:
            series.setdefault(name, []).append((0.0, row["psnr_gain_over_mean_image"], "none"))
    for outcome in outcomes:
        if outcome.get("skipped") or outcome.get("cosine") is None:
            continue
        for name, row in outcome["per_attack"].items():
            if row.get("psnr_gain_over_mean_image") is not None:
                series.setdefault(name, []).append(
                    (max(1.0 - outcome["cosine"], 0.0), row["psnr_gain_over_mean_image"],
                     outcome["spec"]))
    for name, points in series.items():
        points.sort()
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        for x, y, spec in points:
            axis.annotate(spec, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    axis.set_xscale("symlog", linthresh=1e-4)
    axis.axhline(margin_db, color="grey", linestyle="--", linewidth=0.8)
    axis.axhline(0.0, color="black", linewidth=0.6)
    axis.set_xlabel("1 − update cosine to the clean update (utility lost →)")
    axis.set_ylabel("PSNR gain over the mean image (dB)")
    axis.set_title("privacy–utility: each defense of the grid, each attack")
    if series:
        axis.legend(fontsize=7, loc="best")
    else:
        axis.text(0.5, 0.5, "no attack reconstructed frames", ha="center",
                  transform=axis.transAxes)
    _save(figure, path)


def plot_grouped_bars(series: dict[str, dict[str, float]], path: Path,
                      categories: list[str] | None = None, ylabel: str = "PSNR (dB)") -> None:
    """One group of bars per category (x), a bar per series in each (absent values: 0)."""
    categories = categories or list(dict.fromkeys(c for values in series.values()
                                                  for c in values))
    figure, axis = plt.subplots(figsize=(max(6.0, 0.35 * len(categories) * max(2, len(series))),
                                         3.6))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        axis.bar([j + i * width for j in range(len(categories))],
                 [values.get(c, 0.0) for c in categories], width, label=label)
    axis.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories,
                    rotation=35, ha="right", fontsize=7)
    axis.set_ylabel(ylabel)
    axis.legend(fontsize=7)
    _save(figure, path)
