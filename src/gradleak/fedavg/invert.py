"""`invert_update`: any classifier's FedAvg update, inverted as the server sees it.

    from gradleak.fedavg import invert_update, Normalize
    result = invert_update(Net(), w0, w_T, samples=8, shape=(1, 28, 28),
                           input_transform=Normalize(0.5, 0.5), batchnorm="train",
                           hyperparameters={"lr": 0.05, "epochs": 5, "batch": 4})

`w0` and `w_T` are the state dicts the server broadcast and received (Flower's ArrayRecord
`.to_torch_state_dict()`): the model tells its parameters (the update that is matched) from its
buffers (BatchNorm's running statistics and counter, used as the client used them). Images are
recovered in [0, 1] and reach the model through `input_transform`, declared like the client's
own preprocessing. Labels are given, or inferred from the output bias's change (which needs the
client's learning rate and step count: declared, or read off BatchNorm's batch counter).
What the server was told about the client's training is reported with every result; what was
not told is never guessed silently.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.fedavg.attacks import (
    FALLBACK,
    METHODS,
    SEPARATE,
    FedAttackConfig,
    UpdateInversion,
    check_labelled,
)
from gradleak.fedavg.client import OPTIMISERS, ClientConfig, ClientUpdate
from gradleak.fedavg.forward import (
    BATCHNORM_MODES,
    ClientForward,
    Transform,
    batchnorm_layers,
    client_forward,
    identity,
)
from gradleak.fedavg.labels import counts_from_bias, labels_from_counts, single_label
from gradleak.fedavg.separate import Separation, separate_update
from gradleak.fedavg.span import update_spans
from gradleak.fedavg.walk import Walked, plan_walk, walk_update
from gradleak.names import TRAINING_FREE

# optimisers whose update moves the output bias by a positive sum of gradients
SINGLE_LABEL_OPTIMISERS = (None, "sgd", "momentum")
# 1 − cosine above this after the optimisation: the dummy data do not explain the update
POOR_FIT = 0.2


class FitWarning(UserWarning):
    """The attack's matching loss, or the update itself, says its assumptions are wrong."""


@dataclass(frozen=True)
class Normalize:
    """x_model = (x − mean) / std per channel, x in [0, 1]: torchvision's Normalize, which
    Flower's template applies with mean = std = 0.5 (inputs in [−1, 1])."""

    mean: tuple[float, ...] | float = 0.0
    std: tuple[float, ...] | float = 1.0

    def __post_init__(self) -> None:
        for name in ("mean", "std"):
            value = getattr(self, name)
            values = (value,) if isinstance(value, (int, float)) else tuple(value)
            if not values or not all(isinstance(v, (int, float)) and math.isfinite(v)
                                     for v in values):
                raise ConfigError(f"Normalize {name}={value!r}: expected finite numbers")
            object.__setattr__(self, name, tuple(float(v) for v in values))
        if any(s <= 0 for s in self.std):
            raise ConfigError(f"Normalize std={self.std}: expected positive values")

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (images.dim() - 2)
        mean = torch.tensor(self.mean, dtype=images.dtype).view(shape)
        std = torch.tensor(self.std, dtype=images.dtype).view(shape)
        return (images - mean) / std

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "normalize", **asdict(self)}


@dataclass(frozen=True)
class Training:
    """What the server was told about the client's local training (all optional)."""

    lr: float | None = None
    epochs: int | None = None
    batch: int | None = None
    steps: int | None = None  # local SGD steps; epochs · ⌈N / B⌉ when those are declared
    optimiser: str | None = None
    shuffle: bool | None = None  # a new batch order every epoch (method "sim"; None: assumed)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None, source: str) -> Training:
        """From a dict with Flower-style keys (lr, local-epochs / epochs, batch-size / batch)."""
        values = dict(values or {})
        aliases = {"local-epochs": "epochs", "local_epochs": "epochs", "batch-size": "batch",
                   "batch_size": "batch", "learning-rate": "lr", "learning_rate": "lr"}
        found: dict[str, Any] = {}
        for key, value in values.items():
            name = aliases.get(key, key)
            if name in cls.__dataclass_fields__:
                found[name] = value
        for name in ("epochs", "batch", "steps"):
            if name in found and (isinstance(found[name], bool)
                                  or not isinstance(found[name], (int, np.integer))
                                  or found[name] < 1):
                raise ConfigError(f"{source}: {name}={found[name]!r}, expected an integer >= 1")
        if "lr" in found and not (isinstance(found["lr"], (int, float)) and
                                  math.isfinite(found["lr"]) and found["lr"] > 0):
            raise ConfigError(f"{source}: lr={found['lr']!r}, expected a finite number > 0")
        if "shuffle" in found and not isinstance(found["shuffle"], bool):
            raise ConfigError(f"{source}: shuffle={found['shuffle']!r}, expected true or false")
        return cls(**{k: (float(v) if k == "lr" else v if k in ("optimiser", "shuffle")
                          else int(v)) for k, v in found.items()})

    def local_steps(self, samples: int) -> int | None:
        if self.steps is not None:
            return self.steps
        if self.epochs is not None and self.batch is not None:
            return self.epochs * math.ceil(samples / self.batch)
        return None

    def replayable(self, samples: int, batchnorm_train: bool) -> ClientConfig:
        """The client's training as method "sim" replays it, or why it cannot."""
        missing = [name for name in ("lr", "epochs", "batch") if getattr(self, name) is None]
        if missing:
            raise ConfigError(f"method 'sim' replays the client's local steps and needs its "
                              f"{', '.join(missing)}: declare hyperparameters={{'lr': ..., "
                              "'epochs': ..., 'batch': ...}")
        optimiser = self.optimiser or "sgd"
        if optimiser not in OPTIMISERS:
            raise ConfigError(f"method 'sim' replays {', '.join(OPTIMISERS)} steps; the client "
                              f"declared optimiser {self.optimiser!r}")
        assert self.lr is not None and self.epochs is not None and self.batch is not None
        return ClientConfig(epochs=self.epochs, samples=samples, batch=self.batch, lr=self.lr,
                            optimiser=optimiser, batchnorm_train=batchnorm_train,
                            shuffle=self.shuffle is not False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class InversionResult:
    images: torch.Tensor  # (N, C, H, W) in [0, 1], in the dummy set's order
    labels: torch.Tensor  # (N,) the labels the attack used
    labels_inferred: bool
    l_sim: float  # 1 − cosine between the surrogate gradient and w0 − w_T, at the end
    method: str
    training: dict[str, Any]  # what was declared, and the step count used
    batchnorm: str
    running_stats: float | None  # the running-statistics mismatch, where matched
    seconds: float
    path_position: float
    # the first Linear layer's image span the images were kept in, or why there was none
    span: dict[str, Any] = field(default_factory=dict)
    classes: int = 0  # the model's output count: label_counts has one entry per class
    warnings: list[str] = field(default_factory=list)
    restarts_l_sim: list[float] = field(default_factory=list)  # each start's 1 − cos; best kept
    # method "separate": whether every image was told apart in the span, and how many
    # hyperplanes were found (fedavg.separate); the images are FALLBACK's where it was not
    separation: dict[str, Any] = field(default_factory=dict)
    # method "training-free": σ₂/σ₁ of the update's top Linear layer (one image's single step:
    # ~0) and the first conv's equations' residuals at the image (fedavg.walk)
    walk: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k not in ("images", "labels")}
        return {**data, "label_counts": np.bincount(self.labels.numpy(),
                                                    minlength=self.classes).tolist()}


def split_state(model: nn.Module, state: Mapping[str, Any], field_name: str
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameters, buffers) of `state` as the model names them, checked entry by entry."""
    if not isinstance(state, Mapping):
        raise ConfigError(f"{field_name}: expected a state dict (name → tensor), found "
                          f"{type(state).__name__}")
    parameters = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    missing = [n for n in parameters if n not in state]
    unknown = [n for n in state if n not in parameters and n not in buffers]
    if missing:
        hint = (" (the names differ: a wrapper such as nn.Sequential(Normalize, net) renames "
                "every parameter; pass the bare model and input_transform= instead)"
                if unknown else "")
        raise ConfigError(f"{field_name} lacks {len(missing)} of {type(model).__name__}'s "
                          f"parameters ({preview(missing)}); it holds "
                          f"{preview(unknown) if unknown else 'no other names'}{hint}")
    if unknown:
        raise ConfigError(f"{field_name} holds names {type(model).__name__} does not have: "
                          f"{preview(unknown)}")
    out: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
    for which, reference in enumerate((parameters, buffers)):
        for name, like in reference.items():
            if name not in state:
                continue
            value = torch.as_tensor(np.asarray(state[name]) if not isinstance(
                state[name], torch.Tensor) else state[name])
            if tuple(value.shape) != tuple(like.shape):
                raise ConfigError(f"{field_name}[{name!r}] has shape {tuple(value.shape)}, "
                                  f"the model's is {tuple(like.shape)}")
            if which == 0 and not value.is_floating_point():
                raise ConfigError(f"{field_name}[{name!r}] is {value.dtype}, a parameter must "
                                  "be floating point")
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise ConfigError(f"{field_name}[{name!r}] holds NaN or Inf")
            out[which][name] = value.detach().to(like.dtype) if value.is_floating_point() \
                else value.detach()
    return out


def preview(names: list[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_transform(transform: Transform, shape: tuple[int, ...],
                    input_range: tuple[float, float] | None) -> None:
    """The declared transform maps [0, 1] images into the model's declared input range."""
    probe = torch.stack([torch.zeros(shape), torch.ones(shape), torch.full(shape, 0.5)])
    try:
        mapped = transform(probe)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ConfigError(f"input_transform failed on a {tuple(probe.shape)} batch in "
                          f"[0, 1]: {error}") from None
    if not isinstance(mapped, torch.Tensor) or mapped.shape[0] != 3:
        raise ConfigError("input_transform must map a batch (N, C, H, W) to a tensor with the "
                          "same batch size")
    if input_range is None:
        return
    low, high = input_range
    span = max(high - low, 1e-12)
    found = (float(mapped.min()), float(mapped.max()))
    if found[0] < low - 1e-3 * span or found[1] > high + 1e-3 * span:
        raise ConfigError(f"input_transform maps [0, 1] to [{found[0]:.3g}, {found[1]:.3g}], "
                          f"outside the model's input range [{low:g}, {high:g}]")


def invert_update(model: nn.Module, w0: Mapping[str, Any], wT: Mapping[str, Any], *,
                  samples: int, shape: tuple[int, ...], labels: Any = None,
                  input_transform: Transform | None = None,
                  input_range: tuple[float, float] | None = None,
                  batchnorm: str = "train", method: str = "sme",
                  hyperparameters: Training | Mapping[str, Any] | None = None,
                  iterations: int = 1000, running_stats: bool = True,
                  running_weight: float = 1.0, seed: int = 0, progress: bool = False,
                  auxiliary: torch.Tensor | None = None, auxiliary_labels: Any = None,
                  **attack_options: Any) -> InversionResult:
    """Recover the `samples` images of one client's update w0 → w_T (see the module doc).

    batchnorm: the mode the client trained BatchNorm in ("train", the default here and in
    AuditStrategy: per-minibatch statistics, as every torch training loop; "eval": frozen
    running statistics, as SME).
    running_stats: in train mode, also match the batch statistics the running buffers reveal.
    auxiliary: (M, C, H, W) images of the task in [0, 1], none of them the client's: where
    method "separate" starts from (fedavg.separate); with `auxiliary_labels` (M,), what
    start="class-mean" begins from (each used label's mean auxiliary image).
    attack_options: FedAttackConfig fields (tv, lr_images, cls, ...)."""
    training = hyperparameters if isinstance(hyperparameters, Training) else \
        Training.from_mapping(hyperparameters, "hyperparameters")
    shape = tuple(int(s) for s in shape)
    if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < 1:
        raise ConfigError(f"samples={samples!r}: expected the client's example count, >= 1")
    if batchnorm not in BATCHNORM_MODES:
        raise ConfigError(f"batchnorm={batchnorm!r}: expected 'train' or 'eval' (the mode the "
                          "client trained BatchNorm in)")
    if method not in METHODS:
        raise ConfigError(f"method={method!r}: expected one of {', '.join(METHODS)}")
    unknown = set(attack_options) - set(FedAttackConfig.__dataclass_fields__) - {"labels"}
    if unknown:
        raise ConfigError(f"unknown attack option(s) {', '.join(sorted(unknown))}")
    config = FedAttackConfig(method=method, iterations=iterations, seed=seed,
                             **{k: v for k, v in attack_options.items() if k != "labels"})
    config.check()
    labelled = None
    if config.start == "class-mean":
        labelled = (auxiliary, None if auxiliary_labels is None else
                    torch.as_tensor(np.asarray(auxiliary_labels)).long().reshape(-1)) \
            if auxiliary is not None else None
        check_labelled(labelled, shape)
    transform = input_transform or identity
    check_transform(transform, shape, input_range)
    params0, buffers0 = split_state(model, w0, "w0")
    paramsT, buffersT = split_state(model, wT, "w_T")
    walk = plan_walk(model, shape, transform, samples, training.local_steps(samples),
                     training.optimiser, batchnorm) if method == TRAINING_FREE else None
    notes: list[str] = []
    layers = batchnorm_layers(model)
    replayed = replay_config(model, w0, wT, samples, training, batchnorm) \
        if method == "sim" else None
    float_buffers0 = {n: b for n, b in buffers0.items() if b.is_floating_point()}
    if layers and batchnorm == "eval" and not all(f"{n}.running_mean" in float_buffers0
                                                 for n in layers):
        raise ConfigError("w0 lacks BatchNorm running statistics, which BatchNorm in eval "
                          "mode reads: send the model's whole state dict")
    steps = counted_steps(model, buffers0, buffersT) if batchnorm == "train" else None
    steps = steps or training.local_steps(samples)
    notes += batchnorm_mismatch(layers, batchnorm, float_buffers0, buffersT)
    client = client_forward(model, buffers0, buffersT, batchnorm=batchnorm,
                            batch=training.batch, steps=steps, transform=transform,
                            running_stats=running_stats, running_weight=running_weight)
    model.eval()
    start = time.perf_counter()
    span, span_note, features = update_spans(model, params0, paramsT, shape, samples, transform,
                                             optimiser=training.optimiser, steps=steps,
                                             image=config.span or method == SEPARATE)
    if method == SEPARATE:
        check_separable(span, span_note, auxiliary, shape)
    classes = count_classes(model, params0, client, shape)
    chosen, inferred = resolve_labels(model, labels, samples, classes, params0, paramsT,
                                      client, training, steps, shape, seed)
    update = ClientUpdate(params0, paramsT, replayed, steps or 0, chosen)
    separation: Separation | None = None
    if method == SEPARATE:
        assert span is not None
        separation = separate_update(span, params0, paramsT, transform, auxiliary, seed)
        config = FedAttackConfig(**{**config.to_dict(), "method": FALLBACK})
        if not separation.complete:
            notes.append(f"method 'separate' found {separation.hyperplanes} of {samples} "
                         f"hyperplanes, too few to tell the images apart: the images are "
                         f"{FALLBACK}'s, kept in the span")
    walked = None
    if walk is not None:  # the fit of its image is scored by the gradient at w0 (IG's)
        walked = walk_update(walk, params0, paramsT, buffers0, buffersT)
        config = FedAttackConfig(**{**config.to_dict(), "method": "ig"})
        doubt = walked.doubt()
        if doubt is not None:
            notes.append(doubt)
    inversion = UpdateInversion(model, update, shape, classes, config, labels=chosen,
                                client=client, span=span, features=features,
                                auxiliary=labelled)
    result = attack_result(inversion, walked, separation, progress)
    if result["l_sim_raw"] > POOR_FIT:
        notes.append(f"the dummy data explain the update poorly (1 − cosine "
                     f"{result['l_sim_raw']:.3f} > {POOR_FIT}): check input_transform (the "
                     "model's input range), batchnorm (the client's mode) and the labels")
    for note in notes:
        warnings.warn(note, FitWarning, stacklevel=2)
    return InversionResult(
        images=result["images"], labels=chosen, labels_inferred=inferred,
        l_sim=result["l_sim_raw"], method=method,
        training={**training.to_dict(), "steps_used": steps}, batchnorm=batchnorm,
        running_stats=result.get("running_stats"), seconds=time.perf_counter() - start,
        path_position=result["position"],
        span={**(span.summary() if span is not None else {"unused": span_note}),
              "feature_spans": sorted(inversion.features)}, classes=classes,
        warnings=notes, restarts_l_sim=result["restarts_l_sim"],
        separation=separation.summary() if separation is not None else {},
        walk=walked.summary() if walked is not None else {})


def attack_result(inversion: UpdateInversion, walked: Walked | None,
                  separation: Separation | None, progress: bool = False) -> dict[str, Any]:
    """What a method returns: the walk's image (its fit scored by the gradient at w0), a
    complete separation's images, or else the optimisation's run."""
    if walked is not None:
        return walked.as_result(inversion.fit(walked.image))
    if separation is not None and separation.complete:
        return separation.as_result()
    return inversion.run(progress)


def check_separable(span: Any, why: str, auxiliary: torch.Tensor | None,
                    shape: tuple[int, ...]) -> None:
    """Method "separate" needs an image span and auxiliary images of the client's shape; one
    ConfigError before any work otherwise."""
    if span is None:
        raise ConfigError(f"method 'separate' tells the images apart inside the span a first "
                          f"Linear layer's update gives, and this update has none: {why}")
    if auxiliary is None:
        raise ConfigError("method 'separate' starts from auxiliary images of the task (never "
                          "the client's): pass auxiliary= (M, C, H, W) in [0, 1]")
    if not isinstance(auxiliary, torch.Tensor) or auxiliary.dim() != 4 or \
            tuple(auxiliary.shape[1:]) != tuple(shape) or not len(auxiliary):
        raise ConfigError(f"auxiliary: expected a tensor (M >= 1, {', '.join(map(str, shape))}) "
                          f"in [0, 1], found {getattr(auxiliary, 'shape', type(auxiliary))}")
    if not bool(torch.isfinite(auxiliary).all()) or float(auxiliary.min()) < 0 or \
            float(auxiliary.max()) > 1:
        raise ConfigError("auxiliary: images must be finite and in [0, 1]")


def replay_config(model: nn.Module, w0: Mapping[str, Any], wT: Mapping[str, Any], samples: int,
                  training: Training, batchnorm: str) -> ClientConfig:
    """The client's local training as method "sim" replays it, checked against the step count
    BatchNorm's batch counter (or the declaration) gives; one ConfigError, before any work,
    where it cannot be replayed."""
    _, buffers0 = split_state(model, w0, "w0")
    _, buffersT = split_state(model, wT, "w_T")
    layers = batchnorm_layers(model)
    replayed = training.replayable(samples, bool(layers) and batchnorm == "train")
    steps = (counted_steps(model, buffers0, buffersT) if batchnorm == "train" else None) \
        or training.local_steps(samples)
    expected = replayed.epochs * math.ceil(samples / replayed.batch)
    if steps is not None and steps != expected:
        raise ConfigError(f"method 'sim': BatchNorm's batch counter (or the declared steps) says "
                          f"the client took {steps} local steps, its declared epochs and batch "
                          f"give {expected} for {samples} examples")
    return replayed


def counted_steps(model: nn.Module, before: dict[str, torch.Tensor],
                  after: dict[str, torch.Tensor]) -> int | None:
    """Local steps from BatchNorm's batch counter, which every train-mode step increments."""
    for name in batchnorm_layers(model):
        key = f"{name}.num_batches_tracked"
        if key in before and key in after:
            steps = int(after[key]) - int(before[key])
            return steps if steps > 0 else None
    return None


def batchnorm_mismatch(layers: dict[str, nn.Module], mode: str,
                       before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]
                       ) -> list[str]:
    """What the running statistics say about the declared BatchNorm mode."""
    keys = [f"{n}.running_mean" for n in layers if f"{n}.running_mean" in before
            and f"{n}.running_mean" in after]
    if not keys:
        return []
    moved = any(not torch.equal(before[k], after[k]) for k in keys)
    if mode == "eval" and moved:
        return ["BatchNorm's running statistics changed between w0 and w_T: the client trained "
                "in train mode, so batchnorm='train' is the faithful replay"]
    if mode == "train" and not moved:
        return ["BatchNorm's running statistics did not change between w0 and w_T: the "
                "client kept BatchNorm in eval mode (batchnorm='eval')"]
    return []


def count_classes(model: nn.Module, parameters: dict[str, torch.Tensor], client: ClientForward,
                  shape: tuple[int, ...]) -> int:
    from torch.func import functional_call

    probe = torch.full((2, *shape), 0.5)
    try:
        with torch.no_grad(), client.mode(model):
            logits = functional_call(model, (parameters, client.buffers),
                                     (client.transform(probe),))
    except RuntimeError as error:
        raise ConfigError(f"{type(model).__name__} does not take images of shape {shape} "
                          f"(after input_transform): {error}") from None
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ConfigError(f"{type(model).__name__} must return logits (N, classes); it "
                          f"returned {getattr(logits, 'shape', type(logits).__name__)}")
    return int(logits.shape[1])


def inference_gap(training: Training, steps: int | None, samples: int | None = None
                  ) -> str | None:
    """Why the labels cannot be inferred from what the client declared (each caller says how
    to declare it), or None. One image's label needs nothing declared (`single_label`)."""
    if samples == 1 and training.optimiser in SINGLE_LABEL_OPTIMISERS:
        return None
    if training.optimiser not in (None, "sgd"):
        return f"label inference reads a plain-SGD update, and this client used " \
               f"{training.optimiser!r}"
    missing = [what for what, value in (("learning rate", training.lr),
                                        ("local step count", steps)) if value is None]
    if missing:
        return "inferring them from the output bias needs the client's " + " and ".join(missing)
    return None


def resolve_labels(model: nn.Module, labels: Any, samples: int, classes: int,
                   w0: dict[str, torch.Tensor], wT: dict[str, torch.Tensor],
                   client: ClientForward, training: Training, steps: int | None,
                   shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, bool]:
    if labels is not None:
        given = torch.as_tensor(np.asarray(labels)).long().reshape(-1)
        if len(given) != samples:
            raise ConfigError(f"labels: {len(given)} given, the client trained on {samples} "
                              "examples")
        if len(given) and (int(given.min()) < 0 or int(given.max()) >= classes):
            raise ConfigError(f"labels: values must lie in 0..{classes - 1} (the model has "
                              f"{classes} outputs)")
        return given, False
    if samples == 1 and training.optimiser in SINGLE_LABEL_OPTIMISERS:
        return single_label(model, w0, wT, classes), True
    gap = inference_gap(training, steps)
    if gap is not None:
        raise ConfigError(f"labels were not given, and {gap}: declare hyperparameters={{'lr': "
                          "..., 'epochs': ..., 'batch': ...}} (or 'steps'), or pass labels=")
    dummy = torch.rand(samples, *shape, generator=torch.Generator().manual_seed(seed))
    counts = counts_from_bias(model, w0, wT, client, dummy, classes, lr=training.lr,
                              steps=steps, samples=samples)
    return labels_from_counts(counts), True
