"""What victim training reads: its own config and the environment's, and nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from gradleak.envs.config import EnvConfig


@dataclass
class TrainConfig:
    algo: str = "ppo"  # "ppo" or "a2c"
    victim: str = "cnn-small"
    num_envs: int = 8
    rollout_steps: int = 128
    updates: int = 100
    epochs: int = 4  # PPO only; A2C takes one step per rollout
    minibatch: int = 64
    lr: float = 2.5e-4
    gamma: float = 0.99
    lam: float = 0.95
    clip: float = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.01
    max_grad_norm: float = 0.5
    max_episode_steps: int | None = None  # None: the environment's own limit
    seed: int = 0


class TrainingSetup(Protocol):
    """What `train_victim` is given (a `gradleak.presets.Preset` is one): the training and
    environment configs, checked, and the whole resolved config to save beside the victim."""

    train: TrainConfig
    env: EnvConfig

    def validate(self) -> Any: ...

    def to_dict(self) -> dict[str, Any]: ...
