"""Rollouts of a victim in a list of environments (stepped in one process: on 2 cores
subprocess vector environments were slower, see shared/reference/vizdoom-notes.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from gradleak.threads import torch_threads
from gradleak.victims.base import Victim


@contextlib.contextmanager
def single_threaded_torch() -> Iterator[None]:
    """Run torch on one thread while it alternates with the game engine.

    Interleaving engine steps with two-thread forward passes made each step ~20x
    slower on 2 cores (1.6 vs 31 ms per step measured): the second intra-op thread goes to sleep
    while the engine runs and every parallel region then waits for it to wake.
    """
    with torch_threads(1):
        yield


def channels_last_convolutions(victim: nn.Module) -> None:
    """Store the victim's convolution weights channels-last, in place, for batch-1 rollouts.

    Frames reach the first convolution channels-last already (the input transform permutes
    (N, H, W, C) frames without a copy), so oneDNN copied every contiguous conv weight to that
    layout on every call: 12 copies a forward pass of the paper cnn against 8. Measured on 300
    stored frames, one thread: `act` 0.77 → 0.69 ms for the paper cnn and 0.44 → 0.41 for
    cnn-small, logits and values bit for bit the same for all nine image victims. Only for a
    copy the rollout owns (the forked rollout process's): the weights' values are unchanged,
    their strides are not.
    """
    for module in victim.modules():
        if isinstance(module, nn.Conv2d):
            module.weight.data = module.weight.data.contiguous(memory_format=torch.channels_last)


@dataclass
class Step:
    """One batched policy step: a ~ π_θ(·|s), log π(a|s), V(s), π(·|s), and the state a
    recurrent victim carries to the next step (None for a feed-forward one)."""

    actions: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray
    probs: np.ndarray
    next_hidden: np.ndarray | None


def _tensor(array: np.ndarray | None) -> torch.Tensor | None:
    return None if array is None else torch.from_numpy(array)


# inference mode, not no_grad: no version counters or view tracking, 0.73 → 0.57 ms a step for
# cnn-small at batch 1, a fifth of what the capture's rollout adds to the engine's own step
@torch.inference_mode()
def act(victim: Victim, images: np.ndarray, goals: np.ndarray, generator: torch.Generator,
        hidden: np.ndarray | None = None) -> Step:
    """Sample actions for a batch from the pre-step state `hidden` (recurrent victims)."""
    logits, values, following = victim.advance(torch.from_numpy(images),
                                               torch.from_numpy(goals), _tensor(hidden))
    log_pi = torch.log_softmax(logits, dim=-1)
    actions = torch.multinomial(log_pi.exp(), 1, generator=generator).squeeze(-1)
    taken = log_pi.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    return Step(actions.numpy(), taken.numpy(), values.numpy(), log_pi.exp().numpy(),
                None if following is None else following.numpy())


@torch.inference_mode()
def value_of(victim: Victim, images: np.ndarray, goals: np.ndarray,
             hidden: np.ndarray | None = None) -> np.ndarray:
    return victim(torch.from_numpy(images), torch.from_numpy(goals), _tensor(hidden))[1].numpy()


def initial_state(victim: Victim, batch: int) -> np.ndarray | None:
    state = victim.initial_state(batch)
    return None if state is None else state.numpy()


@dataclass
class Rollout:
    """(T, N) arrays of one rollout over N environments, plus the finished episodes."""

    images: np.ndarray  # (T, N, H, W, 3) uint8
    goals: np.ndarray  # (T, N, 3)
    hidden: np.ndarray | None  # (T, N, H): a recurrent victim's pre-step state, else None
    actions: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray
    rewards: np.ndarray
    next_values: np.ndarray  # V(s_{t+1}); 0 after success, V(final obs) after a cut
    continues: np.ndarray  # 1 when s_{t+1} is in the same episode
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    episode_successes: list[bool] = field(default_factory=list)


class VectorRunner:
    """Steps N environments in lock-step and keeps their episodes going across rollouts."""

    def __init__(self, envs: list[gym.Env], seed: int) -> None:
        self.envs = envs
        observations = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
        self.images = np.stack([o["image"] for o in observations])
        self.goals = np.stack([o["goal"] for o in observations]).astype(np.float32)
        self._returns = np.zeros(len(envs))
        self._lengths = np.zeros(len(envs), dtype=np.int64)
        self.hidden: np.ndarray | None = None  # set by the first rollout of a recurrent victim

    def collect(self, victim: Victim, steps: int, generator: torch.Generator) -> Rollout:
        n = len(self.envs)
        shape = (steps, n)
        if victim.recurrent and self.hidden is None:
            self.hidden = initial_state(victim, n)
        out = Rollout(images=np.zeros(shape + self.images.shape[1:], np.uint8),
                      goals=np.zeros(shape + (3,), np.float32),
                      hidden=None if self.hidden is None else
                      np.zeros(shape + self.hidden.shape[1:], np.float32),
                      actions=np.zeros(shape, np.int64), log_probs=np.zeros(shape, np.float32),
                      values=np.zeros(shape, np.float32), rewards=np.zeros(shape, np.float32),
                      next_values=np.zeros(shape, np.float32),
                      continues=np.zeros(shape, np.float32))
        with single_threaded_torch():
            for t in range(steps):
                self._record_step(victim, out, t, generator)
            out.next_values[-1] += out.continues[-1] * value_of(victim, self.images, self.goals,
                                                                self.hidden)
        out.next_values[:-1] += out.continues[:-1] * out.values[1:]
        return out

    def _record_step(self, victim: Victim, out: Rollout, t: int,
                     generator: torch.Generator) -> None:
        out.images[t], out.goals[t] = self.images, self.goals
        if out.hidden is not None:
            out.hidden[t] = self.hidden
        step = act(victim, self.images, self.goals, generator, self.hidden)
        out.actions[t], out.log_probs[t], out.values[t] = step.actions, step.log_probs, \
            step.values
        self.hidden = step.next_hidden
        self._step_all(victim, step.actions, out, t)

    def _step_all(self, victim: Victim, actions: np.ndarray, out: Rollout, t: int) -> None:
        for i, env in enumerate(self.envs):
            observation, reward, terminated, truncated, info = env.step(int(actions[i]))
            state = None if self.hidden is None else self.hidden[i:i + 1]  # after s_t
            out.rewards[t, i] = reward
            self._returns[i] += reward
            self._lengths[i] += 1
            if terminated or truncated:
                if truncated and not terminated:  # bootstrap the cut episode from its last frame
                    out.next_values[t, i] = value_of(victim, observation["image"][None],
                                                     observation["goal"][None], state)[0]
                out.episode_returns.append(float(self._returns[i]))
                out.episode_lengths.append(int(self._lengths[i]))
                out.episode_successes.append(bool(info.get("success", terminated)))
                self._returns[i], self._lengths[i] = 0.0, 0
                if self.hidden is not None:  # a new episode starts from the initial state
                    self.hidden[i] = initial_state(victim, 1)[0]
                observation, _ = env.reset()
            else:
                out.continues[t, i] = 1.0
            self.images[i], self.goals[i] = observation["image"], observation["goal"]

    def close(self) -> None:
        for env in self.envs:
            env.close()
