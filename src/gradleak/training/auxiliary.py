"""Fitting the analytic decoder on auxiliary frames: no gradient is stored or computed.

The attacker knows θ0, so the conv features the gradient reveals can be computed for any frame
it holds. Training frames are the attacker's own training-scene captures (their images; their
gradients are never read) plus frames it renders itself with a random policy on the same
training scenes, each mirrored with probability ½ (a mirrored corridor is still a corridor).
Validation uses the captures' validation episodes (the same episode split as TRACE and LtI).
Loss: MSE + λ₁·L1 + λ_s·(1 − SSIM). AdamW with warm-up and cosine decay, a checkpoint every
epoch (resumable), the best weights by validation loss kept apart.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from gradleak.attacks.analytic import POLICY, module_input
from gradleak.attacks.feature_decoder import DecoderConfig, FeatureDecoder
from gradleak.attacks.optim.matching import victim_at_theta0
from gradleak.capture.reader import CaptureFile
from gradleak.errors import ConfigError
from gradleak.io import load_tensors, read_json
from gradleak.metrics.images import psnr, ssim
from gradleak.training.checkpoint import (
    META,
    WEIGHTS,
    fingerprint_to_dict,
    load_training_state,
    save_attacker,
    save_training_state,
)
from gradleak.training.data import WindowDataset
from gradleak.training.fit import warmup_cosine


@dataclass
class DecoderFitConfig:
    epochs: int = 20
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 1e-5
    warmup_epochs: float = 0.3
    min_lr: float = 1e-5
    grad_clip: float = 1.0
    extra_frames: int = 20_000  # rendered on the captures' training scenes, random policy
    mirror: bool = True
    l1_weight: float = 0.5
    ssim_weight: float = 0.5
    val_fraction: float = 0.05  # validation episodes of the captures (as TRACE and LtI)
    max_val_frames: int = 512
    time_limit_minutes: float | None = None  # stop after the epoch that passes it
    seed: int = 0


def feature_map_shape(victim: nn.Module, module: str, frame_size: int) -> list[int]:
    """(C, h, w) of the last 4-D activation before `module` flattens it."""
    maps: list[torch.Size] = []
    handles = [m.register_forward_hook(lambda _m, _a, out: maps.append(out.shape))
               for m in victim.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            module_input(victim, module, torch.zeros(1, frame_size, frame_size, 3))
    finally:
        for handle in handles:
            handle.remove()
    shapes = [list(shape[1:]) for shape in maps if len(shape) == 4]
    if not shapes:
        raise ConfigError(f"no convolutional feature map feeds {module!r}: the analytic decoder "
                          "needs a conv encoder before it")
    return shapes[-1]


class AuxiliaryFrames:
    """The frames the attacker trains on, split by episode, and θ0's feature extractor."""

    def __init__(self, paths: list[str], config: DecoderFitConfig, progress: bool) -> None:
        self.paths = paths
        common = dict(window=1, stride=1, val_fraction=config.val_fraction, seed=config.seed,
                      expect_split="train")
        train, val = (WindowDataset(paths, part=part, **common) for part in ("train", "val"))
        self.fingerprint = train.fingerprint
        self.train, self.val = self._images(paths, train.rows), self._images(paths, val.rows)
        with CaptureFile(paths[0]) as capture:
            observation = capture.observation(slice(0, 1))
            self.hyperparameters, self.theta0 = observation.hyperparameters, observation.theta0
            self.victim = victim_at_theta0(observation)
            self.rendered = self._render(capture, config, progress)
        for parameter in self.victim.parameters():
            parameter.requires_grad_(False)
        self.val = self.val[np.linspace(0, len(self.val) - 1,
                                        min(len(self.val), config.max_val_frames)).astype(int)]

    @staticmethod
    def _images(paths: list[str], rows: np.ndarray) -> np.ndarray:
        parts = []
        for index, path in enumerate(paths):
            with CaptureFile(path) as capture:
                images = capture.column("images")
            parts.append(images[rows[rows[:, 0] == index, 1]])
        return np.concatenate(parts)

    @staticmethod
    def _render(capture: CaptureFile, config: DecoderFitConfig, progress: bool) -> np.ndarray:
        if config.extra_frames <= 0:
            return np.zeros((0, *capture.column("images", slice(0, 1)).shape[1:]), np.uint8)
        from gradleak.envs.factory import random_walk_frames
        from gradleak.presets import EnvConfig, dataclass_from_dict

        env = dataclass_from_dict(EnvConfig, read_env_config(capture))
        return random_walk_frames(env, list(capture.scenes), config.extra_frames,
                                  seed=config.seed + 1, progress=progress)

    def training_frames(self) -> np.ndarray:
        return np.concatenate([self.train, self.rendered]) if len(self.rendered) else self.train

    @torch.no_grad()
    def features(self, images: torch.Tensor, module: str) -> torch.Tensor:
        """(N, H, W, 3) uint8 → θ0's input to `module`, flattened: what the gradient reveals."""
        return module_input(self.victim, module, images).flatten(1)


def read_env_config(capture: CaptureFile) -> dict[str, Any]:
    import json

    try:
        return json.loads(capture.attrs["env_config"])
    except (KeyError, json.JSONDecodeError) as error:
        raise ConfigError(f"{capture.path}: attribute 'env_config' is missing or not JSON, so "
                          "its training scenes cannot be rendered (set extra_frames=0)") from error


class DecoderFit:
    def __init__(self, model_config: DecoderConfig, config: DecoderFitConfig, paths: list[str],
                 out: Path, resume: bool = False, progress: bool = True) -> None:
        self.config, self.out, self.progress = config, Path(out), progress
        if (self.out / META).exists() and not resume:
            raise ConfigError(f"{self.out} already holds an attacker: pass --resume to continue "
                              "it or choose another --out")
        self.data = AuxiliaryFrames([str(p) for p in paths], config, progress)
        victim = self.data.fingerprint.victim
        shape = feature_map_shape(self.data.victim, model_config.feature_module,
                                  victim.frame_size)
        self.model_config = replace(
            model_config, layer_table=self.data.fingerprint.layer_table,
            gradient_dim=_gradient_dim(paths[0]), frame_size=victim.frame_size,
            num_actions=victim.num_actions, feature_shape=shape,
            entropy_coef=float(self.data.hyperparameters.get("entropy", 0.0)))
        torch.manual_seed(config.seed)
        self.model = FeatureDecoder(self.model_config)
        self.optimiser = torch.optim.AdamW(self.model.parameters(), lr=config.lr,
                                           weight_decay=config.weight_decay)
        self.frames = self.data.training_frames()
        self.steps_per_epoch = max(1, len(self.frames) // config.batch_size)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimiser, warmup_cosine(config, self.steps_per_epoch))  # type: ignore[arg-type]
        self.epoch, self.best, self.history = 0, math.inf, []
        if resume and (self.out / META).exists():
            self._resume()
        else:
            self._prepare()

    def _prepare(self) -> None:
        rows = np.random.default_rng(self.config.seed).permutation(len(self.frames))[:4096]
        features = self.data.features(torch.from_numpy(self.frames[np.sort(rows)]),
                                      self.model_config.feature_module)
        self.model.fit_normaliser(features)
        self.model.set_policy_head(self.data.theta0[f"{POLICY}.weight"],
                                   self.data.theta0[f"{POLICY}.bias"])
        mean = self.data.train.mean(axis=0, dtype=np.float64) / 255.0  # no float copy of all
        self.mean_image = torch.from_numpy(mean).permute(2, 0, 1).float()

    def _batch(self, indices: np.ndarray, generator: np.random.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.from_numpy(self.frames[np.sort(indices)])
        if self.config.mirror:
            flip = torch.from_numpy(generator.random(len(images)) < 0.5)
            images = torch.where(flip[:, None, None, None], images.flip(2), images)
        features = self.data.features(images, self.model_config.feature_module)
        return features, images.permute(0, 3, 1, 2).float() / 255.0

    def loss(self, frames: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
        config = self.config
        return ((frames - truth).pow(2).mean() + config.l1_weight * (frames - truth).abs().mean()
                + config.ssim_weight * (1.0 - ssim(frames, truth).mean()))

    def run(self) -> list[dict[str, Any]]:
        started = time.perf_counter()
        limit = self.config.time_limit_minutes
        while self.epoch < self.config.epochs and not (
                limit is not None and (time.perf_counter() - started) / 60 >= limit):
            record = self._epoch()
            record.update(self._validate())
            self.epoch += 1
            self.history.append(record)
            self._save(record)
        return self.history

    def _epoch(self) -> dict[str, Any]:
        start, config = time.perf_counter(), self.config
        generator = np.random.default_rng([config.seed, self.epoch])
        order = generator.permutation(len(self.frames))
        self.model.train()
        total = 0.0
        steps = tqdm(range(self.steps_per_epoch), disable=not self.progress, leave=False,
                     desc=f"decoder epoch {self.epoch + 1}/{config.epochs}")
        for step in steps:
            features, truth = self._batch(
                order[step * config.batch_size:(step + 1) * config.batch_size], generator)
            loss = self.loss(self.model(features), truth)
            self.optimiser.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
            self.optimiser.step()
            self.scheduler.step()
            total += float(loss.detach())
            steps.set_postfix(loss=f"{float(loss.detach()):.4f}")
        return {"epoch": self.epoch + 1, "lr": self.scheduler.get_last_lr()[0],
                "train_minutes": (time.perf_counter() - start) / 60,
                "train_loss": total / self.steps_per_epoch}

    @torch.no_grad()
    def _validate(self) -> dict[str, float]:
        """Loss, PSNR and SSIM on validation-episode frames (their exact θ0 features)."""
        self.model.eval()
        losses, psnrs, ssims = [], [], []
        for start in range(0, len(self.data.val), self.config.batch_size):
            images = torch.from_numpy(self.data.val[start:start + self.config.batch_size])
            truth = images.permute(0, 3, 1, 2).float() / 255.0
            frames = self.model(self.data.features(images, self.model_config.feature_module))
            losses.append(float(self.loss(frames, truth)) * len(images))
            psnrs.append(psnr(frames, truth))
            ssims.append(ssim(frames, truth))
        count = max(1, len(self.data.val))
        return {"val_loss": sum(losses) / count, "val_psnr": float(torch.cat(psnrs).mean()),
                "val_ssim": float(torch.cat(ssims).mean())}

    def _save(self, record: dict[str, Any]) -> None:
        improved = record["val_loss"] < self.best
        self.best = min(self.best, record["val_loss"])
        meta = {"kind": "decoder", "model": asdict(self.model_config),
                "fit": asdict(self.config), "epoch": self.epoch, "best_val_loss": self.best,
                "history": self.history, "fingerprint": fingerprint_to_dict(
                    self.data.fingerprint), "train_files": self.data.paths,
                "train_frames": {"captured": len(self.data.train),
                                 "rendered": len(self.data.rendered)},
                "val_frames": len(self.data.val), "last": record,
                "training_state": save_training_state(self.out, self.optimiser, self.scheduler),
                "mean_image": self.mean_image.flatten().tolist()}
        save_attacker(self.out, self.model, meta, best=improved)

    def _resume(self) -> None:
        meta = read_json(self.out / META, "attacker config")
        if meta.get("kind") != "decoder":
            raise ConfigError(f"{self.out / META} holds a {meta.get('kind')!r} attacker, "
                              "not the analytic decoder")
        self.model.load_state_dict(load_tensors(self.out / WEIGHTS, "attacker weights"))
        load_training_state(self.out, self.optimiser, self.scheduler, meta["training_state"])
        self.epoch, self.best = int(meta["epoch"]), float(meta["best_val_loss"])
        self.history = list(meta["history"])
        size = self.model_config.frame_size
        self.mean_image = torch.tensor(meta["mean_image"]).view(3, size, size)


def _gradient_dim(path: str) -> int:
    with CaptureFile(path) as capture:
        return int(capture.attrs["gradient_dim"])


def fit_decoder(model_config: DecoderConfig, config: DecoderFitConfig, paths: list[str],
                out: Path, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    fit = DecoderFit(model_config, config, paths, out, resume, progress)
    start = time.perf_counter()
    history = fit.run()
    return {"out": str(out), "kind": "decoder", "epochs": fit.epoch,
            "parameters": sum(p.numel() for p in fit.model.parameters()),
            "minutes": (time.perf_counter() - start) / 60,
            "last": history[-1] if history else {},
            "train_frames": {"captured": len(fit.data.train), "rendered": len(fit.data.rendered)}}
