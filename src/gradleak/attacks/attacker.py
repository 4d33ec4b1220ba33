"""The interface every learned attacker implements: frames and actions from the gradients of
a window of steps, and nothing else (an `ObservedWindows`)."""

from __future__ import annotations

import torch
from torch import nn

from gradleak.attacks.encoders import GradientInput
from gradleak.threat import ObservedWindows, Reconstruction


class WindowAttacker(nn.Module):
    """What every learned attacker shares: reconstruct() from an ObservedWindows alone."""

    name = "attacker"

    @property
    def window(self) -> int:
        """Steps it reads at once: a longer window is fed to it span by span."""
        return 1

    @property
    def gradient_input(self) -> GradientInput | None:
        """The normalised gradient reader fitted before training (None: it has none)."""
        return None

    def attack(self, gradients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, d) → frames (B, T, 3, H, W) in [0, 1] and action logits (B, T, K)."""
        raise NotImplementedError

    @torch.no_grad()
    def reconstruct(self, observed: ObservedWindows) -> Reconstruction:
        if not isinstance(observed, ObservedWindows):
            raise TypeError(f"{self.name} reconstructs from an ObservedWindows (gradients only)")
        was_training = self.training
        self.eval()
        try:
            frames, logits = self.attack(observed.gradients)
        finally:
            self.train(was_training)
        images = (frames.clamp(0, 1) * 255).round().to(torch.uint8).movedim(-3, -1)
        return Reconstruction(actions=logits.argmax(-1).numpy(), images=images.numpy(),
                              extras={"action_probs": logits.softmax(-1).numpy()})
