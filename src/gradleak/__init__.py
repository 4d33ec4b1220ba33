"""gradleak: measure how much a shared gradient stream leaks."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# public names loaded on first use, so that `import gradleak` does not import torch
_LAZY = {"wrap": "gradleak.victims.wrapped",
         "register_model_factory": "gradleak.victims.factories",
         "register_forward": "gradleak.victims.factories"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gradleak' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
