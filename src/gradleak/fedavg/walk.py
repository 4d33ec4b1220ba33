"""Method "training-free": one image's single-step update, inverted layer by layer.

A client that ran one SGD step on one image (E = 1, N = B = 1) sends w0 − w_T = η ∇L(x), one
sample's gradient, and the training-free attack's walk (`gradleak.inversion`) inverts it as it
does an RL step's: the Linear layer reading the conv stack gives its input in closed form, each
conv block below gives its input from its own weight gradient, and the first conv's equations
(its outputs, its weight gradient) give the image. A model whose first layer is Linear on the
image gives the image from that layer alone. Every quantity the walk reads is a ratio of
gradients, so η need not be declared; that the update is one sample's single step is checked
on it (its Linear layers' updates are rank one), not assumed.

BatchNorm is inverted in the mode the client trained it in: eval mode is a known affine map; in
train mode the image was normalised by its own statistics, which the running buffers' change
gives (`set_batch_statistics`), and the walk carries the gradient through them. GroupNorm's
statistics, the image's own, are solved with each block (`inversion.layers.group_norm`). What
the walk cannot pass (max-pooling, a residual addition, convolutions whose gradients do not
determine their input) is refused, naming it, before any work: there the optimisation methods
are what the audit has.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.fedavg.forward import batchnorm_layers
from gradleak.fedavg.span import first_linear, pixel_affine
from gradleak.inversion.conv_blocks import ConvBlock, conv_blocks, deepest_inputs
from gradleak.inversion.conv_recovery import (
    BATCH_STATISTICS_ROUNDS,
    SETTLED,
    output_shape,
    recover_conv_inputs,
    top_descent,
)
from gradleak.inversion.first_conv import (
    FIRST_BLOCK_MARGIN,
    FirstConvEquations,
    NoiseModel,
    first_conv_equations,
    with_batch_statistics,
)
from gradleak.inversion.frame_solve import Bounds, FrameSolve, solve_inputs
from gradleak.inversion.layers.affine_norm import AffineNorm
from gradleak.inversion.layers.base import Known, settled
from gradleak.inversion.layers.conv_equations import convolve
from gradleak.inversion.layers.group_norm import GroupNormBlock
from gradleak.inversion.layers.linear import Linear
from gradleak.names import TRAINING_FREE
from gradleak.victims.roles import StackRoles, discover_stack

Transform = Callable[[torch.Tensor], torch.Tensor]

# σ₂/σ₁ of a Linear layer's update above this: more than one sample's gradient is in it (the
# float32 wire leaves one-step updates at η = 0.004 at 2e-7 to 7e-6; two steps on one image
# showed 1e-4 to 1e-2)
RANK_ONE = 1e-4
# the first conv's output equations off by more than this (relative) at the image: the walk
# did not hold (exact steps: ≤ 2e-3; the one BatchNorm step that settled short, 42.66 dB:
# 0.015; a GroupNorm walk that left one unit off, 33 dB: 0.031; two steps on one image that
# passed the rank check: 0.99)
DOUBTFUL = 0.02
# the first conv's equations solved in float64 (the RL default, float32, suits frames rounded
# to 0..255; an update's image is read to its own precision)
SOLVE = FrameSolve(smoothness=1e-4, precision="float64")
OPTIMISERS = (None, "sgd", "momentum")  # a first step that is the gradient, times a scalar


@dataclass(frozen=True)
class Classifier:
    """A client's model as the walk reads it (`inversion.network.Network`), in float64."""

    model: nn.Module
    stack: StackRoles
    label: str

    def roles(self) -> StackRoles:
        return self.stack

    def get_submodule(self, target: str) -> nn.Module:
        return self.model.get_submodule(target)


@dataclass(frozen=True)
class Walk:
    """How the image of an update comes back: from the first Linear layer (`linear`: its
    name) or down the conv stack (`blocks`)."""

    network: Classifier
    affine: tuple[torch.Tensor, torch.Tensor]  # model input = a·x + c per pixel, flattened
    shape: tuple[int, ...]
    batchnorm: str  # the mode the client trained BatchNorm in
    linear: str | None = None
    blocks: tuple[ConvBlock, ...] = ()

    @property
    def top(self) -> str:
        """The Linear layer whose update must be rank one."""
        if self.linear is not None:
            return self.linear
        feature_linear = self.network.stack.feature_linear
        assert feature_linear is not None
        return feature_linear


def plan_walk(model: nn.Module, shape: tuple[int, ...], transform: Transform, samples: int,
              steps: int | None, optimiser: str | None, batchnorm: str) -> Walk:
    """The walk for this client, or one ConfigError naming what stops it, from the model and
    the declared training alone (no update is read)."""
    why = f"method {TRAINING_FREE!r} inverts one image's single-step update"
    if samples != 1:
        raise ConfigError(f"{why}; this client declares {samples} images (the optimisation "
                          "methods, or 'separate' on an MLP, take several)")
    if steps is not None and steps != 1:
        raise ConfigError(f"{why}; this client took {steps} local steps")
    optimiser = optimiser.lower() if isinstance(optimiser, str) else optimiser
    if optimiser not in OPTIMISERS:
        raise ConfigError(f"{why}; the client's optimiser ({optimiser}) rescales each entry of "
                          "the gradient, so its update is no gradient")
    affine = pixel_affine(transform, shape)
    if affine is None:
        raise ConfigError(f"{why} through an input transform that acts per pixel as a·x + c "
                          "(Normalize); the declared one does not")
    double = copy.deepcopy(model).double().eval()
    dropped = [name for name, module in double.named_modules()
               if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0]
    if dropped:
        raise ConfigError(f"{why} of a deterministic network; {dropped[0]} drops units at "
                          "random while a client trains, so its update is one random "
                          "sub-network's gradient (the optimisation methods, which average "
                          "over it, apply)")
    for name, norm in batchnorm_layers(double).items():
        if batchnorm == "train" and norm.momentum is None:
            raise ConfigError(f"{why}: {name} trained in train mode with momentum=None (a "
                              "cumulative average), whose buffers the walk does not read the "
                              "image's statistics from")
    probe = torch.rand(2, *shape, generator=torch.Generator().manual_seed(0),
                       dtype=torch.float64)
    model_input = transform(probe)
    stack = discover_stack(double, lambda: double(model_input), model_input,
                           "the declared input transform")
    network = Classifier(double, stack,
                         f"method {TRAINING_FREE!r} on the client's {type(model).__name__}")
    if not stack.conv_stack:
        layer, reason = first_linear(double, shape, transform)
        if layer is None:
            raise ConfigError(f"{why}: it walks a conv stack or reads a first Linear layer, "
                              f"and {reason}")
        return Walk(network, affine, shape, batchnorm, linear=layer)
    blocks = conv_blocks(network)  # refuses, naming the first module it cannot pass
    if len(blocks) > 1 and blocks[1].name not in deepest_inputs(network):
        raise ConfigError(f"{why}: the gradient determines the inputs of "
                          f"{', '.join(deepest_inputs(network))} only, and the first conv's "
                          f"equations need the input of {blocks[1].name}")
    if blocks[0].group_norm is not None:
        equations, unknowns = first_block_counts(blocks[0])
        if equations < unknowns:
            raise ConfigError(f"{why}: the image under the first block's GroupNorm comes from "
                              "that block's weight gradient and outputs, about "
                              f"{equations} equations (half the units on) for {unknowns} "
                              "unknowns (the pixels and each group's two statistics)")
    return Walk(network, affine, shape, batchnorm, blocks=tuple(blocks))


@dataclass(frozen=True)
class Walked:
    """The image an update gave, and the checks the walk made on the way."""

    image: torch.Tensor  # (1, C, H, W) in [0, 1]
    rank_ratio: float  # σ₂/σ₁ of the top Linear layer's update
    residuals: dict[str, float]  # the first conv's equations at the image (relative)
    seconds: float = 0.0

    def as_result(self, l_sim: float) -> dict[str, Any]:
        """What an optimisation's run reports, for this image: `l_sim`, 1 − cos between the
        update and the gradient at w0 of the client's loss on it, says how well it explains
        the update (≈ 0 where the walk was exact)."""
        return {"images": self.image, "l_sim_raw": l_sim, "position": 0.0,
                "restarts_l_sim": [l_sim], "restart": 0, "history": []}

    def summary(self) -> dict[str, Any]:
        return {"rank_ratio": self.rank_ratio, "residuals": self.residuals,
                "seconds": self.seconds}

    def doubt(self) -> str | None:
        """Why the image is not to be trusted (None: the equations hold at it)."""
        residual = self.residuals.get("outputs", 0.0)
        if residual <= DOUBTFUL:
            return None
        return (f"method {TRAINING_FREE!r}: the first conv's equations miss its image by "
                f"{residual:.2f} (relative; exact steps: ≤ 0.002), so the walk did not hold "
                "and the image is not exact: a unit the walk could not call, or an update "
                "that is not one image's single-step gradient as this model and transform "
                "compute it (more local steps, another BatchNorm mode or input transform?)")


@torch.no_grad()
def walk_update(walk: Walk, w0: Mapping[str, torch.Tensor], wT: Mapping[str, torch.Tensor],
                buffers0: Mapping[str, torch.Tensor] | None = None,
                buffersT: Mapping[str, torch.Tensor] | None = None) -> Walked:
    """The image of the update w0 → w_T (parameters; `buffers0`, `buffersT`: the buffers
    before and after, BatchNorm's running statistics, whose change gives a train-mode step's
    statistics). Raises ConfigError where the update is not one sample's gradient."""
    start = time.perf_counter()
    walk = at_weights(walk, w0, buffers0 or {}, buffersT or {})
    gradients = {name: (w0[name].double() - wT[name].double())[None] for name in w0}

    def gradient_of(name: str) -> torch.Tensor:
        if name not in gradients:
            raise ConfigError(f"method {TRAINING_FREE!r} reads the update of {name}, which the "
                              "state dicts lack")
        return gradients[name]

    ratio = rank_ratio(gradient_of(f"{walk.top}.weight")[0])
    if ratio > RANK_ONE:
        raise ConfigError(f"method {TRAINING_FREE!r}: the update of {walk.top} has rank > 1 "
                          f"(σ₂/σ₁ = {ratio:.2g} > {RANK_ONE:g}): it holds more than one "
                          "image's gradient, or more than one step")
    network, residuals = walk.network, {}
    if walk.linear is not None:
        module = network.get_submodule(walk.linear)
        model_input = Linear(walk.linear, module).invert(None, gradient_of).value
    else:
        model_input, residuals = first_conv_input(walk, gradient_of)
    a, c = (t.double() for t in walk.affine)
    image = ((model_input.flatten(1) - c) / a).reshape(1, *walk.shape)
    return Walked(image.clamp(0, 1).float(), ratio, residuals, time.perf_counter() - start)


def at_weights(walk: Walk, w0: Mapping[str, torch.Tensor], buffers0: Mapping[str, torch.Tensor],
               buffersT: Mapping[str, torch.Tensor]) -> Walk:
    """The walk with the network at the broadcast weights w0 and the client's buffers, each
    train-mode BatchNorm holding the step's statistics of the image (and left in train mode,
    to say so): the blocks fold each BatchNorm with them."""
    model = copy.deepcopy(walk.network.model)
    state = {name: value.double() if value.is_floating_point() else value
             for name, value in {**buffers0, **w0}.items()}
    model.load_state_dict({**model.state_dict(), **state})
    if walk.batchnorm == "train":
        shapes = {step.module: step.input_shape for step in walk.network.stack.conv_stack}
        for name, norm in batchnorm_layers(model).items():
            set_batch_statistics(name, norm, buffers0, buffersT, shapes.get(name))
    network = replace(walk.network, model=model)
    blocks = tuple(conv_blocks(network)) if walk.blocks else ()
    return replace(walk, network=network, blocks=blocks)


def set_batch_statistics(name: str, norm: nn.Module, buffers0: Mapping[str, torch.Tensor],
                         buffersT: Mapping[str, torch.Tensor],
                         shape: tuple[int, ...] | None) -> None:
    """A train-mode step moves the running statistics by r_T = (1 − m) r_0 + m s, with s the
    image's mean over the map and its unbiased variance: s read back, the variance made the
    biased one the step normalised by."""
    keys = [f"{name}.{buffer}" for buffer in ("running_mean", "running_var")]
    missing = [key for key in keys if key not in buffers0 or key not in buffersT]
    if missing:
        raise ConfigError(f"method {TRAINING_FREE!r}: BatchNorm in train mode normalised the "
                          f"image by its own statistics, which the running buffers' change "
                          f"gives; the state dicts lack {', '.join(missing)}")
    momentum = float(norm.momentum)
    mean, var = ((buffersT[key].double() - (1 - momentum) * buffers0[key].double()) / momentum
                 for key in keys)
    # what the buffers' own precision leaves in them, which the walk's on/off margins allow
    mean_error, var_error = (
        torch.finfo(buffersT[key].dtype).eps * (buffersT[key].double().abs()
                                                + (1 - momentum) * buffers0[key].double().abs())
        / momentum for key in keys)
    count = 1 if shape is None or len(shape) < 3 else shape[-1] * shape[-2]
    with torch.no_grad():
        norm.running_mean.copy_(mean)
        norm.running_var.copy_((var * (count - 1) / count).clamp_min(0.0))
    norm.mean_error, norm.var_error = mean_error, var_error  # see affine_norm.statistics_error
    norm.train()


def first_conv_input(walk: Walk, gradient_of: Callable[[str], torch.Tensor]
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """The model's input under the first conv: the walk down to that block's output, then its
    own equations, solved within the box the transform maps [0, 1] to."""
    network, blocks = walk.network, walk.blocks
    first = blocks[0]
    if len(blocks) > 1:
        found = recover_conv_inputs(gradient_of, network, down_to=blocks[1].name)
        below = blocks[1].name
        output, noise, upstream = found.inputs[below], found.noise[below], found.upstream[below]
    else:  # the Linear layer reads the first block's output
        top = top_descent(gradient_of, network, list(blocks))
        output, noise, upstream = top.y, top.noise, top.upstream
    if first.group_norm is not None:
        return grouped_first_input(walk, Known(output, noise, upstream), gradient_of)
    weight_gradient = first.weight_gradient(gradient_of(f"{first.name}.weight"))
    bias = None if first.bias_source is None else first.bias_gradient(
        gradient_of(first.bias_source[0]))
    equations = first_conv_equations(network, output, noise, upstream, weight_gradient,
                                     bias_gradient=bias)
    bounds = input_box(walk)
    low, high = bounds.low, bounds.high
    start = (low + high) / 2
    if equations.colour is not None:
        start = bounds.clip(equations.colour[:, :, None, None].expand_as(start))
    noise = NoiseModel()  # the equations weighed by how exact the walk above left them

    def solve(equations: FirstConvEquations) -> torch.Tensor:
        return bounds.clip(solve_inputs(equations, start, SOLVE, noise.gradient_weight(equations),
                                        noise.smoothness(equations, SOLVE.smoothness), bounds))

    if first.batch_norm is None:
        model_input = solve(equations)
    else:  # train mode: the outputs alone first, then δ₁ at the off-units from each input
        model_input = solve(replace(equations, weight_gradient=None, bias_check=None))
        for _ in range(BATCH_STATISTICS_ROUNDS):
            trained = with_batch_statistics(equations, equations.delta, model_input)
            model_input, previous = solve(trained), model_input
            if settled(previous, model_input, SETTLED):
                break
        equations = trained
    return model_input, {key: float(value[0]) for key, value in
                         equations.residuals(model_input).items()}


def first_block_counts(block: ConvBlock) -> tuple[int, int]:
    """(equations, unknowns) of a first Conv → GroupNorm → ReLU block's joint solve: its
    weight gradient's entries and, a ReLU leaving about half its units on, half its outputs,
    against the pixels and two statistics a group."""
    conv, (height, width) = block.conv, block.input_shape
    channels, out_height, out_width = output_shape(block)
    equations = conv.weight.numel() + channels * out_height * out_width // 2
    assert block.group_norm is not None
    return equations, conv.in_channels * height * width + 2 * block.group_norm.num_groups


def input_box(walk: Walk) -> Bounds:
    """The box the input transform maps the image's [0, 1] to."""
    a, c = (t.double().reshape(1, *walk.shape) for t in walk.affine)
    return Bounds(torch.minimum(c, a + c), torch.maximum(c, a + c))


def grouped_first_input(walk: Walk, at_output: Known, gradient_of: Callable[[str], torch.Tensor]
                        ) -> tuple[torch.Tensor, dict[str, float]]:
    """The model's input under a first Conv → GroupNorm → ReLU block, from that block's own
    equations (`layers.group_norm`: its weight gradient has a row for every pixel, since δ is
    on every unit), its statistics solved with it."""
    first = walk.blocks[0]
    relu_output = AffineNorm(first).invert(at_output)
    fit = GroupNormBlock(first, first.group_norm).fit_by_margin(relu_output, gradient_of,
                                                                FIRST_BLOCK_MARGIN, jointly=True)
    model_input = fit.input.value
    model_input = input_box(walk).clip(model_input)
    outputs = fit.output.value * fit.output.on
    missed = (convolve(first, model_input) * fit.output.on - outputs).flatten(1).norm(dim=1) \
        / outputs.flatten(1).norm(dim=1).clamp_min(1e-300)
    return model_input, {"outputs": float(missed[0]), "weight_gradient": float(fit.residual[0])}


def rank_ratio(weight_update: torch.Tensor) -> float:
    """σ₂/σ₁ of a Linear layer's (out, in) update: ~0 for one sample's single step."""
    values = torch.linalg.svdvals(weight_update.double())
    if len(values) < 2 or not float(values[0]) > 0:
        return 0.0
    return float(values[1] / values[0])

