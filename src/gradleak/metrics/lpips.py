"""LPIPS (Zhang et al. 2018, AlexNet variant, v0.1) in plain torch, offline.

Two files are needed and nothing is downloaded:
- the linear calibration layers, shipped inside the `torchmetrics` wheel
  (`torchmetrics/functional/image/lpips_models/alex.pth`);
- the ImageNet AlexNet backbone, supplied by the user: `--lpips-weights FILE`, the environment
  variable GRADLEAK_LPIPS_WEIGHTS, or torchvision's usual cache path
  `~/.cache/torch/hub/checkpoints/alexnet-owt-7be5be79.pth`.
Without the backbone, LPIPS is reported as unavailable (with where to put the file) and
training's perceptual term falls back to 1 − SSIM. Both files are read with
`torch.load(weights_only=True)`: tensors only, never arbitrary pickles.
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gradleak.errors import CheckpointError

BACKBONE_FILE = "alexnet-owt-7be5be79.pth"
# torchvision's AlexNet `features`: (index in the Sequential, out, kernel, stride, padding)
ALEXNET_CONVS = ((0, 64, 11, 4, 2), (3, 192, 5, 1, 2), (6, 384, 3, 1, 1), (8, 256, 3, 1, 1),
                 (10, 256, 3, 1, 1))
POOL_BEFORE = {3, 6}  # a 3x3/2 max-pool precedes these convolutions
# LPIPS's input normalisation, applied to images in [-1, 1]
SHIFT = torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1)
SCALE = torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1)


def default_backbone_paths() -> list[Path]:
    paths = []
    if os.environ.get("GRADLEAK_LPIPS_WEIGHTS"):
        paths.append(Path(os.environ["GRADLEAK_LPIPS_WEIGHTS"]))
    torch_home = Path(os.environ.get("TORCH_HOME", Path.home() / ".cache" / "torch"))
    paths.append(torch_home / "hub" / "checkpoints" / BACKBONE_FILE)
    return paths


def unavailable_reason(backbone: str | os.PathLike[str] | None = None) -> str | None:
    """None when LPIPS can be computed; otherwise one line saying where the file must go."""
    if backbone is not None:
        if Path(backbone).is_dir():
            return f"LPIPS unavailable: --lpips-weights {backbone} is a directory, not a file"
        return None if Path(backbone).is_file() else (
            f"LPIPS unavailable: --lpips-weights {backbone} does not exist")
    if any(p.is_file() for p in default_backbone_paths()):
        return None
    return ("LPIPS unavailable: put torchvision's ImageNet AlexNet weights "
            f"({BACKBONE_FILE}) at {default_backbone_paths()[-1]} or pass --lpips-weights FILE")


class LPIPS(nn.Module):
    """Distance between images in [0, 1], shape (N, 3, H, W) → (N,)."""

    def __init__(self, backbone: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c_in, c_out, k, s, p) for (_, c_out, k, s, p), c_in
                                   in zip(ALEXNET_CONVS, (3, 64, 192, 384, 256), strict=True))
        self.lins = nn.ModuleList(nn.Conv2d(c, 1, 1, bias=False) for _, c, *_ in ALEXNET_CONVS)
        self._load_backbone(self._find_backbone(backbone))
        self._load_linear_layers()
        self.requires_grad_(False)
        self.eval()

    @staticmethod
    def _find_backbone(backbone: str | os.PathLike[str] | None) -> Path:
        reason = unavailable_reason(backbone)
        if reason:
            raise CheckpointError(reason)
        if backbone is not None:
            return Path(backbone)
        return next(p for p in default_backbone_paths() if p.is_file())

    def _load_backbone(self, path: Path) -> None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (RuntimeError, OSError, ValueError) as err:
            raise CheckpointError(f"LPIPS backbone {path} is not a readable torch weights file "
                                  f"({err})") from None
        for conv, (index, *_) in zip(self.convs, ALEXNET_CONVS, strict=True):
            for name in ("weight", "bias"):
                key = f"features.{index}.{name}"
                if key not in state or state[key].shape != getattr(conv, name).shape:
                    raise CheckpointError(f"LPIPS backbone {path}: '{key}' is missing or has the "
                                          "wrong shape (expected torchvision's AlexNet)")
                getattr(conv, name).data.copy_(state[key])

    def _load_linear_layers(self) -> None:
        resource = importlib.resources.files("torchmetrics") / "functional" / "image" / \
            "lpips_models" / "alex.pth"
        with importlib.resources.as_file(resource) as path:
            state = torch.load(path, map_location="cpu", weights_only=True)
        for index, lin in enumerate(self.lins):
            lin.weight.data.copy_(state[f"lin{index}.model.1.weight"])

    def _features(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = (x * 2 - 1 - SHIFT.to(x)) / SCALE.to(x)
        features = []
        for conv, (index, *_) in zip(self.convs, ALEXNET_CONVS, strict=True):
            if index in POOL_BEFORE:
                x = F.max_pool2d(x, 3, 2)
            x = F.relu(conv(x))
            features.append(x)
        return features

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(a.shape[0], device=a.device)
        for fa, fb, lin in zip(self._features(a), self._features(b), self.lins, strict=True):
            na = fa / torch.sqrt(1e-8 + (fa**2).sum(dim=1, keepdim=True))
            nb = fb / torch.sqrt(1e-8 + (fb**2).sum(dim=1, keepdim=True))
            total = total + lin((na - nb) ** 2).mean(dim=(1, 2, 3))
        return total
