"""A FedAvg client: E local epochs of minibatch training from w0, then it sends w_T.

Functional throughout (torch.func.functional_call on explicit parameter dicts): nothing goes
through `.grad`, so no optimiser state or `zero_grad` semantics can leak between runs, the
failure that broke the public SME code.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

from gradleak.errors import ConfigError

OPTIMISERS = ("sgd", "momentum", "adamw")


@dataclass
class ClientConfig:
    epochs: int = 20  # E
    samples: int = 50  # N
    batch: int = 10  # B
    lr: float = 0.004  # η (SME's victim)
    optimiser: str = "sgd"  # robustness settings: "momentum" (0.9), "adamw"
    batchnorm_train: bool = False  # BatchNorm in train mode (SME's victim keeps eval mode)
    shuffle: bool = True  # a new batch order every epoch
    seed: int = 0

    def check(self) -> None:
        for name in ("epochs", "samples", "batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"client {name} {getattr(self, name)}: expected >= 1")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"client lr {self.lr}: expected a finite number > 0")
        if self.seed < 0:
            raise ConfigError(f"--seed {self.seed}: expected a non-negative integer")
        if self.optimiser not in OPTIMISERS:
            raise ConfigError(f"client optimiser {self.optimiser!r}: expected one of "
                              f"{', '.join(OPTIMISERS)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ClientUpdate:
    """What the server holds after one round: w0, w_T and the declared training settings."""

    w0: dict[str, torch.Tensor]
    wT: dict[str, torch.Tensor]
    config: ClientConfig | None  # None: the server was not told how the client trained
    steps: int
    labels: torch.Tensor | None  # only when the experiment declares labels known (an oracle)
    # the buffers the client sent with w0 and w_T (BatchNorm's running statistics and counters)
    buffers0: dict[str, torch.Tensor] = field(default_factory=dict)
    buffersT: dict[str, torch.Tensor] = field(default_factory=dict)

    def delta(self) -> dict[str, torch.Tensor]:
        """w0 − w_T: the direction the client's gradients summed to."""
        return {name: self.w0[name] - self.wT[name] for name in self.w0}


def batch_order(config: ClientConfig, rng: np.random.Generator | None = None
                ) -> list[np.ndarray]:
    """Minibatch indices for every local step, epoch after epoch (last batch may be short);
    shuffled by `rng`, by default the client's own seeded one."""
    rng = rng or np.random.default_rng(config.seed)
    steps = []
    for _ in range(config.epochs):
        order = rng.permutation(config.samples) if config.shuffle else np.arange(config.samples)
        steps += [order[i:i + config.batch] for i in range(0, config.samples, config.batch)]
    return steps


def train_client(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                 config: ClientConfig, labels_known: bool = False) -> ClientUpdate:
    """images (N, C, H, W) in [0, 1], labels (N,) → the client's update: what the server
    holds (w0, w_T, the declared settings). It carries the labels only where an experiment
    declares them known, an oracle every result names."""
    config.check()
    if len(images) != config.samples or len(labels) != config.samples:
        raise ConfigError(f"the client holds {len(images)} images and {len(labels)} labels, "
                          f"its config says N = {config.samples}")
    model.train(config.batchnorm_train)
    w0 = {name: p.detach().clone() for name, p in model.named_parameters()}
    initial = {name: b.detach().clone() for name, b in model.named_buffers()}
    buffers = {name: b.clone() for name, b in initial.items()}  # BatchNorm updates these
    weights = {name: p.clone() for name, p in w0.items()}

    def loss(parameters: dict[str, torch.Tensor], running: dict[str, torch.Tensor],
             x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # buffers are an input, not a capture: BatchNorm in train mode updates them in place
        return F.cross_entropy(functional_call(model, (parameters, running), (x,)), y)

    step_gradient = grad(loss)
    state = {name: torch.zeros_like(p) for name, p in weights.items()}
    second = {name: torch.zeros_like(p) for name, p in weights.items()}
    steps = batch_order(config)
    for t, index in enumerate(steps, start=1):
        gradients = step_gradient(weights, buffers, images[index], labels[index])
        weights = local_step(weights, gradients, state, second, config, t)
    return ClientUpdate(w0, weights, config, len(steps), labels.clone() if labels_known else None,
                        initial, buffers)


def local_step(weights: dict[str, torch.Tensor], gradients: dict[str, torch.Tensor],
               state: dict[str, torch.Tensor], second: dict[str, torch.Tensor],
               config: ClientConfig, t: int) -> dict[str, torch.Tensor]:
    """Step t of the client's optimiser; `state` and `second` hold its moments between steps."""
    if config.optimiser == "sgd":
        return {n: w - config.lr * gradients[n] for n, w in weights.items()}
    if config.optimiser == "momentum":
        for n in weights:
            state[n] = 0.9 * state[n] + gradients[n]
        return {n: w - config.lr * state[n] for n, w in weights.items()}
    # AdamW (torch's defaults: β = (0.9, 0.999), ε = 1e-8, weight decay 0.01)
    out = {}
    for n, w in weights.items():
        state[n] = 0.9 * state[n] + 0.1 * gradients[n]
        second[n] = 0.999 * second[n] + 0.001 * gradients[n] ** 2
        m_hat, v_hat = state[n] / (1 - 0.9 ** t), second[n] / (1 - 0.999 ** t)
        out[n] = w * (1 - config.lr * 0.01) - config.lr * m_hat / (v_hat.sqrt() + 1e-8)
    return out
