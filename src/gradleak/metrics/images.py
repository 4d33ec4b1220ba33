"""Image metrics on tensors in [0, 1], shape (N, C, H, W): MSE, PSNR and Gaussian SSIM.

SSIM is Wang et al. (2004): an 11x11 Gaussian window (σ = 1.5), K1 = 0.01, K2 = 0.03, data
range 1, computed per channel over the valid region (no padding) and averaged — the settings of
scikit-image with `gaussian_weights=True, use_sample_covariance=False`. Not CW-SSIM. Images
smaller than the window (8×8 digits) get the largest odd window that fits, σ scaled with it,
and a warning that says so: those scores are not comparable with 11×11 ones.
"""

from __future__ import annotations

import warnings
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
K1, K2 = 0.01, 0.03


def to_unit_tensor(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Frames as stored, (N, H, W, C) uint8 (or float in [0, 1]), any C (RGB, grayscale, a
    stack of either) → (N, C, H, W) float32 in [0, 1]. PSNR and SSIM read every channel alike,
    so a stack of grey frames scores as the mean over its frames."""
    tensor = torch.as_tensor(images)
    if tensor.dim() != 4:
        raise ValueError(f"frames of shape {tuple(tensor.shape)}: expected (N, H, W, C)")
    if tensor.dtype == torch.uint8:
        tensor = tensor.to(torch.float32) / 255.0
    return tensor.permute(0, 3, 1, 2).to(torch.float32).contiguous()


def frame_count(channels: int) -> tuple[int, int]:
    """(frames, channels per frame) of an image with this many channels: 3 is one RGB frame,
    a multiple of 3 a stack of RGB frames, anything else a stack of grey ones."""
    per = 3 if channels % 3 == 0 else 1
    return channels // per, per


def split_frames(images: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) → (N · F, c, H, W): each stacked frame an image of its own (frame_count)."""
    frames, per = frame_count(images.shape[1])
    return images.reshape(len(images) * frames, per, *images.shape[2:])


def mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(N,) mean squared error per image."""
    return ((a - b) ** 2).flatten(1).mean(1)


def psnr(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """(N,) PSNR in dB for data range 1: 10·log10(1 / MSE)."""
    return 10.0 * torch.log10(1.0 / mse(a, b).clamp_min(eps))


@lru_cache(maxsize=4)
def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    coords = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]  # (1, 1, size, size)


def ssim_window(height: int, width: int) -> tuple[int, float]:
    """(size, σ) of the Gaussian window for images of this size: 11 and 1.5, or for smaller
    images the largest odd size that fits with σ scaled alike."""
    fits = min(SSIM_WINDOW, height, width)
    size = fits if fits % 2 else fits - 1
    if size < 1:
        raise ValueError(f"SSIM of {height}×{width} images: no window fits")
    return size, SSIM_SIGMA * size / SSIM_WINDOW


def _small_image_note(height: int, width: int, size: int) -> None:
    # Python's default filter shows it once per message: once per image size in a run
    warnings.warn(f"SSIM on {height}×{width} images: a {size}×{size} window instead of "
                  f"{SSIM_WINDOW}×{SSIM_WINDOW} (scores not comparable with the standard "
                  "window's)", stacklevel=3)


def ssim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(N,) mean SSIM per image; differentiable, so 1 − SSIM can serve as a training loss."""
    channels, height, width = a.shape[1:]
    size, sigma = ssim_window(height, width)
    if size != SSIM_WINDOW:
        _small_image_note(height, width, size)
    window = _gaussian_window(size, sigma).to(a).expand(channels, 1, -1, -1)

    def blur(x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, window, groups=channels)

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = K1**2, K2**2
    ssim_map = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / (
        (mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return ssim_map.flatten(1).mean(1)
