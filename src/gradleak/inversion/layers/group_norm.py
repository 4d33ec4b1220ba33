"""GroupNorm: a Conv → GroupNorm → ReLU block's input and each step's group statistics.

GroupNorm normalises each sample by its own statistics, per group of channels: o = γ r̂ + β
with r̂ = (y − μ_g)/σ_g over the group's channels and positions (y the conv's output). Given the
block's output a = relu(o) and the gradient reaching it (δ_o at the on-units), r̂ is known at
the on-units; μ_g and σ_g, two unknowns per group and step, are not, and neither is r̂ at the
off-units. The gradient reaching y is (1/σ_g) · γ · δ_fold with

    δ_fold = δ_o − (mean_g(γ δ_o) + r̂ · mean_g(γ δ_o r̂)) / γ

(means over the group; the second only over the on-units, where δ_o lives), which involves no
statistic but r̂ at the off-units. So the conv's weight-gradient equations, for an output
channel c of group g and every input channel i, read σ_g · ∇W[c, i] / γ_c = D(δ_fold) x_i:
linear and homogeneous in the input x and the σ_g. Eliminating x (one least squares on the
shared matrix D per group, `layers.conv_equations`) leaves a G×G quadratic form in σ whose null
vector gives the σ_g up to one scale; the conv's outputs at the on-units, y = μ_g + σ_g r̂,
give that scale and the μ_g by a least squares in G + 1 unknowns. The off-units' r̂ is a fixed
point: the conv's own output there, from each round's input and statistics. Its first rounds
are projected onto what GroupNorm makes exact (each group's r̂ has mean 0 and mean square
1 − ε/σ²), which keeps them in the right basin; the plain fixed point finishes the solve.

The walk through a conv stack (`inversion.conv_recovery`) hands the conv's output (y at the
on-units) and the gradient reaching it on to the conv's inverse, which gives the input with its
noise estimate. Under a network's first block the weight gradient alone leaves the image
short of equations; there the image, the σ_g and the μ_g are one least squares with the
on-units' outputs (`fit(jointly=True)`: the FedAvg walk's; the RL frame solve does not read
per-step statistics yet).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.inversion.layers.base import (
    GradientOf,
    Known,
    LayerInverse,
    register_layer_inverse,
    settled,
)
from gradleak.inversion.layers.conv_equations import (
    ConvLayer,
    TapOperator,
    as_map,
    convolve,
    covered_pixels,
    solve_least_squares,
)

# the fixed point on the off-units' r̂: at most this many rounds, until a round moves the
# input by less than SETTLED (relative); projected while a round still moves r̂ by more than
# PROJECTED_UNTIL (measured: benchmarks/results/group_norm_block.md)
ROUNDS = 200
SETTLED = 1e-12
PROJECTED_UNTIL = 1e-3


@dataclass(frozen=True)
class GroupNormFit:
    """What the block inverse found: the conv's input (with the gradient reaching it), what is
    known at the conv's output (y = μ_g + σ_g r̂ at the on-units, the gradient reaching it), each
    step's group statistics (NaN for a group with no unit on: nothing reads them), how many
    rounds the fixed point took, whether it settled within `ROUNDS`, and the weight-gradient
    equations' relative residual."""

    input: Known
    output: Known
    mean: torch.Tensor  # (N, G)
    sd: torch.Tensor  # (N, G)
    rounds: int
    settled: bool  # the fixed point stopped moving within ROUNDS
    residual: torch.Tensor  # (N,)


@register_layer_inverse("group norm")
class GroupNormBlock(LayerInverse):
    """The Conv → GroupNorm → ReLU block of `layer` (its conv) and `norm`, one sample a step."""

    kinds = ("groupnorm",)
    module_types = (nn.GroupNorm,)

    def __init__(self, layer: ConvLayer, norm: nn.GroupNorm,
                 projected_until: float | None = PROJECTED_UNTIL) -> None:
        why = unsolvable(layer.conv, norm)
        if why is not None:
            raise ConfigError(f"{layer.name}: {why}")
        self.layer, self.norm, self.projected_until = layer, norm, projected_until

    def invert(self, at_output: Known, gradient_of: GradientOf) -> Known:
        """What is known at the GroupNorm's input (the conv's output), from the ReLU's output
        and the conv's weight gradient."""
        return self.fit(at_output, gradient_of).output

    @torch.no_grad()
    def fit(self, at_output: Known, gradient_of: GradientOf, jointly: bool = False
            ) -> GroupNormFit:
        """`at_output`: the block's output a = relu(o) and the gradient reaching it, for N
        steps; units are on where a > 0 (or where `at_output.on` says). `jointly`: solve the
        input, the σ_g and the μ_g from the weight gradient and the on-units' outputs at once
        (`joint_solve`: a network's input under its first block, which the weight gradient
        alone leaves short of equations); otherwise the input is eliminated first
        (`eliminated_solve`: a block the weight gradient determines)."""
        layer, norm = self.layer, self.norm
        a = at_output.value.double()
        on = at_output.on if at_output.on is not None else a > 0
        channels, groups = norm.num_channels, norm.num_groups
        gamma, beta = (torch.ones(channels, dtype=torch.float64) if norm.weight is None
                       else norm.weight.detach().double(),
                       torch.zeros(channels, dtype=torch.float64) if norm.bias is None
                       else norm.bias.detach().double())
        gamma, beta = gamma[:, None, None], beta[:, None, None]
        grouping = Grouping(groups, channels)
        known = torch.where(on, (a - beta) / gamma, 0.0)  # r̂ at the on-units
        delta = at_output.gradient.double() * on
        first = grouping.mean(gamma * delta)
        second = grouping.mean(gamma * delta * known)
        boundary = (-beta / gamma).expand_as(a)  # r̂ where o = 0
        live = grouping.total(on.double()) > 0  # (N, G) groups with a unit on
        off = grouping.total((~on).double())
        start = grouping.spread(-grouping.total(known) / off.clamp_min(1))
        rhat = torch.where(on, known, torch.minimum(start, boundary))
        weight_gradient = gradient_of(f"{layer.name}.weight").double()
        rhs = group_rhs(weight_gradient, gamma, grouping)
        previous, project, done = None, self.projected_until is not None, False
        solve: Callable[..., Solve] = eliminated_solve
        if jointly:  # the outputs' equations are the same every round
            solve = partial(joint_solve, outputs=[output_equations(layer, known[step], on[step],
                                                                   grouping)
                                                  for step in range(len(a))])
        for rounds in range(1, ROUNDS + 1):
            folded = delta - (first + rhat * second) / gamma
            x, sd, mean, residual = solve(layer, folded, rhs, known, on, live, grouping)
            output = (convolve(layer, x) - grouping.spread(mean)) / grouping.spread(sd)
            update = torch.where(on, known, torch.minimum(output, boundary))
            if project:
                update = torch.where(on, known, torch.minimum(
                    grouping.standardised(update, on, known, norm.eps, sd), boundary))
            moved = ((update - rhat).flatten(1).norm(dim=1)
                     / rhat.flatten(1).norm(dim=1).clamp_min(1e-300))
            project = project and bool((moved > (self.projected_until or 0.0)).any())
            rhat = update
            if previous is not None and settled(previous, x, SETTLED):
                done = True
                break
            previous = x
        delta_y = folded * gamma / grouping.spread(sd)
        conv = layer.conv
        upstream = torch.nn.grad.conv2d_input(x.shape, conv.weight.detach().double(), delta_y,
                                              stride=conv.stride, padding=conv.padding)
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        spread = grouping.spread(sd)
        output = Known(torch.where(on, grouping.spread(mean) + spread * known, 0.0),
                       at_output.noise.double() * spread / gamma.abs(), delta_y,
                       on=on)
        return GroupNormFit(Known(x, torch.zeros_like(x), upstream), output,
                            torch.where(live, mean, nan), torch.where(live, sd, nan), rounds, done,
                            residual)


Solve = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def eliminated_solve(layer: ConvLayer, folded: torch.Tensor, rhs: torch.Tensor,
                     known: torch.Tensor, on: torch.Tensor, live: torch.Tensor,
                     grouping: Grouping) -> Solve:
    """The input (N, C_in, H, W), the σ_g and μ_g (N, G) and the weight-gradient equations'
    relative residual (N,) for one δ_fold: the input eliminated per group, the σ_g up to scale
    from the null vector, the scale and μ_g from the on-units' outputs."""
    operator = TapOperator.of(layer, folded)
    per_group = solve_least_squares(operator, rhs)  # (N, Q', G·C_in)
    residual = rhs - operator.apply(per_group)
    scales = null_vectors(residual, grouping.groups, live)  # (N, G)
    columns = (per_group.unflatten(2, (grouping.groups, -1)) * scales[:, None, :, None]).sum(2)
    unscaled = full_map(layer, columns)
    scale, mean = output_fit(convolve(layer, unscaled, bias=False), layer.conv.bias, known, on,
                             scales, grouping)
    missed = (residual.unflatten(2, (grouping.groups, -1)) * scales[:, None, :, None]).sum(2)
    target = (rhs.unflatten(2, (grouping.groups, -1)) * scales[:, None, :, None]).sum(2)
    return (scale[:, None, None, None] * unscaled, scale[:, None] * scales, mean,
            missed.flatten(1).norm(dim=1) / target.flatten(1).norm(dim=1).clamp_min(1e-300))


def joint_solve(layer: ConvLayer, folded: torch.Tensor, rhs: torch.Tensor, known: torch.Tensor,
                on: torch.Tensor, live: torch.Tensor, grouping: Grouping,
                outputs: list[tuple[torch.Tensor, torch.Tensor]]) -> Solve:
    """As `eliminated_solve`, by one least squares per step in (input, σ, μ): D(δ_fold) x_i =
    Σ_g σ_g ∇W_g[:, i]/γ for every input channel i, and conv(x) − σ_g r̂ − μ_g = −b at the
    on-units, each set of rows scaled to unit weight; by the normal equations, the outputs'
    part (`output_equations`, per step) given."""
    conv, groups = layer.conv, grouping.groups
    count, in_channels = len(folded), conv.in_channels
    operator = TapOperator.of(layer, folded)
    gram = operator.gram()  # (N, Q', Q') DᵀD
    pixels = gram.shape[-1]
    size = in_channels * pixels
    x = folded.new_zeros(count, in_channels, *layer.input_shape)
    sd, mean = folded.new_ones(count, groups), folded.new_zeros(count, groups)
    residual = folded.new_zeros(count)
    crossed = operator.adjoint(rhs)  # (N, Q', G·C_in): Dᵀ ∇W_g[:, i]/γ
    for step in range(count):
        targets = rhs[step].unflatten(1, (groups, in_channels))  # (R, G, C_in)
        weight = 1 / targets.norm().clamp_min(1e-300) ** 2
        normal = folded.new_zeros(size + 2 * groups, size + 2 * groups)
        for i in range(in_channels):
            block = slice(i * pixels, (i + 1) * pixels)
            normal[block, block] = weight * gram[step]
            normal[block, size:size + groups] = -weight * crossed[step].unflatten(
                1, (groups, in_channels))[:, :, i]
        normal[size:size + groups, size:size + groups] = weight * torch.einsum(
            "rgc,rhc->gh", targets, targets)
        normal[size:, :size] = normal[:size, size:].T
        outputs_normal, outputs_rhs = outputs[step]
        normal += outputs_normal
        used = torch.cat([torch.ones(size, dtype=torch.bool), live[step], live[step]])
        matrix = normal[used][:, used]
        factor, info = torch.linalg.cholesky_ex(matrix)
        if int(info) == 0:
            solution = torch.cholesky_solve(outputs_rhs[used][:, None], factor)[:, 0]
        else:  # singular: the minimum-norm solution
            solution = torch.linalg.lstsq(matrix, outputs_rhs[used][:, None],
                                          driver="gelsd").solution[:, 0]
        full = torch.zeros(len(used), dtype=torch.float64)
        full[used] = solution
        columns = full[:size].view(in_channels, pixels).T
        x[step] = full_map(layer, columns[None])[0]
        sd[step, live[step]] = full[size:size + groups][live[step]]
        mean[step, live[step]] = full[size + groups:][live[step]]
        fitted = operator.take(step).apply(columns[None])[0]  # (R, C_in)
        wanted = (targets * full[size:size + groups][None, :, None]).sum(1)
        residual[step] = (fitted - wanted).norm() / wanted.norm().clamp_min(1e-300)
    return x, sd, mean, residual


def output_equations(layer: ConvLayer, known: torch.Tensor, on: torch.Tensor,
                     grouping: Grouping) -> tuple[torch.Tensor, torch.Tensor]:
    """The normal equations (AᵀA, Aᵀb) of one step's on-unit outputs, conv(x) − σ_g r̂ − μ_g =
    −b, rows scaled by 1/√(units on), over (input laid out (channel, pixel), σ, μ)."""
    conv, groups = layer.conv, grouping.groups
    pixels = int(covered_pixels(layer).sum())
    size = conv.in_channels * pixels
    basis = torch.eye(size, dtype=torch.float64).view(size, conv.in_channels, pixels)
    forward = convolve(layer, full_map(layer, basis.transpose(1, 2)), bias=False)
    units = on.flatten()
    membership = torch.eye(groups, dtype=torch.float64).repeat_interleave(
        grouping.channels // groups, 0)[:, None, :].expand(-1, on[0].numel(), -1)
    membership = membership.reshape(-1, groups)[units]
    rows = torch.cat([forward.flatten(1).T[units], -known.flatten()[units, None] * membership,
                      -membership], 1)
    bias = torch.zeros(conv.out_channels, dtype=torch.float64) if conv.bias is None \
        else conv.bias.detach().double()
    target = -bias[:, None].expand(-1, on[0].numel()).flatten()[units]
    scale = 1 / max(int(units.sum()), 1)
    return scale * rows.T @ rows, scale * rows.T @ target


def unsolvable(conv: nn.Conv2d, norm: nn.GroupNorm) -> str | None:
    """Why the block inverse cannot solve this Conv → GroupNorm block (None: it can)."""
    weight = None if norm.weight is None else norm.weight.detach()
    if weight is not None and bool((weight == 0).any()):
        return (f"its GroupNorm has γ = 0 on channels "
                f"{(weight == 0).nonzero().flatten().tolist()[:5]}, whose output then says "
                "nothing of the conv's")
    return undetermined_scale(conv, norm)


def undetermined_scale(conv: nn.Conv2d, norm: nn.GroupNorm) -> str | None:
    """Why the block's equations leave its input's scale open (None: they do not). For an
    input t·x the statistics become t·σ_g and t·μ_g − (t − 1)·b, and the output and the weight
    gradient stay as they were, unless the conv's bias differs within a group (ε aside)."""
    per_group = norm.num_channels // norm.num_groups
    if conv.bias is None:
        return ("a conv without a bias under GroupNorm: its input's scale is normalised away "
                "(t·x gives the same output and weight gradient), so the block alone does not "
                "determine it")
    bias = conv.bias.detach().double().view(norm.num_groups, per_group)
    if bool((bias == bias[:, :1]).all()):
        return ("its conv's bias is the same on every channel of each GroupNorm group (one "
                "channel a group: InstanceNorm), so the input's scale is normalised away and "
                "the block alone does not determine it")
    return None


def group_rhs(weight_gradient: torch.Tensor, gamma: torch.Tensor, grouping: Grouping
               ) -> torch.Tensor:
    """(N, C_out·k², G·C_in): for each group g, ∇W/γ on that group's output channels (0 on the
    others), laid out as the rows of D(δ) (output channel, tap) against the input channels."""
    count, _, in_channels = weight_gradient.shape[:3]
    scaled = weight_gradient / gamma.flatten()[None, :, None, None, None]
    parts = [(scaled * grouping.of_channel(g)[None, :, None, None, None])
             .flatten(3).permute(0, 1, 3, 2).reshape(count, -1, in_channels)
             for g in range(grouping.groups)]
    return torch.cat(parts, -1)


@dataclass(frozen=True)
class Grouping:
    """GroupNorm's channel groups on (N, C, h, w) maps."""

    groups: int
    channels: int

    def of_channel(self, group: int) -> torch.Tensor:
        """(C,) 1 on the group's channels."""
        index = torch.arange(self.channels) // (self.channels // self.groups)
        return (index == group).double()

    def total(self, values: torch.Tensor) -> torch.Tensor:
        """(N, G) sums over each group."""
        return values.reshape(len(values), self.groups, -1).sum(2)

    def spread(self, per_group: torch.Tensor) -> torch.Tensor:
        """(N, C, 1, 1): each channel its group's value."""
        return per_group.repeat_interleave(self.channels // self.groups, 1)[:, :, None, None]

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """(N, C, 1, 1): each channel its group's mean over channels and positions."""
        return self.spread(values.reshape(len(values), self.groups, -1).mean(2))

    def standardised(self, rhat: torch.Tensor, on: torch.Tensor, known: torch.Tensor,
                     eps: float, sd: torch.Tensor) -> torch.Tensor:
        """r̂ with its off-units moved (shifted, scaled about their mean) so that each group
        has mean 0 and mean square 1 − ε/σ², as GroupNorm's own r̂ has."""
        count = rhat.shape[1] // self.groups * rhat[0, 0].numel()
        off = (~on).double()
        off_count = self.total(off).clamp_min(1)
        centre = -self.total(known) / off_count
        values = torch.where(on, 0.0, rhat)
        deviation = torch.where(on, 0.0, values - self.spread(self.total(values) / off_count))
        wanted = (count * (1 - eps / sd.pow(2)) - self.total(known.pow(2))
                  - off_count * centre.pow(2)).clamp_min(0.0)
        stretch = (wanted / self.total(deviation.pow(2)).clamp_min(1e-300)).sqrt()
        return self.spread(centre) + self.spread(stretch) * deviation


def null_vectors(residual: torch.Tensor, groups: int, live: torch.Tensor) -> torch.Tensor:
    """(N, G) per step the σ_g up to one scale: the null vector of the quadratic form
    Σ_g,h σ_g σ_h ⟨residual_g, residual_h⟩ over the groups with a unit on (positive, norm 1; 1
    on the others, which nothing reads)."""
    parts = residual.unflatten(2, (groups, -1))  # (N, R, G, C_in)
    form = torch.einsum("nrgc,nrhc->ngh", parts, parts)
    scales = torch.ones(len(residual), groups, dtype=torch.float64)
    for step in range(len(residual)):
        active = live[step].nonzero().flatten()
        if not len(active):
            continue
        _, vectors = torch.linalg.eigh(form[step][active][:, active])
        vector = vectors[:, 0]
        scales[step, active] = vector * torch.sign(vector.sum())
    return scales


def full_map(layer: ConvLayer, columns: torch.Tensor) -> torch.Tensor:
    """(N, C_in, H, W) from (N, Q', C_in) columns over the pixels the conv reads (0 elsewhere)."""
    covered = covered_pixels(layer)
    full = columns.new_zeros(len(columns), len(covered), columns.shape[-1])
    full[:, covered] = columns
    return as_map(layer, full)


def output_fit(unscaled: torch.Tensor, bias: torch.Tensor | None, known: torch.Tensor,
               on: torch.Tensor, scales: torch.Tensor, grouping: Grouping
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) t and (N, G) μ from the conv's outputs at the on-units, t·u + b = μ_g + t·s_g·r̂,
    where u is the conv (no bias) of the unscaled input and s the σ_g up to scale."""
    count, groups = len(unscaled), grouping.groups
    b = torch.zeros(unscaled.shape[1], dtype=torch.float64) if bias is None \
        else bias.detach().double()
    coefficient = unscaled - grouping.spread(scales) * known  # of t
    membership = torch.eye(groups, dtype=torch.float64).repeat_interleave(
        grouping.channels // groups, 0)  # (C, G)
    scale, mean = torch.empty(count, dtype=torch.float64), torch.zeros(count, groups,
                                                                      dtype=torch.float64)
    for step in range(count):
        units = on[step]
        rows = torch.cat([coefficient[step][units][:, None],
                          -membership[:, None, None, :].expand(*units.shape, groups)[units]], 1)
        target = -b[:, None, None].expand_as(units)[units]
        used = torch.cat([torch.ones(1, dtype=torch.bool), rows[:, 1:].abs().sum(0) > 0])
        solution = torch.linalg.lstsq(rows[:, used], target[:, None], driver="gelsd").solution
        scale[step] = solution[0, 0]
        mean[step, used[1:]] = solution[1:, 0]
    return scale, mean
