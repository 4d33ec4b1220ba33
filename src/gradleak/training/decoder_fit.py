"""Fitting the feature decoder on auxiliary frames: no gradient is stored or computed.

The attacker knows θ0, so the conv features the gradient reveals can be computed for any frame
it holds. Training frames are the attacker's own training-scene captures (their images; their
gradients are never read) plus frames it renders itself with a random policy on the same
training scenes, each mirrored with probability ½ (a mirrored corridor is still a corridor).
Validation uses the captures' validation episodes (the same episode split as TRACE and LtI).
Loss: MSE + λ₁·L1 + λ_s·(1 − SSIM). AdamW with warm-up and cosine decay, a checkpoint every
epoch (resumable), the best weights by validation loss kept apart.

Under a defense (`defense`, the adaptive attacker of Learning to Invert's protocol) a defended
gradient no longer determines the features, so exact features would teach the decoder the wrong
input. The decoder then trains on the captured frames only, each paired with the features the
attack itself recovers from that frame's gradient after the defense (fresh noise draws: the
defense seed differs from evaluation's). Rendered frames have no gradient and recovered features
cannot be mirrored, so both are off.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradleak.attacks.feature_decoder import DecoderConfig, FeatureDecoder
from gradleak.capture.reader import CaptureFile
from gradleak.envs.actions import ActionFacts, action_facts
from gradleak.errors import ConfigError
from gradleak.metrics.images import psnr, ssim
from gradleak.training.data import check_rgb_frames
from gradleak.training.decoder_config import DecoderFitConfig
from gradleak.training.frames import (
    RENDERED,
    AuxiliaryFrames,
    DecoderBatch,
    FrameSet,
    feature_map_shape,
)
from gradleak.training.loop import (
    Epoch,
    FitLoop,
    refuse_overwrite,
    run_fit,
)
from gradleak.victims.base import create_victim
from gradleak.victims.roles import Roles

# what a fit's summary copies from its checkpoint record
SUMMARY_FIELDS = ("train_frames",)


class DecoderFit(FitLoop):
    """The feature decoder's fit on frames and their θ0 features, in one run directory."""

    kind = "decoder"
    summary_fields = SUMMARY_FIELDS

    def __init__(self, model_config: DecoderConfig, config: DecoderFitConfig, paths: list[str],
                 out: Path, resume: bool = False, progress: bool = True) -> None:
        self.config, self.out, self.progress = config, Path(out), progress
        refuse_overwrite(self.out, resume)
        roles = _check_feature_module(paths[0], model_config.feature_module)
        self.facts = _action_facts(paths[0])  # the environment's, or none: Doom is no given
        model_config = replace(model_config,
                               feature_module=model_config.feature_module or roles.feature_linear,
                               camera_motion=[list(m) for m in self.facts.camera_motion or ()])
        self.data = AuxiliaryFrames([str(p) for p in paths], config, progress,
                                    self.out / RENDERED)
        self.fingerprint, self.train_files = self.data.fingerprint, self.data.paths
        victim = self.fingerprint.victim
        shape = feature_map_shape(self.data.victim, model_config.feature_module)
        self.model_config = replace(
            model_config, layer_table=self.fingerprint.layer_table,
            gradient_dim=_gradient_dim(paths[0]), frame_size=victim.frame_size,
            num_actions=victim.num_actions, feature_shape=shape, victim=victim.name,
            victim_options=dict(victim.options), roles=roles.to_json(),
            entropy_coef=float(self.data.hyperparameters.get("entropy", 0.0)))
        torch.manual_seed(config.seed)
        self.model = FeatureDecoder(self.model_config)
        if self.data.defense is not None:
            self.model.set_theta0(self.data.theta0)  # the conv recursion reads θ0
            self.data.recover_under_defense(self.model.recovered_features, progress)
        self.frames = self.data.training_frames()
        mirror = self.facts.mirror
        self.mirror = None if mirror is None else torch.tensor(mirror)
        self.set_optimiser([p for p in self.model.parameters() if p.requires_grad],  # not θ0's
                           len(self.frames))
        self.start(resume)

    # -- what the loop asks of this kind ---------------------------------------------------------
    def prepare(self) -> None:
        rows = np.sort(np.random.default_rng(self.config.seed).permutation(len(self.frames))
                       [:4096])
        features = self.data.features_of(self.frames, rows,
                                         torch.from_numpy(self.frames.images[rows]),
                                         self.model_config.feature_module)
        self.model.fit_normaliser(features)
        policy = self.model.roles.policy_head
        self.model.set_policy_head(self.data.theta0[f"{policy}.weight"],
                                   self.data.theta0[f"{policy}.bias"])
        self.model.set_theta0(self.data.theta0)
        self.set_mean_image(self.data.train.images)

    def epoch(self) -> Epoch:
        """A seeded permutation of the frames, mirrored at random by the same generator."""
        return self.shuffled_epoch(len(self.frames), lambda rows, generator: self._batch(
            self.frames, rows, generator))

    def objective(self, batch: DecoderBatch, settings: dict[str, float]
                  ) -> tuple[torch.Tensor, dict]:
        free, attacked = self._reconstruct(batch)
        loss = self.image_loss(free, batch.truth)
        return (loss if attacked is free else loss + self.image_loss(attacked, batch.truth)), {}

    def image_loss(self, frames: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
        config = self.config
        return ((frames - truth).pow(2).mean() + config.l1_weight * (frames - truth).abs().mean()
                + config.ssim_weight * (1.0 - ssim(frames, truth).mean()))

    def _batch(self, frames: FrameSet, indices: np.ndarray,
               generator: np.random.Generator | None) -> DecoderBatch:
        """Frames (mirrored at random when a generator is given and the features are exact)
        with their predecessors."""
        previous = frames.previous[indices]
        has = previous >= 0
        before = np.where(has, previous, indices)
        images = torch.from_numpy(frames.images[indices])
        earlier = torch.from_numpy(frames.images[before])
        actions = torch.from_numpy(frames.actions[before])
        if generator is not None and self.config.mirror and self.mirror is not None \
                and frames.features is None:
            flip = torch.from_numpy(generator.random(len(images)) < 0.5)
            images = torch.where(flip[:, None, None, None], images.flip(2), images)
            earlier = torch.where(flip[:, None, None, None], earlier.flip(2), earlier)
            actions = torch.where(flip, self.mirror[actions], actions)
        module = self.model_config.feature_module
        context = self.model_config.context != "none"
        return DecoderBatch(
            self.data.features_of(frames, indices, images, module),
            images.permute(0, 3, 1, 2).float() / 255.0,
            self.data.features_of(frames, before, earlier, module) if context
            else torch.zeros(0), actions, torch.from_numpy(has))

    def _reconstruct(self, batch: DecoderBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(context-free frames, the attack's frames): as `FeatureDecoder.attack` makes them,
        the context being the predecessor's context-free reconstruction."""
        free = self.model(batch.features)
        if self.model_config.context == "none":
            return free, free
        with torch.no_grad():
            earlier = self.model(batch.previous_features)
        return free, self.model(batch.features, earlier, batch.previous_actions,
                                batch.has_previous)

    @torch.no_grad()
    def validate(self, writer: Any) -> dict[str, float]:
        """Loss, PSNR and SSIM of the attack's frames on validation-episode frames (their exact
        θ0 features, or those recovered under the defense), and PSNR of the context-free pass
        for context models."""
        self.model.eval()
        losses, psnrs, ssims, free_psnrs = [], [], [], []
        rows = self.data.val_rows
        for start in range(0, len(rows), self.config.batch_size):
            batch = self._batch(self.data.val, rows[start:start + self.config.batch_size], None)
            free, attacked = self._reconstruct(batch)
            losses.append(float(self.objective(batch, {})[0]) * len(batch.truth))
            psnrs.append(psnr(attacked, batch.truth))
            ssims.append(ssim(attacked, batch.truth))
            free_psnrs.append(psnr(free, batch.truth))
            if writer is not None and start == 0:  # the same first frames every epoch
                writer.add_images("validation/truth_then_reconstruction",
                                  torch.cat([batch.truth[:8], attacked[:8]]).clamp(0, 1),
                                  self.epochs_done + 1)
        count = max(1, len(rows))
        record = {"val_loss": sum(losses) / count, "val_psnr": float(torch.cat(psnrs).mean()),
                  "val_ssim": float(torch.cat(ssims).mean())}
        if self.model_config.context != "none":
            record["val_psnr_context_free"] = float(torch.cat(free_psnrs).mean())
        return record

    def record_fields(self) -> dict[str, Any]:
        return {"train_frames": {"captured": len(self.data.train),
                                 "rendered": len(self.data.rendered)},
                "val_frames": len(self.data.val_rows)}

    def saved(self) -> None:
        if self.epochs_done < self.config.epochs:
            self.data.cache_rendered(self.out / RENDERED)
        else:  # finished: the run directory keeps only the attacker
            (self.out / RENDERED).unlink(missing_ok=True)


def _check_feature_module(path: str, module: str) -> Roles:
    """Before any frame is read: the victim must have the module whose input is decoded, and
    a Linear layer reading its conv features, whose closed-form input starts every feature
    recovery. Returns the capture's roles."""
    with CaptureFile(path) as capture:
        check_rgb_frames(capture)
        victim, roles = create_victim(capture.victim), capture.roles
    if roles.feature_linear is None or module not in ("", *dict(victim.named_modules())):
        raise ConfigError(f"attack.decoder.feature_module={module!r}: victim "
                          f"{capture.victim.name} has no such module or no Linear layer reading "
                          "conv features, so no conv features to decode (the feature decoder "
                          "needs a conv encoder and a Linear layer after it)")
    return roles


def _action_facts(path: str) -> ActionFacts:
    """What the capture's environment declares about its actions (mirrors, camera motion)."""
    with CaptureFile(path) as capture:
        try:
            settings = json.loads(capture.attrs.get("env_config", "{}"))
        except json.JSONDecodeError:
            settings = {}
        return action_facts(settings if isinstance(settings, dict) else {},
                            capture.victim.num_actions)


def _gradient_dim(path: str) -> int:
    with CaptureFile(path) as capture:
        return int(capture.attrs["gradient_dim"])


def fit_decoder(model_config: DecoderConfig, config: DecoderFitConfig, paths: list[str],
                out: Path, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    return run_fit(lambda: DecoderFit(model_config, config, paths, out, resume, progress),
                   out, config.epochs, resume, SUMMARY_FIELDS)
