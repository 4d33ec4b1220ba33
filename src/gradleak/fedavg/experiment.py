"""One FedAvg client attacked: simulate the round, invert the update, match, score, save."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gradleak.fedavg.attacks import FALLBACK, SEPARATE, FedAttackConfig, UpdateInversion
from gradleak.fedavg.client import ClientConfig, ClientUpdate, train_client
from gradleak.fedavg.datasets import ImageSet, load_dataset
from gradleak.fedavg.models import FEDAVG_MODELS
from gradleak.fedavg.forward import identity
from gradleak.fedavg.scoring import hungarian_match
from gradleak.fedavg.separate import separate_update
from gradleak.fedavg.span import update_spans
from gradleak.errors import ConfigError
from gradleak.io import check_output, write_json
from gradleak.metrics.images import mse, psnr, ssim


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: kB


@dataclass
class SimulatedClient:
    """One client of a simulated round: its data, model (at w_T after training) and update."""

    data: ImageSet
    images: torch.Tensor
    labels: torch.Tensor
    model: nn.Module
    update: ClientUpdate


def simulate_client(dataset: str, model_name: str, client: ClientConfig,
                    labels_known: bool = False) -> SimulatedClient:
    """The client's sample of `dataset` (seeded by client.seed), the registered model built for
    it under torch's seed client.seed, and its local training."""
    model_class = FEDAVG_MODELS.get(model_name)
    data = load_dataset(dataset, seed=client.seed)
    images, labels = data.sample(client.samples, seed=client.seed)
    torch.manual_seed(client.seed)
    model = model_class(images.shape[1], images.shape[-1], data.classes)
    update = train_client(model, images, labels, client, labels_known=labels_known)
    return SimulatedClient(data, images, labels, model, update)


def run_fedavg(dataset: str, model_name: str, client: ClientConfig, attack: FedAttackConfig,
               out: Path | None = None, progress: bool = False) -> dict[str, Any]:
    client.check()  # every argument, and the output location, before any work
    attack.check()
    FEDAVG_MODELS.get(model_name)
    if out is not None:
        check_output(out, "--out", directory=True)
    simulated = simulate_client(dataset, model_name, client, attack.labels == "known")
    data, images, labels = simulated.data, simulated.images, simulated.labels
    model, update = simulated.model, simulated.update
    rss_before, start = peak_rss_mb(), time.perf_counter()
    span, span_note, features = update_spans(model, update.w0, update.wT,
                                             tuple(images.shape[1:]), client.samples, identity,
                                             optimiser=client.optimiser, steps=update.steps,
                                             image=attack.span or attack.method == SEPARATE)
    separation = None
    optimised = attack
    if attack.method == SEPARATE:
        if span is None:
            raise ConfigError(f"--attack {SEPARATE}: {model_name} gives no image span "
                              f"({span_note})")
        # the server's auxiliary images: the dataset without this client's
        auxiliary, _ = data.rest(client.samples, seed=client.seed)
        separation = separate_update(span, update.w0, update.wT, identity, auxiliary,
                                     attack.seed)
        optimised = FedAttackConfig(**{**attack.to_dict(), "method": FALLBACK})
    inversion = UpdateInversion(model, update, tuple(images.shape[1:]), data.classes, optimised,
                                span=span, features=features)
    used = inversion.labels
    result = separation.as_result() \
        if separation is not None and separation.complete else inversion.run(progress)
    seconds = time.perf_counter() - start
    recovered = result["images"][hungarian_match(result["images"], images)]
    scores = {"psnr": psnr(recovered, images).numpy(), "ssim": ssim(recovered, images).numpy(),
              "mse": mse(recovered, images).numpy()}
    summary = {"dataset": data.name, "model": model_name, "client": client.to_dict(),
               "attack": attack.to_dict(),
               "labels": "known (an oracle: the client's true labels, handed to the attack)"
               if attack.labels == "known" else "inferred from the output layer's bias update",
               "label_count_l1": int(np.abs(np.bincount(used.numpy(), minlength=data.classes)
                                            - np.bincount(labels.numpy(),
                                                          minlength=data.classes)).sum()),
               "l_sim_raw": result["l_sim_raw"], "restarts_l_sim": result["restarts_l_sim"],
               "l_sim_scaled": result["l_sim_scaled"] if attack.method in ("nlsme", "sme-dvec")
               else None,
               "path_position": result["position"], "seconds": seconds,
               "separation": separation.summary() if separation is not None else None,
               "span": {**(span.summary() if span is not None else {"unused": span_note}),
                        "feature_spans": sorted(inversion.features)},
               "peak_rss_growth_mb": max(0.0, peak_rss_mb() - rss_before),
               **{k: float(v.mean()) for k, v in scores.items()},
               **{f"{k}_std": float(v.std()) for k, v in scores.items()}}
    if out is not None:
        from gradleak.report.plots import plot_private_vs_reconstructed

        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "metrics.json", summary)
        plot_private_vs_reconstructed(images, recovered, out / "reconstructions.png",
                                      f"{attack.method} on {data.name}")
    return summary
