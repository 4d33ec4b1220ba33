"""Score learned attackers and baselines on the same held-out frames.

Windows of T steps (non-overlapping, so each frame counts once) are cut from held-out captures.
Each learned attacker reconstructs them from an ObservedWindows alone; the closed-form rule
reads actions off the same gradients. Two reference rows use no gradient at all: the mean
training image, and (an oracle) each frame's own mean colour — Doom frames are dark, so an
absolute PSNR alone misleads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradleak.attacks.action_rules import policy_weight, recover_actions
from gradleak.attacks.catalogue import attack_for, run
from gradleak.attacks.single_step import Context, SingleStepAttack
from gradleak.capture.reader import CaptureFile
from gradleak.capture.schema import layers_from_json
from gradleak.defenses import Chain, parse_defense
from gradleak.defenses.utility import update_distortion
from gradleak.errors import ConfigError
from gradleak.evaluation.scoring import (
    MEAN_COLOUR,
    MEAN_IMAGE,
    UNIFORM,
    MethodScores,
    control_name,
    frame_scores,
    mean_frame,
    score_actions,
    summarise,
    trainable_parameters,
)
from gradleak.io import check_output
from gradleak.metrics.lpips import LPIPS, unavailable_reason
from gradleak.metrics.lpips import layout as lpips_layout
from gradleak.threat import Observation, ObservedWindows, declared
from gradleak.training.checkpoint import fingerprint_from_dict, load_attacker
from gradleak.training.data import WindowDataset, collate
from gradleak.training.refiner_fit import check_prior, load_prior

RULE = "action rule (odd-sign)"


class Evaluation:
    def __init__(self, data: Sequence[str | os.PathLike[str]], attackers: dict[str, str],
                 window: int | None = None, lpips_weights: str | None = None,
                 max_windows: int | None = None, samples: int = 4,
                 baselines: dict[str, Any] | None = None,
                 baseline_windows: int | dict[str, int] = 2, progress: bool = False,
                 defense: Chain | None = None, skip_nonfinite: bool = False,
                 reference_data: Sequence[str | os.PathLike[str]] | None = None) -> None:
        """`baselines`: row name → a single-step attack's settings, which name the attack
        (`attacks.single_step`)."""
        self.defense, self.data = defense, list(data)
        # each baseline's attack, its settings and any prior they name, before any work
        self.attacks: dict[str, SingleStepAttack] = {}
        self.priors: dict[str, Any] = {}  # each baseline's learned prior, loaded on first use
        for name, config in (baselines or {}).items():
            self.attacks[name] = attack_for(config)
            self.attacks[name].check(config)
            check_prior(self.attacks[name].prior(config))
        if baselines and defense is not None and defense.span > 1:
            raise ConfigError(f"--defense {defense.spec!r} aggregates steps: the optimisation "
                              "baselines invert single steps and are not run on it")
        self.models = {name: load_attacker(path) for name, path in attackers.items()}
        windows = [model.window for model, _ in self.models.values() if model.window > 1]
        self.window = window or (windows[0] if windows else 8)
        self.dataset = WindowDataset(data, window=self.window, stride=self.window, part="all",
                                     expect_split="heldout", defense=defense,
                                     skip_nonfinite=skip_nonfinite, rgb_only=bool(attackers))
        for name, (_, meta) in self.models.items():
            fingerprint_from_dict(meta["fingerprint"]).check(self.dataset.fingerprint,
                                                             f"held-out data for {name}")
            span = self.models[name][0].window
            if span > self.window or self.window % span:
                raise ConfigError(f"attacker {name} reads windows of {span} steps; evaluation "
                                  f"windows of {self.window} must be a multiple of it")
        self.layers = tuple(layers_from_json(self.dataset.fingerprint.layer_table))
        # The optimisation baselines solve one problem per frame: seconds to minutes each, so
        # they see only the first `baseline_windows` windows (their rows say how many frames);
        # a dict gives each baseline its own count (DLG and IG fewer than the training-free one)
        self.baselines = baselines or {}
        self.baseline_windows = (dict(baseline_windows) if isinstance(baseline_windows, dict)
                                 else dict.fromkeys(self.baselines, baseline_windows))
        missing = set(self.baselines) - set(self.baseline_windows)
        if missing:
            raise ConfigError(f"baseline_windows names no count for {', '.join(sorted(missing))}")
        self.progress = progress
        with CaptureFile(data[0]) as capture:  # θ0 and the loss: what the server knows
            self.theta0 = capture.theta0() if self.baselines else {}
            self.hyperparameters, self.roles = capture.hyperparameters, capture.roles
            # what the stream went through: the file's own defenses, then this evaluation's
            self.declared_defense = capture.declared_defense() + declared(
                defense.describe()["transforms"] if defense is not None else ())
            seen = capture.observation(rows=slice(0, 0)) if self.baselines else None
        for name, attack in self.attacks.items():  # what each reads of the threat model
            reason = attack.missing(replace(seen, defense=self.declared_defense))
            if reason:
                raise ConfigError(f"baseline {name}: {reason}")
        self.lpips_note = unavailable_reason(lpips_weights)
        self.lpips = None if self.lpips_note else LPIPS(lpips_weights)
        self.max_windows, self.sample_count = max_windows, samples
        self.mean_image = self._mean_image(reference_data)

    def _mean_image(self, reference_data: Sequence[str | os.PathLike[str]] | None
                    ) -> torch.Tensor:
        """The mean of every frame of `reference_data`, or else of the attackers' training
        captures, so the reference is the same whichever attackers are evaluated and in
        whatever order; a checkpoint's own sampled mean only when those files are gone (and
        `mean_image_source` says so)."""
        self.mean_image_of = "training frames"
        if reference_data:
            mean, frames = mean_frame(reference_data)
            self.mean_image_source = f"every frame of {', '.join(map(str, reference_data))} " \
                                     f"({frames:,})"
            if {Path(p).resolve() for p in reference_data} & {Path(p).resolve()
                                                               for p in self.data}:
                # the reference has seen the frames it is scored on: closer to them than a
                # training mean would be, so gains over it understate the leak
                self.mean_image_of = "audited frames"
            return mean
        files = sorted({str(path) for _, meta in self.models.values()
                        for path in meta.get("train_files", [])})
        if files and all(Path(path).is_file() for path in files):
            mean, frames = mean_frame(files)
            self.mean_image_source = f"every frame of the training captures ({frames:,})"
            return mean
        for name, (_, meta) in self.models.items():
            if "mean_image" in meta:
                size = self.dataset.fingerprint.victim.frame_size
                self.mean_image_source = f"attacker {name}'s checkpoint (its training " \
                                         "captures are not at their recorded paths)"
                return torch.tensor(meta["mean_image"]).view(3, size, size)
        raise ConfigError("no attacker checkpoint carries the mean training image: evaluate "
                          "at least one learned attacker, or name the frames of the reference "
                          "(a training capture)")

    def run(self, batch_size: int = 16) -> dict[str, MethodScores]:
        methods = {name: MethodScores(name, "learned",
                                      parameters=trainable_parameters(model),
                                      defense_mode=self._defense_mode(meta))
                   for name, (model, meta) in self.models.items()}
        methods.update({control_name(name): MethodScores(control_name(name), "control")
                        for name in self.models})
        methods.update({name: MethodScores(name, self.attacks[name].kind)
                        for name in self.baselines})
        if self._captures_policy_head():
            methods[RULE] = MethodScores(RULE, "rule")
        methods[MEAN_IMAGE] = MethodScores(MEAN_IMAGE, "reference")
        methods[MEAN_COLOUR] = MethodScores(MEAN_COLOUR, "reference")
        if self.dataset.span > 1:
            methods[UNIFORM] = MethodScores(UNIFORM, "reference")
        count = len(self.dataset) if self.max_windows is None else min(len(self.dataset),
                                                                      self.max_windows)
        self.truth_samples: list[np.ndarray] = []
        for start in range(0, count, batch_size):
            batch = collate([self.dataset[i] for i in range(start, min(start + batch_size,
                                                                       count))])
            self._score_batch(batch, methods)
            self._score_baselines(batch, methods, start)
        return methods

    def _score_batch(self, batch: Any, methods: dict[str, MethodScores]) -> None:
        truth, actions = batch.images, batch.actions.numpy()
        observed = ObservedWindows(batch.observed.gradients)
        # each learned attacker's control: the same windows read with the next window's
        # gradients (other steps, same stream and defense): what its training alone gives
        others = ObservedWindows(batch.observed.gradients.roll(1, dims=0)) \
            if len(truth) > 1 else None
        for name, (model, _) in self.models.items():
            tick = time.perf_counter()
            images, probs = reconstruct_in_spans(model, observed)
            self._add(methods[name], torch.from_numpy(images).permute(0, 1, 4, 2, 3)
                      .float() / 255.0, truth, None, time.perf_counter() - tick)
            score_actions(methods[name], probs, actions)
            if others is not None:
                images, probs = reconstruct_in_spans(model, others)
                self._add(methods[control_name(name)], torch.from_numpy(images).permute(
                    0, 1, 4, 2, 3).float() / 255.0, truth, None, 0.0)
                score_actions(methods[control_name(name)], probs, actions)
        if RULE in methods:
            self._add_rule(methods[RULE], observed, actions)
        if UNIFORM in methods:
            score_actions(methods[UNIFORM], np.full(actions.shape, 1.0 / actions.shape[-1]),
                           actions)
        mean = self.mean_image.expand_as(truth)
        self._add(methods[MEAN_IMAGE], mean, truth, None, 0.0)
        colour = truth.mean(dim=(-2, -1), keepdim=True).expand_as(truth)
        self._add(methods[MEAN_COLOUR], colour, truth, None, 0.0)
        if sum(len(s) for s in self.truth_samples) < self.sample_count:
            self.truth_samples.append(_to_uint8(truth))

    def _add(self, scores: MethodScores, prediction: torch.Tensor, truth: torch.Tensor,
             correct: np.ndarray | None, seconds: float) -> None:
        for key, value in frame_scores(prediction, truth, self.lpips).items():
            getattr(scores, key).append(value)
        if correct is not None:
            scores.correct.append(correct)
        scores.seconds += seconds
        scores.frames += truth.shape[0] * truth.shape[1]
        if scores.samples is None or len(scores.samples) < self.sample_count:
            new = _to_uint8(prediction)
            scores.samples = new if scores.samples is None else np.concatenate([scores.samples,
                                                                                new])

    def _defense_mode(self, meta: dict[str, Any]) -> str | None:
        """Adaptive: trained under the very defense it is now attacked with (Learning to
        Invert's protocol); zero-shot: trained on anything else (the TRACE paper's)."""
        if self.defense is None:
            return None
        trained = parse_defense(meta.get("fit", {}).get("defense", "none"))
        return "adaptive" if trained.describe()["transforms"] == \
            self.defense.describe()["transforms"] else "zero-shot"

    def _score_baselines(self, batch: Any, methods: dict[str, MethodScores], start: int
                         ) -> None:
        """Each baseline on the windows of this batch that fall within its first
        `baseline_windows[name]` windows (`start` is the batch's first window)."""
        for name, config in self.baselines.items():
            windows = max(0, self.baseline_windows[name] - start)
            if windows <= 0:
                continue
            truth, actions = batch.images[:windows], batch.actions[:windows].numpy()
            b, t = truth.shape[:2]
            flat = self._frames_observation(ObservedWindows(batch.observed.gradients[:windows]))
            if name not in self.priors:  # loaded and checked against θ0 once, not per batch
                prior = self.attacks[name].prior(config)
                self.priors[name] = load_prior(prior, flat) if prior else None
            result, seconds = run(flat, config, Context(self.progress, self.priors[name]))
            images = torch.from_numpy(result.images).view(b, t, *result.images.shape[1:])
            self._add(methods[name], images.permute(0, 1, 4, 2, 3).float() / 255.0, truth,
                      np.asarray(result.actions).reshape(b, t) == actions, seconds)

    def _frames_observation(self, observed: ObservedWindows) -> Observation:
        """The windows' gradients as one row per frame, with what the server knows of them."""
        b, t, d = observed.gradients.shape
        return Observation(gradients=observed.gradients.reshape(b * t, d).numpy(),
                           layers=self.layers, victim=self.dataset.fingerprint.victim,
                           hyperparameters=self.hyperparameters,
                           episode_ids=np.repeat(np.arange(b), t),
                           step_in_episode=np.tile(np.arange(t), b), theta0=self.theta0,
                           roles=self.roles, defense=self.declared_defense)

    def _captures_policy_head(self) -> bool:
        """A capture restricted to other components (`--components cnn`) leaves the rule
        nothing to read; the learned attackers still predict actions."""
        return any(layer.name == policy_weight(self.roles) for layer in self.layers)

    def _add_rule(self, scores: MethodScores, observed: ObservedWindows,
                  actions: np.ndarray) -> None:
        b, t, _ = observed.gradients.shape
        flat = self._frames_observation(observed)
        tick = time.perf_counter()
        predicted = recover_actions(flat, "odd-sign").actions.reshape(b, t)
        scores.seconds += time.perf_counter() - tick
        scores.frames += b * t
        score_actions(scores, np.eye(self.dataset.num_actions)[predicted], actions)


def reconstruct_in_spans(model: Any, observed: ObservedWindows) -> tuple[np.ndarray, np.ndarray]:
    """(images, action probabilities). An attacker with a shorter window (TRACE at T = 1) sees
    each span afresh, as it would in an attack: its context never reaches across spans."""
    b, t, d = observed.gradients.shape
    span = model.window
    pieces = observed.gradients.reshape(b * (t // span), span, d)
    result = model.reconstruct(ObservedWindows(pieces))
    probs = result.extras["action_probs"]
    return (result.images.reshape(b, t, *result.images.shape[2:]),
            probs.reshape(b, t, probs.shape[-1]))


def _to_uint8(frames: torch.Tensor) -> np.ndarray:
    return (frames.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 1, 3, 4, 2).numpy()


def evaluate(data: Sequence[str | os.PathLike[str]], attackers: dict[str, str], out: Path,
             lpips_weights: str | None = None, max_windows: int | None = None,
             baselines: dict[str, Any] | None = None,
             baseline_windows: int | dict[str, int] = 2,
             progress: bool = False, defense: Chain | None = None,
             skip_nonfinite: bool = False,
             reference_data: Sequence[str | os.PathLike[str]] | None = None) -> dict[str, Any]:
    from gradleak.report.scores import write_evaluation  # matplotlib is slow to import

    check_output(out, "--out", directory=True)
    evaluation = Evaluation(data, attackers, lpips_weights=lpips_weights,
                            max_windows=max_windows, baselines=baselines,
                            baseline_windows=baseline_windows, progress=progress,
                            defense=defense, skip_nonfinite=skip_nonfinite,
                            reference_data=reference_data)
    methods = evaluation.run()
    result = {"data": [str(p) for p in data], "attackers": attackers,
              "baselines": {name: asdict(config) for name, config in (baselines or {}).items()},
              "defense": defense.describe() if defense is not None else None,
              "utility": update_distortion(defense, data[0], skip_nonfinite=skip_nonfinite)
              if defense is not None else None,
              "skipped_nonfinite_rows": evaluation.dataset.skipped_rows,
              "window": evaluation.window, "windows": min(len(evaluation.dataset),
                                                          max_windows or len(evaluation.dataset)),
              "lpips": evaluation.lpips_note or "available",
              "lpips_reads": lpips_layout(evaluation.roles.transform.channels),
              "mean_image_source": evaluation.mean_image_source,
              "mean_image_of": evaluation.mean_image_of, "methods": summarise(methods)}
    write_evaluation(out, result, methods, np.concatenate(evaluation.truth_samples))
    return result


