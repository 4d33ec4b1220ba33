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
give that scale and the μ_g by a least squares in G + 1 unknowns. That solve takes r̂ at
the off-units as given (a start: each group's mean made 0), so it is only a start: the block's
equations in the input alone (`BlockEquations`: the outputs and the weight gradient, each
step's statistics computed from the input as GroupNorm computes them) are then solved by
Gauss-Newton (`layers.gauss_newton`). Those equations leave no weak direction for the input's
scale (an input shrunk towards 0 leaves the weight gradient unexplained), which is where a
fixed point on r̂ alone could settle.

The walk through a conv stack (`inversion.conv_recovery`) hands the conv's output (y at the
on-units) and the gradient reaching it on to the conv's inverse, which gives the input with its
noise estimate. Under a network's first block the weight gradient alone leaves the image
short of equations; there the image, the σ_g and the μ_g are one least squares with the
on-units' outputs (`fit(jointly=True)`: the FedAvg walk's; the RL frame solve does not read
per-step statistics yet).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from gradleak.errors import ConfigError
from gradleak.inversion.layers.base import (
    GradientOf,
    Known,
    LayerInverse,
    register_layer_inverse,
)
from gradleak.inversion.layers.conv_equations import (
    ConvLayer,
    TapOperator,
    as_map,
    convolve,
    covered_pixels,
    solve_least_squares,
)
from gradleak.inversion.layers.gauss_newton import deviations, gauss_newton, per_step
from gradleak.inversion.layers.relu import margin_states

# the units the weight gradient misses are kept on where they leave at most this fraction of
# the block's residual; at most SELECTIONS rounds of them (each a solve)
KEPT = 0.5
SELECTIONS = 4
# a unit on by less than this many times the margin is doubtful: the weight gradient may take
# it off (an estimate's noise can pass the margin: one at 1.0003 times it, off in truth, left
# a user's 24 → 48-channel CNN's image 0.04 off)
DOUBT = 4.0


@dataclass(frozen=True)
class GroupNormFit:
    """What the block inverse found: the conv's input (with the gradient reaching it), what is
    known at the conv's output (y = μ_g + σ_g r̂ at the on-units, the gradient reaching it), each
    step's group statistics (NaN for a group with no unit on: nothing reads them), how many
    Gauss-Newton steps each step's solve took, and the weight gradient's relative miss at the
    input found (the gradient's own precision where the solve holds)."""

    input: Known
    output: Known
    mean: torch.Tensor  # (N, G)
    sd: torch.Tensor  # (N, G)
    newton: torch.Tensor  # (N,) Gauss-Newton steps taken
    residual: torch.Tensor  # (N,)


@register_layer_inverse("group norm")
class GroupNormBlock(LayerInverse):
    """The Conv → GroupNorm → ReLU block of `layer` (its conv) and `norm`, one sample a step."""

    kinds = ("groupnorm",)
    module_types = (nn.GroupNorm,)

    def __init__(self, layer: ConvLayer, norm: nn.GroupNorm) -> None:
        why = unsolvable(layer.conv, norm)
        if why is not None:
            raise ConfigError(f"{layer.name}: {why}")
        self.layer, self.norm = layer, norm

    def invert(self, at_output: Known, gradient_of: GradientOf) -> Known:
        """What is known at the GroupNorm's input (the conv's output), from the ReLU's output
        and the conv's weight gradient."""
        return self.fit(at_output, gradient_of).output

    def fit_by_margin(self, at_output: Known, gradient_of: GradientOf, threshold: float,
                      jointly: bool = False) -> GroupNormFit:
        """`fit` with the units on beyond `threshold` noise deviations of 0 (and the rounding
        bound), those within it undecided, those on by less than DOUBT times it doubtful."""
        on, undecided = margin_states(at_output, threshold)
        doubtful = on & ~margin_states(at_output, DOUBT * threshold)[0]
        return self.fit(replace(at_output, on=on), gradient_of, jointly, undecided, doubtful)

    @torch.no_grad()
    def fit(self, at_output: Known, gradient_of: GradientOf, jointly: bool = False,
            undecided: torch.Tensor | None = None, doubtful: torch.Tensor | None = None
            ) -> GroupNormFit:
        """`at_output`: the block's output a = relu(o) and the gradient reaching it, for N
        steps; units are on where a > 0 (or where `at_output.on` says); `undecided`: the units
        too close to 0 to call, those the weight gradient misses added; `doubtful`: units on
        by a small margin, those whose δ the weight gradient has no room for taken off
        (`with_units_flipped`).
        `jointly`: start from one least squares in the input, the σ_g and the μ_g with the
        on-units' outputs (`joint_solve`: a network's input under its first block, which the
        weight gradient alone leaves short of equations); otherwise the input is eliminated
        first (`eliminated_solve`: a block the weight gradient determines)."""
        layer, norm = self.layer, self.norm
        a = at_output.value.double()
        on = at_output.on if at_output.on is not None else a > 0
        gamma, beta = affine(norm)
        grouping = Grouping(norm.num_groups, norm.num_channels)
        reaching = at_output.gradient.double()
        known, delta, first, second = folding(a, reaching, on, gamma, beta, grouping)
        boundary = (-beta / gamma).expand_as(a)  # r̂ where o = 0
        live = grouping.total(on.double()) > 0  # (N, G) groups with a unit on
        off = grouping.total((~on).double())
        start = grouping.spread(-grouping.total(known) / off.clamp_min(1))
        rhat = torch.where(on, known, torch.minimum(start, boundary))
        weight_gradient = gradient_of(f"{layer.name}.weight").double()
        rhs = group_rhs(weight_gradient, gamma, grouping)
        folded = delta - (first + rhat * second) / gamma
        if jointly:
            outputs = [output_equations(layer, known[step], on[step], grouping)
                       for step in range(len(a))]
            x = joint_solve(layer, folded, rhs, known, on, live, grouping, outputs)
        else:
            x = eliminated_solve(layer, folded, rhs, known, on, live, grouping)
        equations = BlockEquations(layer, norm, a, on, reaching, weight_gradient)
        x, newton = gauss_newton(equations.residual, x)
        nothing = torch.zeros_like(on)
        adding = nothing if undecided is None else undecided
        removing = nothing if doubtful is None else doubtful
        for _ in range(SELECTIONS if bool(adding.any() or removing.any()) else 0):
            # units the margin could not call: the weight gradient says which it has no room
            # for (on but off in truth), then which it misses (off but on in truth); each
            # direction tried on its own, so a wrong pick in one does not cost the other
            changed = False
            for sign in (-1, 1):
                candidates = removing & on if sign < 0 else adding & ~on & (a > 0)
                x, flipped, more = equations.with_units_flipped(x, candidates, sign)
                if not torch.equal(flipped, on):
                    on, newton, changed = flipped, newton + more, True
                    equations = BlockEquations(layer, norm, a, on, reaching, weight_gradient)
            if not changed:
                break
        known, delta, first, second = folding(a, reaching, on, gamma, beta, grouping)
        live = grouping.total(on.double()) > 0
        y = convolve(layer, x)
        mean, sd = grouping.statistics(y, norm.eps)
        rhat = torch.where(on, known, (y - grouping.spread(mean)) / grouping.spread(sd))
        folded = delta - (first + rhat * second) / gamma
        residual = equations.weight_gradient_residual(x)
        delta_y = folded * gamma / grouping.spread(sd)
        conv = layer.conv
        upstream = torch.nn.grad.conv2d_input(x.shape, conv.weight.detach().double(), delta_y,
                                              stride=conv.stride, padding=conv.padding)
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        spread = grouping.spread(sd)
        output = Known(torch.where(on, grouping.spread(mean) + spread * known, 0.0),
                       at_output.noise.double() * spread / gamma.abs(), delta_y,
                       on=on)
        # no null space was completed: the block's equations determine the input
        found = Known(x, deviations(equations.residual, x), upstream,
                      completed=torch.zeros(len(x), dtype=torch.bool))
        return GroupNormFit(found, output,
                            torch.where(live, mean, nan), torch.where(live, sd, nan), newton,
                            residual)


def affine(norm: nn.GroupNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """GroupNorm's γ and β as (C, 1, 1) float64 (1 and 0 without the affine map)."""
    channels = norm.num_channels
    gamma = torch.ones(channels, dtype=torch.float64) if norm.weight is None \
        else norm.weight.detach().double()
    beta = torch.zeros(channels, dtype=torch.float64) if norm.bias is None \
        else norm.bias.detach().double()
    return gamma[:, None, None], beta[:, None, None]


def folding(a: torch.Tensor, reaching: torch.Tensor, on: torch.Tensor, gamma: torch.Tensor,
            beta: torch.Tensor, grouping: Grouping
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What δ_fold reads given which units are on: r̂ there (0 elsewhere), δ_o, and the group
    means mean_g(γ δ_o) and mean_g(γ δ_o r̂)."""
    known = torch.where(on, (a - beta) / gamma, 0.0)
    delta = reaching * on
    return known, delta, grouping.mean(gamma * delta), grouping.mean(gamma * delta * known)


def eliminated_solve(layer: ConvLayer, folded: torch.Tensor, rhs: torch.Tensor,
                     known: torch.Tensor, on: torch.Tensor, live: torch.Tensor,
                     grouping: Grouping) -> torch.Tensor:
    """The input (N, C_in, H, W) for one δ_fold: the input eliminated per group, the σ_g up
    to scale from the null vector, the scale (and the μ_g) from the on-units' outputs."""
    operator = TapOperator.of(layer, folded)
    per_group = solve_least_squares(operator, rhs)  # (N, Q', G·C_in)
    residual = rhs - operator.apply(per_group)
    scales = null_vectors(residual, grouping.groups, live)  # (N, G)
    columns = (per_group.unflatten(2, (grouping.groups, -1)) * scales[:, None, :, None]).sum(2)
    unscaled = full_map(layer, columns)
    scale = output_fit(convolve(layer, unscaled, bias=False), layer.conv.bias, known, on, scales,
                       grouping)
    return scale[:, None, None, None] * unscaled


def joint_solve(layer: ConvLayer, folded: torch.Tensor, rhs: torch.Tensor, known: torch.Tensor,
                on: torch.Tensor, live: torch.Tensor, grouping: Grouping,
                outputs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
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
    return x


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


class BlockEquations:
    """The block's equations in its input x alone, each step's statistics computed from x as
    GroupNorm computes them: the block's output (o = a at the units on, relu(o) = a at the
    others), and the conv's weight gradient Σ_p δ_y(p) patch_p(x)ᵀ with δ_y the gradient
    GroupNorm sends back from δ_o (the gradient reaching a, at the units on). Each part is
    relative to its observed size. Smooth in x but for the ReLU's kinks, so `gauss_newton`
    solves them from the first solve's input, and they leave no weak direction for the scale
    (an input shrunk towards 0 leaves the weight gradient unexplained)."""

    def __init__(self, layer: ConvLayer, norm: nn.GroupNorm, a: torch.Tensor, on: torch.Tensor,
                 reaching: torch.Tensor, weight_gradient: torch.Tensor) -> None:
        self.layer, self.norm, self.a, self.on, self.reaching = layer, norm, a, on, reaching
        self.weight_gradient = weight_gradient
        self.output_size = a.flatten(1).norm(dim=1).clamp_min(1e-300)[:, None]
        self.gradient_size = weight_gradient.flatten(1).norm(dim=1).clamp_min(1e-300)[:, None]
        self.gamma, self.beta = affine(norm)

    def normalised(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, G, units) r̂ and (N, G, 1) σ_g at input x."""
        y = convolve(self.layer, x)
        grouped = y.reshape(len(y), self.norm.num_groups, -1)
        sd = (grouped.var(2, unbiased=False, keepdim=True) + self.norm.eps).sqrt()
        return (grouped - grouped.mean(2, keepdim=True)) / sd, sd

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C_in·k², positions) the conv's patches of x."""
        conv = self.layer.conv
        return F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output o (before the ReLU) and the conv's weight gradient, per step."""
        rhat, sd = self.normalised(x)
        shape = self.a.shape
        o = self.gamma * rhat.reshape(shape) + self.beta
        delta = (self.gamma * self.reaching * self.on).reshape_as(rhat)
        delta_y = (delta - delta.mean(2, keepdim=True)
                   - rhat * (delta * rhat).mean(2, keepdim=True)) / sd
        weight_gradient = torch.einsum("nol,nkl->nok", delta_y.reshape(*shape[:2], -1),
                                       self.patches(x))
        return o, weight_gradient.reshape(self.weight_gradient.shape)

    def with_units_flipped(self, x: torch.Tensor, candidates: torch.Tensor, sign: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x solved again with the `candidates` the weight gradient at x asks to flip flipped
        (`flipped_units`: `sign` 1 turns units on, −1 off), kept for the steps where that
        leaves at most KEPT of the residual: the input, the units on, the Gauss-Newton steps
        taken."""
        chosen = self.flipped_units(x, candidates, sign)
        steps = torch.zeros(len(x), dtype=torch.int64)
        if not bool(chosen.any()):
            return x, self.on, steps
        flipped = self.on | chosen if sign > 0 else self.on & ~chosen
        wider = BlockEquations(self.layer, self.norm, self.a, flipped, self.reaching,
                               self.weight_gradient)
        found, steps = gauss_newton(wider.residual, x)
        kept = (wider.residual(found).flatten(1).norm(dim=1)
                <= KEPT * self.residual(x).flatten(1).norm(dim=1))
        return (torch.where(per_step(kept, x), found, x),
                torch.where(per_step(kept, flipped), flipped, self.on), steps)

    def flipped_units(self, x: torch.Tensor, candidates: torch.Tensor, sign: int
                      ) -> torch.Tensor:
        """Of the `candidates`, those whose δ_o the weight gradient's miss at x asks to add
        (`sign` 1, units off here) or to take away (−1, units on here): one at a time, the
        unit whose contribution lowers the miss most, while one does. A unit u = (c, p)
        contributes, δ_o there sent back through GroupNorm, α_u (patch_p on row c − Σ
        patches/n on each row of its group − r̂_u Σ_q r̂_c'q patch_q/n on each row c' of it),
        α_u = γ_c δ_o(u)/σ_g, n the group's units."""
        chosen = torch.zeros(candidates.shape, dtype=torch.bool)
        if not bool(candidates.any()):
            return chosen
        rhat, sd = self.normalised(x)
        all_patches = self.patches(x)  # (N, K, L)
        _, weight_gradients = self.forward(x)
        channels = self.a.shape[1]
        per_group = channels // self.norm.num_groups
        n = rhat.shape[2]
        member = torch.arange(channels) // per_group
        same = (member[:, None] == member[None, :]).double()  # (C, C) same group
        for step in range(len(x)):
            pool = candidates[step].reshape(channels, -1).clone()
            if not bool(pool.any()):
                continue
            miss = (self.weight_gradient[step] - weight_gradients[step]).reshape(channels, -1)
            taps = all_patches[step]  # (K, L)
            r = rhat[step].reshape(channels, -1)  # (C, L)
            alpha = (self.gamma[:, 0] * self.reaching[step].reshape(channels, -1)
                     / sd[step, :, 0].repeat_interleave(per_group)[:, None])  # (C, L)
            total = taps.sum(1)  # (K,)
            weighted = r @ taps.T  # (C, K) Σ_q r̂_cq patch_q
            along_weighted = weighted @ taps  # (C, L)
            norm2 = alpha.pow(2) * (
                taps.pow(2).sum(0)[None] - 2 * (total @ taps)[None] / n
                - 2 * r * along_weighted / n + per_group * float(total @ total) / n ** 2
                + 2 * r * (same @ (weighted @ total))[:, None] / n ** 2
                + r.pow(2) * (same @ weighted.pow(2).sum(1))[:, None] / n ** 2)
            while bool(pool.any()):
                first = same @ (miss @ total)  # (C,)
                second = same @ (miss * weighted).sum(1)  # (C,)
                inner = alpha * (miss @ taps - first[:, None] / n - r * second[:, None] / n)
                score = torch.where(pool, 2 * sign * inner - norm2, -torch.inf)
                best = int(score.argmax())
                if not float(score.reshape(-1)[best]) > 0:
                    break
                c, p = divmod(best, score.shape[1])
                column = torch.zeros_like(miss)
                rows = member == member[c]
                column[rows] = -alpha[c, p] * (total / n + r[c, p] * weighted[rows] / n)
                column[c] += alpha[c, p] * taps[:, p]
                miss = miss - sign * column
                pool[c, p] = False
                chosen[(step, c, *divmod(p, self.a.shape[-1]))] = True
        return chosen

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        """(N, R): the output rows, then the weight-gradient rows."""
        o, weight_gradient = self.forward(x)
        outputs = torch.where(self.on, o - self.a, F.relu(o) - self.a.clamp_min(0)).flatten(1)
        return torch.cat([outputs / self.output_size,
                          (weight_gradient - self.weight_gradient).flatten(1)
                          / self.gradient_size], 1)

    def weight_gradient_residual(self, x: torch.Tensor) -> torch.Tensor:
        """(N,) the weight gradient's relative miss at x."""
        _, weight_gradient = self.forward(x)
        return ((weight_gradient - self.weight_gradient).flatten(1).norm(dim=1)
                / self.gradient_size[:, 0])


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

    def statistics(self, values: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, G) each group's mean and GroupNorm's deviation √(variance + ε)."""
        grouped = values.reshape(len(values), self.groups, -1)
        return grouped.mean(2), (grouped.var(2, unbiased=False) + eps).sqrt()


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
               on: torch.Tensor, scales: torch.Tensor, grouping: Grouping) -> torch.Tensor:
    """(N,) t from the conv's outputs at the on-units, t·u + b = μ_g + t·s_g·r̂ (the μ_g
    solved with it),
    where u is the conv (no bias) of the unscaled input and s the σ_g up to scale."""
    count, groups = len(unscaled), grouping.groups
    b = torch.zeros(unscaled.shape[1], dtype=torch.float64) if bias is None \
        else bias.detach().double()
    coefficient = unscaled - grouping.spread(scales) * known  # of t
    membership = torch.eye(groups, dtype=torch.float64).repeat_interleave(
        grouping.channels // groups, 0)  # (C, G)
    scale = torch.empty(count, dtype=torch.float64)
    for step in range(count):
        units = on[step]
        rows = torch.cat([coefficient[step][units][:, None],
                          -membership[:, None, None, :].expand(*units.shape, groups)[units]], 1)
        target = -b[:, None, None].expand_as(units)[units]
        used = torch.cat([torch.ones(1, dtype=torch.bool), rows[:, 1:].abs().sum(0) > 0])
        solution = torch.linalg.lstsq(rows[:, used], target[:, None], driver="gelsd").solution
        scale[step] = solution[0, 0]
    return scale
