"""Max-pooling: each window's output is its largest input, and the gradient reaching the output
goes back to that input alone (the switch). Given the switches, the input is known at them
(the pooled values) and bounded by them elsewhere, and the gradient reaching the input is the
output's scattered to them. The switches themselves are what one step's gradient does not hand
over directly: below the pool the conv's weight gradient involves δ only at the switches, so finding
them is a combinatorial fit (docs/fedavg.md says how far it has come). Until it is part of the
walk, the walk stops above a max-pool.
"""

from __future__ import annotations

from torch import nn

from gradleak.inversion.layers.base import LayerInverse, register_layer_inverse


@register_layer_inverse("max-pool")
class MaxPool(LayerInverse):
    kinds = ("maxpool",)
    module_types = (nn.MaxPool2d,)

    @classmethod
    def refusal(cls, module: nn.Module) -> str | None:
        return ("max-pooling: the gradient reaching its input is its output's at the argmax "
                "switches, which the walk does not find yet")
