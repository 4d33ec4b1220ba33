"""The feature decoder's network: a conv feature map (C, h, w) → a frame (3, H, W) in [0, 1].

Standardised features, an optional dense path from all of them to every position, a residual
stem, ×2 upsampling stages to the frame size and a sigmoid head. Temporal context (`context`):
"concat" also feeds the previous step's reconstruction at every resolution, "warp" first moves
it by the action taken after it (a learnable affine map per action, initialised from the camera
motion the environment declares, identity where it declares none).
"""

from __future__ import annotations

import torch
from torch import nn

from gradleak.attacks.encoders import ResidualConv
from gradleak.errors import ConfigError

CONTEXTS = ("none", "concat", "warp")


def stage_widths(channels: int, stages: int) -> list[int]:
    return [max(16, channels >> max(0, i - 1)) for i in range(stages + 1)]


def upsampling_stages(height: int, frame_size: int) -> int:
    stages, size = 0, height
    while size < frame_size:
        size, stages = size * 2, stages + 1
    if size != frame_size:
        raise ConfigError(f"frame size {frame_size} is not the feature map's size {height} "
                          "times a power of two")
    return stages


def motion_prior(num_actions: int, camera_motion: list[list[float]]) -> torch.Tensor:
    """(K, 2, 3) affine maps: the declared camera motion per action, identity if undeclared."""
    if camera_motion and len(camera_motion) != num_actions:
        raise ConfigError(f"camera_motion has {len(camera_motion)} entries for "
                          f"{num_actions} actions")
    theta = torch.zeros(num_actions, 2, 3)
    for index in range(num_actions):
        scale, dx, dy = camera_motion[index] if camera_motion else (1.0, 0.0, 0.0)
        theta[index] = torch.tensor([[scale, 0.0, dx], [0.0, scale, dy]])
    return theta


class FrameDecoder(nn.Module):
    def __init__(self, feature_shape: tuple[int, int, int], frame_size: int, channels: int,
                 global_channels: int, context: str, context_channels: int, num_actions: int,
                 camera_motion: list[list[float]]) -> None:
        super().__init__()
        if context not in CONTEXTS:
            raise ConfigError(f"decoder context {context!r}: expected one of "
                              f"{', '.join(CONTEXTS)}")
        depth, height, width = self.feature_shape = feature_shape
        self.frame_size, self.context_kind = frame_size, context
        self.global_channels = global_channels
        self.register_buffer("feature_mean", torch.zeros(depth * height * width))
        self.register_buffer("feature_std", torch.ones(depth * height * width))
        stages = upsampling_stages(height, frame_size)
        widths = stage_widths(channels, stages)
        extra = context_channels if context != "none" else 0
        self.global_path = nn.Linear(depth * height * width, global_channels * height * width) \
            if global_channels else None
        self.stem = nn.Sequential(
            nn.Conv2d(depth + global_channels + extra, widths[0], 3, 1, 1), nn.GELU(),
            ResidualConv(widths[0]))
        self.up = nn.ModuleList(UpStage(widths[i], widths[i + 1], extra) for i in range(stages))
        self.head = nn.Sequential(nn.Conv2d(widths[-1], 3, 3, 1, 1), nn.Sigmoid())
        if extra:
            self.context = ContextPyramid(context_channels, stages)
            self.motion = nn.Parameter(motion_prior(num_actions, camera_motion))

    @torch.no_grad()
    def fit_normaliser(self, features: torch.Tensor) -> None:
        """Per-coordinate standardisation from auxiliary features (N, C·h·w)."""
        features = features.double()
        self.feature_mean.copy_(features.mean(0))
        self.feature_std.copy_(features.std(0).clamp_min(1e-3))

    def forward(self, features: torch.Tensor, previous: torch.Tensor | None = None,
                previous_actions: torch.Tensor | None = None,
                has_previous: torch.Tensor | None = None) -> torch.Tensor:
        """(N, C·h·w) conv features → frames (N, 3, H, W) in [0, 1]. Context models also take
        the previous reconstruction (N, 3, H, W), the action taken after it and whether there
        is one; without them they decode as if every step started an episode."""
        depth, height, width = self.feature_shape
        standard = torch.nan_to_num((features - self.feature_mean) / self.feature_std)
        spatial = standard.view(-1, depth, height, width)
        spread = [] if self.global_path is None else [self.global_path(standard).view(
            -1, self.global_channels, height, width)]
        levels: list[torch.Tensor | None] = [None] * (len(self.up) + 1)
        if self.context_kind != "none":
            levels = self._context(len(features), previous, previous_actions, has_previous)
        coarsest = [] if levels[-1] is None else [levels[-1]]
        x = self.stem(torch.cat([spatial, *spread, *coarsest], 1))
        for i, stage in enumerate(self.up):
            x = stage(x, levels[len(self.up) - 1 - i])
        return self.head(x)

    def _context(self, count: int, previous: torch.Tensor | None,
                 actions: torch.Tensor | None, has: torch.Tensor | None) -> list[torch.Tensor]:
        size = self.frame_size
        if previous is None or has is None:
            previous = self.feature_mean.new_zeros(count, 3, size, size)
            has = torch.zeros(count, dtype=torch.bool, device=previous.device)
        if self.context_kind == "warp" and actions is not None:
            previous = self.warp(previous, actions)
        mask = has.to(previous.dtype)[:, None, None, None]
        return self.context(torch.cat([previous * mask, mask.expand(-1, 1, size, size)], 1))

    def warp(self, frames: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Move each frame by the camera motion of the action taken after it."""
        grid = nn.functional.affine_grid(self.motion[actions], list(frames.shape),
                                         align_corners=False)
        return nn.functional.grid_sample(frames, grid, padding_mode="border",
                                         align_corners=False)


class UpStage(nn.Module):
    """×2 nearest upsampling, then (with the context at that resolution) conv + residual."""

    def __init__(self, channels_in: int, channels_out: int, context: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels_in + context, channels_out, 3, 1, 1)
        self.body = ResidualConv(channels_out)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        x = nn.functional.interpolate(x, scale_factor=2, mode="nearest")
        if context is not None:
            x = torch.cat([x, context], 1)
        return self.body(nn.functional.gelu(self.conv(x)))


class ContextPyramid(nn.Module):
    """(N, 4, H, W) previous frame + validity mask → features at H, H/2, …, H/2^levels."""

    def __init__(self, channels: int, levels: int) -> None:
        super().__init__()
        self.inp = nn.Conv2d(4, channels, 3, 1, 1)
        self.down = nn.ModuleList(nn.Conv2d(channels, channels, 4, 2, 1) for _ in range(levels))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        levels = [nn.functional.gelu(self.inp(x))]
        for down in self.down:
            levels.append(nn.functional.gelu(down(levels[-1])))
        return levels
