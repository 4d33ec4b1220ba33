"""Victim policies: obs → (logits, value), in a registry so adding one is one file."""

from gradleak.victims import cnn as _cnn  # noqa: F401  (registers "cnn" and "cnn-small")
from gradleak.victims import mlp as _mlp  # noqa: F401  (registers "mlp")
from gradleak.victims.base import (
    COMPONENTS,
    VICTIMS,
    LayerInfo,
    Victim,
    VictimConfig,
    create_victim,
    layer_table,
    register_victim,
)

__all__ = ["COMPONENTS", "VICTIMS", "LayerInfo", "Victim", "VictimConfig", "create_victim",
           "layer_table", "register_victim"]
