"""How a client's forward pass ran, for an attack that replays it on dummy data.

Three things a real client does that a naive replay gets wrong, each silently:
- its inputs are in the model's own range (Flower's template normalises to [−1, 1]): the dummy
  images live in [0, 1] and go through the declared `transform` first;
- BatchNorm in train mode normalises with each minibatch's own statistics: the dummy set is
  split into minibatches of the client's declared batch size, each normalised by itself, and no
  running statistic is written (torch's in-place update cannot run under `torch.func`);
- those running statistics are part of what the client sends: after T steps with momentum m,
  r_T = (1 − m)^T r_0 + Σ_t m (1 − m)^(T−t) μ_t, so (r_T − (1 − m)^T r_0) / (1 − (1 − m)^T) is a
  weighted mean of the per-batch means μ_t of every BatchNorm input (and likewise variances).
  `running_targets` holds those, and `loss` returns how far the dummy set's batch statistics
  are from them, an extra term the attack matches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
BATCHNORM_MODES = ("train", "eval")
Transform = Callable[[torch.Tensor], torch.Tensor]


def identity(images: torch.Tensor) -> torch.Tensor:
    return images


def batchnorm_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, BATCHNORMS)}


@dataclass
class ClientForward:
    buffers: dict[str, torch.Tensor]
    transform: Transform = identity
    batchnorm: str = "eval"
    batch: int | None = None  # the client's minibatch size, where BatchNorm trains
    # BatchNorm module name → (mean, variance) the running statistics reveal
    running_targets: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    running_weight: float = 1.0

    @contextlib.contextmanager
    def mode(self, model: nn.Module) -> Iterator[dict[str, list[torch.Tensor]]]:
        """BatchNorm as the client ran it; yields each BatchNorm's inputs seen meanwhile."""
        layers = batchnorm_layers(model)
        seen: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
        saved = {name: (m.training, m.track_running_stats) for name, m in layers.items()}
        hooks = []
        try:
            for name, module in layers.items():
                module.train(self.batchnorm == "train")
                # batch statistics, and nothing written: F.batch_norm gets no running buffers
                module.track_running_stats = self.batchnorm != "train"
                if name in self.running_targets:
                    hooks.append(module.register_forward_pre_hook(
                        lambda _m, inputs, name=name: seen[name].append(inputs[0])))
            yield seen
        finally:
            for hook in hooks:
                hook.remove()
            for name, module in layers.items():
                module.training, module.track_running_stats = saved[name]

    def chunks(self, count: int) -> list[slice]:
        size = self.batch if self.batchnorm == "train" and self.batch else count
        return [slice(i, min(i + size, count)) for i in range(0, count, size)]

    def loss(self, model: nn.Module, weights: dict[str, torch.Tensor], images: torch.Tensor,
             labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The client's mean minibatch loss on `images`, and the running-statistics mismatch
        (0 without targets)."""
        parts = self.chunks(len(images))
        with self.mode(model) as seen:
            losses = [F.cross_entropy(functional_call(model, (weights, self.buffers),
                                                      (self.transform(images[part]),)),
                                      labels[part]) for part in parts]
        return torch.stack(losses).mean(), self._mismatch(seen)

    def _mismatch(self, seen: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        total, scale = torch.zeros(()), torch.zeros(())
        for name, (mean, variance) in self.running_targets.items():
            means, variances = zip(*(batch_statistics(x) for x in seen[name]))
            total = total + squared(torch.stack(means).mean(0) - mean) \
                + squared(torch.stack(variances).mean(0) - variance)
            scale = scale + squared(mean) + squared(variance)
        return total / scale.clamp_min(1e-12) if self.running_targets else total


def squared(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor * tensor).sum()


def batch_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and unbiased variance, as BatchNorm's running statistics record them."""
    dims = [0, *range(2, x.dim())]
    return x.mean(dims), x.var(dims, unbiased=True)


def running_targets(model: nn.Module, before: dict[str, torch.Tensor],
                    after: dict[str, torch.Tensor], steps: int
                    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The per-batch statistics' weighted mean that each BatchNorm's running buffers reveal."""
    targets = {}
    for name, module in batchnorm_layers(model).items():
        keys = (f"{name}.running_mean", f"{name}.running_var")
        momentum = module.momentum
        if momentum is None or not all(k in before and k in after for k in keys):
            continue  # a cumulative average (momentum None) reveals nothing we model
        kept = (1.0 - momentum) ** steps
        if kept >= 1.0 - 1e-12:
            continue
        targets[name] = tuple((after[k].double() - kept * before[k].double()).div(1.0 - kept)
                              .float() for k in keys)
    return targets



def client_forward(model: nn.Module, buffers0: dict[str, torch.Tensor],
                   buffersT: dict[str, torch.Tensor], *, batchnorm: str, batch: int | None,
                   steps: int | None, transform: Transform = identity,
                   running_stats: bool = True, running_weight: float = 1.0) -> ClientForward:
    """The forward pass as the client ran it, from the buffers it sent with w0 and w_T: in
    train mode the dummy set is normalised per minibatch of `batch` and, where `running_stats`,
    matched to the statistics the running buffers moved by over `steps`."""
    floats = {name: b for name, b in buffers0.items() if b.is_floating_point()}
    client = ClientForward(buffers=dict(floats), transform=transform, batchnorm=batchnorm,
                           batch=batch, running_weight=running_weight)
    if batchnorm == "train" and running_stats and steps:
        client.running_targets = running_targets(model, floats, buffersT, steps)
    return client
