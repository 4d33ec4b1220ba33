"""The decoder's training frames: the attacker's own training-scene captures (their images;
their gradients are never read) and frames it renders with a random policy on the same scenes,
cached between sessions; and, under a defense, the features the attack recovers from each
captured frame's defended gradient.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from gradleak.attacks.analytic import module_input
from gradleak.capture.reader import CaptureFile
from gradleak.config import dataclass_from_dict
from gradleak.envs.config import EnvConfig
from gradleak.envs.factory import make_env
from gradleak.errors import ConfigError
from gradleak.io import (
    load_tensors,
    save_tensors,
    tensors_metadata,
)
from gradleak.training.data import WindowDataset
from gradleak.training.decoder_config import DecoderFitConfig
from gradleak.victims.base import Victim, victim_at_theta0

RENDERED = "rendered.safetensors"  # the random-walk frames of an unfinished run


def feature_map_shape(victim: Victim, module: str) -> list[int]:
    """(C, h, w) of the last 4-D activation before `module` flattens it."""
    maps: list[torch.Size] = []
    handles = [m.register_forward_hook(lambda _m, _a, out: maps.append(out.shape))
               for m in victim.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            module_input(victim, module, victim.example_inputs(1)[0])
    finally:
        for handle in handles:
            handle.remove()
    shapes = [list(shape[1:]) for shape in maps if len(shape) == 4]
    if not shapes:
        raise ConfigError(f"no convolutional feature map feeds {module!r}: the feature decoder "
                          "needs a conv encoder before it")
    return shapes[-1]


@dataclass
class FrameSet:
    """Frames in episode order: each frame's predecessor in its episode (−1 at an episode's
    start) and the action taken after it (how the camera moved to the next frame)."""

    images: np.ndarray  # (N, H, W, 3) uint8
    previous: np.ndarray  # (N,) int64
    actions: np.ndarray  # (N,) int64
    features: np.ndarray | None = None  # (N, F) as recovered under a defense; None: exact

    def __len__(self) -> int:
        return len(self.images)

    @staticmethod
    def join(sets: list[FrameSet]) -> FrameSet:
        offsets = np.cumsum([0] + [len(s) for s in sets[:-1]])
        return FrameSet(np.concatenate([s.images for s in sets]),
                        np.concatenate([np.where(s.previous >= 0, s.previous + o, -1)
                                        for s, o in zip(sets, offsets, strict=True)]),
                        np.concatenate([s.actions for s in sets]))


def captured_frames(paths: list[str], rows: np.ndarray) -> FrameSet:
    """The frames of WindowDataset rows (file, row, episode) of window 1, stride 1."""
    sets = []
    for index, path in enumerate(paths):
        chosen = rows[rows[:, 0] == index]
        with CaptureFile(path) as capture:
            images, actions = capture.private_column("images"), capture.private_column("actions")
        steps, episodes = chosen[:, 1], chosen[:, 2]
        follows = np.r_[False, (steps[1:] == steps[:-1] + 1) & (episodes[1:] == episodes[:-1])]
        sets.append(FrameSet(images[steps], np.where(follows, np.arange(len(steps)) - 1, -1),
                             actions[steps].astype(np.int64)))
    return FrameSet.join(sets)


class AuxiliaryFrames:
    """The frames the attacker trains on, split by episode, and θ0's feature extractor."""

    def __init__(self, paths: list[str], config: DecoderFitConfig, progress: bool,
                 cache: Path | None = None) -> None:
        self.paths = paths
        common = dict(window=1, stride=1, val_fraction=config.val_fraction, seed=config.seed,
                      expect_split="train", skip_nonfinite=config.skip_nonfinite)
        self.defense = config.defense_chain()
        train, val = (WindowDataset(paths, part=part, defense=self.defense, **common)
                      for part in ("train", "val"))
        self.fingerprint, self.windows = train.fingerprint, {"train": train, "val": val}
        self.train, self.val = captured_frames(paths, train.rows), captured_frames(paths, val.rows)
        with CaptureFile(paths[0]) as capture:
            observation = capture.observation(slice(0, 0))  # θ0 and the loss, no gradient
            self.hyperparameters, self.theta0 = observation.hyperparameters, observation.theta0
            self.victim = victim_at_theta0(observation)
            self.rendered = self._render(capture, config, progress, cache)
        for parameter in self.victim.parameters():
            parameter.requires_grad_(False)
        self.val_rows = np.linspace(0, len(self.val) - 1,
                                    min(len(self.val), config.max_val_frames)).astype(int)

    def _render(self, capture: CaptureFile, config: DecoderFitConfig, progress: bool,
                cache: Path | None) -> FrameSet:
        """The random-walk frames, read from `cache` when an earlier session of the same run
        rendered them with the same scenes, count and seed (minutes of rendering at 20k)."""
        self.rendered_key = json.dumps({"env": read_env_config(capture) if config.extra_frames
                                        > 0 else None, "scenes": list(capture.scenes),
                                        "count": config.extra_frames, "seed": config.seed + 1},
                                       sort_keys=True)
        if config.extra_frames <= 0 or self.defense is not None:
            empty = np.zeros(0, np.int64)
            return FrameSet(capture.private_column("images", slice(0, 0)), empty, empty)
        if cache is not None and (tensors_metadata(cache) or {}).get("key") == self.rendered_key:
            stored = load_tensors(cache, "rendered frames")
            return FrameSet(stored["images"].numpy(), stored["previous"].numpy(),
                            stored["actions"].numpy())
        env = dataclass_from_dict(EnvConfig, read_env_config(capture))
        images, actions, first = random_walk_frames(env, list(capture.scenes),
                                                    config.extra_frames, seed=config.seed + 1,
                                                    progress=progress)
        return FrameSet(images, np.where(first, -1, np.arange(len(images)) - 1), actions)

    def cache_rendered(self, path: Path) -> None:
        """Keep the rendered frames beside an unfinished run, so a resumed session reads them."""
        if len(self.rendered) and (tensors_metadata(path) or {}).get("key") != self.rendered_key:
            save_tensors(path, {"images": torch.from_numpy(self.rendered.images),
                                "previous": torch.from_numpy(self.rendered.previous),
                                "actions": torch.from_numpy(self.rendered.actions)},
                         {"key": self.rendered_key})

    def training_frames(self) -> FrameSet:
        return self.train if self.defense else FrameSet.join([self.train, self.rendered])

    def recover_under_defense(self, recover: Callable[[torch.Tensor], torch.Tensor],
                              progress: bool, chunk: int = 256) -> None:
        """Attach to every captured frame the features `recover` reads from its defended
        gradient: what the attack will see at test time."""
        for part in ("train", "val"):
            windows, features = self.windows[part], []
            for start in tqdm(range(0, len(windows), chunk), disable=not progress, leave=False,
                              desc=f"recover {part} features under {self.defense.spec}"):
                rows = [windows[i].gradients[0]
                        for i in range(start, min(start + chunk, len(windows)))]
                features.append(recover(torch.stack(rows)).numpy())
            setattr(self, part, replace(getattr(self, part), features=np.concatenate(features)))

    def features_of(self, frames: FrameSet, indices: np.ndarray, images: torch.Tensor,
                    module: str) -> torch.Tensor:
        """The decoder's input for frames[indices] (whose pixels are `images`)."""
        if frames.features is not None:
            return torch.from_numpy(frames.features[indices])
        return self.features(images, module)

    @torch.no_grad()
    def features(self, images: torch.Tensor, module: str) -> torch.Tensor:
        """(N, H, W, 3) uint8 → θ0's input to `module`, flattened: what the gradient reveals."""
        return module_input(self.victim, module, images).flatten(1)


@dataclass
class DecoderBatch:
    features: torch.Tensor  # θ0's features of the frames
    truth: torch.Tensor  # (N, 3, H, W) in [0, 1]
    previous_features: torch.Tensor  # of each frame's predecessor (its own where none)
    previous_actions: torch.Tensor  # the action from the predecessor to the frame
    has_previous: torch.Tensor  # (N,) bool


def read_env_config(capture: CaptureFile) -> dict[str, Any]:
    try:
        return json.loads(capture.attrs["env_config"])
    except (KeyError, json.JSONDecodeError) as error:
        raise ConfigError(f"{capture.path}: attribute 'env_config' is missing or not JSON, so "
                          "its training scenes cannot be rendered (set extra_frames=0)") from error


def random_walk_frames(config: EnvConfig, scenes: list[str], count: int, seed: int,
                       progress: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Frames of a uniformly random policy over `scenes`: auxiliary views an attacker can
    render for itself, without any victim or gradient. Returns (frames (count, H, W, 3) uint8,
    the action taken after each frame, whether each frame starts an episode)."""
    env = make_env(config, scenes)
    rng = np.random.default_rng(seed)
    frames: list[np.ndarray] = []
    actions, first = np.zeros(count, np.int64), np.zeros(count, bool)
    try:
        observation, _ = env.reset(seed=seed)
        first[0] = count > 0
        with tqdm(total=count, disable=not progress, desc="rendering frames", leave=False) as bar:
            while len(frames) < count:
                frames.append(np.asarray(observation["image"], np.uint8))
                bar.update(1)
                action = int(rng.integers(env.action_space.n))
                actions[len(frames) - 1] = action
                observation, _, done, truncated, _ = env.step(action)
                if done or truncated:
                    observation, _ = env.reset(seed=int(rng.integers(2**31)))
                    if len(frames) < count:
                        first[len(frames)] = True
    finally:
        env.close()
    size = config.doomnav.frame_size
    return (np.stack(frames) if frames else np.zeros((0, size, size, 3), np.uint8), actions,
            first)
