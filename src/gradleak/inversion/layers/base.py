"""One inverse per layer kind: what a layer's gradients say of its input, given its output.

The training-free attack walks a victim down from the layer whose input the gradient gives in
closed form (the Linear reading the features). Every layer kind it meets has one inverse, a
`LayerInverse` registered under the kind `victims.roles` gives its modules ("conv", "relu",
"batchnorm", ...): given what is `Known` at the layer's output (its value, how noisy, the loss
gradient reaching it) and the layer's own parameter gradients, it returns what is known at the
layer's input. A kind the walk cannot pass yet says why (`refusal`), from the architecture
alone, so the attack refuses before any row is read. Adding a kind is one module and one
decorator; the walk (`inversion.conv_recovery`) composes the inverses in the order the victim's
roles give.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from gradleak.registry import Registry

GradientOf = Callable[[str], torch.Tensor]  # parameter name → (N, *shape) per-step gradients


@dataclass(frozen=True)
class Known:
    """What the walk knows at one point of the network, for N steps (float64).

    `value` is the activation there; `noise` its per-entry standard deviation (inf where
    nothing fixes it); `rounding` a bound on what the victim's own float32 arithmetic left in
    it; `gradient` the loss gradient reaching it. Below a ReLU, `on` says which units are on:
    there `value` is the pre-activation, elsewhere only ≤ 0 is known. `completed` marks the
    steps where the equations had a null space that the layer's outputs filled in."""

    value: torch.Tensor  # (N, ...)
    noise: torch.Tensor  # (N, ...)
    gradient: torch.Tensor  # (N, ...)
    rounding: torch.Tensor | float = 0.0
    on: torch.Tensor | None = None  # (N, ...) bool
    completed: torch.Tensor | None = None  # (N,) bool

    def steps(self, rows: torch.Tensor) -> Known:
        """These steps only."""
        def cut(value: torch.Tensor | float | None) -> torch.Tensor | float | None:
            return value[rows] if isinstance(value, torch.Tensor) and value.dim() else value

        return replace(self, value=self.value[rows], noise=self.noise[rows],
                       gradient=self.gradient[rows], rounding=cut(self.rounding),
                       on=cut(self.on), completed=cut(self.completed))


class LayerInverse:
    """The inverse of one layer kind. `kinds`: the `victims.roles` kinds it inverts;
    `module_types`: the torch modules of that kind."""

    kinds: ClassVar[tuple[str, ...]] = ()
    module_types: ClassVar[tuple[type[nn.Module], ...]] = ()

    @classmethod
    def refusal(cls, module: nn.Module) -> str | None:
        """Why the walk cannot pass this module (None: it can), from the module alone."""
        return None

    def invert(self, at_output: Known, gradient_of: GradientOf) -> Known:
        """What is known at the layer's input, given what is known at its output and its own
        parameters' per-step gradients."""
        raise NotImplementedError


LAYER_INVERSES: Registry[type[LayerInverse]] = Registry("layer inverse")


def register_layer_inverse(name: str) -> Callable[[type[LayerInverse]], type[LayerInverse]]:
    """Registers an inverse under its layer kind's name; its `kinds` say which role kinds."""
    return LAYER_INVERSES.register(name)


def inverse_for_kind(kind: str) -> type[LayerInverse] | None:
    """The inverse registered for a `victims.roles` kind, or None."""
    for name in LAYER_INVERSES:
        inverse = LAYER_INVERSES.get(name)
        if kind in inverse.kinds:
            return inverse
    return None


def settled(before: torch.Tensor, after: torch.Tensor, tolerance: float) -> bool:
    """Did a fixed point's round move every step's (N, ...) value by less than `tolerance`
    (relative)?"""
    change = (after - before).flatten(1).norm(dim=1)
    return bool((change <= tolerance * after.flatten(1).norm(dim=1).clamp_min(1e-300)).all())


def refusal_of(kind: str, module: nn.Module) -> str | None:
    """Why the walk cannot pass a module of this role kind (None: it can)."""
    inverse = inverse_for_kind(kind)
    if inverse is None:
        known = sorted({k for name in LAYER_INVERSES for k in LAYER_INVERSES.get(name).kinds})
        article = "an" if kind[:1] in "aeiou" else "a"
        return (f"no layer inverse is registered for {article} {kind} (there are for "
                f"{', '.join(known)})")
    return inverse.refusal(module)
