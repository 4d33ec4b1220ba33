"""Area-averaging resize without OpenCV or Pillow: two small matrix products per frame."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from gradleak.threads import blas_controller


@lru_cache(maxsize=16)
def area_weights(source: int, target: int) -> np.ndarray:
    """(target, source) matrix whose row i averages the source pixels that output pixel i covers.

    Pixel j of the source spans [j, j+1); output pixel i spans [i*s, (i+1)*s) with
    s = source/target. Each weight is the overlap length divided by s, so rows sum to one.
    """
    scale = source / target
    edges = np.arange(target + 1) * scale
    lo, hi = edges[:-1, None], edges[1:, None]
    j = np.arange(source)[None, :]
    overlap = np.clip(np.minimum(hi, j + 1) - np.maximum(lo, j), 0.0, None)
    weights = (overlap / scale).astype(np.float32)
    weights.setflags(write=False)
    return weights


def resize_area(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize an (H, W, 3) uint8 frame to (height, width, 3) by area averaging."""
    rows = area_weights(frame.shape[0], height)  # (height, H)
    cols = area_weights(frame.shape[1], width)  # (width, W)
    channels = frame.astype(np.float32).transpose(2, 0, 1)  # (3, H, W)
    # On one BLAS thread: a threaded product wakes OpenBLAS's worker, which then spins between
    # frames (one per engine step) and burns a whole core (measured: the environment's process
    # 1.2 cores at 1,000 steps/s, 0.26 on one thread), which the capture needs for gradients.
    with blas_controller().limit(limits=1):
        resized = (rows @ channels @ cols.T).transpose(1, 2, 0)  # (height, width, 3)
    return np.clip(np.rint(resized), 0, 255).astype(np.uint8)
