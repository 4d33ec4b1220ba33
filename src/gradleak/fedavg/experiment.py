"""One FedAvg client attacked: simulate the round, invert the update, match, score, save."""

from __future__ import annotations

import math
import resource
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.fedavg.attacks import FALLBACK, SEPARATE, FedAttackConfig, UpdateInversion
from gradleak.fedavg.client import ClientConfig, ClientUpdate, train_client
from gradleak.fedavg.datasets import ImageSet, load_dataset
from gradleak.fedavg.forward import ClientForward, client_forward, identity
from gradleak.fedavg.invert import FitWarning, attack_result
from gradleak.fedavg.models import FEDAVG_MODELS
from gradleak.fedavg.scoring import hungarian_match
from gradleak.fedavg.separate import Separation, separate_update
from gradleak.fedavg.span import LINEAR_OPTIMISERS, ImageSpan, first_linear, update_spans
from gradleak.fedavg.walk import Walk, Walked, plan_walk, walk_update
from gradleak.io import check_output, write_json
from gradleak.metrics.images import mse, psnr, ssim
from gradleak.names import TRAINING_FREE


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

    def forward(self) -> ClientForward:
        """The client's forward pass as the server replays it: BatchNorm in the mode the client
        trained it in, matched to the running statistics its buffers carry."""
        config = self.update.config
        assert config is not None  # a simulated client declares how it trained
        return client_forward(self.model, self.update.buffers0, self.update.buffersT,
                              batchnorm="train" if config.batchnorm_train else "eval",
                              batch=config.batch, steps=self.update.steps)

    def attack(self, attack: FedAttackConfig, progress: bool = False) -> Attacked:
        """The server's attack: from the update, the declared settings, the model and (for
        method separate and the class-mean start) the dataset's other images, never the
        client's own."""
        update, shape = self.update, tuple(self.images.shape[1:])
        config = update.config
        assert config is not None
        start = time.perf_counter()
        span, span_note, features = update_spans(self.model, update.w0, update.wT, shape,
                                                 config.samples, identity,
                                                 optimiser=config.optimiser, steps=update.steps,
                                                 image=attack.span or attack.method == SEPARATE)
        separation, optimised, walked = None, attack, None
        if attack.method == TRAINING_FREE:  # its fit scored by the gradient at w0 (IG's)
            walked = walk_update(self.plan_walk(), update.w0, update.wT, update.buffers0,
                                 update.buffersT)
            optimised = FedAttackConfig(**{**attack.to_dict(), "method": "ig"})
            doubt = walked.doubt()
            if doubt is not None:
                warnings.warn(doubt, FitWarning, stacklevel=2)
        if attack.method == SEPARATE:
            if span is None:
                raise ConfigError(f"--attack {SEPARATE}: the client's update gives no image "
                                  f"span ({span_note})")
            auxiliary, _ = self.data.rest(config.samples, seed=config.seed)
            separation = separate_update(span, update.w0, update.wT, identity, auxiliary,
                                         attack.seed)
            optimised = FedAttackConfig(**{**attack.to_dict(), "method": FALLBACK})
        inversion = UpdateInversion(self.model, update, shape, self.data.classes, optimised,
                                    client=self.forward(), span=span, features=features,
                                    auxiliary=self.data.rest(config.samples, seed=config.seed))
        result = attack_result(inversion, walked, separation, progress)
        return Attacked(result, inversion.labels, time.perf_counter() - start, span, span_note,
                        sorted(inversion.features), separation, inversion.client.batchnorm,
                        walked)

    def plan_walk(self) -> Walk:
        """Method training-free's walk for this client (fedavg.walk), or why there is none."""
        config = self.update.config
        assert config is not None
        return plan_walk(self.model, tuple(self.images.shape[1:]), identity, config.samples,
                         self.update.steps, config.optimiser,
                         "train" if config.batchnorm_train else "eval")


@dataclass
class Attacked:
    """What the server's attack on one simulated client gave."""

    result: dict[str, Any]  # UpdateInversion.run's keys (images, l_sim_raw, ...)
    labels: torch.Tensor  # the labels the attack used (inferred unless declared known)
    seconds: float
    span: ImageSpan | None
    span_note: str  # why there is no span, where there is none
    feature_spans: list[str]
    separation: Separation | None
    batchnorm: str  # the mode the replay ran BatchNorm in
    walked: Walked | None = None  # method training-free's image and checks


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


def check_span_possible(dataset: str, model_name: str, client: ClientConfig) -> None:
    """Before any training: the model's first layer reads the flattened image and the client's
    optimiser sums gradients, which the separation needs (the rank gap is checked after)."""
    data = load_dataset(dataset, seed=client.seed)
    shape = tuple(data.images.shape[1:])
    model = FEDAVG_MODELS.get(model_name)(shape[0], shape[-1], data.classes)
    layer, why = first_linear(model, shape, identity)
    if layer is None:
        raise ConfigError(f"--attack {SEPARATE}: model {model_name} gives no image span ({why})")
    if client.optimiser not in LINEAR_OPTIMISERS:
        raise ConfigError(f"--attack {SEPARATE}: the client's optimiser ({client.optimiser}) "
                          "rescales each entry, so its update spans nothing")


def check_walk_possible(dataset: str, model_name: str, client: ClientConfig) -> None:
    """Before any training: one image, one step, and a model the walk passes."""
    data = load_dataset(dataset, seed=client.seed)
    shape = tuple(data.images.shape[1:])
    model = FEDAVG_MODELS.get(model_name)(shape[0], shape[-1], data.classes)
    plan_walk(model, shape, identity, client.samples,
              client.epochs * math.ceil(client.samples / client.batch), client.optimiser,
              "train" if client.batchnorm_train else "eval")


def run_fedavg(dataset: str, model_name: str, client: ClientConfig, attack: FedAttackConfig,
               out: Path | None = None, progress: bool = False) -> dict[str, Any]:
    client.check()  # every argument, and the output location, before any work
    attack.check()
    FEDAVG_MODELS.get(model_name)
    if out is not None:
        check_output(out, "--out", directory=True)
    if attack.method == SEPARATE:
        check_span_possible(dataset, model_name, client)
    if attack.method == TRAINING_FREE:
        check_walk_possible(dataset, model_name, client)
    simulated = simulate_client(dataset, model_name, client, attack.labels == "known")
    data, images, labels = simulated.data, simulated.images, simulated.labels
    rss_before = peak_rss_mb()
    attacked = simulated.attack(attack, progress)
    result, used, seconds = attacked.result, attacked.labels, attacked.seconds
    span, span_note, separation = attacked.span, attacked.span_note, attacked.separation
    recovered = result["images"][hungarian_match(result["images"], images)]
    scores = {"psnr": psnr(recovered, images).numpy(), "ssim": ssim(recovered, images).numpy(),
              "mse": mse(recovered, images).numpy()}
    summary = {"dataset": data.name, "model": model_name, "client": client.to_dict(),
               "attack": attack.to_dict(), "batchnorm": attacked.batchnorm,
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
               "walk": attacked.walked.summary() if attacked.walked is not None else None,
               "span": {**(span.summary() if span is not None else {"unused": span_note}),
                        "feature_spans": attacked.feature_spans},
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
