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
from gradleak.capture.record import rows_per_chunk
from gradleak.capture.schema import GRADIENTS
from gradleak.defenses.base import Chain, Stream, row_keys


def block_distortion(chain: Chain, stream: Stream) -> tuple[float, float]:
    """(cosine, relative norm error) of one update's mean gradient, defended vs clean."""
    return distortion(*block_sums(chain, stream))


def block_sums(chain: Chain, stream: Stream) -> tuple[torch.Tensor, int, torch.Tensor, int]:
    """The sum and count of the defended rows, and of the clean rows they cover (float64)."""
    defended = chain.apply(stream)
    covered = torch.isin(stream.keys, defended.sources.flatten())
    return (stream.gradients[covered].double().sum(0), int(covered.sum()),
            defended.gradients.double().sum(0), len(defended.gradients))


def distortion(clean: torch.Tensor, clean_count: int, noisy: torch.Tensor, noisy_count: int
               ) -> tuple[float, float]:
    """(cosine, relative norm error) between the mean defended and mean clean gradient."""
    if noisy_count == 0:
        return float("nan"), float("nan")
    clean, noisy = clean / clean_count, noisy / noisy_count
    cosine = float(torch.nn.functional.cosine_similarity(clean, noisy, dim=0))
    return cosine, float((noisy - clean).norm() / clean.norm().clamp_min(1e-30))


def update_distortion(chain: Chain, capture: str | os.PathLike[str],
                      steps_per_update: int = 512, updates: int = 4,
                      skip_nonfinite: bool = False, rows_at_once: int | None = None
                      ) -> dict[str, Any]:
    """Each block read and defended in pieces of `rows_at_once` rows or so (default: the
    capture writer's chunk, 64 MB; `pieces`), their sums added: the memory is a piece's, not
    the block's (512 steps of a 1.7M-parameter policy are 3.5 GB before any copy)."""
    cosines, errors = [], []
    with CaptureFile(capture) as handle:
        attrs, rows = handle.attrs, len(handle)
        usable = handle.usable_rows(skip_nonfinite)
        episodes = handle.column("episode_ids")
        size = rows_at_once or rows_per_chunk(int(attrs["gradient_dim"]))
        steps_per_update = min(steps_per_update, rows)  # a small file is one update
        for start in range(0, min(rows, updates * steps_per_update) - steps_per_update + 1,
                           max(steps_per_update, 1)):
            index = start + np.flatnonzero(usable[start:start + steps_per_update])
            keys = row_keys(attrs, start, start + steps_per_update)[
                torch.from_numpy(index - start)]
            sums = [torch.zeros(()), 0, torch.zeros(()), 0]
            for first, last in pieces(episodes[index], chain.span, size):
                rows_read = index[first:last]
                block = handle.column(GRADIENTS, slice(int(rows_read[0]), int(rows_read[-1]) + 1))
                stream = Stream.of(block[rows_read - rows_read[0]].astype(np.float32),
                                   keys[first:last], episodes[rows_read])
                for position, part in enumerate(block_sums(chain, stream)):
                    sums[position] = sums[position] + part
            cosine, error = distortion(*sums)
            cosines.append(cosine)
            errors.append(error)
    return {"cosine": float(np.nanmedian(cosines)) if cosines else None,
            "relative_norm_error": float(np.nanmedian(errors)) if errors else None,
            "updates": len(cosines), "steps_per_update": steps_per_update}


def pieces(episodes: np.ndarray, span: int, size: int) -> list[tuple[int, int]]:
    """Consecutive [first, last) runs of about `size` rows that cut no aggregation window: a
    cut falls only where an episode starts or a whole number of `span`-step windows into one
    (Aggregate averages k consecutive steps inside an episode)."""
    starts = np.r_[True, episodes[1:] != episodes[:-1]]
    run_start = np.maximum.accumulate(np.where(starts, np.arange(len(episodes)), 0))
    allowed = np.flatnonzero(starts | ((np.arange(len(episodes)) - run_start) % span == 0))
    out, first = [], 0
    for cut in [*allowed[1:], len(episodes)]:
        if cut - first >= size or cut == len(episodes):
            if cut > first:
                out.append((first, int(cut)))
            first = int(cut)
    return out
