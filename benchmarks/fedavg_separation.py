"""How far the images inside an MLP client's span can be told apart by its ReLU sparsity.

A first Linear layer's update is [ΔW | Δb] = Σ_n c_n [x_n, 1]ᵀ (`fedavg.span`), with c_n[i] = 0
for every hidden unit i that was off for image n at every local step. Read in the span's
basis, the row of such a unit is a combination of the other N − 1 images only: it lies on the
hyperplane S_n = span{x_k : k ≠ n}, and each image is the intersection of the other N − 1
hyperplanes. So the images come back exactly wherever the N hyperplanes are found, which needs
each S_n to hold more than the N − 1 rows any hyperplane can be fitted through. Per client
(the digits stand-in, Linear 784→256, ReLU, Linear; plain SGD at η = 0.004) this measures, with
the private images used only to name the true hyperplanes:

- the live rows, and how many lie on each true hyperplane within the float32 wire's rounding,
  against N − 1;
- how the units off at θ0 for an image (the forward pass the server can run) cover the rows on
  its hyperplane, and how many more they hold (units that came on during local training);
- how many of --starts random hyperplanes refined by trimmed least squares (keep the N + 3 rows
  nearest, refit) end on a true one (normals' cosine above 1 − 1e-4), and how many true ones
  that refinement keeps when it starts on them.

Writes benchmarks/results/fedavg_separation.{json,md}.

    python benchmarks/fedavg_separation.py [--seeds 3] [--starts 200]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
import torch

from gradleak.fedavg.client import ClientConfig
from gradleak.fedavg.experiment import simulate_client
from gradleak.fedavg.forward import identity
from gradleak.fedavg.span import image_span
from gradleak.io import write_json

RESULTS = Path(__file__).parent / "results" / "fedavg_separation"
SETTINGS = ((1, 4, 4), (10, 50, 5), (20, 50, 10))  # (E, N, B)
# a row is on a hyperplane within this many times the wire's rounding that falls in the span
# (the median share of a row outside the span, times √(N / 785))
ON_PLANE = 3.0
HIT = 1e-4  # a fitted hyperplane is a true one when their normals' cosine is above 1 − this


def rows_in_span(epochs: int, samples: int, batch: int, seed: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(the live rows of the first layer's update in the span's basis, normalised; their
    pre-activations at θ0 on the private images; the true hyperplanes' unit normals; the gap)."""
    client = simulate_client("digits", "mlp", ClientConfig(epochs=epochs, samples=samples,
                                                           batch=batch, seed=seed))
    images, model, update = client.images, client.model, client.update
    span, why = image_span(model, update.w0, update.wT, (1, 28, 28), samples, identity)
    if span is None:
        raise SystemExit(f"E={epochs} N={samples} B={batch} seed {seed}: no span ({why})")
    name = span.layer
    first = torch.cat([update.w0[f"{name}.weight"], update.w0[f"{name}.bias"][:, None]], 1)
    change = first - torch.cat([update.wT[f"{name}.weight"],
                                update.wT[f"{name}.bias"][:, None]], 1)
    full = change.double()
    rows = (full @ span.basis.T).numpy()
    norms = np.linalg.norm(rows, axis=1)
    live = norms > 1e-9 * norms.max()
    # the wire's rounding, as the share of each live row outside the span
    outside = (full - (full @ span.basis.T) @ span.basis).norm(dim=1).numpy()[live] / norms[live]
    truth = torch.cat([images.flatten(1).double(), torch.ones(samples, 1, dtype=torch.float64)],
                      1)
    coordinates = (truth @ span.basis.T).numpy()  # (N, N): the images in the span's basis
    normals = np.linalg.inv(coordinates).T  # row n is orthogonal to every image but n
    normals /= np.linalg.norm(normals, axis=1, keepdims=True)
    pre = (first.double()[torch.from_numpy(live)] @ truth.T).numpy()  # (live, N) at θ0
    return rows[live] / norms[live, None], pre, normals, span.gap, float(np.median(outside))


def trimmed_fit(rows: np.ndarray, normal: np.ndarray, keep: int, rounds: int = 50
                ) -> np.ndarray:
    """The hyperplane through the `keep` rows nearest it, refitted until it stops moving."""
    for _ in range(rounds):
        nearest = np.argpartition(np.abs(rows @ normal), keep)[:keep]
        refit = np.linalg.svd(rows[nearest])[2][-1]
        settled = abs(abs(refit @ normal) - 1) < 1e-14
        normal = refit
        if settled:
            break
    return normal


def on_a_true_plane(normals: np.ndarray, fitted: np.ndarray) -> bool:
    return bool((np.abs(normals @ fitted) > 1 - HIT).any())


def one_client(epochs: int, samples: int, batch: int, seed: int, starts: int) -> dict:
    rows, pre, normals, gap, floor = rows_in_span(epochs, samples, batch, seed)
    # the rounding's share within the span's N of the 785 directions, three deviations
    tolerance = ON_PLANE * floor * np.sqrt(samples / 785)
    on_plane = np.abs(rows @ normals.T) < tolerance  # (live, N)
    off_at_start = pre < 0
    covered = (on_plane & off_at_start).sum(0) / np.maximum(on_plane.sum(0), 1)
    extra = (off_at_start & ~on_plane).sum(0)
    keep = min(samples + 3, len(rows) - 1)
    kept = sum(on_a_true_plane(normals, trimmed_fit(rows, normal, keep)) for normal in normals)
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(starts):
        start = rng.standard_normal(samples)
        hits += on_a_true_plane(normals, trimmed_fit(rows, start / np.linalg.norm(start), keep))
    counts = on_plane.sum(0)
    return {"epochs": epochs, "samples": samples, "batch": batch, "seed": seed, "gap": gap,
            "tolerance": float(tolerance),
            "live_rows": int(len(rows)), "rows_on_plane_min": int(counts.min()),
            "rows_on_plane_median": float(np.median(counts)),
            "rows_on_plane_max": int(counts.max()),
            "planes_above_n_minus_1": int((counts > samples - 1).sum()),
            "off_at_theta0_covers": float(np.median(covered)),
            "off_at_theta0_extra_rows": float(np.median(extra)),
            "true_planes_kept_by_the_fit": int(kept),
            "random_starts": starts, "random_starts_on_a_true_plane": hits}


def markdown(rows: list[dict]) -> str:
    lines = ["# Separating an MLP client's images inside its span: what the update offers", "",
             "Digits stand-in 28×28, Linear 784→256, ReLU, Linear; plain SGD η = 0.004; float32 "
             "wire. A row lies on image n's hyperplane when its residual is below "
             f"{ON_PLANE:g} times the rounding that falls in the span (the median share of a "
             "row outside the span, times √(N / 785)). Medians over seeds (min / median / max "
             "over a client's images for the rows per hyperplane).", "",
             "| E / N / B | live rows | rows per true hyperplane | N − 1 | hyperplanes above "
             "N − 1 | of those rows, off at θ0 | rows off at θ0 not on it | true hyperplanes the "
             "trimmed fit keeps | random starts ending on a true hyperplane |",
             "|---|---|---|---|---|---|---|---|---|"]
    for epochs, samples, batch in SETTINGS:
        group = [r for r in rows if (r["epochs"], r["samples"], r["batch"]) ==
                 (epochs, samples, batch)]

        def med(key: str) -> float:
            return statistics.median(r[key] for r in group)

        lines.append(
            f"| {epochs} / {samples} / {batch} | {med('live_rows'):.0f} | "
            f"{med('rows_on_plane_min'):.0f} / {med('rows_on_plane_median'):.0f} / "
            f"{med('rows_on_plane_max'):.0f} | {samples - 1} | "
            f"{sum(r['planes_above_n_minus_1'] for r in group)} of {samples * len(group)} | "
            f"{med('off_at_theta0_covers'):.0%} | {med('off_at_theta0_extra_rows'):.0f} | "
            f"{sum(r['true_planes_kept_by_the_fit'] for r in group)} of "
            f"{samples * len(group)} | "
            f"{sum(r['random_starts_on_a_true_plane'] for r in group)} of "
            f"{sum(r['random_starts'] for r in group)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--starts", type=int, default=200)
    args = parser.parse_args()
    rows = [one_client(*setting, seed, args.starts) for setting in SETTINGS
            for seed in range(args.seeds)]
    write_json(RESULTS.with_suffix(".json"), {"on_plane_deviations": ON_PLANE, "rows": rows})
    RESULTS.with_suffix(".md").write_text(markdown(rows))
    print(RESULTS.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
