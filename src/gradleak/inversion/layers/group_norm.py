"""GroupNorm: each sample is normalised by its own statistics, per group of channels. Given the
layer's output, its input is known up to two unknowns per group and step (the group's mean and
standard deviation), which the layer's own weight and bias gradients constrain (Σ over the
group's positions of the gradient times the normalised value, and of the gradient), and the
gradient reaching the input mixes every position of the group through them. Not solved yet:
the walk stops above a GroupNorm.
"""

from __future__ import annotations

from torch import nn

from gradleak.inversion.layers.base import LayerInverse, register_layer_inverse


@register_layer_inverse("group norm")
class GroupNorm(LayerInverse):
    kinds = ("groupnorm",)
    module_types = (nn.GroupNorm,)

    @classmethod
    def refusal(cls, module: nn.Module) -> str | None:
        return ("GroupNorm: per-sample statistics, two unknowns per group and step that the "
                "walk does not solve yet")
