"""One episode at a frozen θ0, with the capture protocol's advantages (paper §3, public code).

GAE (γ, λ) over the episode, bootstrapped with V(s_T) when the episode is cut, normalised per
episode; returns = A_raw + V.
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

from gradleak.rl.advantages import episode_advantages, normalise, normalise_minibatches
from gradleak.rl.losses import parse_advantage_norm
from gradleak.rl.rollout import act, initial_state, single_threaded_torch, value_of
from gradleak.victims.base import Victim


@dataclass
class Episode:
    images: np.ndarray  # (T, H, W, 3) uint8: s_0 .. s_{T-1}
    goals: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    values: np.ndarray
    log_probs: np.ndarray
    probs: np.ndarray  # (T, K)
    terminated: bool  # ended by success (no bootstrap)
    hidden: np.ndarray | None = None  # (T, H): a recurrent victim's pre-step states

    def __len__(self) -> int:
        return len(self.actions)


def run_episode(env: gym.Env, victim: Victim, seed: int, scene: str, max_steps: int,
                generator: torch.Generator) -> tuple[Episode, float]:
    """Roll out one episode with sampled actions; returns it and its bootstrap value."""
    with single_threaded_torch():
        return _run_episode(env, victim, seed, scene, max_steps, generator)


def _run_episode(env: gym.Env, victim: Victim, seed: int, scene: str, max_steps: int,
                 generator: torch.Generator) -> tuple[Episode, float]:
    observation, _ = env.reset(seed=seed, options={"scene": scene})
    frames, goals, actions, rewards, values, log_probs, probs = [], [], [], [], [], [], []
    hidden, states = initial_state(victim, 1), []
    terminated = truncated = False
    while len(actions) < max_steps and not (terminated or truncated):
        image, goal = observation["image"][None], observation["goal"][None].astype(np.float32)
        step = act(victim, image, goal, generator, hidden)
        frames.append(observation["image"])
        goals.append(goal[0])
        if hidden is not None:
            states.append(hidden[0])
        hidden = step.next_hidden
        observation, reward, terminated, truncated, _ = env.step(int(step.actions[0]))
        actions.append(int(step.actions[0]))
        rewards.append(reward)
        values.append(float(step.values[0]))
        log_probs.append(float(step.log_probs[0]))
        probs.append(step.probs[0])
    bootstrap = 0.0 if terminated else float(value_of(
        victim, observation["image"][None], observation["goal"][None].astype(np.float32),
        hidden)[0])
    episode = Episode(images=np.stack(frames), goals=np.stack(goals),
                      actions=np.array(actions, np.int64), rewards=np.array(rewards, np.float32),
                      values=np.array(values, np.float32),
                      log_probs=np.array(log_probs, np.float32),
                      probs=np.stack(probs).astype(np.float32), terminated=bool(terminated),
                      hidden=np.stack(states).astype(np.float32) if states else None)
    return episode, bootstrap


def episode_targets(episode: Episode, bootstrap: float, gamma: float, lam: float,
                    advantage_norm: str = "episode") -> dict[str, np.ndarray]:
    raw = episode_advantages(episode.rewards, episode.values, bootstrap, gamma, lam)
    kind, size = parse_advantage_norm(advantage_norm)
    used = normalise(raw) if kind == "episode" else normalise_minibatches(raw, size) \
        if kind == "minibatch" else raw
    return {"advantages_raw": raw.astype(np.float32),
            "advantages": used.astype(np.float32),
            "returns": (raw + episode.values).astype(np.float32)}
