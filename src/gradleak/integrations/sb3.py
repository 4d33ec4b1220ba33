"""Stable-Baselines3 (`pip install gradleak[sb3]`): audit a PPO or A2C agent as it is.

    from stable_baselines3 import PPO
    from gradleak.integrations import sb3

    model = PPO("CnnPolicy", env)          # or MlpPolicy on image frames, or MultiInputPolicy
    victim = sb3.victim(model)              # SB3's own network, parameters under SB3's names
    sb3.save(model, "runs/sb3-victim")      # then: gradleak capture --victim runs/sb3-victim ...
    model.learn(..., callback=sb3.GradleakCapture("runs/sb3/train-{rollout}.h5", every=4))

`victim`, `learning_rule`, `save`, `describe` and `rebuild` come from `sb3_policy` (no SB3
needed to rebuild a described policy, so a capture is audited on a machine without it);
`GradleakCapture`, the callback that records SB3's per-step gradients during its own training,
from `sb3_capture`, loaded on first use since it subclasses SB3's `BaseCallback`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradleak.integrations.sb3_policy import (
    FACTORY,
    describe,
    learning_rule,
    rebuild,
    save,
    victim,
)

if TYPE_CHECKING:  # what editors see; at run time loaded on first use (it needs SB3)
    from gradleak.integrations.sb3_capture import GradleakCapture

__all__ = ["FACTORY", "GradleakCapture", "describe", "learning_rule", "rebuild", "save",
           "victim"]


def __getattr__(name: str) -> Any:
    if name == "GradleakCapture":
        from gradleak.integrations.sb3_capture import GradleakCapture

        return GradleakCapture
    raise AttributeError(f"module 'gradleak.integrations.sb3' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "GradleakCapture"])
