"""What an evaluation scores per method (per-frame image metrics, action accuracy, histogram
error), how the scores are summarised, and the reference a gain is measured against: the exact
mean of the training frames."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gradleak.capture.reader import CaptureFile
from gradleak.errors import ConfigError
from gradleak.metrics.images import mse, psnr, ssim
from gradleak.metrics.lpips import LPIPS

MEAN_IMAGE = "mean training image"



MEAN_COLOUR = "mean colour (oracle)"


def control_name(attacker: str) -> str:
    """The row of a learned attacker fed other steps' gradients (`Evaluation._score_batch`)."""
    return f"{attacker} on other steps' gradients (control)"


UNIFORM = "uniform 1/K histogram"



@dataclass
class MethodScores:
    """Per-frame scores of one method, shape (N, T) each, plus timing."""

    name: str
    # "learned", "training-free", "optimisation", "rule", "control" (a learned attacker fed
    # other steps' gradients), "reference"
    kind: str
    mse: list[np.ndarray] = field(default_factory=list)
    psnr: list[np.ndarray] = field(default_factory=list)
    ssim: list[np.ndarray] = field(default_factory=list)
    lpips: list[np.ndarray] = field(default_factory=list)
    correct: list[np.ndarray] = field(default_factory=list)
    tv: list[np.ndarray] = field(default_factory=list)  # action-histogram error (agg streams)
    seconds: float = 0.0
    frames: int = 0
    parameters: int | None = None
    samples: np.ndarray | None = None  # (S, T, H, W, 3) uint8 for the figure
    defense_mode: str | None = None  # learned attackers under a defense: zero-shot or adaptive



def frame_scores(prediction: torch.Tensor, truth: torch.Tensor, lpips: LPIPS | None
                  ) -> dict[str, np.ndarray]:
    b, t = truth.shape[:2]
    p, q = prediction.flatten(0, 1), truth.flatten(0, 1)
    scores = {"mse": mse(p, q), "psnr": psnr(p, q), "ssim": ssim(p, q)}
    if lpips is not None:
        scores["lpips"] = lpips(p, q)
    return {k: v.reshape(b, t).numpy() for k, v in scores.items()}



def score_actions(scores: MethodScores, probs: np.ndarray, actions: np.ndarray) -> None:
    """probs (B, T, K) against true actions (B, T), or against action histograms (B, T, K) of
    an aggregated stream: total variation ½ Σ_k |p̂_k − q_k| and whether the modes agree."""
    if actions.ndim == probs.ndim:
        scores.tv.append(0.5 * np.abs(probs - actions).sum(-1))
        scores.correct.append(probs.argmax(-1) == actions.argmax(-1))
    else:
        scores.correct.append(probs.argmax(-1) == actions)



def summarise(methods: dict[str, MethodScores]) -> dict[str, Any]:
    """Per-method mean ± std over frames, per-timestep PSNR, and the gain over the mean image."""
    rows = {}
    for name, scores in methods.items():
        row: dict[str, Any] = {"kind": scores.kind}
        for metric in ("mse", "psnr", "ssim", "lpips"):
            values = getattr(scores, metric)
            if values:
                stacked = np.concatenate(values)
                row[metric] = float(stacked.mean())
                row[f"{metric}_std"] = float(stacked.std())
                if metric == "psnr":
                    row["psnr_by_t"] = stacked.mean(axis=0).tolist()
        if scores.correct:
            row["action_accuracy"] = float(np.concatenate(scores.correct).mean())
        if scores.tv:
            stacked = np.concatenate(scores.tv)
            row["histogram_tv"], row["histogram_tv_std"] = float(stacked.mean()), float(
                stacked.std())
        row["ms_per_frame"] = 1e3 * scores.seconds / scores.frames if scores.frames else None
        row["frames"] = scores.frames
        row["parameters"] = scores.parameters
        if scores.defense_mode is not None:
            row["defense_mode"] = scores.defense_mode
        row["order"] = len(rows)  # JSON files sort their keys; tables keep this order
        rows[name] = row
    reference = np.concatenate(methods[MEAN_IMAGE].psnr)  # (windows, T), in window order
    for name, row in rows.items():
        if "psnr" not in row:
            continue
        # a baseline scored on the leading windows only is set against the mean image on
        # those same frames: against every window's it gained or lost by the windows' luck
        windows = len(np.concatenate(methods[name].psnr))
        base = float(reference[:windows].mean())
        row["psnr_gain_over_mean_image"] = row["psnr"] - base
        if windows < len(reference):
            row["mean_image_psnr_same_frames"] = base
    return rows



def mean_frame(paths: Sequence[str | os.PathLike[str]], chunk: int = 1024
               ) -> tuple[torch.Tensor, int]:
    """((3, H, W) float32 in [0, 1], frame count): the exact mean of every frame in the files,
    read `chunk` rows at a time."""
    total, count = None, 0
    for path in paths:
        with CaptureFile(path) as capture:
            for start in range(0, capture.num_rows, chunk):
                frames = capture.private_column("images", slice(start, start + chunk))
                part = frames.astype(np.float64).sum(0)
                total = part if total is None else total + part
                count += len(frames)
    if total is None or not count:
        raise ConfigError(f"no frames in {', '.join(map(str, paths))}")
    return torch.from_numpy(total / count / 255.0).permute(2, 0, 1).float(), count



def trainable_parameters(model: torch.nn.Module) -> int:
    """The attacker's own parameters (a decoder's frozen copy of θ0 is the victim's)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
