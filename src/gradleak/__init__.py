"""gradleak: measure how much a shared gradient stream leaks.

The public API (docs/api.md): `audit` (a capture's verdict, `Verdict`), `wrap` (a user's
policy as a victim), `rollout` (its rollouts at θ0 in the user's own Gymnasium environment),
`record` (a capture from rollouts), `register_model_factory` and `register_forward` (plugins). The frameworks' hooks live in `gradleak.integrations`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Verdict", "audit", "record", "register_forward", "register_model_factory",
           "rollout", "wrap"]

if TYPE_CHECKING:  # what editors and type checkers see; at run time, loaded on first use
    from gradleak.auditing import Verdict, audit
    from gradleak.capture.gym_rollout import rollout
    from gradleak.capture.record import record
    from gradleak.victims.factories import register_forward, register_model_factory
    from gradleak.victims.wrapped import wrap

# public names loaded on first use, so that `import gradleak` does not import torch
_LAZY = {"wrap": "gradleak.victims.wrapped",
         "register_model_factory": "gradleak.victims.factories",
         "register_forward": "gradleak.victims.factories",
         "audit": "gradleak.auditing", "Verdict": "gradleak.auditing",
         "record": "gradleak.capture.record", "rollout": "gradleak.capture.gym_rollout"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gradleak' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
