"""Filling in a conv's input where its weight gradient leaves a null space.

The weight gradient fixes each input channel up to D(δ)'s null space, the same for every
channel. The layer's outputs then fix most of it: at each on-unit the pre-activation is known,
an equation in the input that couples its channels. What those leave free is set by
inequalities: the input is the ReLU → norm output of the layer below (that layer's ReLU output
is ≥ 0, and about half of it exactly 0) and the off-units' pre-activations are ≤ 0; the point
that violates none comes from `layers.least_violation`. Inside `completions_shared` a
completion met again (the other mask rules' walks meet the same ones) is answered from the
first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from gradleak.inversion.layers.affine_norm import NormedLayer, bn_affine
from gradleak.inversion.layers.conv_equations import (
    ConvLayer,
    InputFit,
    block_output,
    covered_pixels,
)
from gradleak.inversion.layers.least_violation import least_violation
from gradleak.threads import computed_ahead, one_thread

T = TypeVar("T")


@dataclass(frozen=True)
class KnownOutputs:
    """What the block above says of this block's output: its pre-activation where the unit is
    on (the ReLU output, BN⁻¹ of what that block received). Each is an equation in the input
    that couples its channels, unlike the weight gradient's."""

    relu: torch.Tensor  # (N, C_out, h, w)
    on: torch.Tensor  # (N, C_out, h, w) bool: only these units' values are equations
    below: NormedLayer | None = None  # the layer whose ReLU → norm output this input is


# D(δ)'s singular values below this fraction of its largest are its null space (an exact null
# direction sits at rounding level, the next well above: where a strided conv's on-units leave
# a checkerboard unread)
NULL_TOLERANCE = 1e-9


# a linear programme for more free coefficients than this is not tried (their inputs are
# marked undetermined instead): above every count met on the held-out captures, below where
# one programme takes seconds (docs/training-free.md)
MAX_FREE = 160


# inside `completions_shared`: the steps completed, by the bytes they read; else None
_SHARED: dict[bytes, Any] | None = None


@dataclass(frozen=True)
class StepCompletion:
    """One step's input from `complete_step`: (Q, C_in) columns, (Q, C_in) bool where no
    equation fixes them, and whether D(δ) had a null space there."""

    solution: torch.Tensor
    undetermined: torch.Tensor
    completed: bool


@torch.no_grad()
def complete_from_outputs(block: ConvLayer, fit: InputFit, outputs: KnownOutputs,
                          steps: torch.Tensor) -> InputFit:
    """The weight gradient fixes each input channel up to D(δ)'s null space, the same for every
    channel: a_i = a_i* + Σ_j c_ij n_j. The on-units' pre-activations are linear in the c_ij,
    so one small least squares per step fixes those the live output channels reach; the rest
    are marked undetermined. Only `steps` (where D's Gram matrix has a null space) are looked
    at, and solved here whole: a* is the minimum-norm solution with the singular values under
    NULL_TOLERANCE dropped (gelsd's own cut-off is machine precision), so that it has no part
    along the null directions it is completed with."""
    solution = fit.solution.clone()
    undetermined = torch.zeros_like(solution, dtype=torch.bool)
    completed = torch.zeros(len(solution), dtype=torch.bool)
    read = covered_pixels(block)
    below = b"" if outputs.below is None else outputs.below.name.encode()

    def parts(step: int) -> tuple[bytes | torch.Tensor, ...]:  # what a completion reads
        return (b"completion", block.name.encode(), below, fit.operator.delta[step],
                fit.rhs[step], outputs.relu[step], outputs.on[step])

    order = steps.nonzero().flatten().tolist()
    keys = {step: shared_key(*parts(step)) for step in order}
    # Small solves a step, on one thread. Two steps at a time in threads was no faster: the
    # many small operations between the solves hold the GIL. The next steps' few large ones
    # (two SVDs and a conv, which release it) run ahead in a thread instead, every input bit
    # for bit the same (the timings: docs/training-free.md).
    with one_thread(), computed_ahead(
            lambda step: prepare_step(block, fit, outputs, step, read),
            first_unanswered(order, keys)) as prepared:
        for step in order:
            done = answered(keys[step],
                            lambda step=step: complete_step(block, outputs, prepared(step)))
            solution[step], undetermined[step] = done.solution, done.undetermined
            completed[step] = done.completed
    return InputFit(fit.operator, fit.rhs, solution, fit.gram, undetermined, completed)


@dataclass(frozen=True)
class FreeDirections:
    """The null-space maps the on-units leave free: (F, Q, C_in) maps, and the conv's output
    (no bias) on each, (F, C_out, h, w), from the per-direction outputs already at hand (a
    conv of the F maps themselves was half of the inequalities' cost)."""

    maps: torch.Tensor
    outputs: torch.Tensor

    def __len__(self) -> int:
        return len(self.maps)


@dataclass(frozen=True)
class PreparedStep:
    """One step's completion up to its inequalities (`prepare_step`): the minimum-norm
    solution, D(δ)'s null directions there (None: it has none) and the null-space part fitted
    to the on-units with the coefficients they leave free."""

    step: int
    solution: torch.Tensor
    directions: torch.Tensor | None = None
    part: torch.Tensor | None = None
    free: FreeDirections | None = None


def prepare_step(block: ConvLayer, fit: InputFit, outputs: KnownOutputs, step: int,
                 read: torch.Tensor) -> PreparedStep:
    """The first half of `complete_from_outputs` on one step (`read`: the block's covered
    pixels): a few large operations, free of the Python lock while they run."""
    matrix = fit.operator.take(step).dense()[0]
    left, singular, right = torch.linalg.svd(matrix, full_matrices=False)
    null = singular < NULL_TOLERANCE * singular[0]
    # where the eigenvalues saw a null space the SVD does not, gelsd's own cut-off
    kept = ~null if bool(null.any()) else \
        singular > torch.finfo(singular.dtype).eps * max(matrix.shape) * singular[0]
    solution = torch.zeros_like(fit.solution[step])
    solution[read] = right[kept].T @ (left[:, kept].T @ fit.rhs[step] / singular[kept][:, None])
    if not bool(null.any()):
        return PreparedStep(step, solution)
    directions = torch.zeros(int(null.sum()), len(read), dtype=solution.dtype)
    directions[:, read] = right[null]  # (J, Q)
    part, free = null_space_part(block, directions, solution, outputs, step)
    return PreparedStep(step, solution, directions, part, free)


def complete_step(block: ConvLayer, outputs: KnownOutputs, prepared: PreparedStep
                  ) -> StepCompletion:
    """The second half: the null-space part checked, and the free coefficients set by the
    inequalities (`resolve_free_part`)."""
    solution, directions, part, free = (prepared.solution, prepared.directions, prepared.part,
                                        prepared.free)
    undetermined = torch.zeros_like(solution, dtype=torch.bool)
    if directions is None:
        return StepCompletion(solution, undetermined, False)
    assert part is not None and free is not None
    if not plausible(part, solution):  # wrong masks above: nothing to trust here
        return StepCompletion(solution, in_every_channel(reaches(directions), block), True)
    solution = solution + part
    if not len(free):
        return StepCompletion(solution, undetermined, True)
    resolved = None if outputs.below is None else resolve_free_part(
        block, outputs.below, solution, free, outputs, prepared.step)
    if resolved is None or not plausible(resolved - solution, solution):
        return StepCompletion(solution, reaches(free.maps), True)
    return StepCompletion(resolved, undetermined, True)


def null_space_part(block: ConvLayer, directions: torch.Tensor, solution: torch.Tensor,
                    outputs: KnownOutputs, step: int) -> tuple[torch.Tensor, FreeDirections]:
    """(Q, C_in) Σ_j c_ij n_j with c fitted to the on-units' pre-activations, and the c that
    stay free: a trained victim's top conv has output channels that are off everywhere on a
    frame, and those say nothing of the input channels they would read."""
    channels_in = block.conv.in_channels
    columns = direction_outputs(block, directions)  # (C_out, P, C_in, J)
    on = outputs.on[step].flatten(1)  # (C_out, P)
    missing = (outputs.relu[step] - block_output(block, solution)).flatten(1)[on]
    system = columns[on].flatten(1)  # (on-units, C_in·J)
    if len(system) < system.shape[1]:  # zero rows: the reduced SVD then spans every column
        system = torch.cat([system, system.new_zeros(system.shape[1] - len(system),
                                                     system.shape[1])])
        missing = torch.cat([missing, missing.new_zeros(len(system) - len(missing))])
    left, singular, right = torch.linalg.svd(system, full_matrices=False)
    rank = int((singular > NULL_TOLERANCE * singular[:1]).sum())
    coefficients = right[:rank].T @ (left[:, :rank].T @ missing / singular[:rank])

    def as_maps(c: torch.Tensor) -> torch.Tensor:  # (F, C_in·J) → (F, Q, C_in)
        # contiguous: the inequalities reduce and gather over F (a strided amax is ten times
        # slower than one copy and a contiguous one)
        maps = c.reshape(-1, channels_in, len(directions)) @ directions
        return maps.transpose(1, 2).contiguous()

    free = right[rank:]
    changes = (columns.flatten(2) @ free.T).permute(2, 0, 1)  # (F, C_out, P)
    return as_maps(coefficients)[0], FreeDirections(
        as_maps(free), changes.reshape(len(free), *outputs.on.shape[1:]))


def direction_outputs(block: ConvLayer, directions: torch.Tensor) -> torch.Tensor:
    """(C_out, P, C_in, J): the conv's output (no bias) with direction j in input channel i."""
    conv = block.conv
    channels_out, channels_in, kernel, _ = conv.weight.shape
    per_channel = F.conv2d(directions.view(-1, 1, *block.input_shape),
                           conv.weight.double().reshape(-1, 1, kernel, kernel),
                           stride=conv.stride, padding=conv.padding)  # (J, C_out·C_in, h, w)
    return per_channel.view(len(directions), channels_out, channels_in, -1).permute(1, 3, 2, 0)


def resolve_free_part(block: ConvLayer, below: NormedLayer, solution: torch.Tensor,
                      free: FreeDirections, outputs: KnownOutputs, step: int
                      ) -> torch.Tensor | None:
    """(Q, C_in) the input within `solution` + span(free) that best satisfies the inequalities
    left: the input is a ReLU → BatchNorm output of the block `below` (BN⁻¹ of it is ≥ 0, and
    about half of it exactly 0), and this block's off-units have pre-activations ≤ 0. Hundreds
    of those are active at the truth against tens of free coefficients, so it is the only point
    that violates none; `least_violation` finds it, minimising the total violation so that
    noise leaves it near the truth. None when there are too many free coefficients or the
    linear programme fails."""
    if len(free) > MAX_FREE:
        return None
    rows, bounds = inequalities(block, below, solution, free, ~outputs.on[step])
    z = least_violation(rows, bounds)
    if z is None:
        return None
    return solution + torch.einsum("f,fqc->qc", torch.from_numpy(z), free.maps)


def shared_key(*parts: bytes | np.ndarray | torch.Tensor) -> bytes | None:
    """The key of what a completion reads inside `completions_shared`; None outside."""
    if _SHARED is None:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(part if isinstance(part, bytes) else
                      (part.numpy() if isinstance(part, torch.Tensor) else part).tobytes())
    return digest.digest()


def answered(key: bytes | None, compute: Callable[[], T]) -> T:
    """`compute()`, answered from the first call with the same key (`shared_key`) inside
    `completions_shared`; computed afresh outside."""
    if _SHARED is None or key is None:
        return compute()
    if key not in _SHARED:
        _SHARED[key] = compute()
    return _SHARED[key]


def first_unanswered(order: list[int], keys: dict[int, bytes | None]) -> list[int]:
    """The steps of `order` `answered` will compute: neither answered already nor the same
    as an earlier step."""
    seen: set[bytes] = set()
    steps = []
    for step in order:
        key = keys[step]
        if key is None or (key not in seen and (_SHARED is None or key not in _SHARED)):
            steps.append(step)
        if key is not None:
            seen.add(key)
    return steps


@contextmanager
def completions_shared() -> Iterator[None]:
    """Within: a step's completion met again is answered from the first solve. The walks of
    the other mask rules meet the same ones on the steps they share with the first (their
    masks agree there); one recovery's worth is kept, keyed by the bytes a completion reads."""
    global _SHARED
    outer, _SHARED = _SHARED, {} if _SHARED is None else _SHARED
    try:
        yield
    finally:
        _SHARED = outer


def in_every_channel(pixels: torch.Tensor, block: ConvLayer) -> torch.Tensor:
    """(Q,) → (Q, C_in): D(δ) is the same for every input channel, so is its null space."""
    return pixels[:, None].expand(-1, block.conv.in_channels)


def plausible(change: torch.Tensor, solution: torch.Tensor) -> bool:
    """A null-space part larger than the map it completes means inconsistent equations (the
    masks above were wrong), not a solution (with the right masks it is a small part of it)."""
    return bool(change.norm() <= solution.norm())


def reaches(maps: torch.Tensor) -> torch.Tensor:
    """Where some of (F, ...) maps is not zero; the SVD leaves 1e-17 where it is."""
    peaks = maps.abs().amax(0)
    return peaks > 1e-12 * peaks.max()


def inequalities(block: ConvLayer, below: NormedLayer, solution: torch.Tensor,
                 free: FreeDirections, off: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """rows z ≤ bounds, each row of unit norm, over the units span(free) reaches: the floor of
    the ReLU below (−BN⁻¹ change ≤ BN⁻¹ of `solution`) and the off-units above."""
    gain, shift, mean = (value.flatten()[None, :] for value in bn_affine(below))
    reached = reaches(free.maps)  # (Q, C_in)
    floor_rows = (-free.maps[:, reached] / gain.expand_as(solution)[reached]).T  # (units, F)
    floor_bounds = (solution / gain - shift + mean)[reached]
    changes = free.outputs
    off = off & reaches(changes)
    rows = torch.cat([floor_rows, changes[:, off].T])
    bounds = torch.cat([floor_bounds, -block_output(block, solution)[off]])
    scale = rows.norm(dim=1).clamp_min(1e-300)
    return (rows / scale[:, None]).numpy(), (bounds / scale).numpy()
