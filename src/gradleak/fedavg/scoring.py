"""Scores for recovered client images: matched to the truth, beside the mean-image reference.

The server does not know which dummy became which private image, so every score first matches
them (the Hungarian assignment minimising total MSE). The reference row is what a server gets
with no gradient at all: the mean image of auxiliary data of the same kind, for every sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from gradleak.metrics.images import psnr, ssim
from gradleak.metrics.lpips import installed_lpips
from gradleak.metrics.scores import image_scores

EXACT_DB = 40.0  # an image "came back exactly": float32 rounding and little else


def hungarian_match(reconstructed: torch.Tensor, private: torch.Tensor) -> np.ndarray:
    """order[i]: the reconstruction assigned to private image i, minimising the total MSE
    (the server does not know which dummy became which sample)."""
    cost = ((reconstructed[:, None] - private[None]) ** 2).flatten(2).mean(2)  # (R, P)
    rows, columns = linear_sum_assignment(cost.numpy())
    order = np.empty(len(private), dtype=np.int64)
    order[columns] = rows
    return order


def per_image_scores(guess: torch.Tensor, truth: torch.Tensor) -> dict[str, list[float]]:
    """Each matched pair's PSNR, SSIM and (where the weights are installed) LPIPS."""
    scores = {"psnr": psnr(guess, truth).tolist(), "ssim": ssim(guess, truth).tolist()}
    metric = installed_lpips()
    if metric is not None:
        scores["lpips"] = [float(v) for v in metric(guess.float(), truth.float())]
    return scores


def better_everywhere(scores: dict[str, list[float]], reference: dict[str, list[float]]
                      ) -> list[bool]:
    """Per image: closer than the reference on every metric at once (higher PSNR and SSIM,
    lower LPIPS)."""
    return [scores["psnr"][i] > reference["psnr"][i] and scores["ssim"][i] > reference["ssim"][i]
            and ("lpips" not in scores or "lpips" not in reference
                 or scores["lpips"][i] < reference["lpips"][i])
            for i in range(len(scores["psnr"]))]


def score_recovery(recovered: torch.Tensor, private: torch.Tensor,
                   reference: torch.Tensor | None = None, *,
                   reference_labels: torch.Tensor | None = None,
                   labels: torch.Tensor | None = None) -> dict[str, Any]:
    """The matched attack's scores and, with auxiliary images, the mean-image row's; with the
    auxiliary images' labels and the labels the attack used (inferred from the update), the
    class-mean row's too: an attack of its own, which needs no optimisation at all. Per image:
    how many came back exactly (≥ EXACT_DB) and how many beat the mean image on every metric."""
    matched = recovered[hungarian_match(recovered, private)]
    each = per_image_scores(matched, private)
    out: dict[str, Any] = {"attack": image_scores(matched, private), "matched": matched,
                           "per_image": each, "exact": sum(v >= EXACT_DB for v in each["psnr"])}
    if reference is not None:
        mean = reference.float().mean(0, keepdim=True).expand_as(private)
        out["mean_image"] = image_scores(mean.contiguous(), private)
        out["above_mean_image"] = sum(better_everywhere(
            each, per_image_scores(mean.contiguous(), private)))
        if reference_labels is not None and labels is not None:
            guess = class_means(reference, reference_labels, labels)
            out["class_mean"] = image_scores(guess[hungarian_match(guess, private)], private)
    return out


def class_means(reference: torch.Tensor, reference_labels: torch.Tensor, labels: torch.Tensor
                ) -> torch.Tensor:
    """(N, C, H, W): for each label, the mean auxiliary image of that class (the mean of all of
    them for a class the auxiliary data lack)."""
    reference = reference.float()
    overall = reference.mean(0)
    return torch.stack([reference[reference_labels == label].mean(0)
                        if bool((reference_labels == label).any()) else overall
                        for label in labels.tolist()])


def label_agreement(used: torch.Tensor, truth: torch.Tensor, classes: int) -> dict[str, int]:
    """How many of the used labels are right, as multisets (the order is unknown)."""
    have = np.bincount(used.numpy(), minlength=classes)
    want = np.bincount(truth.numpy(), minlength=classes)
    return {"right": int(np.minimum(have, want).sum()), "of": int(len(truth))}
