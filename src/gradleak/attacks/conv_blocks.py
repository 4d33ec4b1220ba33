"""The victim's conv stack as the walk meets it: Conv → ReLU [→ BatchNorm] blocks, read by a
Linear layer. Each block is inverted by its layers' inverses (`attacks.layers`: the norm, the
ReLU, the conv) in `attacks.conv_recovery`; a module the walk cannot pass is refused here, with
its layer inverse's reason, before any gradient is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gradleak.attacks.layers import identity_norm, refusal_of
from gradleak.attacks.layers.affine_norm import bn_affine
from gradleak.attacks.layers.conv_equations import convolve
from gradleak.errors import ConfigError
from gradleak.victims.base import Victim


@dataclass(frozen=True)
class ConvBlock:
    name: str  # the conv module's name, e.g. "encoder.3"
    conv: nn.Conv2d
    norm: nn.BatchNorm2d  # the identity (`identity_norm`) when the block has none
    input_size: int  # the square input map's side


def conv_blocks(victim: Victim) -> list[ConvBlock]:
    """The victim's conv stack (its roles) as Conv → ReLU [→ BatchNorm] blocks in order, read
    by a Linear layer (its `feature_linear`). A block without BatchNorm (NatureCNN, SB3's
    CnnPolicy) gets the identity as its affine map. Anything else is refused here, before any
    work, naming the first module the walk cannot pass and why (its layer inverse's reason)."""
    roles = victim.roles()
    name = victim.config.name
    if not roles.conv_stack or roles.feature_linear is None:
        raise ConfigError(f"victim {name}: recovery through the conv stack needs conv layers "
                          "read by a biased Linear layer applied once per sample; this victim "
                          f"has {'no conv stack' if not roles.conv_stack else 'none after it'}")
    steps = [step for step in roles.conv_stack if step.kind != "flatten"]
    for step in steps:
        reason = refusal_of(step.kind, victim.get_submodule(step.module))
        if reason is not None:
            raise ConfigError(f"victim {name}: the walk through the conv stack cannot pass "
                              f"{step.module}, a {step.kind}: {reason}")
    blocks, i = [], 0
    while i < len(steps):
        conv, after = steps[i], [s.kind for s in steps[i + 1:i + 3]]
        if conv.kind != "conv" or after[:1] != ["relu"]:
            what = conv if conv.kind != "conv" else steps[i + 1] if i + 1 < len(steps) else conv
            raise ConfigError(f"victim {name}: the walk through the conv stack passes "
                              "Conv → ReLU [→ BatchNorm] blocks only; "
                              f"{what.module} is a {what.kind}"
                              + (" not followed by a ReLU" if what.kind == "conv" else ""))
        if conv.input_shape[1] != conv.input_shape[2]:
            raise ConfigError(f"victim {name}: {conv.module}: the walk passes convolutions on "
                              f"square maps; it reads {conv.input_shape[1]}×"
                              f"{conv.input_shape[2]}")
        module = victim.get_submodule(conv.module)
        normed = after[1:] == ["batchnorm"]
        norm = victim.get_submodule(steps[i + 2].module) if normed \
            else identity_norm(module.out_channels)
        blocks.append(ConvBlock(conv.module, module, norm, conv.input_shape[1]))
        i += 3 if normed else 2
    if not roles.conv_chain:
        raise ConfigError(f"victim {name}: composing its conv modules in call order does not "
                          f"give what {roles.feature_linear} reads (a residual addition or a "
                          "function between them): the walk cannot pass it")
    return blocks


def solvable(block: ConvBlock) -> bool:
    """Does the weight gradient pin the input down? D needs at least as many independent rows
    as a channel has pixels, and the ReLU switches about half the output units off (their rows
    vanish): ask for twice as many rows. The frame under the first conv fails this at 32×32
    (1024 rows for 1024 pixels, rank-deficient in practice) and at 64×64."""
    out_channels, _, kernel, _ = block.conv.weight.shape
    return out_channels * kernel * kernel >= 2 * block.input_size ** 2



def deepest_inputs(victim: Victim) -> list[str]:
    """The conv modules whose input the recursion reaches, from the top down."""
    names = []
    for block in reversed(conv_blocks(victim)):
        if not solvable(block):
            break
        names.append(block.name)
    if not names:
        raise ConfigError(f"victim {victim.config.name}: no conv input is determined by its "
                          "gradient (each conv's weight gradient has fewer equations than its "
                          "input has pixels)")
    return names


def block_forward(block: ConvBlock, inputs: torch.Tensor) -> torch.Tensor:
    """Conv → ReLU → BN (eval mode) in float64: what the block above received."""
    relu = F.relu(convolve(block, inputs))
    gain, shift, mean = bn_affine(block)
    return gain * (relu - mean + shift)
