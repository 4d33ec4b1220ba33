"""The frame of a patch-embedding victim (a ViT), in closed form, from one step's gradient.

A ViT cuts the frame into patches and embeds each by one Linear map (a Conv2d whose kernel is
its stride), then adds a learned position embedding to every token. On one sample the gradient
of the position embedding at token t is the gradient reaching that token's embedding, δ_t, and
the patch embedding's weight gradient is Σ_t δ_t patch_tᵀ. With Δ = [δ_1 … δ_N] of full row
rank (N tokens below the width: a δ_t that leaves a LayerNorm's backward sums to zero over the
width, so Δ's rank is at most the width − 1), every patch comes back by one least-squares solve:
P = (Δ Δᵀ)⁻¹ Δ ∇W. This is the leak through learned position embeddings of APRIL (Lu et al.,
CVPR 2022). The conv's bias gradient, Σ_t δ_t, checks the stream.

Where the rank condition fails (more tokens than the width, or a degenerate step) the solve
keeps the part of the frame Δ determines and, of the frames that satisfy the equations as well,
takes the smoothest; each step reports its rank: the frame is then only partly exact. On a perturbed stream (a defense, added noise: the fit's
residual says so) the least-squares solve amplifies the errors by Δ's condition number, so the
smoothest frame that fits within the noise is taken instead (`within_noise`). A position embedding that is fixed (a buffer) or absent gives
no δ_t: the victim is refused, naming why, before any row is read.

Nothing is assumed from parameter names: the patch conv is the Conv2d reading the frame with
kernel = stride and no padding, the position embedding a learned parameter of N + k tokens
(k leading tokens such as the class token), and the identity ∇pos[k:] = δ is checked on the
victim itself (one float64 forward and backward pass at θ0) before it is relied on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from gradleak.attacks.frame_inverse import FrameInverse, register_frame_inverse
from gradleak.errors import ConfigError
from gradleak.inversion.frame_solve import conjugate_gradients, weighted_laplacian
from gradleak.threat import Observation
from gradleak.victims.base import Victim

# leading tokens (class, register or distillation tokens) a position embedding may hold
MAX_PREFIX = 8
# the identity ∇pos[k:] = δ holds to this relative error on the float64 check pass
IDENTITY_TOLERANCE = 1e-9
# singular values of Δ below this fraction of its largest are its null space; float32 storage
# leaves ~1e-7 relative noise on each entry, far under any singular value this counts
RANK_TOLERANCE = 1e-6
# the exact solve's residual, relative to ∇W, above which the stream counts as perturbed (a
# defense, noise) and the smoothness prior is weighed in; float32 storage alone leaves ~1e-7
PERTURBED = 1e-5
# the smoothness prior's weights tried, times Δ Δᵀ's mean diagonal (`within_noise`)
PRIOR_WEIGHTS = tuple(10.0 ** k for k in range(-8, 0))
PRIOR_ITERATIONS = 300  # CG iterations of each weight's solve
NULL_ITERATIONS = 500  # CG iterations of the smoothest frame along Δᵀ's null space


@dataclass(frozen=True)
class PatchEmbedding:
    """Where a victim's patches and position embedding are, as found on the victim."""

    conv: str  # the Conv2d cutting the frame into patches (kernel = stride, no padding)
    position: str  # the learned position-embedding parameter added to its tokens
    prefix: int  # tokens ahead of the patches in the position embedding (e.g. the class token)
    grid: tuple[int, int]  # patches down and across
    patch: tuple[int, int]  # pixels of one patch


def patch_convs(victim: Victim) -> list[tuple[str, nn.Conv2d]]:
    """The Conv2d layers that read the frame's channels as non-overlapping patches."""
    channels = victim.input_transform.channels
    return [(name, m) for name, m in victim.named_modules() if isinstance(m, nn.Conv2d)
            and m.kernel_size == m.stride and m.padding in ((0, 0), "valid")
            and m.dilation == (1, 1) and m.groups == 1 and m.in_channels == channels]


def find_patch_embedding(victim: Victim) -> PatchEmbedding:
    """The victim's patch embedding, checked on the victim; a ConfigError naming why not."""
    name = victim.config.name
    convs = patch_convs(victim)
    if not convs:
        raise ConfigError(f"victim {name}: no patch embedding (a Conv2d reading the frame with "
                          "kernel = stride and no padding)")
    conv_name, conv = convs[0]
    transform = victim.input_transform
    grid = (transform.height // conv.stride[0], transform.width // conv.stride[1])
    tokens, width = grid[0] * grid[1], conv.out_channels
    candidates = [(p_name, p.numel() // width - tokens) for p_name, p in victim.named_parameters()
                  if p.requires_grad and p.ndim >= 2 and p.shape[-1] == width
                  and p.numel() % width == 0 and 0 <= p.numel() // width - tokens <= MAX_PREFIX
                  and p.numel() // width == p.shape[-2]]
    fixed = [b_name for b_name, b in victim.named_buffers()
             if b.ndim >= 2 and b.shape[-1] == width and tokens <= b.shape[-2] <= tokens
             + MAX_PREFIX]
    if not candidates:
        why = f" (the position embedding {fixed[0]} is a fixed buffer: its gradient is never " \
              "sent)" if fixed else ""
        raise ConfigError(f"victim {name}: {conv_name} embeds {tokens} patches but no learned "
                          f"position embedding of {tokens} (+ up to {MAX_PREFIX} leading) tokens "
                          f"× {width} is added to them{why}: the patch embedding's closed form "
                          "needs its gradient")
    mismatch = ""
    for position, prefix in candidates:
        error = identity_error(victim, conv_name, position, prefix)
        if error <= IDENTITY_TOLERANCE:
            return PatchEmbedding(conv_name, position, prefix, grid, tuple(conv.kernel_size))
        mismatch = f"{position} (relative difference {error:.1e})"
    raise ConfigError(f"victim {name}: the gradient of {mismatch} is not the gradient reaching "
                      f"{conv_name}'s tokens: the patch embedding's closed form does not hold")


def identity_error(victim: Victim, conv_name: str, position: str, prefix: int) -> float:
    """max |∇pos[k:] − δ| / max |δ| on one random frame in float64 (δ: the gradient at the
    conv's output tokens)."""
    model = {n: p for n, p in victim.named_parameters()}
    dtype = next(victim.parameters()).dtype
    caught: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.retain_grad()
        caught["out"] = out

    handle = victim.get_submodule(conv_name).register_forward_hook(keep)
    mode = victim.training
    victim.eval().double()
    try:
        frames, goals, hidden = victim.example_inputs(batch=1, seed=3)
        generator = torch.Generator().manual_seed(5)
        outputs = victim(frames.double(), None if goals is None else goals.double(),
                         None if hidden is None else hidden.double())
        loss = sum((o * torch.randn(o.shape, generator=generator, dtype=torch.float64)).sum()
                   for o in outputs[:2])
        victim.zero_grad()
        loss.backward()
        delta = caught["out"].grad[0].flatten(1).T  # (tokens, width)
        observed = model[position].grad.reshape(-1, delta.shape[1])[prefix:]
        error = float((observed - delta).abs().max() / delta.abs().max().clamp_min(1e-300))
    finally:
        handle.remove()
        victim.zero_grad()
        victim.to(dtype).train(mode)
    return error


@dataclass(frozen=True)
class PatchSolve:
    """The transformed frames (N, C, H, W) and, per step, the rank of Δ, its token count, its
    condition number, the bias gradient's residual (Σ_t δ_t against ∇b, relative) and the
    smoothness prior's weight (0: the exact solve, the stream being exact)."""

    inputs: torch.Tensor
    rank: torch.Tensor
    tokens: int
    condition: torch.Tensor
    bias_residual: torch.Tensor | None
    prior_weight: torch.Tensor


def gradient_of(observation: Observation, name: str) -> torch.Tensor:
    try:
        return torch.from_numpy(observation.block(name).astype(np.float64))
    except KeyError:
        raise ConfigError(f"the patch embedding's closed form needs the gradient of {name}: "
                          "capture every component (the default)") from None


@dataclass(frozen=True)
class Equations:
    """Δᵀ P = ∇W for each step: Δ (N, T, D) and ∇W (N, D, C·p·p), with the patch grid."""

    delta: torch.Tensor
    weight: torch.Tensor
    embedding: PatchEmbedding
    channels: int

    def image(self, patches: torch.Tensor) -> torch.Tensor:
        """(N, T, C·p·p) patches in raster order → (N, C, rows·p, columns·p)."""
        (rows, columns), (ph, pw) = self.embedding.grid, self.embedding.patch
        image = patches.reshape(len(patches), rows, columns, self.channels, ph, pw)
        return image.permute(0, 3, 1, 4, 2, 5).reshape(len(patches), self.channels, rows * ph,
                                                       columns * pw)

    def patches(self, image: torch.Tensor) -> torch.Tensor:
        """`image`'s inverse."""
        (rows, columns), (ph, pw) = self.embedding.grid, self.embedding.patch
        parts = image.reshape(len(image), self.channels, rows, ph, columns, pw)
        return parts.permute(0, 2, 4, 1, 3, 5).reshape(len(image), rows * columns, -1)

    def residual(self, image: torch.Tensor) -> torch.Tensor:
        """(N,) ‖Δᵀ P − ∇W‖² of each step's image."""
        return (self.delta.transpose(1, 2) @ self.patches(image) - self.weight).pow(2).sum((1, 2))

    def rows(self, rows: torch.Tensor) -> Equations:
        return Equations(self.delta[rows], self.weight[rows], self.embedding, self.channels)


def solve_patches(observation: Observation, embedding: PatchEmbedding,
                  smoothest: bool = True) -> PatchSolve:
    """Every step's patches by least squares on Δᵀ P = ∇W, assembled into the frame the conv
    read (pixels outside the patch grid, if any, repeat the nearest patch's edge); where Δ's
    rank falls short of its tokens the smoothest of the frames that fit (`smoothest`; off: the
    minimum-norm one); on a perturbed stream (a defense, noise) with a smoothness prior weighed
    by the noise the fit shows (`within_noise`)."""
    weight = gradient_of(observation, f"{embedding.conv}.weight")  # (N, D, C, p, p)
    count, width, channels = weight.shape[:3]
    position = gradient_of(observation, embedding.position).reshape(count, -1, width)
    equations = Equations(position[:, embedding.prefix:], weight.flatten(2), embedding, channels)
    u, s, vh = torch.linalg.svd(equations.delta, full_matrices=False)  # Δ = U S Vᴴ
    kept = s > RANK_TOLERANCE * s[:, :1]
    inverse = torch.where(kept, 1 / s.clamp_min(1e-300), torch.zeros_like(s))
    # P = (Δᵀ)⁺ ∇W = U S⁻¹ Vᴴ ∇W
    rank = kept.sum(1)
    image = equations.image(u @ (inverse[..., None] * (vh @ equations.weight)))
    if smoothest:
        image = smoothest_along_null_space(equations, image, rank)
    image, prior = within_noise(equations, image, rank)
    condition = s[:, 0] / torch.where(kept, s, s[:, :1]).amin(1)
    bias_residual = None
    if f"{embedding.conv}.bias" in {layer.name for layer in observation.layers}:
        bias = gradient_of(observation, f"{embedding.conv}.bias")
        bias_residual = (equations.delta.sum(1) - bias).norm(dim=1) / bias.norm(
            dim=1).clamp_min(1e-300)
    transform = observation.roles.transform
    below, right = transform.height - image.shape[2], transform.width - image.shape[3]
    if below or right:
        image = torch.nn.functional.pad(image, (0, right, 0, below), mode="replicate")
    return PatchSolve(image, rank, equations.delta.shape[1], condition, bias_residual, prior)


def smoothest_along_null_space(equations: Equations, image: torch.Tensor, rank: torch.Tensor
                               ) -> torch.Tensor:
    """Where Δ's rank r is below its T tokens, Δᵀ P = ∇W fixes the patches only up to
    P + N Z, N a basis of Δᵀ's null space (T − r mixtures of the patches): of those frames, the
    smoothest (‖∇x‖² least, by CG over Z). The equations hold as exactly as before."""
    tokens = equations.delta.shape[1]
    out = image.clone()
    for short in sorted(set(rank[rank < tokens].tolist())):
        rows = (rank == short).nonzero().flatten()
        part = equations.rows(rows)
        null = torch.linalg.svd(part.delta, full_matrices=True).U[:, :, short:]  # (n, T, T−r)
        start = image[rows]

        def along(z: torch.Tensor, null: torch.Tensor = null, part: Equations = part
                  ) -> torch.Tensor:  # (n, 1, T − r, J) → the image it adds
            return part.image(null @ z[:, 0])

        def back(x: torch.Tensor, null: torch.Tensor = null, part: Equations = part
                 ) -> torch.Tensor:  # along's adjoint
            return (null.transpose(1, 2) @ part.patches(x))[:, None]

        z = conjugate_gradients(lambda z: back(weighted_laplacian(along(z), None)),
                                -back(weighted_laplacian(start, None)),
                                start.new_zeros(len(rows), 1, tokens - short,
                                                part.weight.shape[2]), NULL_ITERATIONS)
        out[rows] = start + along(z)
    return out


def within_noise(equations: Equations, exact: torch.Tensor, rank: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The smoothest image whose fit is as good as the noise allows (the discrepancy
    principle): the exact solve's residual holds D − r of the D dimensions of each column's
    noise, so a fit within residual · D / (D − r) explains the observation as well as the
    truth would. Of `PRIOR_WEIGHTS` (times Δ Δᵀ's mean diagonal) the largest that stays within
    is kept, per step (tried from the largest down, each solve starting from the last); a step
    whose residual is at float32 rounding, or that no weight keeps within, keeps the exact
    solve.
    Returns the images and each step's weight (0: exact)."""
    residual = equations.residual(exact)
    width = equations.delta.shape[2]
    perturbed = (residual > PERTURBED ** 2 * equations.weight.pow(2).sum((1, 2))) & (
        rank < width)
    chosen = torch.zeros(len(exact), dtype=exact.dtype)
    if not bool(perturbed.any()):
        return exact, chosen
    out = exact.clone()
    rows = perturbed.nonzero().flatten()
    start = exact[rows]
    for weight in sorted(PRIOR_WEIGHTS, reverse=True):  # the residual grows with the weight
        part = equations.rows(rows)
        allowed = residual[rows] * width / (width - rank[rows]).to(residual.dtype)
        image = smooth_solve(part, start, weight)
        within = part.residual(image) <= allowed
        out[rows[within]], chosen[rows[within]] = image[within], weight
        rows, start = rows[~within], image[~within]  # the next weight starts where this ended
        if not len(rows):
            break
    return out, chosen


def smooth_solve(equations: Equations, start: torch.Tensor, weight: float) -> torch.Tensor:
    """argmin ‖Δᵀ P − ∇W‖² + weight · s ‖∇x‖² by CG from `start` (s: Δ Δᵀ's mean diagonal,
    so that the weight does not depend on the gradient's scale)."""
    gram = equations.delta @ equations.delta.transpose(1, 2)  # (n, T, T)
    scale = weight * gram.diagonal(dim1=1, dim2=2).mean(1)[:, None, None, None]

    def operator(x: torch.Tensor) -> torch.Tensor:
        return equations.image(gram @ equations.patches(x)) + scale * weighted_laplacian(x, None)

    return conjugate_gradients(operator, equations.image(equations.delta @ equations.weight),
                               start, PRIOR_ITERATIONS)


@register_frame_inverse("patch embedding")
class PatchEmbeddingFrames(FrameInverse):
    """The frames in closed form; per step the rank of Δ (of `tokens`), its condition number
    and the bias check. Exact wherever the rank is full, so a learned prior is refused."""

    priority = 10

    def __init__(self, victim: Victim, config: Any, prior: Any = None) -> None:
        super().__init__(victim, config, prior)
        if prior is not None:
            raise ConfigError(f"attack.training_free.prior={config.prior!r}: victim "
                              f"{victim.config.name} is inverted through its patch embedding, "
                              "in closed form: a learned prior has nothing to add")
        self.embedding = find_patch_embedding(victim)

    @classmethod
    def check(cls, victim: Victim) -> None:
        find_patch_embedding(victim)

    def layers(self) -> list[str]:
        return [f"{self.embedding.conv}.weight", self.embedding.position]

    def frames(self, observation: Observation) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        transform = observation.roles.transform
        frames, diagnostics = [], []
        for begin in range(0, len(observation), self.config.chunk):
            solved = solve_patches(observation.steps(np.arange(
                begin, min(begin + self.config.chunk, len(observation)))), self.embedding)
            frames.append(transform.invert(solved.inputs))
            diagnostics.append({"rank": solved.rank, "prior_weight": solved.prior_weight,
                                "tokens": torch.full_like(solved.rank, solved.tokens),
                                "condition": solved.condition,
                                **({} if solved.bias_residual is None
                                   else {"bias_residual": solved.bias_residual})})
        return torch.cat(frames), {key: torch.cat([d[key] for d in diagnostics])
                                   for key in diagnostics[0]}
