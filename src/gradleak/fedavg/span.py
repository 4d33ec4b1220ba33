"""The subspace a client's images lie in, read exactly off a first Linear layer's update.

A model whose first layer is Linear on the flattened image (an MLP client) changes that layer's
weight and bias, under plain SGD or momentum whatever E and B are, by

    [ΔW | Δb] = Σ_n c_n [x_n, 1]ᵀ        (c_n: the sum of sample n's output gradients)

so the update has rank ≤ N and its row space holds every private image, with 1 in the bias
coordinate. `image_span` reads that row space off the update (SVD; rank N where the N-th
singular value stands clear of the wire's rounding) and `ImageSpan.project` maps any estimate to
the nearest image in it. The truth lies in both the span and the box [0, 1], so projecting onto
either never moves an estimate away from it: the FedAvg attacks alternate the two after every
step. Which combination of the span's directions each image is, the update leaves to the
attack (see docs/fedavg.md).

An input transform that acts per pixel as a·x + c (Normalize) maps the span back to raw pixels;
any other transform, an optimiser that rescales per entry (AdamW), weight decay or a first
layer that is not Linear on the image leaves no usable span, and `image_span` says which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# σ_N / σ_{N+1} below this: the N-th direction is not clear of the wire's rounding (a float32
# MLP client at η = 0.004, N = 50, E = 20 shows 190; an AdamW client shows no gap at all)
MIN_GAP = 20.0
LINEAR_OPTIMISERS = (None, "sgd", "momentum")  # updates that are sums of gradients


@dataclass(frozen=True)
class ImageSpan:
    """Orthonormal rows spanning {[x, 1]} of the client's raw images x in [0, 1]."""

    basis: torch.Tensor  # (rank, pixels + 1) float64, orthonormal rows
    shape: tuple[int, ...]  # (C, H, W)
    layer: str
    gap: float  # σ_N / σ_{N+1} of the layer's update

    @property
    def rank(self) -> int:
        return int(self.basis.shape[0])

    def coordinates(self, images: torch.Tensor) -> torch.Tensor:
        """(N, rank): the nearest point of the span with bias coordinate 1, in its basis."""
        flat = torch.cat([images.detach().flatten(1).double(),
                          torch.ones(len(images), 1, dtype=torch.float64)], 1)
        point = flat @ self.basis.T
        bias = self.basis[:, -1]
        return point - ((point @ bias - 1.0) / (bias @ bias))[:, None] * bias[None]

    def project(self, images: torch.Tensor) -> torch.Tensor:
        """The orthogonal projection of (N, C, H, W) images onto the span, same dtype."""
        flat = self.coordinates(images) @ self.basis
        return flat[:, :-1].reshape(images.shape).to(images.dtype)

    def distance(self, images: torch.Tensor) -> torch.Tensor:
        """(N,) largest pixel change the projection makes: 0 for an image in the span."""
        return (self.project(images).double() - images.double()).flatten(1).abs().amax(1)

    def summary(self) -> dict[str, Any]:
        return {"layer": self.layer, "rank": self.rank, "gap": self.gap}


class _Reached(Exception):
    """Stops the probe at the first layer with parameters, before that layer runs."""

    def __init__(self, name: str, module: nn.Module, seen: torch.Tensor) -> None:
        super().__init__(name)
        self.name, self.module, self.seen = name, module, seen


def first_linear(model: nn.Module, shape: tuple[int, ...],
                 transform: Callable[[torch.Tensor], torch.Tensor]) -> tuple[str | None, str]:
    """The name of the first layer with parameters when it is Linear on the flattened
    (transformed) image, else None and why not. The probe stops before that layer runs, so no
    BatchNorm statistic moves."""
    def reached(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            raise _Reached(name, module, inputs[0].detach())
        return hook

    hooks = [module.register_forward_pre_hook(reached(name))
             for name, module in model.named_modules()
             if any(True for _ in module.parameters(recurse=False))]
    dtype = next(model.parameters()).dtype
    probe = transform(torch.rand(2, *shape, generator=torch.Generator().manual_seed(0)).to(dtype))
    try:
        with torch.no_grad():
            model(probe)
    except _Reached as first:
        name, module, seen = first.name, first.module, first.seen
    else:
        return None, "the model has no layer with parameters"
    finally:
        for hook in hooks:
            hook.remove()
    if not isinstance(module, nn.Linear):
        return None, f"its first layer ({name}) is {type(module).__name__}, not Linear"
    if seen.shape != probe.flatten(1).shape or not torch.equal(seen, probe.flatten(1)):
        return None, f"its first Linear layer ({name}) does not read the flattened image"
    return name, ""


def pixel_affine(transform: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...]
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a, c) with transform(x) = a·x + c per pixel, flattened; None when it is not so."""
    zero = torch.zeros(1, *shape, dtype=torch.float64)
    c = transform(zero).flatten()
    a = transform(zero + 1).flatten() - c
    probe = torch.rand(3, *shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    affine = torch.allclose(transform(probe).flatten(1), a * probe.flatten(1) + c,
                            rtol=1e-9, atol=1e-9)
    return (a, c) if affine and (a.abs() > 1e-12).all() else None


def image_span(model: nn.Module, w0: dict[str, torch.Tensor], wT: dict[str, torch.Tensor],
               shape: tuple[int, ...], samples: int,
               transform: Callable[[torch.Tensor], torch.Tensor]) -> tuple[ImageSpan | None, str]:
    """The span of the client's images, or None and a one-line reason."""
    name, why = first_linear(model, shape, transform)
    if name is None:
        return None, why
    affine = pixel_affine(transform, shape)
    if affine is None:
        return None, "the input transform is not a per-pixel a·x + c, so the span cannot be " \
                     "mapped back to pixels"
    pixels = int(torch.tensor(shape).prod())
    if samples + 1 > pixels:
        return None, f"N = {samples} images span all {pixels} pixels' space"
    if w0.get(f"{name}.bias") is None:
        return None, f"{name} has no bias, so the span's scale is not fixed"
    outputs = int(w0[f"{name}.weight"].shape[0])
    if outputs < samples:
        return None, f"{name} has {outputs} outputs, fewer than N = {samples}"
    rows, gap = row_space(w0, wT, name, samples)
    if rows is None:
        return None, (f"{name}'s update has no rank-{samples} gap (σ_N/σ_N+1 = {gap:.1f} < "
                      f"{MIN_GAP:g}): an optimiser that rescales per entry (AdamW) or weight "
                      "decay leaves no span")
    a, c = affine  # rows span [a·x + c, 1]; back to [x, 1]
    raw = torch.cat([(rows[:, :-1] - rows[:, -1:] * c) / a, rows[:, -1:]], 1)
    basis = torch.linalg.qr(raw.T).Q.T.contiguous()
    return ImageSpan(basis, tuple(shape), name, gap), ""


def feature_spans(model: nn.Module, w0: dict[str, torch.Tensor], wT: dict[str, torch.Tensor],
                  samples: int) -> dict[str, torch.Tensor]:
    """For a one-step update (a gradient): each Linear layer with bias whose update shows a
    rank-N gap, and the orthonormal rows (N, inputs + 1) spanning {[input_n, 1]}, the layer's
    inputs on the N private images. After several steps the layers below have moved between
    them, so the span holds only for the first layer (`image_span`)."""
    spans = {}
    for name, module in model.named_modules():
        if not (isinstance(module, nn.Linear) and module.bias is not None
                and min(module.out_features, module.in_features + 1) > samples):
            continue
        rows, _ = row_space(w0, wT, name, samples)
        if rows is not None:
            spans[name] = rows
    return spans


def row_space(w0: dict[str, torch.Tensor], wT: dict[str, torch.Tensor], name: str,
              samples: int) -> tuple[torch.Tensor | None, float]:
    """The top `samples` right singular vectors of the Linear layer's [ΔW | Δb] (None where
    σ_N/σ_N+1 < MIN_GAP, or it has fewer outputs than N), and that gap."""
    update = torch.cat([(w0[f"{name}.weight"] - wT[f"{name}.weight"]).double(),
                        (w0[f"{name}.bias"] - wT[f"{name}.bias"]).double()[:, None]], 1)
    if min(update.shape) < samples:
        return None, 0.0
    _, values, right = torch.linalg.svd(update, full_matrices=False)
    floor = values[samples] if len(values) > samples else values.new_tensor(0.0)
    gap = float(values[samples - 1] / floor) if floor > 0 else float("inf")
    return (right[:samples], gap) if gap >= MIN_GAP else (None, gap)


def off_span(features: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """The share of ‖[features, 1]‖² outside the span (0 for the private images' own)."""
    full = torch.cat([features.double(), features.new_ones(len(features), 1).double()], 1)
    outside = full - (full @ basis.T) @ basis
    return (outside ** 2).sum() / (full ** 2).sum()


def update_spans(model: nn.Module, w0: dict[str, torch.Tensor], wT: dict[str, torch.Tensor],
                 shape: tuple[int, ...], samples: int,
                 transform: Callable[[torch.Tensor], torch.Tensor], *, optimiser: str | None,
                 steps: int | None, image: bool = True
                 ) -> tuple[ImageSpan | None, str, dict[str, torch.Tensor]]:
    """What an attack may use: the images' span (unless `image` is off), each Linear layer's
    input span for a one-step update, and why there is no image span. Only an update linear
    in the gradients has them: a declared optimiser that rescales each entry (AdamW) has
    none, and an undeclared one (None) is judged by the rank gaps alone."""
    optimiser = optimiser.lower() if isinstance(optimiser, str) else optimiser
    if optimiser not in LINEAR_OPTIMISERS:
        return None, f"the client's optimiser ({optimiser}) rescales each entry: its update " \
                     "spans nothing", {}
    span, why = image_span(model, w0, wT, shape, samples, transform) if image else (None, "off")
    return span, why, feature_spans(model, w0, wT, samples) if steps == 1 else {}


def project_box(span: ImageSpan, images: torch.Tensor, rounds: int = 3) -> torch.Tensor:
    """Alternate the span and the box [0, 1]: both are convex and hold every private image, so
    no projection moves an estimate farther from any of them."""
    for _ in range(rounds):
        images = span.project(images).clamp(0.0, 1.0)
    return images

