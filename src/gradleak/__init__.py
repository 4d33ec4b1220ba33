"""gradleak: measure how much a shared gradient stream leaks."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`gradleak.wrap` without importing torch for `import gradleak`."""
    if name == "wrap":
        from gradleak.victims.wrapped import wrap

        return wrap
    raise AttributeError(f"module 'gradleak' has no attribute {name!r}")
