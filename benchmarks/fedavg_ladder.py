"""The FedAvg ladder: what each attack recovers from a client's update, from one image and one
step up to Dimitrov et al.'s and the NL-SME paper's multi-step clients, MLP and BatchNorm.

Each rung is a simulated client (`fedavg.experiment.simulate_client`: the dataset's seeded
sample, the registered model under the same seed, plain SGD; float32 wire) attacked as the
server would (`SimulatedClient.attack`: labels inferred from the output bias, BatchNorm replayed
in the client's mode, the span where the first layer gives one; `separate` starts from the
dataset's other images). Scores are per image after Hungarian matching: PSNR / SSIM / LPIPS;
exact: ≥ 40 dB; recovered: SSIM ≥ 0.6 (the share Dimitrov et al. report, defined once);
above the mean image: better than the mean auxiliary image in PSNR, SSIM and LPIPS at once.
References beside every row: the mean auxiliary image, each inferred label's mean auxiliary
image (the class mean: labels plus auxiliary data, no optimisation) and each image's own mean
colour (an oracle). A method named "m/class-mean" is m started from those class means (the
label-conditioned prior, `FedAttackConfig.start`) instead of noise. Labels: inferred right, as multisets; with every count right the
labels-known oracle poses the same problem (the dummy images are interchangeable), so it is not
run again here (`flower_audit` has a known-labels row).
Writes benchmarks/results/fedavg_ladder.{json,md,png}; a run stopped midway resumes with
--resume (the JSON is rewritten after every client).

    python benchmarks/fedavg_ladder.py [--iters 1000] [--seeds 3] [--resume]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from gradleak.fedavg.attacks import FedAttackConfig  # noqa: E402
from gradleak.fedavg.client import ClientConfig  # noqa: E402
from gradleak.fedavg.experiment import simulate_client  # noqa: E402
from gradleak.fedavg.scoring import (better_everywhere, class_means,  # noqa: E402
                                     hungarian_match, label_agreement, per_image_scores,
                                     score_recovery)
from gradleak.io import write_json  # noqa: E402
from gradleak.metrics.scores import image_scores  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "fedavg_ladder"
RECOVERED_SSIM = 0.6


@dataclass(frozen=True)
class Rung:
    name: str
    dataset: str
    model: str
    epochs: int
    samples: int
    batch: int
    lr: float
    methods: tuple[str, ...]  # "method" or "method/start" (FedAttackConfig.start)
    target: str  # what the issue asks of this rung
    batchnorm_train: bool = False
    iterations: int | None = None  # a cap for the costly rungs (else --iters)


RUNGS = (
    Rung("one image, one step", "digits", "flower-cnn", 1, 1, 1, 0.05,
         ("ig", "sme", "nlsme", "ig/class-mean"), "≥ 40 dB"),
    Rung("four images, one step", "digits", "flower-cnn", 1, 4, 4, 0.05,
         ("ig", "sme", "nlsme", "ig/class-mean"), "≥ 25 dB, every image above the mean image"),
    Rung("Dimitrov's FEMNIST setting", "digits", "flower-cnn", 10, 50, 5, 0.004,
         ("sme", "nlsme", "sme/class-mean"), "≥ 45% recovered"),
    Rung("Dimitrov's setting, LEAF CNN", "digits", "cnn", 10, 50, 5, 0.004,
         ("sme", "sme/class-mean"), "≥ 45% recovered", iterations=300),
    Rung("NL-SME paper's setting", "digits", "cnn", 20, 50, 10, 0.004,
         ("nlsme", "sme/class-mean"), "≥ 20 dB", iterations=300),
    Rung("MLP client", "digits", "mlp", 20, 50, 10, 0.004, ("separate", "sme"),
         "≥ 90% exact"),
    Rung("ResNet-8, BatchNorm in train mode", "photos", "resnet8", 2, 8, 4, 0.05,
         ("ig", "sme", "sme/class-mean"), "above the mean image", batchnorm_train=True,
         iterations=300),
)


def one_client(rung: Rung, seed: int, iterations: int, methods: list[str]
               ) -> tuple[list[dict], dict]:
    iterations = min(iterations, rung.iterations or iterations)
    client = ClientConfig(epochs=rung.epochs, samples=rung.samples, batch=rung.batch,
                          lr=rung.lr, batchnorm_train=rung.batchnorm_train, seed=seed)
    simulated = simulate_client(rung.dataset, rung.model, client)
    images, data = simulated.images, simulated.data
    auxiliary, auxiliary_labels = data.rest(rung.samples, seed=seed)
    mean = auxiliary.mean(0, keepdim=True).expand_as(images).contiguous()
    colour = images.mean((2, 3), keepdim=True).expand_as(images).contiguous()
    mean_per_image = per_image_scores(mean, images)
    rows, best = [], {}
    for method in methods:
        name, _, start = method.partition("/")
        attacked = simulated.attack(FedAttackConfig(method=name, iterations=iterations,
                                                    start=start or "random", seed=seed))
        scored = score_recovery(attacked.result["images"], images, auxiliary,
                                reference_labels=auxiliary_labels, labels=attacked.labels)
        scores = scored["per_image"]
        guess = class_means(auxiliary, auxiliary_labels, attacked.labels)
        prior = per_image_scores(guess[hungarian_match(guess, images)], images)
        separation = attacked.separation
        rows.append({
            **asdict(rung), "seed": seed, "method": method, "iterations": iterations,
            "seconds": attacked.seconds, "l_sim": attacked.result["l_sim_raw"],
            "batchnorm": attacked.batchnorm, **scored["attack"],
            "exact": scored["exact"],
            "recovered": sum(v >= RECOVERED_SSIM for v in scores["ssim"]),
            "above_mean_image": scored["above_mean_image"],
            # the same counts for the class means alone (no optimisation)
            "class_mean_recovered": sum(v >= RECOVERED_SSIM for v in prior["ssim"]),
            "class_mean_above_mean_image": sum(better_everywhere(prior, mean_per_image)),
            "labels": label_agreement(attacked.labels, simulated.labels, data.classes),
            "separation": separation.summary() if separation is not None else None,
            "mean_image": scored["mean_image"], "class_mean": scored["class_mean"],
            "mean_colour": image_scores(colour, images)})
        if not best or rows[-1]["psnr"] > best["psnr"]:
            best = {"psnr": rows[-1]["psnr"], "method": method, "truth": images[:8],
                    "matched": scored["matched"][:8]}
    return rows, best


def markdown(rows: list[dict], iterations: int, seeds: int) -> str:
    lines = [f"# The FedAvg ladder ({platform.machine()}, 2 threads, torch {torch.__version__}, "
             f"no GPU; up to {iterations} iterations, {seeds} seed(s), labels inferred)", "",
             "Per rung and method: medians over seeds of the per-client mean PSNR (dB) / SSIM / "
             "LPIPS (lower is closer); counts summed over seeds: exact ≥ 40 dB, recovered SSIM ≥ "
             f"{RECOVERED_SSIM}, above the mean image in PSNR, SSIM and LPIPS at once; labels "
             "inferred right. References (medians): the mean auxiliary image, each inferred "
             "label's mean auxiliary image (class mean), each image's own mean colour (an "
             "oracle). Digits: the 28×28 stand-in; photos: 32×32 crops (CIFAR stand-in).", "",
             "The class means' own counts (no optimisation) follow each count after a slash: "
             "on the digits stand-in (8×8 digits resized, little variation within a class) an "
             "SSIM of 0.6 is within reach of the labels alone, so \"recovered\" says little "
             "unless it beats them.", "",
             "| rung | model | E / N / B | method | iters | PSNR / SSIM / LPIPS | exact | "
             "recovered / class mean's | above mean image / class mean's | labels | mean image | "
             "class mean | mean colour | s / client | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rung in RUNGS:
        for method in rung.methods:
            group = [r for r in rows if r["name"] == rung.name and r["method"] == method]
            if not group:
                continue
            total = rung.samples * len(group)

            def med(key: str, sub: str | None = None) -> float:
                return statistics.median(r[key][sub] if sub else r[key] for r in group)

            def triple(key: str | None) -> str:
                if key is None:
                    return f"{med('psnr'):.2f} / {med('ssim'):.3f} / " + (
                        f"{med('lpips'):.3f}" if "lpips" in group[0] else "-")
                return f"{med(key, 'psnr'):.2f} / {med(key, 'ssim'):.3f} / " + (
                    f"{med(key, 'lpips'):.3f}" if "lpips" in group[0][key] else "-")

            bn = ", BN train" if rung.batchnorm_train else ""
            lines.append(
                f"| {rung.name} | `{rung.model}`{bn} | {rung.epochs} / {rung.samples} / "
                f"{rung.batch} | {method} | {group[0]['iterations']} | {triple(None)} | "
                f"{sum(r['exact'] for r in group)} of {total} | "
                f"{sum(r['recovered'] for r in group)} / "
                f"{sum(r['class_mean_recovered'] for r in group)} of {total} | "
                f"{sum(r['above_mean_image'] for r in group)} / "
                f"{sum(r['class_mean_above_mean_image'] for r in group)} of {total} | "
                f"{sum(r['labels']['right'] for r in group)} of {total} | "
                f"{triple('mean_image')} | {triple('class_mean')} | {triple('mean_colour')} | "
                f"{med('seconds'):.1f} | {rung.target} |")
    lines += ["", "Dimitrov et al.'s replay (`sim`) on the same settings: `fedavg_replay`; the "
              "Flower federation (3 × 8 digits, E = 5, B = 4, through `AuditStrategy`): "
              "`flower_audit`; the MLP client at more settings: `fedavg_separate`."]
    return "\n".join(lines) + "\n"


def picture(best: dict[str, dict], path: Path) -> None:
    """Per rung (the first client this run attacked), the client's images above the best
    method's."""
    names = [r.name for r in RUNGS if r.name in best]
    columns = max(len(best[n]["truth"]) for n in names)
    figure, axes = plt.subplots(2 * len(names), columns, squeeze=False,
                                figsize=(0.8 * columns + 1.6, 1.7 * len(names)))
    for k, name in enumerate(names):
        for row, key in enumerate(("truth", "matched")):
            for i in range(columns):
                axis = axes[2 * k + row, i]
                axis.set_xticks([])
                axis.set_yticks([])
                if i < len(best[name][key]):
                    image = best[name][key][i].detach().clamp(0, 1).permute(1, 2, 0).numpy()
                    axis.imshow(image.squeeze(-1) if image.shape[-1] == 1 else image,
                                cmap="gray", vmin=0, vmax=1)
                else:
                    axis.axis("off")
            label = textwrap.fill(name, 18) if row == 0 else best[name]["method"]
            axes[2 * k + row, 0].set_ylabel(label, fontsize=6, rotation=0, ha="right")
    figure.tight_layout()
    figure.savefig(path, dpi=72)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=1000,
                        help="iterations per inversion (the costly rungs cap it at 300)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--resume", action="store_true",
                        help="keep the clients a stopped run of the same settings finished")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows: list[dict] = []
    target = RESULTS.with_suffix(".json")
    if args.resume and target.exists():
        saved = json.loads(target.read_text())
        if saved["iterations"] == args.iters:
            rows = saved["rows"]
    best: dict[str, dict] = {}
    for rung in RUNGS:
        for seed in range(args.seeds):
            done = {r["method"] for r in rows if r["name"] == rung.name and r["seed"] == seed}
            missing = [m for m in rung.methods if m not in done]  # a resumed run's remainder
            if not missing:
                continue
            found, shown = one_client(rung, seed, args.iters, missing)
            rows += found
            best.setdefault(rung.name, shown)
            write_json(target, {"iterations": args.iters, "seeds": args.seeds, "rows": rows})
            print(f"{rung.name} seed {seed}: " + ", ".join(
                f"{r['method']} {r['psnr']:.2f} dB" for r in found), flush=True)
    RESULTS.with_suffix(".md").write_text(markdown(rows, args.iters, args.seeds))
    picture(best, RESULTS.with_suffix(".png"))
    print(RESULTS.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
