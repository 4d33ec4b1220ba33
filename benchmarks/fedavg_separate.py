"""How many of an MLP client's images come back exactly from its multi-step update.

`fedavg.separate` (method "separate"): the images' span read off the first Linear layer's
update, then told apart inside it by the hidden units each image kept off from θ0 to w_T,
starting from the server's auxiliary images (the dataset without the client's). The digits
stand-in 28×28, Linear 784→256, ReLU, Linear; plain SGD at η = 0.004; float32 wire. Per setting
(E / N / B) and seed: whether every hyperplane was found, the images' PSNR / SSIM / LPIPS after
Hungarian matching, how many are exact (≥ 40 dB), beside the mean auxiliary digit and each
image's own mean colour (an oracle), and seconds per client. A client whose separation is
incomplete scores its images as none: `invert_update` then falls back to SME in the span.
Writes benchmarks/results/fedavg_separate.{json,md}.

    python benchmarks/fedavg_separate.py [--seeds 5]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from gradleak.fedavg.client import ClientConfig
from gradleak.fedavg.experiment import simulate_client
from gradleak.fedavg.forward import identity
from gradleak.fedavg.scoring import EXACT_DB, score_recovery
from gradleak.fedavg.separate import separate_update
from gradleak.fedavg.span import image_span
from gradleak.io import write_json
from gradleak.metrics.images import psnr
from gradleak.metrics.scores import image_scores

RESULTS = Path(__file__).parent / "results" / "fedavg_separate"
# (E, N, B): one step of four; three epochs of twelve; Dimitrov et al.'s FEMNIST setting (10
# epochs of 10 batches of 5); the NL-SME paper's (20 epochs, 50 images, batches of 10)
SETTINGS = ((1, 4, 4), (3, 12, 4), (10, 50, 5), (20, 50, 10))


def one_client(epochs: int, samples: int, batch: int, seed: int) -> dict:
    client = simulate_client("digits", "mlp", ClientConfig(epochs=epochs, samples=samples,
                                                           batch=batch, seed=seed))
    images, model, update = client.images, client.model, client.update
    auxiliary, _ = client.data.rest(samples, seed=seed)
    span, why = image_span(model, update.w0, update.wT, (1, 28, 28), samples, identity)
    if span is None:
        raise SystemExit(f"E={epochs} N={samples} B={batch} seed {seed}: no span ({why})")
    result = separate_update(span, update.w0, update.wT, identity, auxiliary, seed)
    colour = images.mean((1, 2, 3), keepdim=True).expand_as(images).contiguous()
    row = {"epochs": epochs, "samples": samples, "batch": batch, "seed": seed,
           "steps": update.steps, "span_gap": span.gap, **result.summary(),
           "mean_colour": image_scores(colour, images)}
    if result.images is None:
        scored = score_recovery(torch.zeros_like(images), images, auxiliary)
        return {**row, "exact": 0, "psnr_median": None, "psnr_min": None,
                "mean_image": scored["mean_image"]}
    scored = score_recovery(result.images, images, auxiliary)
    per_image = psnr(scored["matched"], images)
    return {**row, **scored["attack"], "mean_image": scored["mean_image"],
            "exact": int((per_image >= EXACT_DB).sum()),
            "psnr_median": float(per_image.median()), "psnr_min": float(per_image.min())}


def markdown(rows: list[dict]) -> str:
    lines = ["# Exact images from an MLP client's multi-step update (method `separate`)", "",
             "Digits stand-in 28×28, Linear 784→256, ReLU, Linear; plain SGD η = 0.004; float32 "
             "wire; the server's auxiliary images are the dataset without the client's. Exact: "
             f"≥ {EXACT_DB:g} dB after Hungarian matching. PSNR: median and minimum over a "
             "client's images, then the median over seeds; SSIM / LPIPS: means, then the "
             "median over seeds. An incomplete separation counts no image.", "",
             "| E / N / B | local steps | clients complete | exact images | PSNR median / min "
             "| SSIM | LPIPS | mean digit PSNR / SSIM / LPIPS | mean colour (oracle) | "
             "s / client |", "|---|---|---|---|---|---|---|---|---|---|"]
    for epochs, samples, batch in SETTINGS:
        group = [r for r in rows if (r["epochs"], r["samples"], r["batch"]) ==
                 (epochs, samples, batch)]
        if not group:
            continue
        done = [r for r in group if r["complete"]]

        def med(get, among=group) -> str:
            values = [get(r) for r in among if get(r) is not None]
            return f"{statistics.median(values):.3f}" if values else "–"

        exact, images = sum(r["exact"] for r in group), samples * len(group)
        lines.append(
            f"| {epochs} / {samples} / {batch} | {group[0]['steps']} | {len(done)} of "
            f"{len(group)} | {exact} of {images} ({exact / images:.0%})"
            f" | {med(lambda r: r['psnr_median'], done)} / {med(lambda r: r['psnr_min'], done)}"
            f" | {med(lambda r: r.get('ssim'), done)} | {med(lambda r: r.get('lpips'), done)} | "
            f"{med(lambda r: r['mean_image']['psnr'])} / {med(lambda r: r['mean_image']['ssim'])}"
            f" / {med(lambda r: r['mean_image']['lpips'])} | "
            f"{med(lambda r: r['mean_colour']['psnr'])} / "
            f"{med(lambda r: r['mean_colour']['ssim'])} | {med(lambda r: r['seconds'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for setting in SETTINGS:
        for seed in range(args.seeds):
            rows.append(one_client(*setting, seed))
            r = rows[-1]
            print(f"E/N/B {setting} seed {seed}: complete {r['complete']}, hyperplanes "
                  f"{r['hyperplanes']}, exact {r['exact']}, {r['seconds']:.1f} s", flush=True)
    write_json(RESULTS.with_suffix(".json"), {"exact_db": EXACT_DB, "rows": rows})
    RESULTS.with_suffix(".md").write_text(markdown(rows))
    print(RESULTS.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
