"""How the training-free attack takes the frame out of one step's gradient: one registered
route per way a victim's first layers can be inverted (the recursion down a conv stack, the
patch embedding of a ViT). The attack asks each route whether the victim's architecture allows
it, before any row is read, and takes the first that does (lowest `priority`). Adding a route
is one module and one decorator."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from gradleak.errors import ConfigError
from gradleak.registry import Registry
from gradleak.threat import Observation
from gradleak.victims.base import Victim


class FrameInverse:
    """One route from the gradient to the frame. `victim` is θ0 in float64, eval mode;
    `config` the attack's `ExactConfig`; `prior` a fitted refiner or None."""

    priority: ClassVar[int] = 100

    def __init__(self, victim: Victim, config: Any, prior: Any = None) -> None:
        self.victim, self.config, self.prior = victim, config, prior

    @classmethod
    def check(cls, victim: Victim) -> None:
        """A ConfigError naming why this route cannot run on the victim, from its
        architecture alone."""
        raise NotImplementedError

    @classmethod
    def unavailable(cls, victim: Victim) -> str | None:
        """`check`'s reason, or None where the route runs."""
        try:
            cls.check(victim)
        except ConfigError as error:
            return str(error)
        return None

    def layers(self) -> list[str]:
        """The parameters whose gradients the route reads (checked before any row is)."""
        return []

    def frames(self, observation: Observation) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(N, H, W, C) float frames in frame units, and per-step diagnostics (N, ...)."""
        raise NotImplementedError


FRAME_INVERSES: Registry[type[FrameInverse]] = Registry("frame inverse")
register_frame_inverse = FRAME_INVERSES.register


def frame_inverse_for(victim: Victim) -> type[FrameInverse]:
    """The first route that applies to the victim; a ConfigError naming every route's reason
    otherwise."""
    reasons = {}
    for name in sorted(FRAME_INVERSES.names(), key=lambda n: FRAME_INVERSES.get(n).priority):
        route = FRAME_INVERSES.get(name)
        reason = route.unavailable(victim)
        if reason is None:
            return route
        reasons[name] = reason
    raise ConfigError("; ".join(f"{name}: {reason}" for name, reason in reasons.items()))
