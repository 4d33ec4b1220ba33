"""nn.Identity (a placeholder a model keeps where a layer is switched off): what is known at its
output is known at its input."""

from __future__ import annotations

from torch import nn

from gradleak.attacks.layers.base import GradientOf, Known, LayerInverse, register_layer_inverse


@register_layer_inverse("identity")
class Identity(LayerInverse):
    kinds = ("identity",)
    module_types = (nn.Identity,)

    def invert(self, at_output: Known, gradient_of: GradientOf | None = None) -> Known:
        return at_output
