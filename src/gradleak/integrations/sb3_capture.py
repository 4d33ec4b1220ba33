"""`model.learn(..., callback=GradleakCapture("runs/sb3/train-{rollout}.h5", every=4))`: the
per-step gradients a distributed SB3 client would send, recorded during its own training.

At the end of each chosen rollout (SB3 has computed its advantages and returns, and not yet
updated θ), every step of the rollout buffer becomes one row: the frame as SB3 preprocessed it,
the action, SB3's own advantage and return, the old log-probability and value, and the gradient
of SB3's loss on that step alone at the rollout's θ0 (a minibatch of one, where SB3 applies no
advantage normalisation: the file declares raw advantages). One file per recorded rollout, since
each has its own θ0; the rows of each environment are contiguous, split into segments where SB3
marks an episode start (a segment cut by the rollout's end is not closed by success).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradleak.capture.grads import StepBatch, per_step_gradients
from gradleak.capture.run import capture_attributes
from gradleak.capture.schema import step_columns
from gradleak.capture.writer import CaptureWriter
from gradleak.errors import ConfigError
from gradleak.integrations.sb3 import learning_rule, victim
from gradleak.io import check_output, theta_sha256
from gradleak.rl.losses import LossCoefficients
from gradleak.victims.base import layer_table

try:
    from stable_baselines3.common.callbacks import BaseCallback
except ImportError as missing:  # the extra is not installed
    raise ConfigError("gradleak.integrations.sb3_capture needs Stable-Baselines3: pip install "
                      "-c constraints.txt 'gradleak[sb3]'") from missing


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


def write_rollout(model: Any, out: Path, split: str, index: int) -> None:
    """One standard capture file of the rollout in `model.rollout_buffer`, at the current θ."""
    check_output(out, "GradleakCapture path")
    buffer, rule = model.rollout_buffer, learning_rule(model)
    converted = victim(model)
    layers = layer_table(converted)
    coefficients = LossCoefficients(value=rule["value"], entropy=rule["entropy"],
                                    clip=rule["clip"])
    images = np.ascontiguousarray(buffer.observations.transpose(0, 1, 3, 4, 2))  # (T, N, H, W, 3)
    with torch.no_grad():
        logits, _ = converted(torch.from_numpy(images.reshape(-1, *images.shape[2:])))
    probs = logits.softmax(-1).numpy().reshape(*images.shape[:2], -1)
    settings = {"theta0_sha256": theta_sha256(converted),
                "victim_config": converted.config.to_dict(), "algorithm": rule["algorithm"],
                "loss": coefficients.to_dict(), "gamma": rule["gamma"], "lam": rule["lam"],
                "split": split, "scenes": ["stable-baselines3"], "components":
                ["cnn", "fc", "heads"], "seed": int(model.seed or 0), "shard": [0, 1],
                "env": {"backend": "stable-baselines3", "rollout": index},
                "advantage_norm": "none"}
    attrs = capture_attributes(converted, layers, rule["algorithm"], coefficients, rule["gamma"],
                               rule["lam"], "none", settings, ["stable-baselines3"],
                               f"stable-baselines3 rollout {index}")
    theta0 = {k: v.detach().numpy() for k, v in converted.state_dict().items()}
    columns = step_columns(converted.config.frame_size, converted.config.num_actions)
    writer = CaptureWriter(out, attrs, columns, attrs["gradient_dim"], theta0, overwrite=True,
                           gradient_dtype="float32")
    try:
        for episode, (env, start, stop) in enumerate(segments(buffer.episode_starts)):
            rows = slice(start, stop)
            step = StepBatch(torch.from_numpy(images[rows, env]),
                             torch.from_numpy(buffer.actions[rows, env, 0].astype(np.int64)),
                             torch.from_numpy(buffer.advantages[rows, env].astype(np.float32)),
                             torch.from_numpy(buffer.returns[rows, env].astype(np.float32)),
                             torch.from_numpy(buffer.log_probs[rows, env].astype(np.float32)))
            gradients = per_step_gradients(converted, step, coefficients, layers,
                                           ppo=rule["algorithm"] == "ppo")
            writer.append_episode(_rows(buffer, images, probs, rows, env, episode),
                                  gradients.numpy())
    finally:
        writer.close()
    writer.finish()


def _rows(buffer: Any, images: np.ndarray, probs: np.ndarray, rows: slice, env: int,
          episode: int) -> dict[str, np.ndarray]:
    n = rows.stop - rows.start
    dones = np.zeros(n, bool)
    dones[-1] = True
    advantages = buffer.advantages[rows, env].astype(np.float32)
    return {"images": images[rows, env], "goals": np.zeros((n, 3), np.float32),
            "actions": buffer.actions[rows, env, 0].astype(np.int64),
            "rewards": buffer.rewards[rows, env].astype(np.float32),
            "values": buffer.values[rows, env].astype(np.float32),
            "log_probs": buffer.log_probs[rows, env].astype(np.float32),
            "probs": probs[rows, env].astype(np.float32), "advantages": advantages,
            "advantages_raw": advantages, "returns": buffer.returns[rows, env].astype(np.float32),
            "dones": dones, "terminated": np.zeros(n, bool),
            "episode_ids": np.full(n, episode, np.int64), "scene_ids": np.zeros(n, np.int32),
            "step_in_episode": np.arange(n, dtype=np.int32)}
