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
