"""Fitting the training-free attack's learned prior (`attacks.frame_refiner`) on the attacker's
own steps: no victim data.

The attacker knows θ0, the architecture and the client's loss, so it captures its own steps on
training scenes against the same θ0 (`gradleak capture --scenes train`) and runs the
training-free attack on every one of them (`ExactAttack`, about a second a frame at 84×84).
That gives pairs (the attack's frame, the true frame) with the attack's own failure modes in
them. The refiner learns the residual; the episode-disjoint validation split is the one TRACE
and LtI use. The attack's frames are computed once and kept beside the run (uint8, resumable
chunk by chunk) until the last epoch is done; loss MSE + λ₁·L1, mirrored at random (a mirrored
corridor is still a corridor). The checkpoint records the capture fingerprint and the attack's
settings, and `load_prior` refuses it for another θ0.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from gradleak.attacks.exact import ExactAttack, ExactConfig
from gradleak.attacks.frame_refiner import FrameRefiner, RefinerConfig
from gradleak.capture.schema import layers_to_json
from gradleak.capture.shards import open_captures
from gradleak.defenses import parse_defense
from gradleak.errors import ConfigError
from gradleak.io import load_tensors, save_tensors, theta_sha256
from gradleak.metrics.images import psnr, ssim
from gradleak.threat import Observation
from gradleak.training.checkpoint import (
    META,
    fingerprint_from_dict,
    fingerprint_to_dict,
    load_attacker,
)
from gradleak.training.data import CaptureFingerprint, check_rgb_frames, episode_is_validation
from gradleak.training.loop import (
    Epoch,
    FitLoop,
    FitSchedule,
    refuse_overwrite,
    run_fit,
)
from gradleak.victims.base import victim_at_theta0

PAIRS = "exact_pairs"  # the attack's frames beside the true ones, until the fit ends
SUMMARY_FIELDS = ("train_frames", "val_frames")
CHUNK = 64  # steps attacked between two saves of the pairs


@dataclass
class RefinerFitConfig(FitSchedule):
    """The refiner's fit: the shared schedule with its own defaults."""

    epochs: int = 30
    batch_size: int = 16
    lr: float = 1e-3
    warmup_epochs: float = 0.5
    min_lr: float = 1e-5
    val_fraction: float = 0.1
    l1_weight: float = 0.1
    mirror: bool = True
    # attack only the first this many usable steps of the captures (about a second a frame at
    # 84×84); None: every one
    max_frames: int | None = None


@dataclass
class FramePairs:
    """uint8 (N, H, W, C) frames the attack made and the true ones, their file and episode."""

    attacked: np.ndarray
    truth: np.ndarray
    files: np.ndarray
    episodes: np.ndarray

    def __len__(self) -> int:
        return len(self.truth)

    def select(self, rows: np.ndarray) -> FramePairs:
        return FramePairs(self.attacked[rows], self.truth[rows], self.files[rows],
                          self.episodes[rows])


class RefinerFit(FitLoop):
    """The refiner's fit on the training-free attack's frames of the attacker's own captures."""

    kind = "refiner"
    summary_fields = SUMMARY_FIELDS

    def __init__(self, model_config: RefinerConfig, config: RefinerFitConfig,
                 exact: ExactConfig, paths: list[str], out: Path, resume: bool = False,
                 progress: bool = True) -> None:
        self.config, self.out, self.progress = config, Path(out), progress
        if parse_defense(config.defense).defenses:
            # the shared schedule carries the field; this fit attacks the captures as stored
            raise ConfigError(f"attack.prior_fit.defense={config.defense!r}: the learned prior "
                              "is fitted on the attack's frames of undefended captures (a prior "
                              "fitted under a defense is not built); set it to none")
        refuse_overwrite(self.out, resume)
        exact.check()
        if exact.prior:
            raise ConfigError(f"attack.training_free.prior={exact.prior!r}: the prior is fitted on "
                              "the attack's own frames, without a prior; unset it")
        self.paths = [str(p) for p in paths]
        self.fingerprint, frame_shape = read_fingerprint(self.paths)
        height, _, channels = frame_shape
        self.model_config = replace(model_config, frame_size=height, channels=channels)
        self.train_files = self.paths
        self.exact = exact
        pairs = attacked_pairs(self.paths, exact, self.pairs_path(), config.max_frames,
                               config.skip_nonfinite, progress)
        validation = np.array([episode_is_validation(config.seed, int(f), int(e),
                                                     config.val_fraction)
                               for f, e in zip(pairs.files, pairs.episodes, strict=True)])
        if validation.all() or not validation.any():
            validation = (pairs.episodes == pairs.episodes[-1]) & (pairs.files == pairs.files[-1])
        if validation.all():
            raise ConfigError(f"{', '.join(self.paths)}: one episode only; the refiner needs "
                              "one to fit and another to validate on")
        self.train, self.val = pairs.select(~validation), pairs.select(validation)
        torch.manual_seed(config.seed)
        self.model = FrameRefiner(self.model_config)
        self.set_optimiser(self.model.parameters(), len(self.train))
        self.start(resume)

    def prepare(self) -> None:
        self.set_mean_image(self.train.truth)

    def epoch(self) -> Epoch:
        return self.shuffled_epoch(len(self.train), lambda rows, generator: self._batch(
            self.train, rows, generator))

    def _batch(self, pairs: FramePairs, rows: np.ndarray,
               generator: np.random.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        attacked, truth = unit(pairs.attacked[rows]), unit(pairs.truth[rows])
        if generator is not None and self.config.mirror:
            flip = torch.from_numpy(generator.random(len(rows)) < 0.5)[:, None, None, None]
            attacked = torch.where(flip, attacked.flip(-1), attacked)
            truth = torch.where(flip, truth.flip(-1), truth)
        return attacked, truth

    def objective(self, batch: tuple[torch.Tensor, torch.Tensor],
                  settings: dict[str, float]) -> tuple[torch.Tensor, dict]:
        attacked, truth = batch
        refined = self.model(attacked)
        return ((refined - truth).pow(2).mean()
                + self.config.l1_weight * (refined - truth).abs().mean()), {}

    @torch.no_grad()
    def validate(self, writer: Any) -> dict[str, float]:
        """Loss, PSNR and SSIM of the refined validation frames, and the attack's own PSNR on
        them (what the refiner has to beat)."""
        self.model.eval()
        losses, refined_psnr, refined_ssim, attacked_psnr = [], [], [], []
        for start in range(0, len(self.val), self.config.batch_size):
            rows = np.arange(start, min(start + self.config.batch_size, len(self.val)))
            attacked, truth = self._batch(self.val, rows, None)
            refined = self.model(attacked)
            losses.append(float(self.objective((attacked, truth), {})[0]) * len(rows))
            refined_psnr.append(psnr(refined, truth))
            refined_ssim.append(ssim(refined, truth))
            attacked_psnr.append(psnr(attacked, truth))
            if writer is not None and start == 0:
                writer.add_images("validation/truth_attack_refined",
                                  torch.cat([truth[:8], attacked[:8], refined[:8]]),
                                  self.epochs_done + 1)
        return {"val_loss": sum(losses) / len(self.val),
                "val_psnr": float(torch.cat(refined_psnr).mean()),
                "val_ssim": float(torch.cat(refined_ssim).mean()),
                "val_psnr_attack": float(torch.cat(attacked_psnr).mean())}

    def record_fields(self) -> dict[str, Any]:
        """The frame counts, and the attack that made the frames it refines: the prior is
        meant for frames made the same way."""
        return {"train_frames": len(self.train), "val_frames": len(self.val),
                "exact": asdict(self.exact)}

    def saved(self) -> None:
        if self.epochs_done >= self.config.epochs:  # finished: keep only the prior
            self.pairs_path().unlink(missing_ok=True)

    def pairs_path(self) -> Path:
        """The attack's frames, named by what made them: a resumed run with other captures or
        other attack settings makes its own."""
        made_by = json.dumps([fingerprint_to_dict(self.fingerprint), asdict(self.exact)],
                             sort_keys=True)
        return self.out / f"{PAIRS}-{hashlib.sha256(made_by.encode()).hexdigest()[:12]}" \
                          ".safetensors"


def unit(frames: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255.0


def read_fingerprint(paths: list[str]) -> tuple[CaptureFingerprint, tuple[int, int, int]]:
    """The captures' victim, θ0 and layout, and their frame shape; training-scene captures of
    RGB frames only, refused before any work."""
    files = open_captures(paths)
    try:
        first = files[0]
        check_rgb_frames(first)
        for capture in files:
            if capture.attrs.get("split") != "train":
                raise ConfigError(f"{capture.path} holds {capture.attrs.get('split')!r} "
                                  "scenes: the prior is fitted on the attacker's own "
                                  "training-scene captures")
        return (CaptureFingerprint(first.attrs["theta0_sha256"], first.attrs["layer_table"],
                                   first.victim), first.roles.transform.frame_shape)
    finally:
        for capture in files:
            capture.close()


def attacked_pairs(paths: list[str], exact: ExactConfig, cache: Path, limit: int | None,
                   skip_nonfinite: bool, progress: bool) -> FramePairs:
    """The training-free attack on the usable rows of the captures (the first `limit`),
    CHUNK steps at a time, saved after each chunk so that an interrupted run resumes where it
    stopped."""
    done = load_tensors(cache, "attacked frames") if cache.exists() else {}
    parts: list[dict[str, np.ndarray]] = []
    files = open_captures(paths)
    try:
        usable = [np.flatnonzero(capture.usable_rows(skip_nonfinite)) for capture in files]
        if limit is not None:
            ends = np.cumsum([0] + [len(rows) for rows in usable])
            usable = [rows[:max(0, limit - end)] for rows, end in zip(usable, ends, strict=False)]
        todo = [(index, rows[start:start + CHUNK]) for index, rows in enumerate(usable)
                for start in range(0, len(rows), CHUNK)]
        for index, rows in tqdm(todo, disable=not progress, desc="training-free attack",
                                unit="chunk"):
            key = f"{index}.{rows[0]}.{len(rows)}"  # a file's chunk: its first row and length
            if f"{key}.truth" not in done:
                capture = files[index]
                frames = ExactAttack(capture.observation(rows), exact).reconstruct().images
                done.update({f"{key}.attacked": torch.from_numpy(frames),
                             f"{key}.truth": torch.from_numpy(capture.target(rows).images),
                             f"{key}.episodes": torch.from_numpy(
                                 capture.column("episode_ids", rows).astype(np.int64))})
                save_tensors(cache, done)
            parts.append({name: done[f"{key}.{name}"].numpy()
                          for name in ("attacked", "truth", "episodes")}
                         | {"files": np.full(len(rows), index)})
    finally:
        for capture in files:
            capture.close()
    return FramePairs(*(np.concatenate([part[name] for part in parts])
                        for name in ("attacked", "truth", "files", "episodes")))


def fit_refiner(model_config: RefinerConfig, config: RefinerFitConfig, exact: ExactConfig,
                paths: list[str], out: Path, resume: bool = False,
                progress: bool = True) -> dict[str, Any]:
    return run_fit(lambda: RefinerFit(model_config, config, exact, paths, out, resume,
                                      progress), out, config.epochs, resume, SUMMARY_FIELDS)


def check_prior(path: str) -> None:
    """Before any row is read: the prior's directory ("": none) holds a fitted run."""
    if path and not (Path(path) / META).is_file():
        raise ConfigError(f"attack.training_free.prior={path!r}: no {META} there; "
                          "fit one with `gradleak train-prior --data TRAIN.h5 --out DIR` on "
                          "training-scene captures at the same θ0")


def exact_attack(observation: Observation, config: ExactConfig) -> ExactAttack:
    """The training-free attack with the learned prior `config.prior` names, if any."""
    prior = load_prior(config.prior, observation) if config.prior else None
    return ExactAttack(observation, config, prior)


def load_prior(path: str | Path, observation: Observation) -> FrameRefiner:
    """A fitted refiner for the training-free attack on `observation`: refused, naming both,
    when it was fitted against another victim, θ0 or layout."""
    model, meta = load_attacker(path)
    if meta["kind"] != RefinerFit.kind:
        raise ConfigError(f"attack.training_free.prior={str(path)!r} holds a {meta['kind']!r} "
                          "attacker, not a prior fitted by `gradleak train-prior`")
    seen = CaptureFingerprint(theta_sha256(victim_at_theta0(observation)),
                              layers_to_json(observation.layers), observation.victim)
    fingerprint_from_dict(meta["fingerprint"]).check(seen, f"the prior {path}")
    return model
