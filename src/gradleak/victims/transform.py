"""How stored frames become what a victim's first layer reads, and back: the input transform a
capture declares in its roles."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from gradleak.errors import ConfigError


@dataclass(frozen=True)
class InputTransform:
    """Stored frames (N, H, W, C) uint8 → what the network reads: (N, C, H, W) float,
    x = (frame · scale − mean) / std per channel. C = stack × (3 for RGB, 1 for grayscale)."""

    height: int
    width: int
    channels: int = 3
    stack: int = 1  # frames stacked along the channel axis, oldest first
    scale: float = 1.0 / 255.0
    mean: tuple[float, ...] = ()  # per channel; () = 0
    std: tuple[float, ...] = ()  # per channel; () = 1

    def __post_init__(self) -> None:
        for name in ("height", "width", "channels", "stack"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"input transform: {name} is {value!r}, expected a positive "
                                  "integer")
        if self.channels % self.stack or self.channels // self.stack not in (1, 3):
            raise ConfigError(f"input transform: {self.channels} channels in a stack of "
                              f"{self.stack} frames: expected 1 (grayscale) or 3 (RGB) per frame")
        for name in ("mean", "std"):
            values = getattr(self, name)
            if values and len(values) != self.channels:
                raise ConfigError(f"input transform: {name} has {len(values)} values, expected "
                                  f"one per channel ({self.channels})")
        if not self.scale > 0 or any(s <= 0 for s in self.std):
            raise ConfigError("input transform: scale and std must be positive")

    @property
    def frame_shape(self) -> tuple[int, int, int]:
        return (self.height, self.width, self.channels)

    @property
    def rgb(self) -> bool:
        """Square RGB single frames: what the learned attackers and image metrics expect."""
        return self.channels == 3 and self.stack == 1 and self.height == self.width

    def _per_channel(self, values: tuple[float, ...], default: float, like: torch.Tensor
                     ) -> torch.Tensor:
        data = values or (default,) * self.channels
        return torch.tensor(data, dtype=like.dtype, device=like.device).view(1, -1, 1, 1)

    def apply(self, frames: torch.Tensor) -> torch.Tensor:
        """(N, H, W, C) uint8 or float in frame units → (N, C, H, W) network input (float32
        unless given float64)."""
        dtype = frames.dtype if frames.dtype == torch.float64 else torch.float32
        x = frames.permute(0, 3, 1, 2).to(dtype) * self.scale
        if self.mean:
            x = x - self._per_channel(self.mean, 0.0, x)
        if self.std:
            x = x / self._per_channel(self.std, 1.0, x)
        return x

    def invert(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) network input → (N, H, W, C) float frames (0..255 for valid input)."""
        if self.std:
            x = x * self._per_channel(self.std, 1.0, x)
        if self.mean:
            x = x + self._per_channel(self.mean, 0.0, x)
        return (x / self.scale).permute(0, 2, 3, 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, source: str) -> InputTransform:
        if not isinstance(data, dict) or not {"height", "width"} <= set(data):
            raise ConfigError(f"{source}: expected an object with height and width, found "
                              f"{data!r}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"{source}: unknown field(s) {', '.join(sorted(unknown))}")
        try:
            return cls(**{**data, "mean": tuple(float(v) for v in data.get("mean", ())),
                          "std": tuple(float(v) for v in data.get("std", ())),
                          "scale": float(data.get("scale", 1 / 255))})
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{source}: {error}") from None
