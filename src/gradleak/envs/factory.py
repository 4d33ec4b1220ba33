"""Build environments and scene lists from an EnvConfig, whatever the backend."""

from __future__ import annotations

import copy
from typing import Any

import gymnasium as gym

from gradleak.envs.adapter import make_gym_env
from gradleak.envs.config import EnvConfig
from gradleak.envs.doomnav import DoomNavEnv
from gradleak.envs.scenes import SceneCatalog
from gradleak.errors import ConfigError

BACKENDS = ("doomnav", "gym")


def _check_backend(config: EnvConfig) -> None:
    if config.backend not in BACKENDS:
        raise ConfigError(f"environment backend {config.backend!r}: expected one of "
                          f"{', '.join(BACKENDS)}")
    if config.backend == "gym" and not config.gym_id:
        raise ConfigError("environment backend 'gym' needs gym_id (e.g. MiniWorld-OneRoom-v0)")


def scene_catalog(config: EnvConfig) -> SceneCatalog | None:
    """The DoomNav maps and their geometry, to share between `scene_names` and `make_env`;
    None for a generic environment."""
    _check_backend(config)
    return SceneCatalog(config.doomnav.wad) if config.backend == "doomnav" else None


def scene_names(config: EnvConfig, split: str, catalog: SceneCatalog | None = None) -> list[str]:
    """The scenes of one split: DoomNav regions, or the generic environment as one scene."""
    _check_backend(config)
    if config.backend == "gym":
        return [str(config.gym_id)]
    catalog = catalog or SceneCatalog(config.doomnav.wad)
    maps = {"train": config.train_maps, "heldout": config.heldout_maps}.get(split) or None
    scenes = catalog.scenes(split, maps=maps, max_regions_per_map=config.max_regions_per_map)
    if not scenes:
        raise ConfigError(f"the {split!r} split of {catalog.wad.path.name} has no usable scenes")
    return [scene.name for scene in scenes]


def make_env(config: EnvConfig, scenes: list[str], max_steps: int | None = None,
             catalog: SceneCatalog | None = None) -> gym.Env:
    _check_backend(config)
    if config.backend == "gym":
        env: Any = make_gym_env(str(config.gym_id), config.doomnav.frame_size)
        if max_steps:
            env = gym.wrappers.TimeLimit(env, max_steps)
        return env
    doomnav = copy.deepcopy(config.doomnav)
    doomnav.scenes = list(scenes)
    if max_steps:
        doomnav.max_steps = max_steps
    return DoomNavEnv(doomnav, catalog=catalog)


def num_actions(config: EnvConfig) -> int:
    _check_backend(config)
    if config.backend == "gym":
        env = make_gym_env(str(config.gym_id), config.doomnav.frame_size)
        try:
            return int(env.action_space.n)
        finally:
            env.close()
    return config.doomnav.num_actions
