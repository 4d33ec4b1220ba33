"""`gradleak.rollout`: a user's policy run in their own Gymnasium environment at θ0, with GAE
and the advantage normalisation they declare, ready for `record`.

    rollout = gradleak.rollout(victim, env, steps=512, gamma=0.99, lam=0.95,
                               advantage_norm="minibatch:64", seed=1)
    rollout.record(victim, "runs/mine/heldout.h5", split="heldout",
                   loss={"value": 0.25, "entropy": 0.01, "clip": 0.1})

Actions are sampled from the victim's policy at its current weights (θ0, never updated), one
episode after another (episode k is reset with `seed + k`) until `steps` steps; the last one is
cut there and bootstrapped with V of the observation it stopped at, as an episode the
environment truncates is. Observations become frames as stored, (H, W, C) uint8: as given, from
(C, H, W) (a frame stack, as Gymnasium's `FrameStackObservation` gives it over grayscale frames)
or from (H, W) when C = 1; `frame=` maps anything else. Everything is checked before the first
step: the environment (one, not a vector of them), its discrete actions against the policy's,
and one observation's frame against the victim's declared shape.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from gradleak.capture.episodes import run_episode
from gradleak.capture.record import record
from gradleak.errors import ConfigError
from gradleak.io import theta_sha256
from gradleak.rl.advantages import episode_advantages, normalise, normalise_minibatches
from gradleak.rl.losses import parse_advantage_norm
from gradleak.victims.base import Victim

Frame = Callable[[Any], np.ndarray]


@dataclass(frozen=True)
class EnvRollout:
    """One rollout at θ0: per step, in episode order."""

    images: np.ndarray  # (T, H, W, C) uint8, as stored
    actions: np.ndarray  # (T,) int64
    rewards: np.ndarray  # (T,) float32
    values: np.ndarray  # (T,) V(s_t) at θ0
    log_probs: np.ndarray  # (T,) log π(a_t | s_t) at θ0
    advantages_raw: np.ndarray  # (T,) GAE(γ, λ)
    advantages: np.ndarray  # (T,) as the loss uses them: normalised as declared
    returns: np.ndarray  # (T,) advantages_raw + values
    episode_ids: np.ndarray  # (T,) 0, 0, ..., 1, ...
    hidden: np.ndarray | None  # (T, H) a recurrent victim's pre-step states
    gamma: float
    lam: float
    advantage_norm: str
    theta0_sha256: str  # the weights it ran at

    def __len__(self) -> int:
        return len(self.actions)

    def record(self, victim: Victim, out: str | os.PathLike[str], *, loss: dict[str, float],
               algorithm: str = "ppo", split: str = "train", overwrite: bool = False
               ) -> dict[str, Any]:
        """`gradleak.record` of this rollout: `loss` holds the value, entropy and clip
        coefficients (γ and λ are the rollout's). Refused if the victim's weights changed
        since the rollout: its values and advantages belong to those weights."""
        if theta_sha256(victim) != self.theta0_sha256:
            raise ConfigError("rollout.record: the victim's weights changed since the rollout; "
                              "record a rollout at the weights it ran at (θ0), before any update")
        for key, own in (("gamma", self.gamma), ("lam", self.lam)):
            if key in loss and float(loss[key]) != own:
                raise ConfigError(f"rollout.record: loss {key}={loss[key]} but the rollout's "
                                  f"GAE used {key}={own}")
        return record(victim, out, images=self.images, actions=self.actions,
                      advantages=self.advantages, returns=self.returns,
                      episode_ids=self.episode_ids,
                      loss={**loss, "gamma": self.gamma, "lam": self.lam}, algorithm=algorithm,
                      advantage_norm=self.advantage_norm, old_log_probs=self.log_probs,
                      rewards=self.rewards, hidden=self.hidden, split=split,
                      source="gradleak.rollout", overwrite=overwrite)


def rollout(victim: Victim, env: gym.Env, steps: int, *, gamma: float = 0.99, lam: float = 0.95,
            advantage_norm: str = "none", seed: int = 0, frame: Frame | None = None
            ) -> EnvRollout:
    """`steps` steps of `victim`'s policy in `env` (module docstring)."""
    shape = victim.input_transform.frame_shape
    _check(victim, env, steps, gamma, lam, advantage_norm, seed)
    read = frame or frame_reader(env.observation_space, shape)
    stored = StoredFrames(env, read, shape)
    stored.reset(seed=seed)  # one observation's frame checked before any step
    generator = torch.Generator().manual_seed(seed)
    victim.eval()
    sha = theta_sha256(victim)
    episodes, raws, total = [], [], 0
    while total < steps:
        episode, bootstrap = run_episode(stored, victim, seed + len(episodes), "", steps - total,
                                         generator)
        episodes.append(episode)
        raws.append(episode_advantages(episode.rewards, episode.values, bootstrap, gamma, lam))
        total += len(episode)
    raw = np.concatenate(raws)
    values = np.concatenate([e.values for e in episodes]).astype(np.float64)
    return EnvRollout(
        images=np.concatenate([e.images for e in episodes]),
        actions=np.concatenate([e.actions for e in episodes]),
        rewards=np.concatenate([e.rewards for e in episodes]),
        values=values.astype(np.float32),
        log_probs=np.concatenate([e.log_probs for e in episodes]),
        advantages_raw=raw.astype(np.float32),
        advantages=normalised(raws, advantage_norm).astype(np.float32),
        returns=(raw + values).astype(np.float32),
        episode_ids=np.repeat(np.arange(len(episodes)), [len(e) for e in episodes]),
        hidden=None if episodes[0].hidden is None
        else np.concatenate([e.hidden for e in episodes]),
        gamma=float(gamma), lam=float(lam), advantage_norm=advantage_norm, theta0_sha256=sha)


def normalised(raws: list[np.ndarray], advantage_norm: str) -> np.ndarray:
    """The episodes' raw advantages as the declared normalisation leaves them: per episode
    (population std), per run of M consecutive steps of the rollout or over the whole rollout
    (sample std, as SB3 and CleanRL), or not at all."""
    kind, size = parse_advantage_norm(advantage_norm)
    if kind == "episode":
        return np.concatenate([normalise(raw) for raw in raws])
    every = np.concatenate(raws)
    if kind == "minibatch":
        return normalise_minibatches(every, size)
    if kind == "rollout":
        return normalise_minibatches(every, len(every))
    return every


def frame_reader(space: gym.Space, shape: tuple[int, int, int]) -> Frame:
    """How an observation of `space` becomes a stored (H, W, C) uint8 frame, or a ConfigError
    saying what `frame=` must do instead."""
    height, width, channels = shape
    hint = ("; pass frame= (observation -> the frame as stored, (H, W, C) uint8) to say how "
            "an observation becomes one")
    if not isinstance(space, gym.spaces.Box) or space.dtype != np.uint8:
        raise ConfigError(f"rollout: the environment's observations are {space}, not uint8 "
                          f"frames" + hint)
    if space.shape == shape:
        return np.asarray
    if space.shape == (channels, height, width):
        return lambda observation: np.ascontiguousarray(np.moveaxis(observation, 0, -1))
    if channels == 1 and space.shape == (height, width):
        return lambda observation: np.asarray(observation)[..., None]
    raise ConfigError(f"rollout: the environment's observations have shape {space.shape}; the "
                      f"victim's frames are {shape} (H, W, C), read as such, as (C, H, W) or, "
                      "grayscale, (H, W)" + hint)


class StoredFrames(gym.Wrapper):
    """The user's environment as the capture protocol reads it: observations {"image": the
    stored frame, "goal": zeros}, reset with a seed alone (the protocol's scene option is
    gradleak's own)."""

    def __init__(self, env: gym.Env, frame: Frame, shape: tuple[int, int, int]) -> None:
        super().__init__(env)
        self.frame, self.shape = frame, shape

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        observation, info = self.env.reset(seed=seed)
        return self.stored(observation), info

    def step(self, action: Any) -> tuple[dict[str, np.ndarray], Any, bool, bool, dict]:
        observation, reward, terminated, truncated, info = self.env.step(action)
        return self.stored(observation), float(reward), bool(terminated), bool(truncated), info

    def stored(self, observation: Any) -> dict[str, np.ndarray]:
        image = self.frame(observation)
        if not isinstance(image, np.ndarray) or image.dtype != np.uint8 \
                or image.shape != self.shape:
            what = f"{image.dtype} {image.shape}" if isinstance(image, np.ndarray) \
                else type(image).__name__
            raise ConfigError(f"rollout: an observation became a frame of {what}; the victim's "
                              f"frames are uint8 {self.shape} (H, W, C)")
        return {"image": image, "goal": np.zeros(3, np.float32)}


def _check(victim: Victim, env: Any, steps: int, gamma: float, lam: float, advantage_norm: str,
           seed: int) -> None:
    if isinstance(env, gym.vector.VectorEnv) or not isinstance(env, gym.Env):
        raise ConfigError(f"rollout: env is a {type(env).__name__}; expected one gymnasium.Env "
                          "(one environment of a vector of them, with the same wrappers)")
    if "goal" in victim.extra_inputs:
        raise ConfigError(f"rollout: victim {victim.config.name} reads a goal beside the frame; "
                          "collect its steps yourself and pass goals= to gradleak.record")
    count = victim.config.num_actions
    if not isinstance(env.action_space, gym.spaces.Discrete) or env.action_space.n != count:
        raise ConfigError(f"rollout: the environment's actions are {env.action_space}; the "
                          f"victim's policy has {count} discrete actions")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"rollout: steps={steps!r}, expected a positive integer")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"rollout: seed={seed!r}, expected an integer >= 0")
    for name, value in (("gamma", gamma), ("lam", lam)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0.0 <= value <= 1.0:
            raise ConfigError(f"rollout: {name}={value!r}, expected 0 <= {name} <= 1")
    parse_advantage_norm(advantage_norm)
