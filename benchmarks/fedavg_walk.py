"""One image, one step: the training-free walk on FedAvg clients, beside IG on the same updates.

A client that trained one SGD step on one image (E = N = B = 1, η = 0.004 as every FedAvg
benchmark here, float32 wire) sends one sample's gradient. Method "training-free"
(`fedavg.walk`) walks the model down from its Linear layer with the RL attack's layer inverses
and solves the first conv's equations; nothing is declared (η cancels, the label comes from
the output bias's sign). Per model × dataset × seed: PSNR / SSIM / LPIPS, exact (≥ 40 dB), the
label, 1 − cos of the image's own gradient against the update, ms per image; IG (300
iterations, as the ladder's CNN rungs: 1,000 on the strided CNN take 90 s a client here) on
the same update; the mean auxiliary image and the image's mean colour (an
oracle). Models the walk refuses are listed with its reason. Writes
benchmarks/results/fedavg_walk.{json,md}.

    python benchmarks/fedavg_walk.py [--seeds 6] [--ig-iterations 300] [--models M ...]

`--models` measures those models only and keeps the other models' rows of the results file.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from host import machine, write_results

from gradleak.errors import ConfigError
from gradleak.fedavg.attacks import FedAttackConfig
from gradleak.fedavg.client import ClientConfig
from gradleak.fedavg.datasets import load_dataset
from gradleak.fedavg.experiment import simulate_client
from gradleak.fedavg.forward import identity
from gradleak.fedavg.models import FEDAVG_MODELS
from gradleak.fedavg.scoring import EXACT_DB, score_recovery
from gradleak.fedavg.walk import plan_walk
from gradleak.metrics.scores import image_scores

RESULTS = Path(__file__).parent / "results" / "fedavg_walk.json"
DATASETS = {"digits": "digits 28×28", "photos": "photos 32×32"}
# (model, BatchNorm in train mode)
WALKED = (("lenet-sigmoid", False), ("cnn-strided", False), ("cnn-strided-bn", True),
          ("cnn-strided-gn", False), ("mlp", False))
REFUSED = ("flower-cnn", "cnn", "cnn-bn", "resnet8")
METRICS = ("psnr", "ssim", "lpips")


def one_client(dataset: str, model: str, train_mode: bool, seed: int, ig_iterations: int
               ) -> dict:
    client = simulate_client(dataset, model, ClientConfig(epochs=1, samples=1, batch=1,
                                                          batchnorm_train=train_mode,
                                                          seed=seed))
    images = client.images
    auxiliary, _ = client.data.rest(1, seed=seed)
    colour = images.mean((2, 3), keepdim=True).expand_as(images).contiguous()
    row = {"dataset": dataset, "model": model, "batchnorm_train": train_mode, "seed": seed,
           "mean_colour": image_scores(colour, images)}
    for method, iterations in (("training-free", 1), ("ig", ig_iterations)):
        attacked = client.attack(FedAttackConfig(method=method, iterations=iterations,
                                                 seed=seed))
        scored = score_recovery(attacked.result["images"], images, auxiliary)
        row[method] = {**scored["attack"], "exact": scored["exact"],
                       "label_right": bool(torch.equal(attacked.labels, client.labels)),
                       "l_sim": attacked.result["l_sim_raw"],
                       "ms": 1000 * attacked.seconds}
        if attacked.walked is not None:
            row[method]["walk"] = attacked.walked.summary()
        row["mean_image"] = scored["mean_image"]
    return row


def refusal(dataset: str, model: str) -> str:
    data = load_dataset(dataset)
    shape = tuple(data.images.shape[1:])
    try:
        plan_walk(FEDAVG_MODELS.get(model)(shape[0], shape[-1], data.classes), shape, identity,
                  1, 1, "sgd", "eval")
    except ConfigError as error:
        return str(error)
    return ""


def median(rows: list[dict], *path: str) -> float:
    values = []
    for row in rows:
        value = row
        for key in path:
            value = value[key]
        values.append(float(value))
    return statistics.median(values)


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = ["# One image, one step: the training-free walk on FedAvg clients "
             f"({result['machine']})", "",
             f"{result['seeds']} clients per model and dataset, each one image and one plain "
             "SGD step (η = 0.004, float32 wire); nothing declared to the attack (η cancels in "
             "the walk, the label is the output bias's only negative entry). Medians over "
             f"clients; exact: ≥ {EXACT_DB:g} dB; 1 − cos: the recovered image's own gradient "
             "at w0 against the update. IG: the same updates, "
             f"{result['ig_iterations']} iterations. References: the mean auxiliary image, "
             "the image's own mean colour (an oracle).", "",
             "| dataset | model | training-free PSNR / SSIM / LPIPS | min PSNR | exact | labels "
             "| 1 − cos | ms / image | IG PSNR / SSIM / LPIPS | IG exact | mean image | mean "
             "colour |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for dataset in DATASETS:
        for model, train_mode in WALKED:
            group = [r for r in rows if r["dataset"] == dataset and r["model"] == model]
            if not group:
                continue

            def triple(method: str, group: list[dict] = group) -> str:
                return " / ".join(f"{median(group, method, m):.{2 if m == 'psnr' else 3}f}"
                                  for m in METRICS)

            walked = [r["training-free"] for r in group]
            lines.append(
                f"| {DATASETS[dataset]} | `{model}`{', BN train' if train_mode else ''} | "
                f"{triple('training-free')} | "
                f"{min(w['psnr'] for w in walked):.2f} | "
                f"{sum(w['exact'] for w in walked)} of {len(group)} | "
                f"{sum(w['label_right'] for w in walked)} of {len(group)} | "
                f"{median(group, 'training-free', 'l_sim'):.1e} | "
                f"{median(group, 'training-free', 'ms'):.0f} | {triple('ig')} | "
                f"{sum(r['ig']['exact'] for r in group)} of {len(group)} | "
                f"{triple('mean_image')} | {median(group, 'mean_colour', 'psnr'):.2f} / "
                f"{median(group, 'mean_colour', 'ssim'):.3f} |")
    lines += ["", "Refused before any work (the walk's reason, one image of the digits):", ""]
    lines += [f"- `{model}`: {reason}" for model, reason in result["refused"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--ig-iterations", type=int, default=300)
    parser.add_argument("--models", nargs="+", choices=[model for model, _ in WALKED],
                        help="measure these only, keeping the results file's other rows")
    args = parser.parse_args()
    rows = []
    if args.models and RESULTS.exists():
        kept = json.loads(RESULTS.read_text())
        if (kept["seeds"], kept["ig_iterations"]) != (args.seeds, args.ig_iterations):
            parser.error(f"{RESULTS} holds {kept['seeds']} seeds at {kept['ig_iterations']} IG "
                         "iterations: measure the same to keep its rows")
        rows = [row for row in kept["rows"] if row["model"] not in args.models]
    for dataset in DATASETS:
        for model, train_mode in WALKED:
            if args.models and model not in args.models:
                continue
            for seed in range(args.seeds):
                rows.append(one_client(dataset, model, train_mode, seed, args.ig_iterations))
                walked, ig = rows[-1]["training-free"], rows[-1]["ig"]
                print(f"{dataset} {model} seed {seed}: training-free {walked['psnr']:.2f} dB "
                      f"({walked['ms']:.0f} ms), IG {ig['psnr']:.2f} dB", flush=True)
    result = {"machine": machine(), "seeds": args.seeds, "ig_iterations": args.ig_iterations,
              "exact_db": EXACT_DB, "rows": rows,
              "refused": {model: refusal("digits", model) for model in REFUSED}}
    write_results(RESULTS, result, markdown(result))


if __name__ == "__main__":
    main()
