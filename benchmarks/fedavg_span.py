"""What the spans of Linear layers' updates give the FedAvg attacks, and what they do not.

The digits stand-in (28×28), plain SGD at η = 0.004, labels inferred from the update.
- `mlp` (first layer Linear on the image): the dummy images kept in the span the first layer's
  update determines, whatever E and B (`fedavg.image_span`);
- `flower-cnn` (Flower's template CNN, inputs in [0, 1]), one-step updates: the dummy inputs of
  each Linear layer pulled into the span its update determines (`fedavg.feature_spans`).
Per (model, E, N, B) and seed: IG, SME and NL-SME with the spans and without (the control), on
the same clients and budgets. Scores are
Hungarian-matched per image (PSNR / SSIM / LPIPS), beside the mean digit and each image's own
mean colour (an oracle); "exact" counts images at ≥ 40 dB. Also: the span's rank and gap, and the
largest pixel change the projection makes to the private images (0 if they lie in it).
Writes benchmarks/results/fedavg_span.{json,md}.

    python benchmarks/fedavg_span.py [--iters 1000] [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from gradleak.fedavg.attacks import FedAttackConfig, UpdateInversion
from gradleak.fedavg.client import ClientConfig, train_client
from gradleak.fedavg.datasets import digits
from gradleak.fedavg.forward import identity
from gradleak.fedavg.models import FEDAVG_MODELS
from gradleak.fedavg.scoring import EXACT_DB, score_recovery
from gradleak.fedavg.span import feature_spans, image_span
from gradleak.io import write_json
from gradleak.metrics.images import psnr
from gradleak.metrics.scores import image_scores

RESULTS = Path(__file__).parent / "results" / "fedavg_span"
SETTINGS = (("mlp", 1, 1, 1), ("mlp", 1, 4, 4), ("mlp", 20, 50, 10),
            ("flower-cnn", 1, 1, 1), ("flower-cnn", 1, 4, 4))  # (model, E, N, B)
METHODS = ("ig", "sme", "nlsme")


def one_client(name: str, epochs: int, samples: int, batch: int, seed: int, iterations: int
               ) -> list[dict]:
    data = digits()
    images, labels = data.sample(samples, seed=seed)
    torch.manual_seed(seed)
    model = FEDAVG_MODELS.get(name)(1, 28, data.classes)
    client = ClientConfig(epochs=epochs, samples=samples, batch=batch, seed=seed)
    update = train_client(model, images, labels, client)
    span, _ = image_span(model, update.w0, update.wT, (1, 28, 28), samples, identity)
    features = feature_spans(model, update.w0, update.wT, samples) if update.steps == 1 else {}
    colour = images.mean((1, 2, 3), keepdim=True).expand_as(images).contiguous()
    base = {"model": name, "epochs": epochs, "samples": samples, "batch": batch, "seed": seed,
            "span_rank": span.rank if span else None, "span_gap": span.gap if span else None,
            "truth_off_span": float(span.distance(images).max()) if span else None,
            "feature_spans": sorted(features), "mean_colour": image_scores(colour, images)}
    rows = []
    for method in METHODS:
        for kept in (True, False):
            config = FedAttackConfig(method=method, iterations=iterations, seed=seed, span=kept,
                                     feature_span=FedAttackConfig.feature_span if kept else 0)
            start = time.perf_counter()
            result = UpdateInversion(model, update, (1, 28, 28), data.classes, config,
                                     span=span if kept else None,
                                     features=features if kept else None).run()
            seconds = time.perf_counter() - start
            scored = score_recovery(result["images"], images, data.images)
            per_image = psnr(scored["matched"], images)
            rows.append({**base, "method": method, "span": kept, "seconds": seconds,
                         **scored["attack"], "mean_image": scored["mean_image"],
                         "exact": int((per_image >= EXACT_DB).sum())})
    return rows


def markdown(rows: list[dict], iterations: int) -> str:
    lines = [f"# Spans of Linear layers' updates, used or not ({iterations} iterations, labels "
             "inferred)", "",
             "Digits stand-in 28×28, plain SGD η = 0.004. `mlp`: Linear 784→256, ReLU, Linear; "
             "its images' span. `flower-cnn`: Flower's template CNN on [0, 1] inputs; one-step "
             "updates, each Linear layer's input span. Medians over seeds of the per-client "
             "means. Exact: images ≥ 40 dB.", "",
             "| model | E / N / B | method | spans | PSNR | SSIM | LPIPS | exact | mean digit | "
             "mean colour (oracle) | s / client |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["model"], r["epochs"], r["samples"], r["batch"], r["method"], r["span"])
                   for r in rows},
                  key=lambda k: (k[0] != "mlp", k[2], k[1], METHODS.index(k[4]), not k[5]))
    for name, e, n, b, method, kept in keys:
        group = [r for r in rows if (r["model"], r["epochs"], r["samples"], r["batch"],
                                     r["method"], r["span"]) == (name, e, n, b, method, kept)]

        def med(get) -> float:
            return statistics.median(get(r) for r in group)

        lines.append(
            f"| {name} | {e} / {n} / {b} | {method} | {'used' if kept else 'no'} | "
            f"{med(lambda r: r['psnr']):.2f} | {med(lambda r: r['ssim']):.3f} | "
            f"{med(lambda r: r.get('lpips', float('nan'))):.3f} | "
            f"{sum(r['exact'] for r in group)} of {n * len(group)} | "
            f"{med(lambda r: r['mean_image']['psnr']):.2f} / "
            f"{med(lambda r: r['mean_image'].get('lpips', float('nan'))):.3f} | "
            f"{med(lambda r: r['mean_colour']['psnr']):.2f} / "
            f"{med(lambda r: r['mean_colour'].get('lpips', float('nan'))):.3f} | "
            f"{med(lambda r: r['seconds']):.1f} |")
    spans = {(r["epochs"], r["samples"], r["batch"]): r for r in rows if r["model"] == "mlp"}
    lines += ["", "The `mlp` images' span: rank, σ_N/σ_N+1 (float32 wire) and the largest pixel "
              "change its projection makes to the private images (median over seeds).", "",
              "| E / N / B | rank | gap | private images off the span |", "|---|---|---|---|"]
    for (e, n, b), r in sorted(spans.items(), key=lambda kv: kv[0][1]):
        group = [x for x in rows if x["model"] == "mlp"
                 and (x["epochs"], x["samples"], x["batch"]) == (e, n, b)]
        lines.append(f"| {e} / {n} / {b} | {r['span_rank']} | "
                     f"{statistics.median(x['span_gap'] for x in group):.3g} | "
                     f"{statistics.median(x['truth_off_span'] for x in group):.2e} |")
    used = Counter((r["samples"], ", ".join(sorted(r["feature_spans"], key=int)) or "none")
                   for r in rows if r["model"] != "mlp" and r["method"] == METHODS[0]
                   and r["span"])
    lines += ["", "`flower-cnn`'s Linear layers (module index) with a rank-N span: "
              + "; ".join(f"N = {n}: {names} ({count} client{'s' * (count > 1)})"
                          for (n, names), count in sorted(used.items())) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for name, epochs, samples, batch in SETTINGS:
        for seed in range(args.seeds):
            rows += one_client(name, epochs, samples, batch, seed, args.iters)
            print(f"{name} E={epochs} N={samples} B={batch} seed {seed} done", flush=True)
    write_json(RESULTS.with_suffix(".json"), {"iterations": args.iters, "rows": rows})
    RESULTS.with_suffix(".md").write_text(markdown(rows, args.iters))
    print(RESULTS.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
