"""The client's labels, inferred from its update: the server need not be told them.

With cross-entropy, the output layer's bias gradient on one step is mean_i (p_i − y_i) over its
minibatch. Under plain SGD the update sums them: (b0 − b_T)/η = Σ_t mean_{i∈B_t} (p_i − y_i).
Each sample is seen once per epoch, so the label part is Σ_epochs Σ_batches count_c(batch)/|B|,
which for equal batches is E · count_c / B. The prediction part is estimated by the model's
mean softmax p̄ at the trajectory's two ends on the dummy starting images, giving
count_c ≈ (B / E) (T · p̄_c − Δb_c / η), rounded to N labels by largest remainder. What is
inferred is a multiset of labels, which is all the attack needs (images are matched to the
truth afterwards).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from gradleak.errors import ConfigError
from gradleak.fedavg.client import ClientUpdate
from gradleak.fedavg.forward import ClientForward


def output_bias(model: nn.Module, classes: int) -> str:
    """The name of the bias of the last Linear layer with one output per class."""
    found = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and module.out_features == classes
             and module.bias is not None]
    if not found:
        raise ConfigError(f"{type(model).__name__} has no Linear output layer with a bias and "
                          f"{classes} outputs: its labels cannot be inferred from the update "
                          "(declare them known instead)")
    return f"{found[-1]}.bias"


def infer_label_counts(model: nn.Module, update: ClientUpdate, dummy: torch.Tensor,
                       classes: int, client: ClientForward | None = None) -> np.ndarray:
    """(classes,) non-negative integer counts summing to the client's N; `client`: how its
    forward pass ran (by default the model's buffers, BatchNorm in eval mode)."""
    config = update.config
    if config.optimiser != "sgd":
        raise ConfigError(f"label inference reads a plain-SGD update; this client used "
                          f"{config.optimiser!r}: declare its labels known (--labels known)")
    client = client or ClientForward(buffers={n: b.detach() for n, b in model.named_buffers()})
    return counts_from_bias(model, update.w0, update.wT, client, dummy, classes,
                            lr=config.lr, steps=update.steps, samples=config.samples)


def single_label(model: nn.Module, w0: dict[str, torch.Tensor], wT: dict[str, torch.Tensor],
                 classes: int) -> torch.Tensor:
    """(1,) the label of a one-image client (iDLG's rule, Zhao et al. 2020): each SGD step
    moves the output bias by η(p − e_y), whose only negative entry is the label's, and any
    number of steps (momentum too) keeps it so; no rate or step count is needed."""
    name = output_bias(model, classes)
    return (w0[name] - wT[name]).double().argmin().reshape(1)


def counts_from_bias(model: nn.Module, w0: dict[str, torch.Tensor], wT: dict[str, torch.Tensor],
                     client: ClientForward, dummy: torch.Tensor, classes: int, *, lr: float,
                     steps: int, samples: int) -> np.ndarray:
    """Label counts from the output bias's change over `steps` plain-SGD steps at rate `lr`.
    The (B / E) factor of the estimate is a common scale, which the rounding to N removes, so
    the batch size and epochs need not be known, only T and η."""
    name = output_bias(model, classes)
    delta = (w0[name] - wT[name]).double() / lr
    with torch.no_grad(), client.mode(model):
        mean_p = torch.stack([
            torch.cat([functional_call(model, (w, client.buffers),
                                       (client.transform(dummy[part]),)).softmax(-1)
                       for part in client.chunks(len(dummy))]).mean(0)
            for w in (w0, wT)]).mean(0).double()
    estimate = steps * mean_p - delta
    return largest_remainder(estimate.clamp_min(0).numpy(), samples)


def largest_remainder(values: np.ndarray, total: int) -> np.ndarray:
    """Integers proportional to `values` (≥ 0) that sum to `total`."""
    scaled = values * (total / values.sum()) if values.sum() > 0 else \
        np.full(len(values), total / len(values))
    counts = np.floor(scaled).astype(np.int64)
    order = np.argsort(-(scaled - counts), kind="stable")
    counts[order[:total - int(counts.sum())]] += 1
    if not math.isclose(float(counts.sum()), total):
        raise AssertionError("largest remainder lost a label")
    return counts


def labels_from_counts(counts: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.repeat(np.arange(len(counts)), counts)).long()
