"""Gradient inputs and encoders shared by the learned attackers (TRACE and LtI).

A per-step gradient is huge (163k coordinates for cnn-small, 936k for the paper's CNN), sparse
and heavy-tailed. Each attacker reads it through `GradientInput`: an optional fixed coordinate
subset, per-sample RMS scaling (its log kept as one extra feature, since |A| lives in the
scale), then per-coordinate standardisation with statistics of the training data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.inversion.closed_form import linear_input, linear_pairs
from gradleak.victims.base import LayerInfo, layers_from_json

PROJECTIONS = ("dense", "lowrank", "subsample", "structured")


def subsample_index(gradient_dim: int, fraction: float, seed: int) -> torch.Tensor:
    """A fixed, sorted random subset of coordinates (the attacker's choice, seeded)."""
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"subsample fraction {fraction}: expected a value in (0, 1]")
    count = max(1, round(gradient_dim * fraction))
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(gradient_dim, generator=generator)[:count].sort().values


def block(gradients: torch.Tensor, layer: LayerInfo) -> torch.Tensor:
    return gradients[..., layer.offset:layer.offset + layer.size]


def flat_linear_input(gradients: torch.Tensor, weight: LayerInfo, bias: LayerInfo
                      ) -> torch.Tensor:
    """(..., in): a Linear layer's input from flat gradient rows (`closed_form.linear_input`),
    zero where ∇b vanishes (nothing flowed back through the layer at that step): a learned
    attacker's feature must be finite."""
    return torch.nan_to_num(linear_input(block(gradients, weight).unflatten(-1, weight.shape),
                                         block(gradients, bias)), nan=0.0)


class GradientInput(nn.Module):
    """(..., d) raw gradients → (..., k + 1) normalised features (k kept coordinates + log RMS)."""

    def __init__(self, gradient_dim: int, index: torch.Tensor | None = None,
                 selected: int | None = None) -> None:
        super().__init__()
        self.gradient_dim = gradient_dim
        kept = selected or (gradient_dim if index is None else len(index))
        self.register_buffer("index", index if index is not None else torch.zeros(0,
                                                                                  dtype=torch.long))
        self.register_buffer("mean", torch.zeros(kept))
        self.register_buffer("std", torch.ones(kept))
        self.register_buffer("log_rms_mean", torch.zeros(()))
        self.register_buffer("log_rms_std", torch.ones(()))
        self.features = kept + 1

    def select(self, gradients: torch.Tensor) -> torch.Tensor:
        if gradients.shape[-1] != self.gradient_dim:
            raise ConfigError(f"gradient width {gradients.shape[-1]} does not match the "
                              f"attacker's {self.gradient_dim}")
        return gradients.index_select(-1, self.index) if len(self.index) else gradients

    @staticmethod
    def rms_scale(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rms = selected.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
        return selected / rms, rms.log()

    @torch.no_grad()
    def fit(self, chunks: Iterable[torch.Tensor]) -> int:
        """Standardisation statistics from training gradients, streamed as (n, d) chunks so
        a large sample never sits in memory at full width. Returns the rows seen."""
        count, total, total_sq, levels = 0, 0.0, 0.0, []
        for chunk in chunks:  # rows arrive on the CPU; the buffers may live on a GPU
            scaled, log_rms = self.rms_scale(self.select(chunk.to(self.mean.device,
                                                                  torch.float64)))
            count += len(scaled)
            total = total + scaled.sum(0)
            total_sq = total_sq + (scaled**2).sum(0)
            levels.append(log_rms.flatten())
        if count == 0:
            return 0
        mean = total / count
        std = (total_sq / count - mean**2).clamp_min(0).sqrt()
        self.mean.copy_(mean)
        # Coordinates that are (almost) always zero would blow up: floor the std.
        self.std.copy_(std.clamp_min(1e-3))
        level = torch.cat(levels)
        self.log_rms_mean.copy_(level.mean())
        self.log_rms_std.copy_(level.std().clamp_min(1e-3) if len(level) > 1
                               else torch.ones(()))
        return count

    def forward(self, gradients: torch.Tensor) -> torch.Tensor:
        scaled, log_rms = self.rms_scale(self.select(gradients))
        standard = (scaled - self.mean) / self.std
        level = (log_rms - self.log_rms_mean) / self.log_rms_std
        return torch.cat([standard, level], dim=-1)


class StructuredInput(GradientInput):
    """The gradient read through its structure instead of coordinate by coordinate.

    For every Linear layer with a bias (one sample: ∇W = δ xᵀ, ∇b = δ) its exact input
    x = ∇Wᵀ∇b/‖∇b‖² and δ itself; for every conv weight the norm of each output channel's
    gradient; every other 1-D parameter's gradient as it is (conv biases, BatchNorm). For
    cnn-small that is ~1.7k features instead of 163k coordinates.
    """

    def __init__(self, gradient_dim: int, layer_table: str) -> None:
        layers = layers_from_json(layer_table or "[]")
        linear = linear_pairs(layers)
        if not linear:
            raise ConfigError("the structured projection needs Linear layers with a bias in the "
                              "captured gradients; use projection 'dense' for this victim")
        used = {layer.name for pair in linear for layer in pair}
        convs = [layer for layer in layers if len(layer.shape) == 4]
        vectors = [layer for layer in layers if len(layer.shape) == 1 and layer.name not in used]
        width = (sum(w.shape[1] + w.shape[0] for w, _ in linear) + sum(c.shape[0] for c in convs)
                 + sum(v.size for v in vectors))
        super().__init__(gradient_dim, None, selected=width)
        self.linear, self.convs, self.vectors = linear, convs, vectors

    def select(self, gradients: torch.Tensor) -> torch.Tensor:
        if gradients.shape[-1] != self.gradient_dim:
            raise ConfigError(f"gradient width {gradients.shape[-1]} does not match the "
                              f"attacker's {self.gradient_dim}")

        parts = []
        for weight, bias in self.linear:
            parts += [flat_linear_input(gradients, weight, bias), block(gradients, bias)]
        parts += [block(gradients, c).unflatten(-1, (c.shape[0], -1)).norm(dim=-1)
                  for c in self.convs]
        parts += [block(gradients, v) for v in self.vectors]
        return torch.cat(parts, dim=-1)


class WideLinear(nn.Linear):
    """A Linear from a small latent to a whole frame's worth of outputs (out ≫ in). Without
    autograd (an attack, a validation pass) it reads its weight through a contiguous copy of
    the transpose: MKL's product with the stored (out, in) weight is several times slower for
    one latent (docs/design-attacks.md), equal to rounding. With autograd it is nn.Linear,
    so training, gradients and checkpoints are unchanged; the copy is made again whenever the
    weight changes (an optimiser step, a load, a move)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias)
        self._transposed: tuple[tuple[Any, ...], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return super().forward(x)
        rows = x.reshape(-1, self.in_features)
        out = torch.mm(rows, self.transposed_weight()) if self.bias is None \
            else torch.addmm(self.bias, rows, self.transposed_weight())
        return out.view(*x.shape[:-1], self.out_features)

    def transposed_weight(self) -> torch.Tensor:
        weight = self.weight
        key = (weight._version, weight.data_ptr(), weight.device, weight.dtype)
        if self._transposed is None or self._transposed[0] != key:
            self._transposed = (key, weight.detach().t().contiguous())
        return self._transposed[1]


class ResidualMLP(nn.Module):
    """Pre-norm residual block: x + W2 · GELU(W1 · LN(x))."""

    def __init__(self, width: int, dropout: float, expansion: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, expansion * width)
        self.down = nn.Linear(expansion * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.down(nn.functional.gelu(self.up(self.norm(x)))))


def input_projection(kind: str, features: int, width: int, rank: int) -> nn.Module:
    """dense: Linear(d, d_enc) (the paper); lowrank: d → r → d_enc; subsample and structured:
    GradientInput already reduced the gradient, so a dense layer on what it kept."""
    if kind not in PROJECTIONS:
        raise ConfigError(f"projection {kind!r}: expected one of {', '.join(PROJECTIONS)}")
    if kind == "lowrank":
        return nn.Sequential(nn.Linear(features, rank, bias=False), nn.Linear(rank, width))
    return nn.Linear(features, width)


class GradientEncoder(nn.Module):
    """Projection → LN → GELU → residual MLP blocks → LN → Linear to the latent size."""

    def __init__(self, gradient_input: GradientInput, projection: str, width: int, latent: int,
                 blocks: int, rank: int, dropout: float) -> None:
        super().__init__()
        self.input = gradient_input
        self.project = input_projection(projection, gradient_input.features, width, rank)
        self.norm_in = nn.LayerNorm(width)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(ResidualMLP(width, dropout) for _ in range(blocks)))
        self.norm_out = nn.LayerNorm(width)
        self.out = nn.Linear(width, latent)

    def forward(self, gradients: torch.Tensor) -> torch.Tensor:  # (..., d) → (..., latent)
        x = self.dropout(nn.functional.gelu(self.norm_in(self.project(self.input(gradients)))))
        return self.out(self.norm_out(self.blocks(x)))


class ImageEncoder(nn.Module):
    """A small CNN: frame (B, 3, H, W) in [0, 1] → token (B, latent)."""

    def __init__(self, latent: int, channels: int) -> None:
        super().__init__()
        c = channels
        self.net = nn.Sequential(
            nn.Conv2d(3, c, 4, 2, 1), nn.GELU(),
            nn.Conv2d(c, 2 * c, 4, 2, 1), nn.GELU(),
            nn.Conv2d(2 * c, 4 * c, 4, 2, 1), nn.GELU(),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(4 * c * 16, latent))

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.net(frames)


class ResidualConv(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        groups = math.gcd(8, channels)
        self.body = nn.Sequential(nn.GroupNorm(groups, channels), nn.GELU(),
                                  nn.Conv2d(channels, channels, 3, 1, 1),
                                  nn.GroupNorm(groups, channels), nn.GELU(),
                                  nn.Conv2d(channels, channels, 3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class ImageDecoder(nn.Module):
    """Latent → frame in [0, 1]: Linear to a (4c, H/4, W/4) map, two ×2 transposed
    convolutions each followed by GroupNorm and two residual blocks, then two convolutions and
    a sigmoid (the reference decoder, with its widths 256/128/64 scaled to 4c/2c/c)."""

    def __init__(self, latent: int, frame_size: int, channels: int) -> None:
        super().__init__()
        if frame_size % 4:
            raise ConfigError(f"frame size {frame_size}: the decoder needs a multiple of 4")
        c, self.base = channels, frame_size // 4
        self.fc = WideLinear(latent, 4 * c * self.base * self.base)
        groups = math.gcd(8, c)
        self.net = nn.Sequential(
            nn.ConvTranspose2d(4 * c, 2 * c, 4, 2, 1), nn.GroupNorm(groups, 2 * c), nn.GELU(),
            ResidualConv(2 * c), ResidualConv(2 * c),
            nn.ConvTranspose2d(2 * c, c, 4, 2, 1), nn.GroupNorm(groups, c), nn.GELU(),
            ResidualConv(c), ResidualConv(c),
            nn.Conv2d(c, max(c // 2, 4), 3, 1, 1), nn.GELU(),
            nn.Conv2d(max(c // 2, 4), 3, 3, 1, 1), nn.Sigmoid())

    # channels-last lets oneDNN skip its layout reorders around every conv (the gain:
    # docs/design-attacks.md; `benchmarks/recovery_speed.py` times TRACE's inference in both)
    memory_format = torch.channels_last

    def forward(self, latent: torch.Tensor) -> torch.Tensor:  # (B, latent) → (B, 3, H, W)
        x = self.fc(latent).view(len(latent), -1, self.base, self.base)
        return self.net(x.contiguous(memory_format=self.memory_format)).contiguous()
