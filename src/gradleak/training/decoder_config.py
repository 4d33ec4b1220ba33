"""The feature decoder fit's settings: the shared schedule with its own defaults, and what only a
frame decoder has (rendered frames, mirroring, its loss weights). Read by the fit and by its
frame sets."""

from __future__ import annotations

from dataclasses import dataclass

from gradleak.defenses import Chain, parse_defense
from gradleak.errors import ConfigError
from gradleak.training.loop import FitSchedule


@dataclass
class DecoderFitConfig(FitSchedule):
    """The feature decoder's fit on frames: the shared schedule with its own defaults, and
    what only a frame decoder has (rendered frames, mirroring, its loss weights)."""

    epochs: int = 20
    batch_size: int = 64
    lr: float = 2e-3
    warmup_epochs: float = 0.3
    min_lr: float = 1e-5
    extra_frames: int = 20_000  # rendered on the captures' training scenes, random policy
    mirror: bool = True
    l1_weight: float = 0.5
    ssim_weight: float = 0.5
    max_val_frames: int = 512

    def defense_chain(self) -> Chain | None:
        """The per-step defense to train under, or None; its conflicts named up front."""
        chain = parse_defense(self.defense, self.defense_seed)
        if not chain.defenses:
            return None
        if not chain.per_step:
            raise ConfigError(f"decoder fit defense {self.defense!r} aggregates steps: the "
                              "feature decoder reads one step's gradient")
        if self.extra_frames > 0:
            raise ConfigError(f"decoder fit defense {self.defense!r} with extra_frames="
                              f"{self.extra_frames}: rendered frames have no gradient to "
                              "defend; set extra_frames to 0")
        return chain
