"""The images inside an MLP client's span, told apart exactly by its ReLU sparsity.

A first Linear layer's update is [ΔW | Δb] = Σ_n d_n [x_n, 1]ᵀ (`fedavg.span`), where d_n[j],
the sum of sample n's output gradients at hidden unit j over all local steps, is exactly 0 for
every unit that stayed off for image n at every step. Written in the span's coordinates
(x_n = Bᵀ c_n), row j of the update is a_j = Σ_n d_n[j] c_n, so every unit that was off for image
n gives a row on the hyperplane S_n = span{c_k : k ≠ n}. Each S_n holds more rows than the N − 1
that any hyperplane can be fitted through (`benchmarks/results/fedavg_separation.md` counts
them), so a hyperplane holding that many rows, to the wire's rounding, is a true one; and with
all N normals q_n found, the images are the dual basis: q_i · c_n = 0 for i ≠ n, with the bias
coordinate 1. docs/fedavg.md says what it recovers and where it stops.

Finding the rows of one S_n is the hard part (SPEAR's random subsets, Dimitrov et al. NeurIPS
2024, need (rows on S_n / live rows)^(N−1) tries). The server can do much better: it knows θ0
and w_T, so for an estimate c of an image it can tell which units were off for it along the
path from θ0 to w_T. Those units' rows lie on that image's hyperplane far more often than not
once the estimate is roughly right. The estimates are the server's auxiliary images (any images
of the task, never the client's), each mapped into the span and the box [0, 1]; later rounds
map them into the subspace the hyperplanes not yet found leave open, and finally the box's
vertices there, which for images with exact zeros are the images themselves.

A hyperplane is kept only when it holds N + `min_extra_rows` rows within `on_plane` times each
row's rounding (read off the row's share outside the span), those rows pin it down
(σ_{N−1}/σ_N, also with the `leave_out` rows it leans on most removed) and their residuals look
like rounding (reduced χ²). Near-proportional gradient sums of two same-label images make a few
false hyperplanes pass; each costs one image, mixed from two: the box repair moves it along the
line from the image it mixes with to the box's boundary.

Needs: a span (`fedavg.span.image_span`), the first layer's rows at w0 and w_T, auxiliary
images; the client's hyperparameters are not needed. Images without exact zeros or ones (natural
photos) lose the vertex stage and the box repair, not the hyperplanes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.optimize import linprog

from gradleak.errors import ConfigError
from gradleak.fedavg.span import ImageSpan, pixel_affine


# how far a new hyperplane's unit normal must stand from the found ones' span: a true one stands
# well clear, a mix of two found ones (or one found again, a little tilted) almost on it
# (docs/fedavg.md gives the measured spread)
NEW_DIRECTION = 5e-3


@dataclass(frozen=True)
class SeparationConfig:
    on_plane: float = 5.0  # a row lies on a hyperplane within this many times its rounding
    min_extra_rows: int = 8  # a kept hyperplane holds at least N + this many rows
    conditioning: float = 100.0  # σ_{N−1} / σ_N of its rows, at least
    leave_out: int = 4  # ... and still `leave_out_conditioning` with this many rows removed
    leave_out_conditioning: float = 30.0
    max_chi2: float = 2.5  # the rows' mean squared residual in rounding units, per free row
    margin: float = 0.05  # units within this pre-activation of 0 at θ0 count as possibly off
    path_points: int = 11  # points on the straight path θ0 → w_T a unit must be off at
    starts: int = 1800  # auxiliary images tried in the first round
    rounds: int = 20  # later rounds, each with `round_starts` images mapped into the open space
    round_starts: int = 300
    stall: int = 3  # rounds without a new hyperplane before giving up
    vertex_below: int = 50  # with this few hyperplanes missing, try the box's vertices too
    vertex_tries: int = 15
    vertex_missing: int = 3  # with at most this many still missing, the images from vertices

    def check(self) -> None:
        for name in ("min_extra_rows", "leave_out", "path_points", "starts", "rounds",
                     "round_starts", "stall", "vertex_below", "vertex_tries", "vertex_missing"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"separation {name}={value!r}: expected an integer >= 0")
        for name in ("on_plane", "conditioning", "leave_out_conditioning", "max_chi2"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"separation {name}={getattr(self, name)!r}: expected > 0")
        if self.path_points < 2:
            raise ConfigError("separation path_points: expected at least 2 (θ0 and w_T)")


@dataclass
class Separation:
    """The images, when every hyperplane was found; else how many were."""

    images: torch.Tensor | None  # (N, C, H, W) in [0, 1], in no particular order
    hyperplanes: int
    samples: int
    starts: int  # estimates tried
    repaired: int  # images the box repair moved (each a mix of two)
    seconds: float
    normals: np.ndarray  # (found, N) unit normals of the hyperplanes, in the span's coordinates

    @property
    def complete(self) -> bool:
        return self.images is not None

    def as_result(self) -> dict[str, Any]:
        """What an optimisation's run reports, for these images: no matching loss (they come
        from the update's algebra, not from matching it), NaN where a number is expected."""
        return {"images": self.images, "l_sim_raw": float("nan"), "position": float("nan"),
                "restarts_l_sim": [], "restart": 0, "history": []}

    def summary(self) -> dict[str, Any]:
        return {"complete": self.complete, "hyperplanes": self.hyperplanes,
                "samples": self.samples, "starts": self.starts, "repaired": self.repaired,
                "seconds": self.seconds}


def raw_rows(weight: torch.Tensor, bias: torch.Tensor, affine: tuple[torch.Tensor, torch.Tensor]
             ) -> np.ndarray:
    """[W·diag(a) | W·c + b]: the layer acting on [x, 1] for raw pixels x, when the model reads
    a·x + c (float64)."""
    a, c = (t.double() for t in affine)
    w = weight.double()
    return torch.cat([w * a[None], (w @ c + bias.double())[:, None]], 1).numpy()


class _Rows:
    """The live rows of one update in the span's coordinates, with what the search reads."""

    def __init__(self, span: ImageSpan, first: np.ndarray, last: np.ndarray,
                 config: SeparationConfig,
                 affine: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        basis = span.basis.numpy()
        self.basis, self.samples, self.config = basis, span.rank, config
        full = first - last  # the layer's change as a map on [raw pixels, 1] ...
        if affine is not None:  # ... and as the sum Σ_n d_n [x_n, 1]ᵀ over raw images
            a, c = (t.double().numpy() for t in affine)
            weight = full[:, :-1] / a
            bias = full[:, -1] - weight @ c
            full = np.concatenate([(weight - bias[:, None] * c[None]) / a, bias[:, None]], 1)
        rows = full @ basis.T
        # each row's rounding: its share outside the span, per coordinate
        noise = np.linalg.norm(full - rows @ basis, axis=1) / np.sqrt(full.shape[1] - span.rank)
        live = np.linalg.norm(rows, axis=1) > 10 * np.sqrt(span.rank) * np.maximum(noise, 1e-300)
        self.rows, self.noise = rows[live], noise[live]
        self.weighted = self.rows / self.noise[:, None]
        _, values, right = np.linalg.svd(self.rows, full_matrices=False)
        left = self.rows @ right.T / values
        self.whitened = left / np.linalg.norm(left, axis=1, keepdims=True)
        self.unwhiten = right.T / values  # a normal in whitened rows -> in span coordinates
        first, last = first[live], last[live]

        def normalised(weights: np.ndarray) -> np.ndarray:
            return weights @ basis.T / np.linalg.norm(weights[:, :-1], axis=1)[:, None]

        self.start_pre = normalised(first)
        self.path = np.stack([normalised((1 - t) * first + t * last)
                              for t in np.linspace(0.0, 1.0, config.path_points)])
        self.pixels = basis[:, :-1].T  # pixels = pixels @ c
        self.bias = basis[:, -1]

    def __len__(self) -> int:
        return len(self.rows)

    def on(self, normal: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
        near = np.abs(self.weighted @ normal) < self.config.on_plane
        return np.flatnonzero(near if allowed is None else near & allowed)

    def fit(self, index: np.ndarray) -> np.ndarray:
        return np.linalg.svd(self.weighted[index])[2][-1]

    def refine(self, normal: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
        """Refit on the rows within rounding until they stop changing."""
        normal, index = normal / np.linalg.norm(normal), None
        for _ in range(30):
            new = self.on(normal, allowed)
            if len(new) < self.samples - 1 or (index is not None and np.array_equal(new, index)):
                break
            index, normal = new, self.fit(new)
        return normal

    def grow(self, normal: np.ndarray, tries: int = 3) -> np.ndarray:
        """Add the nearest rows outside the hyperplane one at a time while the refit keeps every
        row within rounding: the rows a refit from a slightly tilted start leaves out."""
        index = self.on(normal)
        if len(index) < self.samples - 1:
            return normal
        while True:
            outside = np.setdiff1d(np.arange(len(self)), index)
            added = False
            for row in outside[np.argsort(np.abs(self.weighted[outside] @ normal))][:tries]:
                trial_index = np.append(index, row)
                trial = self.fit(trial_index)
                if np.abs(self.weighted[trial_index] @ trial).max() < self.config.on_plane:
                    index, normal, added = trial_index, trial, True
                    break
            if not added:
                return normal

    def polish(self, normal: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
        """Turn the hyperplane in its weakest direction to the angle most rows outside it share:
        from a mix of two true hyperplanes toward one of them."""
        count = len(self.on(normal, allowed))
        for _ in range(4):
            index = self.on(normal, allowed)
            if len(index) < 2:
                break
            right = np.linalg.svd(self.weighted[index])[2]
            first, second = right[-1], right[-2]
            outside = np.setdiff1d(np.arange(len(self)), index)
            if allowed is not None:
                outside = outside[allowed[outside]]
            if len(outside) < 3:
                break
            angles = np.sort(np.arctan2(-(self.weighted[outside] @ first),
                                        self.weighted[outside] @ second) % np.pi)
            circle = np.concatenate([angles, angles + np.pi])
            shared = np.searchsorted(circle, circle + 1e-3) - np.arange(len(circle))
            best = int(np.argmax(shared[:len(angles)]))
            if shared[best] < 3:
                break
            angle = float(np.median(circle[best:best + shared[best]]))
            turned = self.refine(np.cos(angle) * first + np.sin(angle) * second, allowed)
            turned_count = len(self.on(turned, allowed))
            if turned_count <= count:
                break
            normal, count = turned, turned_count
        return normal

    def from_estimate(self, estimate: np.ndarray) -> np.ndarray:
        """A hyperplane through the rows of the units the estimate keeps off from θ0 to w_T."""
        allowed = self.start_pre @ estimate < self.config.margin
        order = np.argsort((self.path @ estimate).max(0))
        normal = self.unwhiten @ np.linalg.svd(self.whitened[order[:self.samples + 5]])[2][-1]
        return self.polish(self.refine(normal, allowed), allowed)

    def conditioning(self, index: np.ndarray, drops: int) -> float:
        """σ_{N−1}/σ_N of the rows after removing, one at a time, the `drops` rows whose removal
        leaves the hyperplane least determined (judged in the plane of the two weakest
        directions, where a row that alone pins a mix of two hyperplanes shows); stops early
        once below the bar."""
        kept = np.asarray(index)
        for _ in range(drops):
            _, values, right = np.linalg.svd(self.weighted[kept], full_matrices=False)
            weak = self.weighted[kept] @ right[-2:].T  # (rows, 2): their weight on the two
            gram = np.diag(values[-2:] ** 2)[None] - weak[:, :, None] * weak[:, None, :]
            low = np.linalg.eigvalsh(gram)  # each row removed: the 2 × 2 Gram's eigenvalues
            ratio = np.sqrt(np.maximum(low[:, 1], 0) / np.maximum(low[:, 0], 1e-300))
            worst = int(np.argmin(ratio))
            if ratio[worst] < self.config.leave_out_conditioning:
                return float(ratio[worst])
            kept = np.delete(kept, worst)
        return self._ratio(list(kept))

    def _ratio(self, index: list[int]) -> float:
        values = np.linalg.svd(self.weighted[index], compute_uv=False)
        return float(values[-2] / max(values[-1], 1e-300))

    def certified(self, normal: np.ndarray) -> bool:
        config, index = self.config, self.on(normal)
        if len(index) < self.samples + config.min_extra_rows:
            return False
        if self._ratio(list(index)) < config.conditioning:
            return False
        residual = self.weighted[index] @ normal
        if (residual ** 2).sum() / (len(index) - self.samples + 1) > config.max_chi2:
            return False
        return self.conditioning(index, config.leave_out) >= config.leave_out_conditioning

    def loosely_certified(self, normal: np.ndarray) -> bool:
        """For a hyperplane found from a box vertex: holds N rows, pinned down."""
        index = self.on(normal)
        return len(index) >= self.samples and \
            self._ratio(list(index)) >= self.config.leave_out_conditioning

    def duals(self, normals: np.ndarray) -> np.ndarray | None:
        """(N, N) images' coordinates, row n on every hyperplane but n's, bias coordinate 1."""
        duals = np.linalg.inv(normals)
        scale = self.bias @ duals
        return None if np.any(np.abs(scale) < 1e-12) else (duals / scale).T

    def clear_of(self, normal: np.ndarray, others: np.ndarray) -> bool:
        """Whether the unit normal stands NEW_DIRECTION clear of the others' span."""
        if not len(others):
            return True
        inside = np.linalg.lstsq(others.T, normal, rcond=None)[0] @ others
        return bool(np.linalg.norm(normal - inside) >= NEW_DIRECTION)

    def consistent(self, normals: np.ndarray, rounds: int = 10
                   ) -> tuple[np.ndarray, np.ndarray | None]:
        """Refit each hyperplane on the rows of the units its own image keeps off at θ0, and
        recompute the images, until nothing moves: a hyperplane mixed from several true ones
        leans toward the one whose image it holds."""
        normals = normals.copy()
        for n in range(len(normals)):  # a refit that drifts onto another's span is undone
            grown = self.grow(normals[n])
            if self.clear_of(grown, np.delete(normals, n, 0)):
                normals[n] = grown
        images = self.duals(normals)
        for _ in range(rounds):
            if images is None:
                return normals, None
            refit = normals.copy()
            for n in range(len(normals)):
                allowed = self.start_pre @ images[n] < self.config.margin
                turned = self.polish(self.refine(normals[n], allowed), allowed)
                turned *= np.sign(turned @ normals[n]) or 1.0
                if self.clear_of(turned, np.delete(refit, n, 0)):
                    refit[n] = turned
            if np.allclose(np.abs(np.sum(refit * normals, 1)), 1.0, atol=1e-12):
                break
            normals, images = refit, self.duals(refit)
        return normals, images

    def into_open(self, estimate: np.ndarray, normals: np.ndarray) -> np.ndarray:
        """The nearest point with bias coordinate 1 on every found hyperplane (the images not
        yet separated all lie there), then alternated with the box [0, 1]."""
        def project(c: np.ndarray) -> np.ndarray:
            constraints = np.vstack([normals, self.bias[None]])
            target = np.zeros(len(constraints))
            target[-1] = 1.0
            step = np.linalg.lstsq(constraints @ constraints.T, constraints @ c - target,
                                   rcond=None)[0]
            return c - constraints.T @ step
        estimate = project(estimate)
        for _ in range(3):
            pixels = np.clip(np.append(self.pixels @ estimate, 1.0), 0.0, 1.0)
            estimate = project(self.basis @ pixels)
        return estimate

    def vertex(self, normals: np.ndarray, objective: np.ndarray) -> np.ndarray | None:
        """The vertex of the box (relaxed by the wire's rounding) on every hyperplane in
        `normals`, with bias coordinate 1, that minimises objective · c; None if there is none.
        Solved in the coordinates of the open subspace, which has few dimensions late on."""
        equal = np.vstack([normals, self.bias[None]])
        target = np.zeros(len(equal))
        target[-1] = 1.0
        particular = np.linalg.lstsq(equal, target, rcond=None)[0]
        _, values, right = np.linalg.svd(equal)
        free = right[int((values > 1e-10 * values[0]).sum()):].T  # (N, open dimensions)
        if free.shape[1] == 0:
            return particular
        pixels, slack = self.pixels @ free, 1e-3
        moving = np.abs(pixels).max(1) > 1e-12  # pixels no open direction changes stay put
        base = self.pixels[moving] @ particular
        solved = linprog(free.T @ objective, A_ub=np.vstack([pixels[moving], -pixels[moving]]),
                         b_ub=np.concatenate([1 + slack - base, slack + base]),
                         bounds=[(None, None)] * free.shape[1], method="highs")
        return particular + free @ solved.x if solved.status == 0 else None

    def vertices(self, normals: np.ndarray, count: int, rng: np.random.Generator
                 ) -> list[np.ndarray]:
        """Vertices of the box inside the open subspace, by linear programmes with random
        objectives; most active box constraints first."""
        found = [self.vertex(normals, self.pixels.T @ rng.standard_normal(len(self.pixels)))
                 for _ in range(count)]
        return sorted((c for c in found if c is not None), key=lambda c: -active(self.pixels @ c))

    def by_vertices(self, normals: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
        """All N images when a few hyperplanes are missing: the images not separated are the
        box's most active vertices in the open subspace, and each separated image n the vertex
        of the box on every found hyperplane but its own that lies farthest off its own (every
        other image lies on it). Holds for images with exact zeros or ones."""
        missing = self.samples - len(normals)
        candidates = self.vertices(normals, 8 * missing, rng)
        unfound: list[np.ndarray] = []
        for c in candidates:
            if all(np.abs(self.pixels @ (c - other)).max() > 1e-3 for other in unfound):
                unfound.append(c)
            if len(unfound) == missing:
                break
        if len(unfound) < missing:
            return None
        images = []
        for n in range(len(normals)):
            others = np.delete(normals, n, 0)
            ends = [self.vertex(others, sign * normals[n]) for sign in (1.0, -1.0)]
            ends = [c for c in ends if c is not None]
            if not ends:
                return None
            images.append(max(ends, key=lambda c: abs(float(normals[n] @ c))))
        return np.array(images + unfound)


def active(pixels: np.ndarray, tolerance: float = 1e-4) -> int:
    """Pixels at 0 or 1: the box constraints an image holds with equality."""
    return int(((np.abs(pixels) < tolerance) | (np.abs(pixels - 1) < tolerance)).sum())


def box_repair(pixels: np.ndarray, images: np.ndarray) -> tuple[np.ndarray, int]:
    """Move each image along the line from another one to where it leaves the box, where that
    holds at least 10 more pixels at 0 or 1: a mix of two images becomes the one it was mixed
    toward. (N, coordinates) in, the same out, and how many moved."""
    points = images @ pixels.T
    moved = 0
    for k in range(len(images)):
        base, best = active(points[k]), None
        for other in range(len(images)):
            if other == k:
                continue
            direction = points[k] - points[other]
            with np.errstate(divide="ignore", invalid="ignore"):
                up = np.where(direction > 1e-12, (1 - points[k]) / direction, np.inf)
                down = np.where(direction < -1e-12, -points[k] / direction, np.inf)
            step = max(0.0, float(min(up.min(), down.min())))
            if step < 1e-3 or not np.isfinite(step):
                continue
            candidate = images[k] + step * (images[k] - images[other])
            count = active(pixels @ candidate)
            if count >= base + 10 and (best is None or count > best[0]):
                best = (count, candidate)
        if best is not None:
            images[k], points[k] = best[1], pixels @ best[1]
            moved += 1
    return images, moved


def separate(span: ImageSpan, first: np.ndarray, last: np.ndarray, auxiliary: torch.Tensor,
             seed: int = 0, config: SeparationConfig | None = None,
             affine: tuple[torch.Tensor, torch.Tensor] | None = None) -> Separation:
    """The client's images from its first layer's rows at w0 (`first`) and w_T (`last`), both
    (units, pixels + 1) acting on [raw pixels, 1] (`raw_rows` of the per-pixel `affine` the
    model reads, a·x + c; None: the identity), starting from `auxiliary` images (M, C, H, W) in
    [0, 1] of the task, none of them the client's."""
    config = config or SeparationConfig()
    config.check()
    pixels = int(np.prod(span.shape))
    if first.shape != last.shape or first.shape[1] != pixels + 1:
        raise ConfigError(f"separate: rows of shape {first.shape} and {last.shape}, expected "
                          f"(units, {pixels + 1}) for images of shape {span.shape}")
    if auxiliary.dim() != 4 or tuple(auxiliary.shape[1:]) != tuple(span.shape) or \
            not len(auxiliary):
        raise ConfigError(f"separate: auxiliary images of shape {tuple(auxiliary.shape)}, "
                          f"expected (M >= 1, {', '.join(map(str, span.shape))})")
    start = time.perf_counter()
    rows = _Rows(span, first, last, config, affine)
    samples, rng = span.rank, np.random.default_rng(seed)
    flat = auxiliary.detach().flatten(1).double().numpy()
    estimates = np.concatenate([flat, np.ones((len(flat), 1))], 1) @ rows.basis.T
    normals: list[np.ndarray] = []
    tried = 0

    def open_space() -> np.ndarray:
        return np.array(normals) if normals else np.zeros((0, samples))

    def keep(normal: np.ndarray, certified: bool) -> bool:
        # a new hyperplane must stand clear of the found ones' span: a mix of two found ones
        # (two same-label images' near-proportional gradient sums) holds many rows too
        if not certified or not rows.clear_of(normal, open_space()):
            return False
        normals.append(normal)
        return True

    for index in rng.permutation(len(estimates))[:config.starts]:
        if len(normals) >= samples:
            break
        normal = rows.from_estimate(rows.into_open(estimates[index], np.zeros((0, samples))))
        keep(normal, rows.certified(normal))
        tried += 1
    stalled = 0
    for _ in range(config.rounds):
        if len(normals) >= samples or stalled >= config.stall:
            break
        before, found = len(normals), open_space()
        trials = [rows.into_open(estimates[i], found)
                  for i in rng.permutation(len(estimates))[:config.round_starts]]
        if samples - len(normals) <= config.vertex_below:
            trials += rows.vertices(found, config.vertex_tries, rng)
        for estimate in trials:
            if len(normals) >= samples:
                break
            normal = rows.from_estimate(estimate)
            keep(normal, rows.certified(normal))
            tried += 1
        stalled = stalled + 1 if len(normals) == before else 0
    # the last few: the box's vertices in the open subspace, most active first
    while 0 < samples - len(normals) <= config.vertex_below:
        added = False
        for vertex in rows.vertices(open_space(), config.vertex_tries, rng)[:3]:
            normal = rows.from_estimate(vertex)
            tried += 1
            if keep(normal, rows.loosely_certified(normal)):
                added = True
                break
        if not added:
            break
    images, repaired = None, 0
    final, coordinates = open_space(), None
    if len(normals) == samples:
        final, coordinates = rows.consistent(final)
    elif 0 < samples - len(normals) <= config.vertex_missing:
        coordinates = rows.by_vertices(final, rng)
    if coordinates is not None:
        coordinates, repaired = box_repair(rows.pixels, coordinates)
        images = torch.from_numpy(np.clip(coordinates @ rows.pixels.T, 0.0, 1.0)).float() \
            .reshape(samples, *span.shape)
    return Separation(images, len(normals), samples, tried, repaired,
                      time.perf_counter() - start, final)


def separate_update(span: ImageSpan, w0: dict[str, torch.Tensor], wT: dict[str, torch.Tensor],
                    transform: Any, auxiliary: torch.Tensor | None, seed: int = 0,
                    config: SeparationConfig | None = None) -> Separation:
    """`separate` on a client's update: the span's layer read from the state dicts, through
    the model's per-pixel input transform."""
    if auxiliary is None:
        raise ConfigError("method 'separate' starts from auxiliary images of the task (never "
                          "the client's): pass them (--reference, reference=, auxiliary=)")
    affine = pixel_affine(transform, span.shape)
    if affine is None:  # image_span has checked it already
        raise ConfigError("method 'separate': the input transform is not per-pixel a·x + c")
    weight, bias = f"{span.layer}.weight", f"{span.layer}.bias"
    return separate(span, raw_rows(w0[weight], w0[bias], affine),
                    raw_rows(wT[weight], wT[bias], affine), auxiliary, seed, config, affine)
