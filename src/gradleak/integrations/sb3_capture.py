"""`model.learn(..., callback=GradleakCapture("runs/sb3/train-{rollout}.h5", every=4))`: the
per-step gradients a distributed SB3 client would send, recorded during its own training.

At the end of each chosen rollout (SB3 has computed its advantages and returns, and not yet
updated θ), every step of the rollout buffer becomes one row: the frame as SB3 preprocessed it,
the action, SB3's own advantage and return, the old log-probability and value, and the gradient
of SB3's loss on that step alone at the rollout's θ0 (a minibatch of one, where SB3 applies no
advantage normalisation: the file declares raw advantages). CnnPolicy, MlpPolicy on frames and
MultiInputPolicy (frame + goal) rollouts are recorded alike. One file per recorded rollout, since
each has its own θ0; the rows of each environment are contiguous, split into segments where SB3
marks an episode start (a segment cut by the rollout's end is not closed by success).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from gradleak.capture.record import record
from gradleak.errors import ConfigError
from gradleak.integrations.sb3_policy import learning_rule, victim

try:
    from stable_baselines3.common.callbacks import BaseCallback
except ImportError as missing:  # the extra is not installed
    raise ConfigError("gradleak.integrations.sb3.GradleakCapture needs Stable-Baselines3: pip "
                      "install -c constraints.txt 'gradleak[sb3]'") from missing


class GradleakCapture(BaseCallback):
    def __init__(self, path: str | os.PathLike[str], every: int = 1, split: str = "train"
                 ) -> None:
        super().__init__()
        if every < 1:
            raise ConfigError(f"every={every}: expected a rollout interval >= 1")
        self.path, self.every, self.split = str(path), every, split
        self.rollouts, self.written = 0, []

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        index, self.rollouts = self.rollouts, self.rollouts + 1
        if index % self.every == 0:
            out = Path(self.path.format(rollout=index)) if "{rollout}" in self.path \
                else Path(self.path).with_name(f"{Path(self.path).stem}.rollout-{index}"
                                              f"{Path(self.path).suffix}")
            write_rollout(self.model, out, self.split, index)
            self.written.append(str(out))


def segments(starts: np.ndarray) -> list[tuple[int, int, int]]:
    """(env, first step, stop) of each piece of an episode in a (T, N) rollout."""
    steps, envs = starts.shape
    found = []
    for env in range(envs):
        cuts = [0, *[t for t in range(1, steps) if starts[t, env]], steps]
        found += [(env, a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    return found


def frames_in_order(frames: np.ndarray, order: np.ndarray, chunk: int = 1024) -> np.ndarray:
    """(T, N, C, H, W) → (T·N, H, W, C) uint8 rows in `order`, built with one copy (a rollout of
    2,048 × 8 stacked 84×84 frames is 0.46 GB; reshaping, indexing and transposing it whole
    would hold two or three)."""
    flat = frames.reshape(-1, *frames.shape[2:])
    out = np.empty((len(order), *frames.shape[3:], frames.shape[2]), np.uint8)
    for start in range(0, len(order), chunk):
        out[start:start + chunk] = flat[order[start:start + chunk]].transpose(0, 2, 3, 1)
    return out


def write_rollout(model: Any, out: Path, split: str, index: int) -> None:
    """One standard capture file of the rollout in `model.rollout_buffer`, at the current θ:
    each environment's steps in order, one episode id per segment."""
    buffer, rule = model.rollout_buffer, learning_rule(model)
    pieces = segments(buffer.episode_starts)
    order = np.concatenate([np.arange(a, b) * buffer.n_envs + env for env, a, b in pieces])
    ids = np.concatenate([np.full(b - a, i) for i, (_, a, b) in enumerate(pieces)])

    def rows(values: np.ndarray) -> np.ndarray:  # (T, N, ...) → the chosen order
        return values.reshape(-1, *values.shape[2:])[order]

    audited = victim(model)
    key, goal_key = (audited.config.options.get(k) for k in ("image_key", "goal_key"))
    frames = buffer.observations[key] if key else buffer.observations  # (T, N, C, H, W)
    goals = rows(buffer.observations[goal_key]).astype(np.float32) if goal_key else None
    record(audited, out, images=frames_in_order(frames, order),
           goals=goals, actions=rows(buffer.actions)[:, 0].astype(np.int64),
           advantages=rows(buffer.advantages), returns=rows(buffer.returns),
           episode_ids=ids, loss=rule, algorithm=rule["algorithm"], advantage_norm="none",
           old_log_probs=rows(buffer.log_probs), rewards=rows(buffer.rewards), split=split,
           source=f"stable-baselines3 rollout {index}", overwrite=True)
