"""Audit recorded client updates: every method on every update file, scored where the truth is
known, one row per (update, method), and the report over all of them.

`audit_update` is what a worker process runs for the Flower strategy and what
`gradleak fedavg-invert` runs for one file: it reads only the update file, the model and the
declared options, never the client's data (the truth, when given, is used to score only).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.fedavg.attacks import METHODS, FedAttackConfig
from gradleak.fedavg.invert import FitWarning, Training, invert_update, replay_config
from gradleak.fedavg.scoring import label_agreement, score_recovery
from gradleak.fedavg.update_file import read_update, transform_from_dict
from gradleak.io import write_json
from gradleak.metrics.leak import leaks
from gradleak.metrics.scores import image_scores


@dataclass
class AuditOptions:
    methods: tuple[str, ...] = ("sme",)
    iterations: int = 1000
    batchnorm: str | None = None  # None: the mode the update file declares, else "train"
    labels: str = "infer"  # "infer" from the output bias, or "known" (the truth's, declared)
    running_stats: bool = True
    seed: int = 0
    threads: int = 1  # torch threads in a worker: several workers share the machine
    attack: dict[str, Any] = field(default_factory=dict)  # FedAttackConfig fields

    def check(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:  # none at all: record the updates only
            raise ConfigError(f"methods {list(self.methods)}: expected some of "
                              f"{', '.join(METHODS)}")
        if self.iterations < 1:
            raise ConfigError(f"iterations {self.iterations}: expected >= 1")
        if self.batchnorm not in (None, "train", "eval"):
            raise ConfigError(f"batchnorm {self.batchnorm!r}: expected train or eval")
        if self.labels not in ("infer", "known"):
            raise ConfigError(f"labels {self.labels!r}: expected infer or known")
        if self.threads < 1:
            raise ConfigError(f"threads {self.threads}: expected >= 1")
        own = {"method", "iterations", "seed", "labels"}  # AuditOptions' fields say those
        unknown = sorted(set(self.attack) - (set(FedAttackConfig.__dataclass_fields__) - own))
        if unknown:
            raise ConfigError(f"attack options {unknown}: expected FedAttackConfig fields other "
                              f"than {sorted(own)}")
        FedAttackConfig(**self.attack).check()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Truth:
    """The client's private data, for scoring only (a simulation, or an auditor who owns it)."""

    images: torch.Tensor  # (N, C, H, W) in [0, 1]
    labels: torch.Tensor | None = None


def audit_update(path: Path, model_fn: Callable[[], nn.Module], options: AuditOptions,
                 out: Path, truth: Truth | None = None, reference: torch.Tensor | None = None,
                 input_transform: Any = None, declared: dict[str, Any] | None = None,
                 shape: tuple[int, ...] | None = None, label: str | None = None,
                 reference_labels: torch.Tensor | None = None) -> list[dict[str, Any]]:
    """Each method on one update file; rows written to OUT/<label>.json (label: the file's
    stem unless given), pictures beside it. `declared` and `shape` override what the file says
    (hyperparameters, image shape). With the auxiliary images' labels, each row also scores
    each used label's mean auxiliary image (the class-mean row: what the labels alone give)."""
    label = label or path.stem
    torch.set_num_threads(options.threads)
    update = read_update(path)
    meta = update.meta
    transform = input_transform if input_transform is not None else \
        transform_from_dict(meta.get("input_transform"), str(path))
    training = Training.from_mapping({**meta.get("config", {}), **meta.get("hyperparameters", {}),
                                      **(declared or {})}, f"{path}: hyperparameters")
    if "separate" in options.methods and reference is None:
        raise ConfigError("method 'separate' starts from the auxiliary images: give them "
                          "(--reference, AuditStrategy(reference=))")
    if options.attack.get("start") == "class-mean" and reference_labels is None:
        raise ConfigError("start 'class-mean' begins from each label's mean auxiliary image: "
                          "give labelled auxiliary images (--reference with labels, "
                          "AuditStrategy(reference=, reference_labels=))")
    if "sim" in options.methods:  # refused here, not after the other methods' compute
        replay_config(model_fn(), update.w0, update.wT, int(meta["num_examples"]), training,
                      options.batchnorm or meta.get("batchnorm", "train"))
    labels = None
    if options.labels == "known":
        if truth is None or truth.labels is None:
            raise ConfigError("labels are declared known, but no true labels were given")
        labels = truth.labels
    rows = []
    for method in options.methods:
        model = model_fn()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"the model factory returned a {type(model).__name__}, expected "
                              "a torch.nn.Module")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FitWarning)
            result = invert_update(
                model, update.w0, update.wT, samples=int(meta["num_examples"]),
                shape=tuple(shape or meta["shape"]), labels=labels, input_transform=transform,
                batchnorm=options.batchnorm or meta.get("batchnorm", "train"), method=method,
                hyperparameters=training, iterations=options.iterations,
                running_stats=options.running_stats, seed=options.seed,
                auxiliary=reference, auxiliary_labels=reference_labels, **options.attack)
        row = {"update": path.name, "round": meta["round"], "node_id": meta["node_id"],
               "num_examples": meta["num_examples"], **result.summary(),
               "update_norm": update_norm(model, update.w0, update.wT),
               "warnings": [str(w.message) for w in caught if w.category is FitWarning]}
        if truth is not None:
            row.update(score_row(result.images, result.labels, truth, reference, model,
                                 out / f"{label}-{method}.png", method, reference_labels))
        rows.append(row)
    write_json(out / f"{label}.json", {"rows": rows, "options": options.to_dict()})
    return rows


def update_norm(model: nn.Module, w0: dict[str, torch.Tensor], wT: dict[str, torch.Tensor]
                ) -> float:
    """‖w0 − w_T‖ over the parameters (not the buffers): equal across clients when a clipping
    mod set it."""
    return float(sum(((w0[n].double() - wT[n].double()) ** 2).sum()
                     for n, _ in model.named_parameters()) ** 0.5)


def score_row(images: torch.Tensor, labels: torch.Tensor, truth: Truth,
              reference: torch.Tensor | None, model: nn.Module, picture: Path,
              method: str, reference_labels: torch.Tensor | None = None) -> dict[str, Any]:
    from gradleak.report.plots import plot_private_vs_reconstructed

    if tuple(images.shape) != tuple(truth.images.shape):
        raise ConfigError(f"the truth holds images of shape {tuple(truth.images.shape)}, the "
                          f"update's are {tuple(images.shape)}")
    scores = score_recovery(images, truth.images, reference, reference_labels=reference_labels,
                            labels=labels)
    row: dict[str, Any] = {**scores["attack"], "images": len(truth.images),
                           "exact": scores["exact"], "per_image_psnr": scores["per_image"]["psnr"]}
    if "mean_image" in scores:
        row["mean_image"] = scores["mean_image"]
        row["above_mean_image"] = scores["above_mean_image"]
        row["psnr_gain_over_mean_image"] = row["psnr"] - scores["mean_image"]["psnr"]
    if "class_mean" in scores:
        row["class_mean"] = scores["class_mean"]
    # each image's own mean colour: an oracle reference (it reads the private image)
    colour = truth.images.mean((2, 3), keepdim=True).expand_as(truth.images).contiguous()
    row["mean_colour"] = image_scores(colour, truth.images)
    if truth.labels is not None:
        classes = max(int(truth.labels.max()), int(labels.max())) + 1
        row["labels_right"] = label_agreement(labels, truth.labels, classes)["right"]
    picture.parent.mkdir(parents=True, exist_ok=True)
    plot_private_vs_reconstructed(truth.images, scores["matched"], picture, method)
    row["picture"] = picture.name
    return row


def averaged(scores: Sequence[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric every score measured."""
    keys = [k for k in ("psnr", "ssim", "lpips") if scores and all(k in s for s in scores)]
    return {k: sum(s[k] for s in scores) / len(scores) for k in keys}


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per method: mean scores over audited updates, the references beside them, and the
    metrics on which the method beats the mean image (`metrics.leak`, the RL verdict's rule)."""
    out: dict[str, Any] = {}
    for method in sorted({r["method"] for r in rows}):
        mine = [r for r in rows if r["method"] == method]
        scored = [r for r in mine if "psnr" in r]
        entry: dict[str, Any] = {"updates": len(mine),
                                 "l_sim": sum(r["l_sim"] for r in mine) / len(mine),
                                 "seconds": sum(r["seconds"] for r in mine) / len(mine),
                                 "poor_fit": sum(bool(r["warnings"]) for r in mine)}
        for key in ("psnr", "ssim", "lpips", "psnr_gain_over_mean_image"):
            values = [r[key] for r in scored if r.get(key) is not None]
            if values:
                entry[key] = sum(values) / len(values)
        for key in ("images", "exact", "above_mean_image"):  # image counts, summed
            if scored and all(key in r for r in scored):
                entry[key] = sum(r[key] for r in scored)
        for name in ("mean_image", "mean_colour", "class_mean"):
            reference = averaged([r[name] for r in scored if name in r])
            if reference:
                entry[name] = reference
        if "mean_image" in entry:
            entry["mean_image_psnr"] = entry["mean_image"]["psnr"]
            entry["leaks"] = leaks(entry, entry["mean_image"])
            if "class_mean" in entry:  # the labels alone, set against the mean image as well
                gain = entry["class_mean"]["psnr"] - entry["mean_image"]["psnr"]
                entry["class_mean_leaks"] = leaks(
                    {**entry["class_mean"], "psnr_gain_over_mean_image": gain},
                    entry["mean_image"])
        labelled = [r for r in scored if "labels_right" in r and r["labels_inferred"]]
        if labelled:
            entry["labels_inferred_right"] = sum(r["labels_right"] for r in labelled)
            entry["labels_inferred_of"] = sum(r["num_examples"] for r in labelled)
        out[method] = entry
    return out

