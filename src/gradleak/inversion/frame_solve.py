"""The frame from the first conv's equations (`inversion.first_conv`), batched over frames.

One step's equations fix about 0.6 of an 84×84 frame (their rank, `attacks.equation_rank`);
the rest is the prior's. The solve is least squares over both sets of equations (each row
scaled to unit norm) plus a smoothness term, by Jacobi-preconditioned conjugate gradients on
the normal equations, then `rounds` reweighting rounds:

- *Edges.* The quadratic smoothness ‖∇x‖² spreads every edge the equations leave free over
  several pixels. Each round weighs an edge between neighbours by ε / max(|x_i − x_j|, ε)
  (|·| over colour channels; ε = `edge_scale` of the input range), the iteratively
  reweighted least-squares form of total variation: flat regions keep the quadratic weight,
  edges the current frame has cost |∇x| instead of |∇x|².
- *Colour.* The smoothness weighs a difference that changes the colour (a channel minus the
  channels' mean) `chroma` times one shared by every channel: what the equations leave free
  would otherwise be filled with colour noise.
- *Colour axes.* From the first round on, each frame's smoothness works along its own colour
  axes: the eigenvectors of the colour covariance of its current neighbour differences (a
  frame lit in warm light varies along a reddish brightness axis, not along grey), each axis
  weighed (largest variance / its variance)^`colour_power` and given its own edge weights.
  The axes come from the frame being solved, so nothing is learned. A frame solved from noisy
  equations has axes fitted to its noise: there the prior blends the axes with the chroma
  weighting by how far the frame's equations are trusted (`round_prior`).
- *Inequalities.* The off-units of the first conv (conv₁(x) at most its ceiling: −b, or an
  undecided unit's value plus its noise, `FirstConvEquations.ceiling`) and the input range are
  constraints the equations do not state. Each round adds, as equalities at their bound, the
  ones the current frame violates (an active set, the semi-smooth Newton step for their
  quadratic penalty).

Steps that saw the same frame (the agent stood still or walked into a wall) are solved as one
(`Tie`, found by `same_frames` from the recursion's exact first-block maps): their
weight-gradient equations differ (each step has its own δ₁), so together they fix more of the
frame.

Each round warm-starts CG from the frame before it. With `rounds` = 0 the solve is the
quadratic one, clipped to the transform's range. What each choice gained, and the settings it
beat: `docs/training-free.md`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gradleak.errors import ConfigError
from gradleak.inversion.first_conv import FirstConvEquations, NoiseModel, cast, per_frame
from gradleak.victims.transform import InputTransform

PRECISIONS = {"float64": torch.float64, "float32": torch.float32}
# the projection's pull towards the guess, beside unit-norm equation rows: small enough to
# leave the unpulled projection's frames as they are
PROXIMITY = 1e-4
# consecutive steps' first-block maps this close (relative) saw one frame (`same_frames`):
# 100x above the pairs of identical frames on a float32 capture, 100x below any other pair
SAME_FRAME_TOLERANCE = 1e-4
# (N, K, H−1, W) rows, (N, K, H, W−1) columns: K = 1, shared by the channels, or one per colour axis
EdgeWeights = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class FrameSolve:
    """How the frame is solved from its equations."""

    smoothness: float = 1e-3  # weight of the smoothness prior for what the equations leave free
    iterations: int = 150  # CG iterations of the first, quadratic solve
    rounds: int = 4  # reweighting rounds after it (edges and violated inequalities)
    round_iterations: int = 100  # CG iterations of each round
    edge_scale: float = 0.01  # ε of the edge weights, as a fraction of the input range; 0: off
    inequalities: bool = True  # enforce the off-units and the input range in the rounds
    # the solve's arithmetic: float32 gives the float64 frames in less time (its conv is the
    # faster; docs/training-free.md)
    precision: str = "float32"
    # the smoothness of the colour differences (each channel minus the channels' mean), times
    # that of the brightness: the frame's colour varies much less than its brightness
    chroma: float = 5.0
    # the rounds' smoothness along each frame's own colour axes, weighed (largest variance /
    # the axis's variance)^colour_power; 0: the chroma weighting in the rounds too
    colour_power: float = 0.5

    def check(self) -> None:
        if not self.colour_power >= 0:
            raise ConfigError(f"colour_power {self.colour_power}: expected >= 0 (0: off)")
        if not self.chroma > 0:
            raise ConfigError(f"chroma {self.chroma}: expected > 0 (1: every channel alike)")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r}: expected one of "
                              f"{', '.join(PRECISIONS)}")
        for name in ("iterations", "round_iterations"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} {getattr(self, name)}: expected >= 1")
        if self.rounds < 0:
            raise ConfigError(f"rounds {self.rounds}: expected >= 0")
        if not (self.smoothness >= 0 and self.edge_scale >= 0):
            raise ConfigError("smoothness and edge_scale must be non-negative")


@dataclass(frozen=True)
class Bounds:
    """The network input's valid range, (1, C, H, W) each."""

    low: torch.Tensor
    high: torch.Tensor

    @classmethod
    def of(cls, transform: InputTransform) -> Bounds:
        height, width, channels = transform.frame_shape
        frame = torch.zeros(1, height, width, channels, dtype=torch.float64)
        return cls(transform.apply(frame), transform.apply(frame + 255.0))

    def clip(self, x: torch.Tensor) -> torch.Tensor:
        return torch.maximum(torch.minimum(x, self.high.to(x.dtype)), self.low.to(x.dtype))

    def to(self, dtype: torch.dtype) -> Bounds:
        return Bounds(self.low.to(dtype), self.high.to(dtype))

    @property
    def scale(self) -> float:
        return float((self.high - self.low).mean())


@torch.no_grad()
def solve_frames(equations: FirstConvEquations, transform: InputTransform,
                 solve: FrameSolve = FrameSolve(), noise: NoiseModel | None = NoiseModel(),
                 tie: Tie | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Frames (N, H, W, C) in frame units (0..255) from the equations, and their relative
    residuals before clipping. CG starts from the mean-colour frame where the gradients give it
    (the mid-range frame otherwise): what the equations and the prior leave free keeps it.
    `noise` weighs the sets by how exact they are (None: as if exact), and keeps the start on
    the steps where the recursion failed."""
    dtype = PRECISIONS[solve.precision]
    bounds = Bounds.of(transform)
    start = ((bounds.low + bounds.high) / 2).expand(len(equations.on), -1, -1, -1).clone()
    if equations.colour is not None:
        start = bounds.clip(equations.colour[:, :, None, None].expand_as(start))
    work = equations.to(dtype)
    if noise is None:
        x = solve_inputs(work, start.to(dtype), solve, bounds=bounds.to(dtype), tie=tie).double()
    else:
        x = solve_inputs(work, start.to(dtype), solve,
                         cast(noise.gradient_weight(equations), dtype),
                         noise.smoothness(equations, solve.smoothness).to(dtype),
                         bounds.to(dtype), tie).double()
        failed = noise.failed(equations)
        x[failed] = start[failed]
    residuals = equations.residuals(x)
    return transform.invert(bounds.clip(x)), residuals


@torch.no_grad()
def project_frames(equations: FirstConvEquations, transform: InputTransform,
                   frames: torch.Tensor, iterations: int, solve: FrameSolve = FrameSolve(),
                   noise: NoiseModel | None = NoiseModel(), tie: Tie | None = None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Frames (N, H, W, C, 0..255: a learned prior's guess) moved onto the equations: CG on
    them alone, from the frames, for `iterations` steps. What the equations fix comes from
    them; what they leave free keeps the guess (the solution nearest it, in the
    preconditioner's norm; steps that saw one frame, `tie`, keep their guesses' mean). Steps
    whose recursion failed keep the guess whole. Returns the frames and their residuals, as
    `solve_frames` does. A small pull towards the guess (`PROXIMITY`) keeps the system
    definite: without it, CG in float32 on the outputs alone (a third of the unknowns) drifted
    along their null space and diverged."""
    bounds, dtype = Bounds.of(transform), PRECISIONS[solve.precision]
    start = transform.apply(frames.double())
    weight = None if noise is None else cast(noise.gradient_weight(equations), dtype)
    system = normal_equations(equations.to(dtype), start.shape, weight)
    tie = Tie.none(len(start)) if tie is None else tie
    guess = tie.mean(start.to(dtype))
    x = conjugate_gradients(lambda v: tie.sum(system(v)) + PROXIMITY * v,
                            tie.sum(system.rhs) + PROXIMITY * guess, guess, iterations,
                            tie.sum(system.diagonal) + PROXIMITY).double()
    if noise is not None:
        failed = noise.failed(equations)
        x[failed] = start[failed]
    residuals = equations.residuals(x)
    return transform.invert(bounds.clip(x)), residuals


@torch.no_grad()
def solve_inputs(equations: FirstConvEquations, start: torch.Tensor, solve: FrameSolve,
                 gradient_weight: torch.Tensor | None = None,
                 smoothness: torch.Tensor | None = None, bounds: Bounds | None = None,
                 tie: Tie | None = None) -> torch.Tensor:
    """The network input x (N, C, H, W) by CG from `start`, then the reweighting rounds; with
    smoothness 0 and no rounds, the solution of the equations nearest `start` (their null space
    keeps its part of `start`). `smoothness` (N, 1, 1, 1) overrides the configured weight per
    frame, and `gradient_weight` (N,) scales each frame's weight-gradient equations. The
    inequalities need `bounds`, the edges the input range."""
    weight = solve.smoothness if smoothness is None else smoothness
    tie = Tie.none(len(start)) if tie is None else tie
    fit = normal_equations(equations, start.shape, gradient_weight)
    prior = Prior(((1.0, uniform_edges(start), solve.chroma),))
    operator, rhs, diagonal = tie.system(fit, weight, prior)
    x = conjugate_gradients(operator, rhs, tie.mean(start), solve.iterations, diagonal)
    for _ in range(solve.rounds):
        frame = x if bounds is None else bounds.clip(x)
        prior = round_prior(frame, solve, 1.0 if bounds is None else bounds.scale,
                            gradient_weight)
        system = fit
        if solve.inequalities and bounds is not None:
            system = with_violated(fit, x, bounds)
        operator, rhs, diagonal = tie.system(system, weight, prior)
        x = conjugate_gradients(operator, rhs, x, solve.round_iterations, diagonal)
    return x


@dataclass(frozen=True)
class Tie:
    """Steps that saw the same frame (`group` (N,): the index of each step's group) share one
    unknown: their equations add up (Σ_s ‖A_s x − b_s‖²) and the prior counts once (the mean of
    theirs). Every vector CG makes stays equal within a group, so the solve is CG on the tied
    problem, written over all N steps."""

    group: torch.Tensor  # (N,) long, 0 .. G−1
    size: torch.Tensor  # (N,) how many steps share each step's group

    @classmethod
    def none(cls, count: int) -> Tie:
        return cls(torch.arange(count), torch.ones(count))

    @classmethod
    def of(cls, group: torch.Tensor) -> Tie:
        _, group, counts = torch.unique(group, return_inverse=True, return_counts=True)
        return cls(group, counts[group].double())

    @property
    def trivial(self) -> bool:
        return bool((self.size == 1).all())

    def sum(self, v: torch.Tensor) -> torch.Tensor:
        if self.trivial:
            return v
        total = v.new_zeros(int(self.group.max()) + 1, *v.shape[1:])
        return total.index_add_(0, self.group, v)[self.group]

    def mean(self, v: torch.Tensor) -> torch.Tensor:
        return v if self.trivial else self.sum(v) / per_frame(self.size.to(v.dtype))

    def system(self, fit: NormalSystem, weight: float | torch.Tensor, prior: Prior):
        """The operator, right-hand side and Jacobi diagonal of the tied solve."""
        def operator(x: torch.Tensor) -> torch.Tensor:
            return self.sum(fit(x)) + self.mean(weight * prior(x))

        diagonal = self.sum(fit.diagonal) + self.mean(weight * prior.diagonal(fit.rhs.shape[1]))
        return operator, self.sum(fit.rhs), diagonal


def same_frames(maps: torch.Tensor, episodes: np.ndarray, steps: np.ndarray,
                tolerance: float) -> Tie:
    """The steps that saw one frame: consecutive steps of an episode whose first-block maps
    (N, ...: the recursion's output, the second conv's input) differ by at most `tolerance`,
    relative (0: none). On what a client sends the recursion returns those maps to float32
    rounding, so identical frames give maps far closer than different ones (docs/training-free.md).
    Maps that are all zero say nothing of the frame and are never tied."""
    flat = maps.flatten(1).double()
    if tolerance == 0 or len(flat) < 2:
        return Tie.none(len(flat))
    follows = torch.from_numpy((episodes[1:] == episodes[:-1])
                               & (steps[1:] == steps[:-1] + 1))
    size = flat[:-1].norm(dim=1)
    same = follows & (size > 0) & ((flat[1:] - flat[:-1]).norm(dim=1) <= tolerance * size)
    return Tie.of(torch.cat([torch.zeros(1, dtype=torch.long), (~same).long().cumsum(0)]))


@dataclass(frozen=True)
class Prior:
    """The smoothness operator Σ_i share_i · DᵀW_iD K_i: a blend, per frame, of terms (share:
    a float or (N, 1, 1, 1); edge weights; colour), each symmetric, so the blend is too."""

    terms: tuple[tuple[float | torch.Tensor, EdgeWeights, Colour], ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return sum(share * smoothness_normal(x, edges, colour)
                   for share, edges, colour in self.terms)

    def diagonal(self, channels: int) -> torch.Tensor:
        return sum(share * degree(edges, colour, channels)
                   for share, edges, colour in self.terms)


def round_prior(frame: torch.Tensor, solve: FrameSolve, scale: float,
                trust: torch.Tensor | None = None) -> Prior:
    """A round's prior from the frame before it: its edges weighed as total variation (ε =
    `edge_scale` × `scale`, the input range), its colour along its own axes as far as its
    equations are trusted, by the chroma weight for the rest. `trust` (N,) is the
    weight-gradient equations' weight (None: fully): a frame solved from noisy equations has
    axes fitted to the noise, and an exact one keeps them whole (docs/training-free.md)."""
    def edges(colour: Colour) -> EdgeWeights:
        if solve.edge_scale == 0:
            return uniform_edges(frame)
        return edge_weights(frame, solve.edge_scale * scale, colour)

    if solve.colour_power == 0:
        return Prior(((1.0, edges(solve.chroma), solve.chroma),))
    axes = ColourAxes.of(frame, solve.colour_power)
    own = (edges(axes), axes)
    if trust is None:
        return Prior(((1.0, *own),))
    share = per_frame(trust.to(frame.dtype))
    return Prior(((share, *own), (1 - share, edges(solve.chroma), solve.chroma)))


@dataclass(frozen=True)
class ColourAxes:
    """Each frame's colour axes: the eigenvectors of the (C, C) covariance of its neighbour
    differences, along which they are uncorrelated, and each axis's smoothness weight."""

    axes: torch.Tensor  # (N, C, C), column k the k-th axis
    weights: torch.Tensor  # (N, C)

    @classmethod
    def of(cls, x: torch.Tensor, power: float) -> ColourAxes:
        """Axis k weighs (λ_max / λ_k)^power for λ the difference variances; a frame with no
        differences at all keeps every axis at weight 1."""
        differences = torch.cat([(x[..., 1:, :] - x[..., :-1, :]).flatten(2),
                                 (x[..., :, 1:] - x[..., :, :-1]).flatten(2)], 2)
        covariance = (differences @ differences.transpose(1, 2)).double()
        variances, axes = torch.linalg.eigh(covariance)
        largest = variances[:, -1:]
        # a variance at rounding level weighs as much as one a million times below the largest
        weights = (largest / variances.clamp_min(1e-6 * largest)) ** power
        weights = torch.where(largest > 0, weights, 1.0)
        return cls(axes.to(x.dtype), weights.to(x.dtype))

    def along(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) the frame's coordinates on its axes."""
        return torch.einsum("nck,nchw->nkhw", self.axes, x)

    def back(self, y: torch.Tensor) -> torch.Tensor:
        return torch.einsum("nck,nkhw->nchw", self.axes, y)


Colour = float | ColourAxes  # the chroma weight, or each frame's own colour axes


@dataclass(frozen=True)
class NormalSystem:
    """AᵀA x = Aᵀb for the first conv's equations, each row scaled to unit norm, and the
    inequalities a solve made active. `outputs` (N, O, h, w) weighs each unit's output
    equation (1/‖W_o‖² on an on-unit or a violated off-unit, 0 elsewhere), `gradient_rows`
    (N, O, 1) each channel's weight-gradient equations (None: without them), `box` (N, C, H, W)
    the input-range equalities (1 where x is out of range)."""

    equations: FirstConvEquations
    outputs: torch.Tensor
    gradient_rows: torch.Tensor | None
    rhs: torch.Tensor
    diagonal: torch.Tensor
    box: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """AᵀA x with one unfold and one fold: the output and weight-gradient equations read
        the same patches, so one pass over them serves both (a conv and its adjoint for each
        set costs more)."""
        equations, conv = self.equations, self.equations.block.conv
        patches = equations.patches(x)  # (N, C·k², P)
        weight = equations.weight.flatten(1)  # (O, C·k²)
        columns = weight.t() @ ((weight @ patches) * self.outputs.flatten(2))
        if self.gradient_rows is not None:
            delta = equations.delta.flatten(2)
            gradient = torch.bmm(delta, patches.transpose(1, 2)) * self.gradient_rows
            columns = columns + torch.bmm(gradient.transpose(1, 2), delta)
        product = torch.nn.functional.fold(columns, x.shape[-2:], equations.kernel,
                                           padding=conv.padding, stride=conv.stride)
        return product if self.box is None else product + self.box * x


def normal_equations(equations: FirstConvEquations, shape: torch.Size,
                     gradient_weight: torch.Tensor | None = None) -> NormalSystem:
    """The normal equations with every equation's row scaled to unit norm (an output equation
    of unit o by 1/‖W_o‖, a weight-gradient equation of channel o by 1/‖δ₁(o, ·)‖): rows of
    very different scale are what make the system hard. `gradient_weight` (N,) then scales
    each step's weight-gradient rows' squares."""
    conv = equations.block.conv
    weight = equations.weight
    row_out = equations.on.to(weight.dtype) / output_row_norms(equations)  # 1/‖row‖² where on
    rhs = equations.conv_adjoint(equations.outputs * row_out, shape)
    # diag(AᵀA): each on-unit adds its row's weight² at every pixel it reads
    diagonal = torch.nn.grad.conv2d_input(shape, weight ** 2, row_out, conv.stride,
                                          conv.padding)
    row_grad = None
    if equations.weight_gradient is not None:
        observed = equations.weight_gradient.flatten(2)
        delta = equations.delta.flatten(2)
        row_grad = 1 / delta.pow(2).sum(2, keepdim=True).clamp_min(1e-300)  # (N, O, 1)
        row_grad = torch.where(delta.pow(2).sum(2, keepdim=True) > 0, row_grad, 0.0)
        if gradient_weight is not None:
            row_grad = row_grad * gradient_weight[:, None, None]
        rhs = rhs + equations.weight_gradient_adjoint(observed * row_grad, shape)
        # a pixel's coefficient in ∇W₁[o, c, tap] is δ₁(o, p) for the one p whose tap reads it
        scaled = equations.delta ** 2 * row_grad[..., None]
        diagonal = diagonal + torch.nn.grad.conv2d_input(
            shape, torch.ones_like(weight), scaled, conv.stride, conv.padding)
    return NormalSystem(equations, row_out, row_grad, rhs, diagonal)


def output_row_norms(equations: FirstConvEquations) -> torch.Tensor:
    """(1, O, 1, 1) ‖W_o‖², the squared norm of an output equation's row."""
    return equations.weight.flatten(1).pow(2).sum(1)[None, :, None, None]


def with_violated(system: NormalSystem, x: torch.Tensor, bounds: Bounds) -> NormalSystem:
    """The system with each inequality x violates added as an equality at its bound: an
    off-unit's conv₁(x) at its ceiling (−b₁, or an undecided unit's recovered value plus its
    noise: `FirstConvEquations.ceiling`; rows scaled to unit norm, as the on-units') and the
    input's range, pixel by pixel."""
    equations = system.equations
    conv = equations.block.conv
    ceiling = equations.off_ceiling()
    violated = (equations.off & (equations.conv(x) > ceiling)).to(x.dtype) \
        / output_row_norms(equations)
    below, above = (x < bounds.low).to(x.dtype), (x > bounds.high).to(x.dtype)
    rhs = system.rhs + equations.conv_adjoint(ceiling * violated, x.shape) \
        + below * bounds.low + above * bounds.high
    diagonal = system.diagonal + below + above + torch.nn.grad.conv2d_input(
        x.shape, equations.weight ** 2, violated, conv.stride, conv.padding)
    # on- and off-units are disjoint: a violated off-unit's weight adds where on's is 0
    return NormalSystem(equations, system.outputs + violated, system.gradient_rows, rhs,
                        diagonal, below + above)


def uniform_edges(x: torch.Tensor) -> EdgeWeights:
    """Every edge weighed 1: the quadratic smoothness ‖∇x‖²."""
    n, _, height, width = x.shape
    return (x.new_ones(n, 1, height - 1, width), x.new_ones(n, 1, height, width - 1))


def edge_weights(x: torch.Tensor, scale: float, colour: Colour = 1.0) -> EdgeWeights:
    """ε / max(|Δ|, ε) per edge: total variation's reweighted least-squares weights, 1 where
    the frame is flat. |Δ| is over the colour channels, or, given the frame's colour axes, each
    axis's own (one weight per axis)."""
    if isinstance(colour, ColourAxes):
        y = colour.along(x)
        rows, cols = (y[..., 1:, :] - y[..., :-1, :]).abs(), (y[..., :, 1:] - y[..., :, :-1]).abs()
    else:
        rows = (x[..., 1:, :] - x[..., :-1, :]).pow(2).sum(1, keepdim=True).sqrt()
        cols = (x[..., :, 1:] - x[..., :, :-1]).pow(2).sum(1, keepdim=True).sqrt()
    return scale / rows.clamp_min(scale), scale / cols.clamp_min(scale)


def smoothness_normal(x: torch.Tensor, edges: EdgeWeights | None = None,
                      colour: Colour = 1.0) -> torch.Tensor:
    """DᵀWD K x for D the horizontal and vertical differences, W the edge weights (1: none) and
    K on the colour channels. With a chroma weight, K = I + (chroma − 1)(I − 11ᵀ/C): a
    difference shared by every channel (brightness) costs as before, one that changes the
    colour `chroma` times as much; K acts per pixel and W per edge, so they commute and the
    operator stays symmetric. With colour axes U (per frame) and their weights S, the operator
    is U S DᵀW_kD Uᵀ x, axis k with its own edge weights W_k: symmetric too."""
    if isinstance(colour, ColourAxes):
        along = weighted_laplacian(colour.along(x), edges) * colour.weights[:, :, None, None]
        return colour.back(along)
    out = weighted_laplacian(x, edges)
    if colour == 1.0 or x.shape[1] == 1:
        return out
    return out + (colour - 1.0) * (out - out.mean(1, keepdim=True))


def weighted_laplacian(x: torch.Tensor, edges: EdgeWeights | None) -> torch.Tensor:
    """DᵀWD x, channel by channel (W's channels: 1, shared, or one per channel of x)."""
    out = torch.zeros_like(x)
    rows, cols = x[..., 1:, :] - x[..., :-1, :], x[..., :, 1:] - x[..., :, :-1]
    if edges is not None:
        rows, cols = rows * edges[0], cols * edges[1]
    out[..., 1:, :] += rows
    out[..., :-1, :] -= rows
    out[..., :, 1:] += cols
    out[..., :, :-1] -= cols
    return out


def degree(edges: EdgeWeights, colour: Colour = 1.0, channels: int = 1) -> torch.Tensor:
    """(N, 1 or C, H, W) diag(DᵀWD K): each pixel's summed edge weights, times K's diagonal
    (with colour axes, Σ_k U_ck² S_k times axis k's summed weights)."""
    rows, cols = edges
    out = rows.new_zeros(rows.shape[0], rows.shape[1], cols.shape[2], rows.shape[3])
    out[..., 1:, :] += rows
    out[..., :-1, :] += rows
    out[..., :, 1:] += cols
    out[..., :, :-1] += cols
    if isinstance(colour, ColourAxes):
        per_axis = out.expand(-1, channels, -1, -1) * colour.weights[:, :, None, None]
        return torch.einsum("nck,nkhw->nchw", colour.axes ** 2, per_axis)
    return out * (1.0 + (colour - 1.0) * (1.0 - 1.0 / channels))


def conjugate_gradients(operator, rhs: torch.Tensor, x: torch.Tensor, iterations: int,
                        diagonal: torch.Tensor | None = None, tolerance: float = 1e-14
                        ) -> torch.Tensor:
    """Preconditioned CG (Jacobi: `diagonal`) on a symmetric positive semi-definite operator,
    one independent problem per row. A row stops once its residual falls below `tolerance`
    times its start, or its curvature does (nothing left to gain in its search direction)."""
    inverse = None if diagonal is None else torch.where(diagonal > 0, 1 / diagonal,
                                                        torch.zeros_like(diagonal))

    def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return per_frame((a * b).flatten(1).sum(1))

    def precondition(r: torch.Tensor) -> torch.Tensor:
        return r if inverse is None else r * inverse

    residual = rhs - operator(x)
    preconditioned = precondition(residual)
    direction, norm = preconditioned.clone(), dot(residual, preconditioned)
    floor = norm * tolerance ** 2
    for _ in range(iterations):
        product = operator(direction)
        curvature = dot(direction, product)
        active = (norm > floor) & (curvature > 0)
        if not bool(active.any()):
            break
        step = torch.where(active, norm / torch.where(active, curvature, 1.0), 0.0)
        x = x + step * direction
        residual = residual - step * product
        preconditioned = precondition(residual)
        new = dot(residual, preconditioned)
        direction = torch.where(active, preconditioned + new / torch.where(active, norm, 1.0)
                                * direction, direction)
        norm = torch.where(active, new, norm)
    return x
