"""Layers that pass their input on at θ0: nn.Identity (a placeholder a model keeps where a
layer is switched off) and dropout, which a victim in eval mode (as every capture is taken)
does not apply. What is known at the output is known at the input."""

from __future__ import annotations

from torch import nn

from gradleak.inversion.layers.base import GradientOf, Known, LayerInverse, register_layer_inverse


@register_layer_inverse("identity")
class Identity(LayerInverse):
    kinds = ("identity", "dropout", "dropout1d", "dropout2d", "dropout3d", "alphadropout",
             "featurealphadropout")
    module_types = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
                    nn.AlphaDropout, nn.FeatureAlphaDropout)

    def invert(self, at_output: Known, gradient_of: GradientOf | None = None) -> Known:
        return at_output
