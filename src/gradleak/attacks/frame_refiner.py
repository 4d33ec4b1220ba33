"""A learned prior for the training-free frames: a residual refiner, then the equations again.

The first conv's equations fix about 0.6 of each frame; the solve's total-variation prior fills
the rest (`inversion.frame_solve`). What that prior gets wrong has a pattern a small network can
learn without a single private gradient: the attacker knows θ0, the architecture and the
client's loss, so it captures its own steps on training scenes against the same θ0 and runs the
training-free attack on them, giving pairs (its frame, the true frame). `FrameRefiner` maps x̂
to clamp(x̂ + f(x̂)), a three-scale residual CNN that starts at the identity (its last layer is
zero), and `training/refiner_fit.py` fits it. At attack time the refined frame goes back
through the equations (`ExactAttack`): a few CG iterations from it on the equations alone keep
what the equations fix and take the refiner's guess only where they leave the frame free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gradleak.names import WITH_PRIOR


@dataclass
class RefinerConfig:
    width: int = 32  # channels at full resolution, doubled at each coarser scale
    scales: int = 3  # resolutions, each half the one above
    frame_size: int = 84  # set by the fit from the captures
    channels: int = 3


def conv_block(inputs: int, outputs: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 3, stride, 1), nn.GELU(),
                         nn.Conv2d(outputs, outputs, 3, 1, 1), nn.GELU())


class FrameRefiner(nn.Module):
    """x̂ (N, C, H, W) in [0, 1] → clamp(x̂ + f(x̂)): a U-Net whose skips join each scale on the
    way up; the identity at initialisation."""

    name = WITH_PRIOR

    def __init__(self, config: RefinerConfig) -> None:
        super().__init__()
        self.config = config
        widths = [config.width * 2 ** level for level in range(config.scales)]
        self.down = nn.ModuleList(
            [conv_block(config.channels, widths[0])]
            + [conv_block(widths[level - 1], widths[level], stride=2)
               for level in range(1, config.scales)])
        self.up = nn.ModuleList([nn.ConvTranspose2d(widths[level], widths[level - 1], 2, 2)
                                 for level in range(config.scales - 1, 0, -1)])
        self.merge = nn.ModuleList([conv_block(2 * widths[level - 1], widths[level - 1])
                                    for level in range(config.scales - 1, 0, -1)])
        self.out = nn.Conv2d(widths[0], config.channels, 3, 1, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        skips, h = [], frames
        for block in self.down:
            h = block(h)
            skips.append(h)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips[:-1]), strict=True):
            h = up(h)[..., :skip.shape[-2], :skip.shape[-1]]
            h = nn.functional.pad(h, (0, skip.shape[-1] - h.shape[-1],
                                      0, skip.shape[-2] - h.shape[-2]))
            h = merge(torch.cat([skip, h], 1))
        return (frames + self.out(h)).clamp(0, 1)
