"""Dimitrov et al.'s replay (`sim`) beside SME on multi-step FedAvg clients.

The digits stand-in (28×28), Flower's template CNN (`flower-cnn`, inputs in [0, 1]), plain SGD,
labels inferred from the update. Dimitrov's FEMNIST setting: E = 10 epochs of 10 batches of 5
(N = 50), at SME's η = 0.004 and at η = 0.05, where the client's trajectory bends more; a
small client (E = 2, N = 4, B = 2) beside it. Each client's update is attacked by SME and by
`sim` with the same iterations; scores are Hungarian-matched per image (PSNR / SSIM / LPIPS)
beside the mean digit, each inferred label's mean digit (an attack needing no optimisation)
and each image's own mean colour (an oracle). An image counts as
recovered when its SSIM is ≥ 0.6 (the share Dimitrov et al. report, defined here once).
Writes benchmarks/results/fedavg_replay.{json,md}.

    python benchmarks/fedavg_replay.py [--iters 300] [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from gradleak.fedavg.attacks import FedAttackConfig, UpdateInversion
from gradleak.fedavg.client import ClientConfig, train_client
from gradleak.fedavg.datasets import digits
from gradleak.fedavg.models import FEDAVG_MODELS
from gradleak.fedavg.scoring import score_recovery
from gradleak.io import write_json
from gradleak.metrics.images import ssim
from gradleak.metrics.scores import image_scores

RESULTS = Path(__file__).parent / "results" / "fedavg_replay"
SETTINGS = ((2, 4, 2, 0.05), (10, 50, 5, 0.004), (10, 50, 5, 0.05))  # (E, N, B, η)
METHODS = ("sme", "sim")
MODEL = "flower-cnn"
RECOVERED_SSIM = 0.6


def one_client(epochs: int, samples: int, batch: int, lr: float, seed: int, iterations: int
               ) -> list[dict]:
    data = digits()
    images, labels = data.sample(samples, seed=seed)
    auxiliary, auxiliary_labels = data.rest(samples, seed=seed)
    torch.manual_seed(seed)
    model = FEDAVG_MODELS.get(MODEL)(1, 28, data.classes)
    client = ClientConfig(epochs=epochs, samples=samples, batch=batch, lr=lr, seed=seed)
    update = train_client(model, images, labels, client)
    colour = images.mean((1, 2, 3), keepdim=True).expand_as(images).contiguous()
    base = {"model": MODEL, "epochs": epochs, "samples": samples, "batch": batch, "lr": lr,
            "seed": seed, "mean_colour": image_scores(colour, images)}
    rows = []
    for method in METHODS:
        config = FedAttackConfig(method=method, iterations=iterations, seed=seed)
        start = time.perf_counter()
        attack = UpdateInversion(model, update, (1, 28, 28), data.classes, config)
        result = attack.run()
        seconds = time.perf_counter() - start
        scored = score_recovery(result["images"], images, auxiliary,
                                reference_labels=auxiliary_labels, labels=attack.labels)
        per_image = ssim(scored["matched"], images)
        rows.append({**base, "method": method, "seconds": seconds, "l_sim": result["l_sim_raw"],
                     **scored["attack"], "mean_image": scored["mean_image"],
                     "class_mean": scored["class_mean"],
                     "labels_right": int(torch.minimum(
                         torch.bincount(attack.labels, minlength=data.classes),
                         torch.bincount(labels, minlength=data.classes)).sum()),
                     "recovered": int((per_image >= RECOVERED_SSIM).sum())})
    return rows


def markdown(rows: list[dict], iterations: int) -> str:
    lines = [f"# Replaying the client's steps (`sim`) beside SME ({iterations} iterations, "
             "labels inferred)", "",
             f"Digits stand-in 28×28, `{MODEL}` (Flower's template CNN) on [0, 1] inputs, plain "
             "SGD. Medians over seeds of the per-client means; recovered: images with SSIM ≥ "
             f"{RECOVERED_SSIM}, summed over seeds; labels: inferred labels right, summed.", "",
             "Class mean: each inferred label's mean auxiliary digit, matched (no optimisation; "
             "the auxiliary digits are the stand-in's others).", "",
             "| E / N / B | η | method | PSNR | SSIM | LPIPS | recovered | labels | 1 − cos | "
             "class mean | mean digit | mean colour (oracle) | s / client |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e, n, b, lr in SETTINGS:
        for method in METHODS:
            group = [r for r in rows if (r["epochs"], r["samples"], r["batch"], r["lr"],
                                         r["method"]) == (e, n, b, lr, method)]
            if not group:
                continue

            def med(get) -> float:
                return statistics.median(get(r) for r in group)

            lines.append(
                f"| {e} / {n} / {b} | {lr:g} | {method} | {med(lambda r: r['psnr']):.2f} | "
                f"{med(lambda r: r['ssim']):.3f} | {med(lambda r: r['lpips']):.3f} | "
                f"{sum(r['recovered'] for r in group)} of {n * len(group)} | "
                f"{sum(r['labels_right'] for r in group)} of {n * len(group)} | "
                f"{med(lambda r: r['l_sim']):.4f} | "
                f"{med(lambda r: r['class_mean']['psnr']):.2f} / "
                f"{med(lambda r: r['class_mean']['ssim']):.3f} | "
                f"{med(lambda r: r['mean_image']['psnr']):.2f} / "
                f"{med(lambda r: r['mean_image']['lpips']):.3f} | "
                f"{med(lambda r: r['mean_colour']['psnr']):.2f} / "
                f"{med(lambda r: r['mean_colour']['lpips']):.3f} | "
                f"{med(lambda r: r['seconds']):.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = []
    for epochs, samples, batch, lr in SETTINGS:
        for seed in range(args.seeds):
            rows += one_client(epochs, samples, batch, lr, seed, args.iters)
            print(f"E={epochs} N={samples} B={batch} lr={lr} seed {seed} done", flush=True)
    write_json(RESULTS.with_suffix(".json"), {"iterations": args.iters, "rows": rows})
    RESULTS.with_suffix(".md").write_text(markdown(rows, args.iters))
    print(RESULTS.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
