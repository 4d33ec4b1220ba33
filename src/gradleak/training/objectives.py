"""Training objectives of the learned attackers, each one nn.Module so that DistributedDataParallel
sees exactly one forward per backward (TRACE's scheduled-sampling and rollout passes included).

TRACE (reference file, "Training"): α1 MSE + α2 L1 + α3 action CE + α4 perceptual + α5 rollout.
Scheduled sampling: with probability β each context frame is replaced by the model's own
teacher-forced prediction of it. Rollout: from a random start, R steps where each predicted
frame becomes the next step's context (detached: it trains robustness to the model's own
errors without back-propagating through time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradleak.attacks.lti import LearningToInvert, LtiConfig
from gradleak.attacks.trace import Trace, TraceConfig
from gradleak.errors import ConfigError
from gradleak.metrics.images import ssim
from gradleak.metrics.lpips import LPIPS, unavailable_reason
from gradleak.registry import Registry
from gradleak.training.checkpoint import MODELS


@dataclass(frozen=True)
class FitKind:
    """What fitting a window attacker needs to know of its kind, in one registry entry."""

    objective: Callable[..., nn.Module]  # (model, weights, perceptual, rollout_steps)
    window: Callable[[Any], int]  # the steps one training window holds, from the model config
    strided: bool  # windows start every `stride` steps (else at every step)
    scheduled_sampling: bool  # teacher forcing annealed over epochs (a recurrent decoder)
    adaptive_windows: int  # windows per fine-tuning epoch under a defense


FIT_KINDS: Registry[FitKind] = Registry("learned attacker kind")


def window_attacker(kind: str, model: type, settings: type, *, window: Callable[[Any], int],
                    strided: bool, scheduled_sampling: bool, adaptive_windows: int
                    ) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Registers a learned attacker that reads windows of gradients (a `WindowAttacker`): the
    decorated objective `(model, loss weights, perceptual term, rollout steps) -> nn.Module`
    is its training loss, `model` and `settings` rebuild its checkpoints
    (`training.checkpoint.MODELS`); `gradleak train-attacker KIND` then fits it and `evaluate
    --attacker` scores it."""
    def register(objective: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        MODELS.register(kind)((model, settings))
        FIT_KINDS.register(kind)(FitKind(objective, window, strided, scheduled_sampling,
                                         adaptive_windows))
        return objective

    return register


@dataclass
class LossWeights:
    mse: float = 1.0
    l1: float = 0.5
    action: float = 0.01
    perceptual: float = 0.2
    rollout: float = 0.5

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PERCEPTUAL_TERMS = ("vgg", "alex", "ssim")


class Perceptual(nn.Module):
    """LPIPS with the VGG16 (the paper's) or AlexNet backbone, or 1 − SSIM: the named term, and
    1 − SSIM with a one-line reason when the LPIPS weights are missing — never silently 0."""

    def __init__(self, term: str = "vgg", lpips_weights: str | None = None) -> None:
        super().__init__()
        if term not in PERCEPTUAL_TERMS:
            raise ConfigError(f"perceptual term '{term}' is not one of {PERCEPTUAL_TERMS}")
        self.reason = None if term == "ssim" else unavailable_reason(lpips_weights, term)
        self.lpips = None if term == "ssim" or self.reason else LPIPS(lpips_weights, term)
        self.name = f"lpips-{term}" if self.lpips is not None else "1-ssim"

    def forward(self, prediction: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
        prediction, truth = prediction.flatten(0, -4), truth.flatten(0, -4)  # (N, 3, H, W)
        if self.lpips is not None:
            return self.lpips(prediction, truth).mean()
        return (1.0 - ssim(prediction, truth)).mean()


def action_cross_entropy(logits: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Against action indices (B, T), or action histograms (B, T, K) of aggregated streams."""
    if actions.is_floating_point():
        return F.cross_entropy(logits.flatten(0, -2), actions.flatten(0, -2))
    return F.cross_entropy(logits.flatten(0, -2), actions.flatten())


def _image_terms(prediction: torch.Tensor, truth: torch.Tensor, logits: torch.Tensor,
                 actions: torch.Tensor, perceptual: Perceptual, weights: LossWeights
                 ) -> dict[str, torch.Tensor]:
    parts = {"mse": F.mse_loss(prediction, truth), "l1": F.l1_loss(prediction, truth),
             "action": action_cross_entropy(logits, actions)}
    if weights.perceptual:
        parts["perceptual"] = perceptual(prediction, truth)
    return parts


def _total(parts: dict[str, torch.Tensor], weights: LossWeights) -> torch.Tensor:
    return sum(getattr(weights, name) * value for name, value in parts.items())


@window_attacker("trace", Trace, TraceConfig, window=lambda config: config.window, strided=True,
                 scheduled_sampling=True, adaptive_windows=400)
class TraceObjective(nn.Module):
    def __init__(self, model: Trace, weights: LossWeights, perceptual: Perceptual,
                 rollout_steps: int) -> None:
        super().__init__()
        self.model, self.weights, self.perceptual = model, weights, perceptual
        self.rollout_steps = rollout_steps

    def forward(self, gradients: torch.Tensor, truth: torch.Tensor, actions: torch.Tensor,
                beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        context = truth
        if beta > 0:
            with torch.no_grad():
                guess, _ = self.model(gradients, truth)
            chosen = torch.rand(truth.shape[:2], device=truth.device) < beta
            context = torch.where(chosen[..., None, None, None], guess, truth)
        prediction, logits = self.model(gradients, context)
        parts = _image_terms(prediction, truth, logits, actions, self.perceptual, self.weights)
        steps = min(self.rollout_steps, truth.shape[1])
        if steps and self.weights.rollout:
            parts["rollout"] = self._rollout(gradients, truth, steps)
        return _total(parts, self.weights), parts

    def _rollout(self, gradients: torch.Tensor, truth: torch.Tensor, steps: int) -> torch.Tensor:
        start = int(torch.randint(0, truth.shape[1] - steps + 1, ()))
        context = truth
        loss = truth.new_zeros(())
        for r in range(steps):
            end = start + r + 1
            frames, _ = self.model(gradients[:, :end], context[:, :end], last_only=True)
            loss = loss + F.mse_loss(frames[:, -1], truth[:, end - 1])
            context = context.clone()  # the last pass still needs the old tensor for backward
            context[:, end - 1] = frames[:, -1].detach()
        return loss / steps


@window_attacker("lti", LearningToInvert, LtiConfig, window=lambda config: 1, strided=False,
                 scheduled_sampling=False, adaptive_windows=4000)
class LtiObjective(nn.Module):
    """Per-frame regression: MSE + L1 + action CE (+ perceptual when weighted). LtI inverts
    each step on its own: it has no rollout, whatever `rollout_steps` says."""

    def __init__(self, model: LearningToInvert, weights: LossWeights,
                 perceptual: Perceptual, rollout_steps: int = 0) -> None:
        super().__init__()
        self.model, self.weights, self.perceptual = model, weights, perceptual

    def forward(self, gradients: torch.Tensor, truth: torch.Tensor, actions: torch.Tensor,
                beta: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        prediction, logits = self.model(gradients)
        parts = _image_terms(prediction, truth, logits, actions, self.perceptual, self.weights)
        return _total(parts, self.weights), parts
