"""Victim policies: obs → (logits, value), in a registry so adding one is one file."""

from gradleak.victims import cnn as _cnn  # noqa: F401  (cnn, cnn-small, cnn-k10, nature-cnn)
from gradleak.victims import impala as _impala  # noqa: F401  (impala, impala-wide, -small)
from gradleak.victims import mlp as _mlp  # noqa: F401  (registers "mlp")
from gradleak.victims import multimodal as _multimodal  # noqa: F401  (multimodal, -small)
from gradleak.victims import recurrent as _recurrent  # noqa: F401  (cnn-gru, -small)
from gradleak.victims import resnet as _resnet  # noqa: F401  (resnet8)
from gradleak.victims import vit as _vit  # noqa: F401  (vit-tiny, -small)
from gradleak.victims import wrapped as _wrapped  # noqa: F401  (wrapped: gradleak.wrap)
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
