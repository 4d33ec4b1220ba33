"""The training-free attack's layer inverses, one module per layer kind (`layers.base`): the
Linear reading the features, the affine normalisation, the ReLU and the one-to-one activations
(LeakyReLU, ELU), the conv (with its equations, null-space completion and least-violation point
in modules of their own), the pre-activation residual block, identity and dropout, and the
Conv → GroupNorm → ReLU block with each step's statistics, and the kind the walk knows but
cannot pass yet (max-pooling), which says why. Importing this package registers them all."""

from gradleak.inversion.layers import (  # noqa: F401
    conv,
    group_norm,
    identity,
    invertible_activation,
    linear,
    max_pool,
    relu,
    residual,
)
from gradleak.inversion.layers.affine_norm import AffineNorm, identity_norm
from gradleak.inversion.layers.base import (
    LAYER_INVERSES,
    Known,
    LayerInverse,
    inverse_for_kind,
    refusal_of,
    register_layer_inverse,
)

__all__ = ["LAYER_INVERSES", "AffineNorm", "Known", "LayerInverse", "identity_norm",
           "inverse_for_kind", "refusal_of", "register_layer_inverse"]
