"""`gradleak.capture.record`: a standard capture from rollouts the user already has.

    from gradleak.capture.record import record
    record(victim, "runs/mine/train.h5", images=frames, actions=actions, advantages=adv,
           returns=ret, episode_ids=episodes, loss={"value": 0.5, "entropy": 0.01, "clip": 0.2,
           "gamma": 0.99, "lam": 0.95})

Each row's gradient is the victim's loss on that step alone at its current θ (θ0), with the
advantages as given: they are what the client's loss used, and `advantage_norm` says how they
were normalised (stored, never assumed). Rows must come grouped by episode, in step order.
Gradients are computed and written in chunks (CHUNK_BYTES), so memory does not grow with the
rollout.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradleak.capture.grads import StepBatch, per_step_gradients
from gradleak.capture.plan import capture_attributes
from gradleak.capture.schema import step_columns
from gradleak.capture.writer import CaptureWriter, refuse_unless_capture
from gradleak.errors import ConfigError
from gradleak.io import check_output, created_directories, theta_sha256
from gradleak.rl.losses import LOSS_KEYS, LossCoefficients, parse_advantage_norm
from gradleak.victims.base import Victim, layer_table

SPLITS = ("train", "heldout")
CHUNK_BYTES = 64 * 2 ** 20  # gradient rows held in memory at once (the rest is on disk)


def record(victim: Victim, out: str | os.PathLike[str], *, images: np.ndarray,
           actions: np.ndarray, advantages: np.ndarray, returns: np.ndarray,
           episode_ids: np.ndarray, loss: dict[str, float], algorithm: str = "ppo",
           advantage_norm: str = "none", old_log_probs: np.ndarray | None = None,
           rewards: np.ndarray | None = None, goals: np.ndarray | None = None,
           hidden: np.ndarray | None = None, split: str = "train",
           source: str = "gradleak.capture.record", overwrite: bool = False) -> dict[str, Any]:
    """Write the capture; returns its path, rows and episodes. Everything is checked first."""
    out = check_output(Path(out), "record out")
    steps = _checked(victim, images, actions, advantages, returns, episode_ids, loss, algorithm,
                     advantage_norm, goals, hidden)
    _check_optional(steps, old_log_probs, rewards, split, source)
    if overwrite:
        refuse_unless_capture(out)
    actions = np.asarray(actions).astype(np.int64)  # whole numbers, checked
    victim.eval()
    coefficients = LossCoefficients(value=loss["value"], entropy=loss["entropy"],
                                    clip=loss["clip"])
    batch = StepBatch(torch.from_numpy(np.ascontiguousarray(images)),
                      torch.as_tensor(actions, dtype=torch.int64),
                      torch.as_tensor(advantages, dtype=torch.float32),
                      torch.as_tensor(returns, dtype=torch.float32), torch.zeros(steps),
                      None if goals is None else torch.as_tensor(goals, dtype=torch.float32),
                      None if hidden is None else torch.as_tensor(hidden, dtype=torch.float32))
    layers = layer_table(victim)
    chunk = rows_per_chunk(sum(layer.size for layer in layers))
    with torch.no_grad():  # in chunks: a long rollout's activations need not fit at once
        outputs = [victim(part.images, part.goals, part.hidden) for part in
                   (batch.slice(a, a + chunk) for a in range(0, steps, chunk))]
    log_pi = torch.cat([logits for logits, _ in outputs]).log_softmax(-1)
    values = torch.cat([value for _, value in outputs])
    batch.old_log_probs = (log_pi.gather(-1, batch.actions[:, None])[:, 0]
                           if old_log_probs is None
                           else torch.as_tensor(old_log_probs, dtype=torch.float32))
    columns = {"images": np.asarray(images), "actions": np.asarray(actions, np.int64),
               "advantages": np.asarray(advantages, np.float32),
               "advantages_raw": np.asarray(advantages, np.float32),
               "returns": np.asarray(returns, np.float32), "values": values.numpy(),
               "log_probs": batch.old_log_probs.numpy(), "probs": log_pi.exp().numpy(),
               "rewards": np.zeros(steps, np.float32) if rewards is None
               else np.asarray(rewards, np.float32),
               "goals": np.zeros((steps, 3), np.float32) if goals is None
               else np.asarray(goals, np.float32)}
    if hidden is not None:
        columns["hidden_states"] = np.asarray(hidden, np.float32)
    settings = {"theta0_sha256": theta_sha256(victim), "victim_config": victim.config.to_dict(),
                "algorithm": algorithm, "loss": coefficients.to_dict(), "gamma": loss["gamma"],
                "lam": loss["lam"], "split": split, "scenes": [source],
                "components": ["cnn", "fc", "heads"], "seed": 0, "shard": [0, 1],
                "env": {"backend": "record", "source": source},
                "advantage_norm": advantage_norm}
    attrs = capture_attributes(victim, layers, algorithm, coefficients, loss["gamma"],
                               loss["lam"], advantage_norm, settings, [source], source)
    theta0 = {k: v.detach().numpy() for k, v in victim.state_dict().items()}
    schema = step_columns(victim.input_transform.frame_shape, victim.config.num_actions,
                          victim.hidden_size)
    episodes = _episode_bounds(np.asarray(episode_ids))
    with created_directories(out.parent):
        writer = CaptureWriter(out, attrs, schema, attrs["gradient_dim"], theta0,
                               overwrite=overwrite, gradient_dtype="float32")
        try:
            for number, (start, stop) in enumerate(episodes):
                for first in range(start, stop, chunk):  # each chunk's gradients, then the next
                    last = min(first + chunk, stop)
                    gradients = per_step_gradients(victim, batch.slice(first, last),
                                                   coefficients, layers, algorithm == "ppo",
                                                   chunk=chunk)
                    writer.append_rows(_episode_rows(columns, first, last, number, start, stop),
                                       gradients.numpy())
                writer.end_episode()
        finally:
            writer.close()
        writer.finish()
    return {"out": str(out), "rows": steps, "episodes": len(episodes)}


def _checked(victim: Victim, images: np.ndarray, actions: np.ndarray, advantages: np.ndarray,
             returns: np.ndarray, episode_ids: np.ndarray, loss: dict[str, float],
             algorithm: str, advantage_norm: str, goals: np.ndarray | None,
             hidden: np.ndarray | None) -> int:
    """The number of steps, once every input has the shape, type and range it must."""
    count, shape = victim.config.num_actions, victim.input_transform.frame_shape
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.shape[1:] != shape:
        raise ConfigError(f"images: {images.dtype} {images.shape}, expected uint8 (N, "
                          f"{', '.join(map(str, shape))}) frames as stored (height, width, "
                          f"channels) for victim {victim.config.name}")
    steps = len(images)
    if steps == 0:
        raise ConfigError("images: no steps; expected at least one")
    for name, values in (("advantages", advantages), ("returns", returns)):
        _column(name, values, (steps,))
    for name, values in (("actions", actions), ("episode_ids", episode_ids)):
        column = _column(name, values, (steps,))
        fractional = np.flatnonzero(column != np.round(column))
        if len(fractional):
            raise ConfigError(f"{name}: {float(column[fractional[0]]):g} at step {fractional[0]} is "
                              "not a whole number")
    if not ((np.asarray(actions) >= 0) & (np.asarray(actions) < count)).all():
        raise ConfigError(f"actions: expected each in 0..{count - 1}")
    _check_loss(loss)
    if algorithm not in ("ppo", "a2c"):
        raise ConfigError(f"algorithm {algorithm!r}: expected ppo or a2c")
    parse_advantage_norm(advantage_norm)
    if "goal" in victim.extra_inputs and goals is None:
        raise ConfigError(f"victim {victim.config.name} reads goals: pass goals (N, 3)")
    if goals is not None:
        _column("goals", goals, (steps, 3))
    if victim.recurrent and (hidden is None or np.shape(hidden) != (steps, victim.hidden_size)):
        raise ConfigError(f"victim {victim.config.name} is recurrent: pass each step's "
                          f"pre-step state as hidden ({steps}, {victim.hidden_size})")
    if hidden is not None:
        _column("hidden", hidden, (steps, victim.hidden_size))
    _episode_bounds(np.asarray(episode_ids))
    return steps


def _column(name: str, values: Any, shape: tuple[int, ...]) -> np.ndarray:
    """`values` as float64, refused unless numbers of this shape, all finite."""
    array = np.asarray(values)
    if array.dtype.kind not in "biuf":
        raise ConfigError(f"{name}: {array.dtype} values, expected numbers")
    if array.shape != shape:
        raise ConfigError(f"{name}: shape {array.shape}, expected {shape}")
    array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise ConfigError(f"{name}: holds NaN/Inf")
    return array


# the loss's coefficients: the range each must lie in
LOSS_RANGES = {"value": (0.0, math.inf), "entropy": (-math.inf, math.inf),
               "clip": (0.0, math.inf), "gamma": (0.0, 1.0), "lam": (0.0, 1.0)}


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, dict):
        raise ConfigError(f"loss: a {type(loss).__name__}, expected a dict of "
                          f"{', '.join(LOSS_KEYS)}")
    missing = [key for key in LOSS_KEYS if key not in loss]
    if missing:
        raise ConfigError(f"loss: declare the client's {', '.join(LOSS_KEYS)} (missing "
                          f"{', '.join(missing)})")
    for key, (low, high) in LOSS_RANGES.items():
        value = loss[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or not low <= value <= high:
            raise ConfigError(f"loss[{key!r}] = {value!r}: expected a number in "
                              f"[{low:g}, {high:g}]")


def _check_optional(steps: int, old_log_probs: Any, rewards: Any, split: Any, source: Any
                    ) -> None:
    if old_log_probs is not None:
        logs = _column("old_log_probs", old_log_probs, (steps,))
        if (logs > 1e-6).any():
            raise ConfigError("old_log_probs: a log-probability above 0")
    if rewards is not None:
        _column("rewards", rewards, (steps,))
    if split not in SPLITS:
        raise ConfigError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
    if not isinstance(source, str):
        raise ConfigError(f"source {source!r}: expected a string")


def rows_per_chunk(gradient_dim: int) -> int:
    """Steps whose gradients are held at once: CHUNK_BYTES of float32, 1 to 32 steps, so the
    memory `record` needs does not grow with the rollout."""
    return max(1, min(32, CHUNK_BYTES // (4 * gradient_dim)))


def _episode_bounds(episode_ids: np.ndarray) -> list[tuple[int, int]]:
    starts = np.flatnonzero(np.r_[True, episode_ids[1:] != episode_ids[:-1]])
    if len(np.unique(episode_ids)) != len(starts):
        raise ConfigError("episode_ids: each episode's steps must be contiguous, in step order")
    stops = np.r_[starts[1:], len(episode_ids)]
    return [(int(a), int(b)) for a, b in zip(starts, stops, strict=True)]


def _episode_rows(columns: dict[str, np.ndarray], first: int, last: int, number: int,
                  start: int, stop: int) -> dict[str, np.ndarray]:
    """Rows first..last of the episode that runs start..stop."""
    n = last - first
    dones = np.zeros(n, bool)
    dones[-1] = last == stop
    return {**{name: values[first:last] for name, values in columns.items()}, "dones": dones,
            "terminated": np.zeros(n, bool), "episode_ids": np.full(n, number, np.int64),
            "scene_ids": np.zeros(n, np.int32),
            "step_in_episode": np.arange(first - start, last - start, dtype=np.int32)}
