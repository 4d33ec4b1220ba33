"""Closed-form recovery through the conv stack, from one per-step gradient and θ0.

The FC layer's input y (the last block's output) comes out of the gradient exactly (see
`gradleak.attacks.analytic`), and so does the gradient reaching it, g_y = W_fcᵀ ∇b_fc. Each
block is Conv → ReLU → BatchNorm (eval mode: a known per-channel affine map; a BatchNorm before
the ReLU is folded into the conv, `conv_blocks.folded_block`), so walking down one block at a
time:

1. BN⁻¹ gives the ReLU output r from y (`layers.affine_norm`); the unit is on where r > 0,
   and the conv's output gradient is δ = g_y · γ/σ · [r > 0] (`layers.relu`).
2. On one sample the conv's weight gradient is Σ_p δ(p) ⊗ patch_p(a) — linear in the conv's
   input a, with one matrix D(δ) shared by all input channels. Where D has at least as many rows
   (C_out·k²) as a channel has pixels, a is its least-squares solution: exact without noise.
3. The gradient reaching a is conv_transpose(δ, W), exact given δ (`layers.conv`); then the
   block below (`invert_block` composes the three inverses).

Where D(δ) is rank-deficient (a trained victim's top conv has output channels off on the whole
frame, and under a stride-2 conv the pixels only the centre tap reads then meet fewer live
channels than there are of them), the input is fixed in D's null space by the block's own
outputs (the on-units' pre-activations, linear in the input and coupling its channels) and then
by inequalities: the input is a ReLU → BN output of the block below (BN⁻¹ of it ≥ 0, half of it
exactly 0) and the off-units' pre-activations are ≤ 0 (`layers.null_space`).
What stays free is marked undetermined, so the block below leaves those units undecided.

So errors do not compound through the activations, only through the on/off masks. A `MaskRule`
decides them from each unit's recovered r and its noise deviation (estimated from the fit's
residual): within a margin of deviations of zero, or by its posterior probability of being on,
a unit is undecided, and alternating rounds settle it (fit δ to the weight gradient given a,
and keep each undecided unit on where that δ is nearer g_y·γ/σ than 0). Several rules are
walked where the first leaves a step inconsistent, and each step keeps the most consistent.

The recursion stops above the first block whose D has too few rows for its unknowns (the frame
under the strided 8×8 first conv of the paper's CNN): that layer needs a prior.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from gradleak.errors import ConfigError
from gradleak.inversion.conv_blocks import ConvBlock, block_forward, conv_blocks, deepest_inputs
from gradleak.inversion.layers.affine_norm import AffineNorm, through_batch_statistics
from gradleak.inversion.layers.base import GradientOf, Known, settled
from gradleak.inversion.layers.conv import Conv
from gradleak.inversion.layers.conv_equations import convolve
from gradleak.inversion.layers.group_norm import GroupNormBlock
from gradleak.inversion.layers.linear import Linear
from gradleak.inversion.layers.null_space import completions_shared
from gradleak.inversion.layers.relu import MaskRule, Relu
from gradleak.inversion.network import Network

# Why these: the margins suit exact and float16/bfloat16-rounded gradients (no single one
# every step; see `recover_conv_inputs`), the posterior suits added noise, whose deviation the
# fit's residual estimates well, its ambiguous units settled by the fitted δ alone or by their
# odds times its evidence (neither is better on every step: docs/training-free.md). The first
# is walked on every step, the others only where it is not consistent to float32 rounding
# (`CONSISTENT`): on exact gradients one walk, not four.
MASK_RULES = (MaskRule(None, rounds=1), MaskRule(10.0), MaskRule(20.0),
              MaskRule(None, rounds=1, odds=False))
# The deepest block's on-units, whichever rule walked the blocks above: the frame solve reads
# that block's input, and there the posterior with four alternations of a channel-robust input
# and its fitted δ decides best, its ambiguous units by their odds or, on some steps under
# coarse quantisation, by the fitted δ alone (each kept where the features say it is better)
DEEPEST_RULES = (MaskRule(None, rounds=4),)
# a step whose deepest map reproduces the features to this relative error is taken as exact
CONSISTENT = 1e-4
# and one further off than this went wrong above the deepest block, where re-deciding that
# block's units does not bring it closer
RESETTLE_GAP = 0.25


@dataclass
class ConvInputs:
    """What the recursion recovered: each conv's input, its noise estimate and output mask."""

    inputs: dict[str, torch.Tensor]  # conv name → (N, C_in, H, W)
    noise: dict[str, torch.Tensor]  # conv name → (N, C_in, H, W) estimated standard deviation
    masks: dict[str, torch.Tensor]  # conv name → (N, C_out, h, w) the ReLU units found on
    rules: list[str] | None = None  # per step, the label of the mask rule whose walk was kept
    # conv name → (N, C_in, H, W) the loss gradient reaching that input: with the block below's
    # BN gain and on-units it is that block's output gradient δ
    upstream: dict[str, torch.Tensor] = field(default_factory=dict)
    # conv name → (N,) bool: the steps where that input's D(δ) had a null space
    completed: dict[str, torch.Tensor] = field(default_factory=dict)

    # (N, C, h, w) the last block's output, the FC layer's input: exact from the FC gradient
    # whatever the masks (so the yardstick for the runs that do depend on them)
    features: torch.Tensor | None = None

    @torch.no_grad()
    def inconsistency(self, blocks: list[ConvBlock], name: str) -> torch.Tensor:
        """(N,) ‖the blocks from conv `name` up applied to its recovered input − features‖ /
        ‖features‖: a wrong on/off decision anywhere below shows up here."""
        if self.features is None:
            raise ValueError("inconsistency needs the features the walk started from")
        names = [block.name for block in blocks]
        return forward_gap(blocks[names.index(name):], self.inputs[name], self.features)

    def shallow_copy(self) -> ConvInputs:
        """New dicts holding the same tensors: a walk adds its blocks to them."""
        return ConvInputs(dict(self.inputs), dict(self.noise), dict(self.masks),
                          None if self.rules is None else list(self.rules), dict(self.upstream),
                          dict(self.completed), self.features)

    def steps(self, rows: torch.Tensor) -> ConvInputs:
        """These steps only."""
        def cut(field: str) -> dict[str, torch.Tensor]:
            return {key: value[rows] for key, value in getattr(self, field).items()}

        return ConvInputs(cut("inputs"), cut("noise"), cut("masks"),
                          None if self.rules is None else [self.rules[r] for r in rows.tolist()],
                          cut("upstream"), cut("completed"),
                          None if self.features is None else self.features[rows])

    @staticmethod
    def best_of(runs: list[Run], count: int) -> ConvInputs:
        """Per step of `count`, the run of least score among those that walked it (the earlier
        run on a tie), with that run's label of the step; every step must be in some run."""
        if any(run.found.rules is None for run in runs):
            raise ValueError("best_of needs every run's rules, the label of each of its steps")
        score = torch.full((count,), float("inf"), dtype=torch.float64)
        choice = torch.full((count,), -1)
        for number, run in enumerate(runs):
            result = torch.nan_to_num(run.score.double(), nan=float("inf"))
            better = (result < score[run.rows]) | (choice[run.rows] < 0)
            score[run.rows[better]], choice[run.rows[better]] = result[better], number
        if bool((choice < 0).any()):
            raise ValueError(f"steps {(choice < 0).nonzero().flatten().tolist()} are in no run")

        def chosen(values: list[torch.Tensor]) -> torch.Tensor:
            full = values[0].new_zeros((count, *values[0].shape[1:]))
            for number, (run, value) in enumerate(zip(runs, values)):
                kept = choice[run.rows] == number
                full[run.rows[kept]] = value[kept]
            return full

        def field_of(name: str) -> dict[str, torch.Tensor]:
            return {key: chosen([getattr(run.found, name)[key] for run in runs])
                    for key in getattr(runs[0].found, name)}

        labels = [""] * count
        for number, run in enumerate(runs):
            for row, label in zip(run.rows.tolist(), run.found.rules or []):
                if choice[row] == number:
                    labels[row] = label
        features = None if runs[0].found.features is None else chosen(
            [run.found.features for run in runs])
        return ConvInputs(field_of("inputs"), field_of("noise"), field_of("masks"), labels,
                          field_of("upstream"), field_of("completed"), features)


def forward_gap(blocks: list[ConvBlock], inputs: torch.Tensor, features: torch.Tensor
                ) -> torch.Tensor:
    """(N,) ‖`blocks` applied to `inputs` − features‖ / ‖features‖."""
    forward = inputs
    for block in blocks:
        forward = block_forward(block, forward)
    return ((forward - features).flatten(1).norm(dim=1)
            / features.flatten(1).norm(dim=1).clamp_min(1e-300))


@dataclass
class Run:
    """One rule's walk of some steps to the deepest input: `rows` (which steps of the whole
    batch), what it found and its (len(rows),) inconsistency there."""

    rows: torch.Tensor
    found: ConvInputs
    score: torch.Tensor


@dataclass
class Descent:
    """Some steps' walk under one rule, down to above block `index` (-1: done): what it found
    so far and what the next block down needs. `rows` index the whole batch."""

    rows: torch.Tensor
    found: ConvInputs
    y: torch.Tensor  # (N, C, h, w) the input recovered last, the output of block `index`
    noise: torch.Tensor
    upstream: torch.Tensor  # the loss gradient reaching it
    index: int
    clean: torch.Tensor | None = None  # (N,) consistent after the top block

    def steps(self, keep: torch.Tensor) -> Descent:
        return Descent(self.rows[keep], self.found.steps(keep), self.y[keep], self.noise[keep],
                       self.upstream[keep], self.index,
                       None if self.clean is None else self.clean[keep])


@torch.no_grad()
def recover_conv_inputs(gradient_of: GradientOf, network: Network, down_to: str | None = None,
                        rules: tuple[MaskRule, ...] = MASK_RULES,
                        deepest_rules: tuple[MaskRule, ...] = DEEPEST_RULES) -> ConvInputs:
    """Walk down from the FC layer to the input of conv `down_to` (default: as far as the
    gradients determine it). `network` holds θ0 and is in eval mode; the gradients in any float
    dtype (read once, as given), the arithmetic in float64.

    Why several rules: no single one suits every step (a unit's noise varies with the step's
    advantage and how many units are on; rounding and added noise differ) and the features,
    exact from the FC gradient whatever the masks, say which run went right: per step the run
    whose deepest map, passed forward through the blocks above, is nearest them is kept (the
    attacker's own criterion; it matches the oracle's choice). The first rule is walked on every
    step, the others only on the steps it leaves inconsistent. Then each of `deepest_rules`
    decides the deepest block's units again where no walk was consistent, kept where better
    (`resettle_deepest`)."""
    read: dict[str, torch.Tensor] = {}

    def once(name: str) -> torch.Tensor:  # every walk reads the same gradients, as stored
        if name not in read:
            read[name] = gradient_of(name)
        return read[name]

    if not rules:
        raise ConfigError("recovery through the conv stack needs at least one mask rule")
    with completions_shared():
        found = walk_every_rule(once, network, down_to, rules)
        blocks = conv_blocks(network)
        for rule in deepest_rules:
            found = resettle_deepest(once, blocks, checked_deepest(network, blocks, down_to),
                                     found, rule)
        return found


def walk_every_rule(once: GradientOf, network: Network, down_to: str | None,
                    rules: tuple[MaskRule, ...]) -> ConvInputs:
    """Each rule walks the steps every rule before it left inconsistent (the first: all);
    per step the walk whose features agree best. A step a rule makes consistent is exact to
    float32 rounding, so the rules after it are not walked there.

    A walk pauses a step where, consistent after the top block, it turns inconsistent above the
    deepest input: a wrong mask, so the next rule tries it before the expensive lower blocks are
    solved. A step no rule makes consistent is finished once, by the first rule that paused it,
    beside the walks that reached its deepest input unpaused (finishing every rule's paused
    walk gives the same inputs at several times the cost)."""
    blocks = conv_blocks(network)
    deepest = checked_deepest(network, blocks, down_to)
    start = top_descent(once, network, blocks)
    runs: list[Run] = []
    paused: list[tuple[MaskRule, Descent]] = []
    score = torch.full((len(start.rows),), float("inf"), dtype=torch.float64)
    pending = start
    for rule in rules:
        done, stopped = descend(once, blocks, deepest, rule, pending, pause=True)
        if done is not None:
            runs.append(finished_run(done, rule, blocks, deepest))
            score[done.rows] = torch.minimum(score[done.rows], runs[-1].score)
        paused += [(rule, descent) for descent in stopped]
        rows = (~(score <= CONSISTENT)).nonzero().flatten()
        if not len(rows):
            break
        pending = start.steps(rows)
    unfinished = ~(score <= CONSISTENT)
    for rule, descent in paused:  # in the rules' order
        keep = unfinished[descent.rows].nonzero().flatten()
        if len(keep):
            unfinished[descent.rows[keep]] = False
            done, _ = descend(once, blocks, deepest, rule, descent.steps(keep), pause=False)
            assert done is not None
            runs.append(finished_run(done, rule, blocks, deepest))
    return ConvInputs.best_of(runs, len(score))


def finished_run(descent: Descent, rule: MaskRule, blocks: list[ConvBlock], deepest: str
                 ) -> Run:
    descent.found.rules = [rule.label] * len(descent.rows)
    return Run(descent.rows, descent.found, descent.found.inconsistency(blocks, deepest))


def walk_down(gradient_of: GradientOf, network: Network, down_to: str | None, rule: MaskRule
              ) -> ConvInputs:
    """One pass of the recursion on every step, deciding the on-units by `rule`."""
    blocks = conv_blocks(network)
    deepest = checked_deepest(network, blocks, down_to)
    done, _ = descend(gradient_of, blocks, deepest, rule,
                      top_descent(gradient_of, network, blocks), pause=False)
    assert done is not None
    return done.found


def top_descent(gradient_of: GradientOf, network: Network, blocks: list[ConvBlock]) -> Descent:
    """Every step above the top block: its output (the FC layer's input) and the gradient
    reaching it, from the FC gradients alone, whatever the masks."""
    feature_linear = network.roles().feature_linear
    top = Linear(feature_linear, network.get_submodule(feature_linear)).invert(None, gradient_of)
    count, shape = len(top.value), output_shape(blocks[-1])
    y, noise = top.value.view(count, *shape), top.noise.view(count, *shape)
    upstream = top.gradient.view_as(y)
    return Descent(torch.arange(count), ConvInputs({}, {}, {}, features=y), y, noise, upstream,
                   len(blocks) - 1)


def output_shape(block: ConvBlock) -> tuple[int, int, int]:
    """(C_out, h, w): what the block's conv gives for its input map."""
    conv = block.conv
    return (conv.out_channels, *((size + 2 * conv.padding[i] - conv.kernel_size[i])
                                 // conv.stride[i] + 1 for i, size in enumerate(block.input_shape)))


def descend(gradient_of: GradientOf, blocks: list[ConvBlock], deepest: str, rule: MaskRule,
            descent: Descent, pause: bool) -> tuple[Descent | None, list[Descent]]:
    """Walk `descent`'s steps down to the input of conv `deepest`, deciding the on-units by
    `rule`: (the steps walked to it, the steps paused above it). With `pause`, a step
    consistent with the features after the top block and inconsistent after a lower one stops
    there (consistent at the top: the gradient is clean, so the inconsistency is a mask this rule
    got wrong; inconsistent at the top: noise, which every rule meets alike)."""
    state, paused = descent, []
    found = state.found.shallow_copy()  # the descent it started from stays as it was
    for index in range(state.index, -1, -1):
        block, below = blocks[index], blocks[index - 1] if index else None
        weight_gradient = block.weight_gradient(
            gradient_of(f"{block.name}.weight")[state.rows].double())
        at_input, on = invert_block(block, below, Known(state.y, state.noise, state.upstream),
                                    weight_gradient, rule)
        y, noise, upstream = at_input.value, at_input.noise, at_input.gradient
        found.inputs[block.name], found.noise[block.name] = y, noise
        found.masks[block.name], found.completed[block.name] = on, at_input.completed
        found.upstream[block.name] = upstream
        state = Descent(state.rows, found, y, noise, upstream, index - 1, state.clean)
        if block.name == deepest:
            refresh_upward(found, blocks)
            return state, paused
        if not pause:
            continue
        consistent = found.inconsistency(blocks, block.name) <= CONSISTENT
        if state.clean is None:
            state.clean = consistent
            continue
        stop = state.clean & ~consistent
        if bool(stop.any()):
            paused.append(state.steps(stop.nonzero().flatten()))
            state = state.steps((~stop).nonzero().flatten())
            found = state.found
            if not len(state.rows):
                return None, paused
    raise AssertionError("unreachable: the deepest input is one of the blocks'")


def resettle_deepest(gradient_of: GradientOf, blocks: list[ConvBlock], deepest: str,
                     found: ConvInputs, rule: MaskRule) -> ConvInputs:
    """The deepest block solved again under `rule` from the chosen walk's block above,
    on the steps no walk made consistent but whose deepest map is within `RESETTLE_GAP` of the
    features; kept where its input, passed forward, is nearer them (the attacker's own
    criterion, as between the walks)."""
    names = [block.name for block in blocks]
    index = names.index(deepest)
    if index + 1 == len(blocks):  # the top block: no block above to start from
        return found
    block, above = blocks[index], names[index + 1]
    below = blocks[index - 1] if index else None
    gap = found.inconsistency(blocks, deepest)
    rows = ((gap > CONSISTENT) & (gap <= RESETTLE_GAP)).nonzero().flatten()
    if not len(rows):
        return found
    weight_gradient = block.weight_gradient(gradient_of(f"{block.name}.weight")[rows].double())
    at_input, on = invert_block(block, below, Known(found.inputs[above][rows],
                                                    found.noise[above][rows],
                                                    found.upstream[above][rows]),
                                weight_gradient, rule)
    y, noise, completed = at_input.value, at_input.noise, at_input.completed
    # a step whose units all came out as before has the same input (up to rounding)
    moved = (on != found.masks[deepest][rows]).flatten(1).any(1)
    better = moved & (forward_gap(blocks[index:], y, found.features[rows]) < gap[rows])
    if not bool(better.any()):
        return found
    steps = rows[better]
    for part, value in (("inputs", y), ("noise", noise), ("masks", on),
                         ("completed", completed), ("upstream", at_input.gradient)):
        getattr(found, part)[deepest][steps] = value[better]
    if found.rules is not None:
        for step in steps.tolist():
            found.rules[step] += f", {rule.label} ×{rule.rounds} at {deepest}"
    return refresh_upward(found, blocks)


def checked_deepest(network: Network, blocks: list[ConvBlock], down_to: str | None) -> str:
    reachable = deepest_inputs(network)
    deepest = down_to or reachable[-1]
    if deepest not in reachable:
        known = [block.name for block in blocks]
        raise ConfigError(f"conv input {deepest!r}: the gradients determine the inputs of "
                          f"{', '.join(reachable) or 'none'}" + (
                              " only (below, a conv's weight gradient has fewer equations than "
                              "its input has pixels: that layer needs a prior)"
                              if deepest in known else f"; the convs are {', '.join(known)}"))
    return deepest


def refresh_upward(found: ConvInputs, blocks: list[ConvBlock]) -> ConvInputs:
    """Where a block's D(δ) had a null space its input may keep an error the inequalities did
    not remove, while the block below, solved with the right masks, is exact: there the input is
    the forward pass of the input below."""
    names = [block.name for block in blocks]
    reached = [name for name in names if name in found.inputs]  # bottom-up
    for lower, upper in zip(reached, reached[1:]):
        steps = found.completed[upper]
        if steps.any():
            block = blocks[names.index(lower)]
            forward = block_forward(block, found.inputs[lower][steps])
            found.inputs[upper][steps] = forward
    return found


def invert_block(block: ConvBlock, below: ConvBlock | None, at_output: Known,
                 weight_gradient: torch.Tensor, rule: MaskRule) -> tuple[Known, torch.Tensor]:
    """One block down, by its layers' inverses: its norm, its ReLU (units decided by `rule`)
    and its conv (`below`: the block whose output the conv reads). What is known at the conv's
    input, and the on-units used."""
    relu_output = AffineNorm(block).invert(at_output)
    # the inequalities that fill a null space take the input as a ReLU's output (≥ 0)
    floor = below if below is None or below.activation is None else None
    conv, gradient_of = Conv(block, floor), {f"{block.name}.weight": weight_gradient}.__getitem__
    if block.group_norm is not None:
        # the block's own equations (its outputs beside the weight gradient) give the conv's
        # input, its noise and the gradient reaching it: closer than the conv's alone
        fit = GroupNormBlock(block, block.group_norm).fit_by_margin(
            relu_output, gradient_of, GROUP_NORM_MARGIN if rule.margin is None else rule.margin)
        return fit.input, fit.output.on
    activation = Relu(rule, block, weight_gradient) if block.activation is None \
        else block.activation
    pre_activation = activation.invert(relu_output)
    if block.batch_norm is None:
        return conv.invert(pre_activation, gradient_of), pre_activation.on
    # train mode: δ at the conv's output carries the sample's statistics, whose normalised
    # input at the off-units is the conv's own output there: from the boundary (0 after the
    # BatchNorm) first, then from each round's input
    known = pre_activation.on if pre_activation.on is not None \
        else torch.ones_like(pre_activation.value, dtype=torch.bool)
    output, previous = torch.where(known, pre_activation.value, 0.0), None
    for _ in range(BATCH_STATISTICS_ROUNDS):
        delta = through_batch_statistics(pre_activation.gradient,
                                         block.batch_normalised(output))
        at_input = conv.invert(replace(pre_activation, gradient=delta), gradient_of)
        if previous is not None and settled(previous, at_input.value, SETTLED):
            break
        previous = at_input.value
        output = torch.where(known, pre_activation.value,
                             convolve(block, at_input.value).clamp_max(0.0))
    return at_input, pre_activation.on


# a GroupNorm block's units: on beyond this many noise deviations (and the rounding bound) of 0,
# where the mask rule has no margin of its own (the posterior rules)
GROUP_NORM_MARGIN = 10.0
# a train-mode block's fixed point (the off-units' normalised outputs, the input) converges
# linearly: at most this many rounds, until a round moves the input by less than SETTLED
BATCH_STATISTICS_ROUNDS = 40
SETTLED = 1e-10
