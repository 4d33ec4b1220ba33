"""Use any Gymnasium environment with RGB observations and discrete actions in place of DoomNav.

MiniWorld, AI2-THOR wrappers, Atari, ...: the adapter resizes the frame to the victim's input
size and presents DoomNav's observation layout ({"image", "goal"}); the goal vector is zero,
since a generic environment has no point goal.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from gradleak.envs.frames import resize_area
from gradleak.errors import ConfigError


def _find_rgb_key(space: gym.Space, env_id: str) -> str | None:
    if isinstance(space, gym.spaces.Box):
        _check_rgb(space, env_id, "observation")
        return None
    if isinstance(space, gym.spaces.Dict):
        for key in ("image", "rgb", "pixels", "obs"):
            if key in space.spaces:
                _check_rgb(space.spaces[key], env_id, f"observation[{key!r}]")
                return key
    raise ConfigError(f"environment {env_id}: observation space {space} is neither an RGB Box "
                      "nor a Dict with an 'image', 'rgb' or 'pixels' entry")


def _check_rgb(space: gym.Space, env_id: str, where: str) -> None:
    if not (isinstance(space, gym.spaces.Box) and len(space.shape) == 3 and space.shape[-1] == 3):
        raise ConfigError(f"environment {env_id}: {where} must be an (H, W, 3) RGB Box, "
                          f"found {space}")


class GymImageAdapter(gym.Wrapper):
    """Wraps an RGB, discrete-action environment into DoomNav's observation layout."""

    def __init__(self, env: gym.Env, frame_size: int, env_id: str = "environment") -> None:
        super().__init__(env)
        if not isinstance(env.action_space, gym.spaces.Discrete):
            raise ConfigError(f"{env_id}: action space {env.action_space} is not Discrete")
        self._key = _find_rgb_key(env.observation_space, env_id)
        self.frame_size = frame_size
        self.scene_name = env_id
        self.observation_space = gym.spaces.Dict({
            "image": gym.spaces.Box(0, 255, (frame_size, frame_size, 3), np.uint8),
            "goal": gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
        })

    def _convert(self, observation: Any) -> dict[str, np.ndarray]:
        frame = observation if self._key is None else observation[self._key]
        frame = np.asarray(frame)
        if frame.dtype != np.uint8:  # float frames in [0, 1]
            frame = np.clip(np.rint(frame * 255.0), 0, 255).astype(np.uint8)
        image = resize_area(frame, self.frame_size, self.frame_size)
        return {"image": image, "goal": np.zeros(3, np.float32)}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        options = dict(options or {})
        options.pop("scene", None)  # a generic environment has one scene: itself
        observation, info = self.env.reset(seed=seed, options=options or None)
        info = dict(info, scene=self.scene_name, success=False, engine_ended=False)
        return self._convert(observation), info

    def step(self, action: int):
        observation, reward, terminated, truncated, info = self.env.step(action)
        info = dict(info, scene=self.scene_name)
        info.setdefault("success", bool(terminated))
        info.setdefault("engine_ended", False)
        return self._convert(observation), float(reward), terminated, truncated, info


def make_gym_env(env_id: str, frame_size: int, **kwargs: Any) -> GymImageAdapter:
    try:
        env = gym.make(env_id, **kwargs)
    except gym.error.Error as err:
        raise ConfigError(f"Gymnasium environment {env_id!r} cannot be made: {err}") from None
    return GymImageAdapter(env, frame_size, env_id)
