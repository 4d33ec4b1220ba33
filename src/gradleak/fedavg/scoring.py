"""Scores for recovered client images: matched to the truth, beside the mean-image reference.

The server does not know which dummy became which private image, so every score first matches
them (the Hungarian assignment minimising total MSE). The reference row is what a server gets
with no gradient at all: the mean image of auxiliary data of the same kind, for every sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment

from gradleak.metrics.images import psnr, ssim

LPIPS_MIN_SIDE = 32  # AlexNet's pooling needs at least this; smaller images are upsampled


def hungarian_match(reconstructed: torch.Tensor, private: torch.Tensor) -> np.ndarray:
    """order[i]: the reconstruction assigned to private image i, minimising the total MSE
    (the server does not know which dummy became which sample)."""
    cost = ((reconstructed[:, None] - private[None]) ** 2).flatten(2).mean(2)  # (R, P)
    rows, columns = linear_sum_assignment(cost.numpy())
    order = np.empty(len(private), dtype=np.int64)
    order[columns] = rows
    return order


def image_scores(guess: torch.Tensor, truth: torch.Tensor) -> dict[str, float]:
    """Mean PSNR, SSIM and (weights installed) LPIPS-Alex of matched (N, C, H, W) pairs in
    [0, 1]. Grayscale is repeated to RGB for LPIPS and images under 32 px upsampled
    (bilinear) to 32, as LPIPS's network needs; SSIM warns about its window on small images."""
    from gradleak.metrics.lpips import installed_lpips

    scores = {"psnr": float(psnr(guess, truth).mean()), "ssim": float(ssim(guess, truth).mean())}
    metric = installed_lpips()
    if metric is not None:
        a, b = (lpips_input(x) for x in (guess, truth))
        with torch.no_grad():
            scores["lpips"] = float(metric(a, b).mean())
    return scores


def lpips_input(images: torch.Tensor) -> torch.Tensor:
    x = images.float()
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    side = min(x.shape[-2:])
    if side < LPIPS_MIN_SIDE:
        x = F.interpolate(x, scale_factor=LPIPS_MIN_SIDE / side, mode="bilinear",
                          align_corners=False)
    return x


def score_recovery(recovered: torch.Tensor, private: torch.Tensor,
                   reference: torch.Tensor | None = None) -> dict[str, Any]:
    """The matched attack's scores and, with auxiliary images, the mean-image row's."""
    matched = recovered[hungarian_match(recovered, private)]
    out: dict[str, Any] = {"attack": image_scores(matched, private), "matched": matched}
    if reference is not None:
        mean = reference.float().mean(0, keepdim=True).expand_as(private)
        out["mean_image"] = image_scores(mean.contiguous(), private)
    return out


def label_agreement(used: torch.Tensor, truth: torch.Tensor, classes: int) -> dict[str, int]:
    """How many of the used labels are right, as multisets (the order is unknown)."""
    have = np.bincount(used.numpy(), minlength=classes)
    want = np.bincount(truth.numpy(), minlength=classes)
    return {"right": int(np.minimum(have, want).sum()), "of": int(len(truth))}
