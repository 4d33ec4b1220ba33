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

from gradleak.metrics.scores import image_scores


def hungarian_match(reconstructed: torch.Tensor, private: torch.Tensor) -> np.ndarray:
    """order[i]: the reconstruction assigned to private image i, minimising the total MSE
    (the server does not know which dummy became which sample)."""
    cost = ((reconstructed[:, None] - private[None]) ** 2).flatten(2).mean(2)  # (R, P)
    rows, columns = linear_sum_assignment(cost.numpy())
    order = np.empty(len(private), dtype=np.int64)
    order[columns] = rows
    return order


def score_recovery(recovered: torch.Tensor, private: torch.Tensor,
                   reference: torch.Tensor | None = None, *,
                   reference_labels: torch.Tensor | None = None,
                   labels: torch.Tensor | None = None) -> dict[str, Any]:
    """The matched attack's scores and, with auxiliary images, the mean-image row's; with the
    auxiliary images' labels and the labels the attack used (inferred from the update), the
    class-mean row's too: an attack of its own, which needs no optimisation at all."""
    matched = recovered[hungarian_match(recovered, private)]
    out: dict[str, Any] = {"attack": image_scores(matched, private), "matched": matched}
    if reference is not None:
        mean = reference.float().mean(0, keepdim=True).expand_as(private)
        out["mean_image"] = image_scores(mean.contiguous(), private)
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
