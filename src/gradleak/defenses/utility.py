"""What a defense costs the victim: how far it moves the update the server would apply.

The server averages the gradients of one update's steps. For each of a few consecutive blocks
of `steps_per_update` capture rows we compare the mean of the defended gradients with the mean
of the clean gradients they came from (for aggregation: of the steps the kept windows cover):
cosine similarity (direction) and relative norm error ‖ḡ_def − ḡ‖ / ‖ḡ‖ (both), reported as
the median over blocks.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from gradleak.capture.reader import CaptureFile
from gradleak.capture.schema import GRADIENTS
from gradleak.defenses.base import Chain, Stream, row_keys


def block_distortion(chain: Chain, stream: Stream) -> tuple[float, float]:
    """(cosine, relative norm error) of one update's mean gradient, defended vs clean."""
    defended = chain.apply(stream)
    if len(defended.gradients) == 0:
        return float("nan"), float("nan")
    covered = torch.isin(stream.keys, defended.sources.flatten())
    clean = stream.gradients[covered].mean(0).double()
    noisy = defended.gradients.mean(0).double()
    cosine = float(torch.nn.functional.cosine_similarity(clean, noisy, dim=0))
    relative = float((noisy - clean).norm() / clean.norm().clamp_min(1e-30))
    return cosine, relative


def update_distortion(chain: Chain, capture: str | os.PathLike[str],
                      steps_per_update: int = 512, updates: int = 4,
                      skip_nonfinite: bool = False) -> dict[str, Any]:
    cosines, errors = [], []
    with CaptureFile(capture) as handle:
        attrs, rows = handle.attrs, len(handle)
        usable = handle.usable_rows(skip_nonfinite)
        episodes = handle.column("episode_ids")
        steps_per_update = min(steps_per_update, rows)  # a small file is one update
        for start in range(0, min(rows, updates * steps_per_update) - steps_per_update + 1,
                           max(steps_per_update, 1)):
            stop = start + steps_per_update
            keep = usable[start:stop]
            gradients = handle.column(GRADIENTS, slice(start, stop)).astype(np.float32)[keep]
            stream = Stream.of(gradients, row_keys(attrs, start, stop)[torch.from_numpy(keep)],
                               episodes[start:stop][keep])
            cosine, error = block_distortion(chain, stream)
            cosines.append(cosine)
            errors.append(error)
    return {"cosine": float(np.nanmedian(cosines)) if cosines else None,
            "relative_norm_error": float(np.nanmedian(errors)) if errors else None,
            "updates": len(cosines), "steps_per_update": steps_per_update}
