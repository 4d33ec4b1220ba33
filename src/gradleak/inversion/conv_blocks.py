"""A network's conv stack as the walk meets it: Conv [→ BatchNorm | GroupNorm] → ReLU (or a
one-to-one activation: LeakyReLU, ELU, sigmoid, tanh) [→ BatchNorm] blocks on maps of any
shape, read by a Linear layer; dropout, identities and flattening pass through. Each block is
inverted by its layers' inverses (`inversion.layers`: the norm, the activation, the conv) in
`inversion.conv_recovery`; a module the walk cannot pass is refused here, with its layer
inverse's reason, before any gradient is read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from gradleak.errors import ConfigError
from gradleak.inversion.layers import identity_norm, refusal_of
from gradleak.inversion.layers.affine_norm import bn_affine, norm_affine
from gradleak.inversion.layers.conv_equations import convolve
from gradleak.inversion.layers.group_norm import unsolvable
from gradleak.inversion.layers.identity import Identity
from gradleak.inversion.layers.invertible_activation import InvertibleActivation
from gradleak.inversion.network import Network


@dataclass(frozen=True, eq=False)  # compared by identity, as its modules are
class ConvBlock:
    """One Conv [→ BatchNorm] → ReLU [→ BatchNorm] block. A BatchNorm between the conv and the
    ReLU (eval mode: a per-channel affine map) is folded into `conv`, which then has weight
    gain·W and bias gain·(b − μ) + β: the walk sees Conv → ReLU [→ BatchNorm] either way. The
    folded conv's weight gradient is the observed one over the gain (`weight_gradient`), and
    the gradient of its bias is the folded BatchNorm's β's (`bias_gradient`)."""

    name: str  # the conv module's name, e.g. "encoder.3": its gradients are read by it
    conv: nn.Conv2d  # with the BatchNorm before the ReLU folded in, and a bias (0 if none)
    norm: nn.BatchNorm2d  # after the ReLU; the identity (`identity_norm`) when the block has none
    input_shape: tuple[int, int]  # the input map's height and width
    scale: torch.Tensor | None = None  # (C_out,) the folded BatchNorm's gain γ/σ
    # the parameter whose per-step gradient is Σ_p δ(p) at the folded conv's output, and what
    # to divide it by (None: nothing); None: no such parameter
    bias_source: tuple[str, torch.Tensor | None] | None = None
    # a one-to-one activation (LeakyReLU, ELU) in the ReLU's place; None: a ReLU
    activation: InvertibleActivation | None = None
    # the BatchNorm folded in when it normalised the sample by its own statistics (train mode,
    # its buffers holding them): the conv's output gradient then carries their terms
    # (`layers.affine_norm.through_batch_statistics`); None: eval mode, or none folded
    batch_norm: nn.BatchNorm2d | None = None
    # a GroupNorm between the conv and the ReLU: never folded, since its statistics are each
    # step's own, which its block inverse solves for (`layers.group_norm`); None: none
    group_norm: nn.GroupNorm | None = None

    def weight_gradient(self, observed: torch.Tensor) -> torch.Tensor:
        """The folded conv's per-step weight gradient (N, O, C, k, k) from the observed one."""
        if self.scale is None:
            return observed
        scale = self.scale[:, None, None, None]
        return torch.where(scale != 0, observed / torch.where(scale != 0, scale, 1.0), 0.0)

    def batch_normalised(self, output: torch.Tensor) -> torch.Tensor:
        """The normalised input r̂ = (output − β)/γ of the folded train-mode BatchNorm, from its
        output (the folded conv's)."""
        norm = self.batch_norm
        assert norm is not None
        weight = torch.ones(norm.num_features, dtype=torch.float64) if norm.weight is None \
            else norm.weight.detach().double()
        bias = torch.zeros_like(weight) if norm.bias is None else norm.bias.detach().double()
        return (output - bias[:, None, None]) / weight[:, None, None]

    def bias_gradient(self, observed: torch.Tensor) -> torch.Tensor:
        """The folded conv's per-step bias gradient (N, O) from the `bias_source` parameter's."""
        divisor = None if self.bias_source is None else self.bias_source[1]
        if divisor is None:
            return observed
        return torch.where(divisor != 0, observed / torch.where(divisor != 0, divisor, 1.0), 0.0)


def conv_blocks(network: Network) -> list[ConvBlock]:
    """The network's conv stack (its roles) as Conv [→ BatchNorm] → ReLU [→ BatchNorm] blocks in
    order, read by a Linear layer (its `feature_linear`). A block without a BatchNorm after its
    ReLU (NatureCNN, SB3's CnnPolicy, the Conv → BatchNorm → ReLU of most image networks) gets
    the identity there. Anything else is refused here, before any work, naming the first module
    the walk cannot pass and why (its layer inverse's reason)."""
    roles = network.roles()
    name = network.label
    if not roles.conv_stack or roles.feature_linear is None:
        raise ConfigError(f"{name}: recovery through the conv stack needs conv layers "
                          "read by a biased Linear layer applied once per sample; this network "
                          f"has {'no conv stack' if not roles.conv_stack else 'none after it'}")
    for step in roles.conv_stack:  # a functional step is a ReLU the forward code applies
        reason = None if step.kind == "flatten" or step.functional else refusal_of(
            step.kind, network.get_submodule(step.module))
        if reason is not None:
            raise ConfigError(f"{name}: the walk through the conv stack cannot pass "
                              f"{step.module}, {article(step.kind)} {step.kind}: {reason}")
    if not roles.conv_chain:
        raise ConfigError(f"{name}: composing its conv modules in call order does not "
                          f"give what {roles.feature_linear} reads (a residual addition or a "
                          "function between them): the walk cannot pass it")
    steps = [step for step in roles.conv_stack if step.kind not in PASSED_THROUGH]
    kinds = [step.kind for step in steps]
    blocks, i = [], 0
    while i < len(steps):
        conv = steps[i]
        pre = i + 1 < len(steps) and kinds[i + 1] == "batchnorm"
        grouped = i + 1 < len(steps) and kinds[i + 1] == "groupnorm"
        relu = i + 1 + (pre or grouped)
        if conv.kind != "conv" or relu >= len(steps) or kinds[relu] not in ACTIVATIONS:
            what = conv if conv.kind != "conv" else steps[min(relu, len(steps) - 1)]
            raise ConfigError(f"{name}: the walk through the conv stack passes "
                              "Conv [→ BatchNorm | GroupNorm] → ReLU [→ BatchNorm] blocks only; "
                              f"{what.module} is {article(what.kind)} {what.kind}"
                              + (" not followed by a ReLU"
                                 if what.kind in ("conv", "batchnorm", "groupnorm") else ""))
        module = network.get_submodule(conv.module)
        before = network.get_submodule(steps[i + 1].module) if pre else None
        post = relu + 1 < len(steps) and kinds[relu + 1] == "batchnorm"
        norm = network.get_submodule(steps[relu + 1].module) if post \
            else identity_norm(module.out_channels)
        block = folded_block(conv.module, module, before, steps[i + 1].module if pre else None,
                             norm, (conv.input_shape[1], conv.input_shape[2]))
        if grouped:
            block = grouped_block(name, block, module, network.get_submodule(steps[i + 1].module),
                                  steps[i + 1].module, kinds[relu])
        if kinds[relu] != "relu":
            block = replace(block, activation=InvertibleActivation(
                network.get_submodule(steps[relu].module)))
        blocks.append(block)
        i = relu + 1 + post
    return blocks


# what may stand in a block's ReLU's place
ACTIVATIONS = ("relu", *InvertibleActivation.kinds)
# kinds whose input is their output at θ0: the blocks are read without them
PASSED_THROUGH = ("flatten", *Identity.kinds)


def article(kind: str) -> str:
    return "an" if kind[:1] in "aeiou" else "a"


def folded_block(name: str, conv: nn.Conv2d, before: nn.BatchNorm2d | None,
                 before_name: str | None, norm: nn.BatchNorm2d, input_shape: tuple[int, int]
                 ) -> ConvBlock:
    """The block of `conv` with the BatchNorm `before` its ReLU (None: none) folded in."""
    if before is None and conv.bias is not None:
        return ConvBlock(name, conv, norm, input_shape, bias_source=(f"{name}.bias", None))
    weight = conv.weight.detach().double()
    bias = weight.new_zeros(conv.out_channels) if conv.bias is None \
        else conv.bias.detach().double()
    scale, source = None, None if conv.bias is None else (f"{name}.bias", None)
    if before is not None:
        gain, _, mean = norm_affine(before)
        scale = gain.flatten()
        beta = 0.0 if before.bias is None else before.bias.detach().double()
        weight = weight * scale[:, None, None, None]
        bias = scale * (bias - mean.flatten()) + beta
        # ∂L/∂β is Σ_p δ(p) at the folded conv's output; ∂L/∂b is that times the gain in eval
        # mode, and 0 in train mode (the batch mean absorbs b)
        source = (f"{before_name}.bias", None) if before.bias is not None else \
            None if conv.bias is None or before.training else (f"{name}.bias", scale)
    merged = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                       conv.padding, dtype=torch.float64).requires_grad_(False)
    merged.weight.copy_(weight)
    merged.bias.copy_(bias)
    return ConvBlock(name, merged, norm, input_shape, scale, source,
                     batch_norm=before if before is not None and before.training else None)


def grouped_block(network_name: str, block: ConvBlock, conv: nn.Conv2d, norm: nn.GroupNorm,
                  norm_name: str, activation: str) -> ConvBlock:
    """The block with its GroupNorm between the conv and the ReLU, or one ConfigError naming
    why the GroupNorm's block inverse cannot pass it."""
    if activation != "relu":
        raise ConfigError(f"{network_name}: the walk passes a GroupNorm followed by a ReLU; "
                          f"{norm_name} is followed by {article(activation)} {activation}")
    why = unsolvable(conv, norm)  # the module's own bias, not the block's (0 if none)
    if why is not None:
        raise ConfigError(f"{network_name}: the walk cannot pass {norm_name}: {why}")
    return replace(block, group_norm=norm)


def solvable(block: ConvBlock) -> bool:
    """Does the weight gradient pin the input down? D needs at least as many independent rows
    as a channel has pixels. A ReLU switches about half the output units off (their rows
    vanish): there ask for twice as many rows. The frame under the first conv fails this at
    32×32 (1024 rows for 1024 pixels, rank-deficient in practice) and at 64×64. A one-to-one
    activation (`InvertibleActivation`) leaves every row, and every output unit's
    pre-activation is an equation too."""
    out_channels, _, kernel, _ = block.conv.weight.shape
    height, width = block.input_shape
    # GroupNorm puts δ on every unit, off ones included (`layers.group_norm`)
    needed = 1 if block.activation is not None or block.group_norm is not None else 2
    return out_channels * kernel * kernel >= needed * height * width


def deepest_inputs(network: Network) -> list[str]:
    """The conv modules whose input the recursion reaches, from the top down."""
    names = []
    for block in reversed(conv_blocks(network)):
        if not solvable(block):
            break
        names.append(block.name)
    if not names:
        raise ConfigError(f"{network.label}: no conv input is determined by its "
                          "gradient (each conv's weight gradient has fewer equations than its "
                          "input has pixels)")
    return names


def block_forward(block: ConvBlock, inputs: torch.Tensor) -> torch.Tensor:
    """Conv [→ GroupNorm] → ReLU → BN (eval mode) in float64: what the block above received."""
    pre = convolve(block, inputs)
    if block.group_norm is not None:
        norm = block.group_norm
        pre = F.group_norm(pre, norm.num_groups,
                           None if norm.weight is None else norm.weight.detach().double(),
                           None if norm.bias is None else norm.bias.detach().double(), norm.eps)
    relu = F.relu(pre) if block.activation is None else block.activation.forward(pre)
    gain, shift, mean = bn_affine(block)
    return gain * (relu - mean + shift)
