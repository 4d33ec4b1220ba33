"""The environment's config: which backend, which maps, and DoomNav's own settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from gradleak.envs.doomnav import DoomNavConfig


@dataclass
class EnvConfig:
    backend: str = "doomnav"  # "doomnav" or "gym" (any RGB Gymnasium env, through the adapter)
    gym_id: str | None = None
    doomnav: DoomNavConfig = field(default_factory=DoomNavConfig)
    train_maps: list[str] = field(default_factory=list)  # a subset of the train split; [] = all
    heldout_maps: list[str] = field(default_factory=list)
    max_regions_per_map: int | None = None
