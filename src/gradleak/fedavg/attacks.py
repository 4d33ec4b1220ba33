"""IG, SME, NL-SME and the review's controls on one FedAvg update, in one optimisation loop.

Every method matches what the dummy set would have sent to the observed direction w0 − w_T
(1 − cosine). The first five take the dummy set's gradient at one surrogate point of the
client's trajectory; `sim` replays the client's local steps instead:

| method | what is matched | d (per-parameter scale on the gradient) |
|---|---|---|
| ig | the gradient at w0 | 1 |
| sme | the gradient at (1 − α) w0 + α w_T, α learnt | 1 |
| nlsme | the gradient at (1 − t)² w0 + 2(1 − t)t P1 + t² w_T; t, P1 learnt | learnt in [0.1, 10] |
| sme-dvec | the gradient on SME's line | learnt, as NL-SME (the review's control) |
| nlsme-nod | the gradient on NL-SME's curve | 1 (Bézier only) |
| sim | w0 − w_T of the client's E · ⌈N / B⌉ steps replayed from w0 on the dummy set | 1 |

`sim` is Dimitrov et al.'s attack (TMLR 2022, "Data Leakage in Federated Averaging"): the
declared η, E, B and optimiser drive the replay, the same N dummy images serve every epoch, and
each epoch's batch order is the attacker's own seeded draw (the client's shuffling is private;
a client declared not to shuffle is replayed in order).

Extra terms: TV on the dummy images, λ_P ‖P1 − midpoint‖², λ_d ‖d − 1‖², and optionally
λ_cls · CE(f(D̃; w_T), labels). L_sim is always reported on the raw surrogate gradient (d ≡ 1)
and, for the methods with d, on the scaled one too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

from gradleak.errors import ConfigError
from gradleak.fedavg.client import ClientUpdate, batch_order, local_step
from gradleak.fedavg.forward import ClientForward
from gradleak.fedavg.scoring import class_means
from gradleak.fedavg.span import ImageSpan, off_span, project_box
from gradleak.names import TRAINING_FREE

METHODS = ("ig", "sme", "nlsme", "sme-dvec", "nlsme-nod", "sim", "separate", TRAINING_FREE)
# not an optimisation: the images told apart inside an MLP client's span (fedavg.separate),
# with FALLBACK where that is incomplete
SEPARATE, FALLBACK = "separate", "sme"
# nor is TRAINING_FREE: one image's single-step update walked down (fedavg.walk)
CURVED = {"nlsme", "nlsme-nod"}
RESTART_STRIDE = 1_000_003  # restart r starts from torch's generator at seed + r · stride
REPLAY_STREAM = 0x5EED  # sim's batch orders: np.random.default_rng([seed, REPLAY_STREAM])
SCALED = {"nlsme", "sme-dvec"}
STARTS = ("random", "class-mean")
START_NOISE = 0.1  # a class-mean restart's perturbation, in pixel units
START_LR = {"random": 1.0, "class-mean": 0.01}


@dataclass
class FedAttackConfig:
    method: str = "nlsme"
    iterations: int = 1000
    # Adam's step on the images; None: the start's own (START_LR: 1.0 from random, the public
    # SME code's CNN setting; 0.01 from the class means, which a step of 1.0 throws away)
    lr_images: float | None = None
    lr_path: float = 1e-3  # α or t, as SME's α
    lr_control: float = 1e-4  # P1 (chosen here: no NL-SME code is public)
    lr_scale: float = 1e-2  # d (chosen here)
    tv: float = 0.01
    lambda_control: float = 1e-2  # λ_P
    lambda_scale: float = 1e-4  # λ_d
    cls: float = 0.0  # λ_cls; > 0 uses the labels
    # "infer": from the output layer's bias update (fedavg.labels), the default; "known": the
    # client's true labels, an oracle every result names
    labels: str = "infer"
    # keep the dummy images in the span a first Linear layer's update determines (fedavg.span),
    # where the model has one; no effect on a model that starts with a convolution
    span: bool = True
    # weight of the share of each Linear layer's dummy inputs outside the span its update
    # determines, for a one-step update (fedavg.span.feature_spans); 0 turns it off
    feature_span: float = 0.1
    # independent starts; the one whose update matches best (lowest 1 − cos) is kept: the
    # choice reads the matching loss, never the private images
    restarts: int = 1
    # where the dummy images start: "random" (uniform noise, SME's), or "class-mean": each
    # used label's mean auxiliary image (labelled images of the task, none the client's), a
    # label-conditioned prior; later restarts add noise of std START_NOISE to it
    start: str = "random"
    seed: int = 0

    def check(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"FedAvg attack {self.method!r}: expected one of "
                              f"{', '.join(METHODS)}")
        if self.iterations < 1:
            raise ConfigError(f"iterations {self.iterations}: expected >= 1")
        if isinstance(self.restarts, bool) or not isinstance(self.restarts, int) \
                or self.restarts < 1:
            raise ConfigError(f"restarts {self.restarts!r}: expected an integer >= 1")
        if not (math.isfinite(self.feature_span) and self.feature_span >= 0):
            raise ConfigError(f"feature_span {self.feature_span}: expected a finite weight >= 0")
        if not (math.isfinite(self.cls) and self.cls >= 0):
            raise ConfigError(f"--cls {self.cls}: expected a finite λ_cls >= 0")
        if self.seed < 0:
            raise ConfigError(f"--seed {self.seed}: expected a non-negative integer")
        if self.labels not in ("infer", "known"):
            raise ConfigError(f"--labels {self.labels!r}: expected infer or known")
        if self.lr_images is not None and not (math.isfinite(self.lr_images)
                                               and self.lr_images > 0):
            raise ConfigError(f"lr_images {self.lr_images}: expected a finite step > 0")
        if self.start not in STARTS:
            raise ConfigError(f"--start {self.start!r}: expected {' or '.join(STARTS)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_labelled(auxiliary: tuple[torch.Tensor, torch.Tensor] | None,
                   shape: tuple[int, ...]) -> None:
    """The class-mean start's auxiliary data: labelled images of the client's shape."""
    if auxiliary is None or auxiliary[1] is None:
        raise ConfigError("start 'class-mean' begins from each label's mean auxiliary image: "
                          "give labelled images of the task, none the client's (--reference "
                          "with labels, auxiliary= and auxiliary_labels=)")
    images, labels = auxiliary
    if tuple(images.shape[1:]) != tuple(shape) or len(labels) != len(images) or not len(images):
        raise ConfigError(f"start 'class-mean': {len(images)} auxiliary images of shape "
                          f"{tuple(images.shape[1:])} with {len(labels)} labels; expected one "
                          f"label per image, images of the client's shape {tuple(shape)}")
    if not bool(torch.isfinite(images).all()) or float(images.min()) < 0 \
            or float(images.max()) > 1:
        raise ConfigError("start 'class-mean': the auxiliary images must lie in [0, 1], as the "
                          "client's raw images do")


def replayed_steps(update: ClientUpdate, count: int, seed: int) -> list[np.ndarray]:
    """The minibatches `sim` replays: the declared E and B over the dummy set, each epoch in the
    attacker's own seeded order (a stream apart from any client's: the client's order is
    private, and a shared seed must not hand it over)."""
    declared = update.config
    if declared is None:
        raise ConfigError("method 'sim' replays the client's local steps: declare its learning "
                          "rate, epochs and batch size (hyperparameters={'lr': ..., 'epochs': "
                          "..., 'batch': ...})")
    if declared.samples != count:
        raise ConfigError(f"method 'sim': the client declared N = {declared.samples} examples, "
                          f"the attack recovers {count}")
    return batch_order(declared, np.random.default_rng([seed, REPLAY_STREAM]))


class Surrogate(nn.Module):
    """The learnable part of a method: path position, control point, scale."""

    def __init__(self, update: ClientUpdate, method: str) -> None:
        super().__init__()
        self.method = method
        self.w0 = {n: w.detach() for n, w in update.w0.items()}
        self.wT = {n: w.detach() for n, w in update.wT.items()}
        fixed = method in ("ig", "sim")  # sim replays the steps: it has no surrogate point
        self.position = nn.Parameter(torch.tensor(0.0 if fixed else 0.5))
        self.position.requires_grad_(not fixed)
        self.midpoint = {n: (self.w0[n] + self.wT[n]) / 2 for n in self.w0}
        self.control = nn.ParameterDict({n.replace(".", "/"): nn.Parameter(m.clone())
                                         for n, m in self.midpoint.items()}) \
            if method in CURVED else None
        self.scale = nn.ParameterDict({n.replace(".", "/"): nn.Parameter(torch.ones_like(w))
                                       for n, w in self.w0.items()}) \
            if method in SCALED else None

    def point(self) -> dict[str, torch.Tensor]:
        if not self.position.requires_grad:  # IG: w0 itself, no arithmetic on 8M weights
            return self.w0
        t = self.position.clamp(0.0, 1.0)
        if self.control is None:
            return {n: torch.lerp(self.w0[n], self.wT[n], t) for n in self.w0}
        return {n: (1 - t) ** 2 * self.w0[n] + 2 * (1 - t) * t * self.control[n.replace(".", "/")]
                + t ** 2 * self.wT[n] for n in self.w0}

    def scaled(self, gradients: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.scale is None:
            return gradients
        # d is clamped in place after every step, so no clamp here: a clamp would cost two more
        # passes over every weight and change neither the value nor the gradient.
        return {n: g * self.scale[n.replace(".", "/")] for n, g in gradients.items()}

    def penalties(self, config: FedAttackConfig) -> torch.Tensor:
        total = torch.zeros(())
        if self.control is not None and config.lambda_control:
            total = total + config.lambda_control * sum(
                squared_norm(self.control[n.replace(".", "/")] - m)
                for n, m in self.midpoint.items())
        if self.scale is not None and config.lambda_scale:
            total = total + config.lambda_scale * sum(squared_norm(d - 1)
                                                      for d in self.scale.values())
        return total


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    return torch.dot(flat, flat)  # one BLAS pass, where pow(2).sum() takes two over 8M weights


def cosine_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                    b_norm: torch.Tensor | None = None) -> torch.Tensor:
    """1 − cos(a, b) over all parameters; pass ‖b‖ when b is fixed across calls."""
    inner = sum(torch.dot(a[n].reshape(-1), b[n].reshape(-1)) for n in a)
    if b_norm is None:
        b_norm = sum(squared_norm(b[n]) for n in b).sqrt()
    return 1.0 - inner / (sum(squared_norm(a[n]) for n in a).sqrt() * b_norm + 1e-12)


def total_variation(images: torch.Tensor) -> torch.Tensor:
    return ((images[..., 1:, :] - images[..., :-1, :]).abs().mean()
            + (images[..., :, 1:] - images[..., :, :-1]).abs().mean())


class UpdateInversion:
    """Optimise dummy images (and the surrogate) so the surrogate gradient points along w0 − w_T."""

    def __init__(self, model: nn.Module, update: ClientUpdate, shape: tuple[int, ...],
                 classes: int, config: FedAttackConfig, *, labels: torch.Tensor | None = None,
                 client: ClientForward | None = None, span: ImageSpan | None = None,
                 features: dict[str, torch.Tensor] | None = None,
                 auxiliary: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """What the server holds: the model (architecture, w0), the update w0 → w_T and the
        client's declared settings. Labels are inferred from the update unless the config
        declares them known (the update then carries them) or they are given here. `client`
        says how the client's forward pass ran (input transform, BatchNorm mode, buffers); by
        default the model's own buffers with BatchNorm in eval mode, inputs in [0, 1]. `span`:
        the images' span, which every step projects the dummy images back onto. `features`:
        for a one-step update, the span of each Linear layer's inputs (a penalty term).
        `auxiliary`: labelled images of the task, none the client's (images in [0, 1] of the
        client's shape, labels), which the class-mean start reads."""
        config.check()
        if config.start == "class-mean":
            check_labelled(auxiliary, shape)
        if config.method == SEPARATE:
            raise ConfigError(f"UpdateInversion optimises; {SEPARATE!r} is fedavg.separate's, "
                              f"with {FALLBACK!r} where it is incomplete")
        if config.method == TRAINING_FREE:
            raise ConfigError(f"UpdateInversion optimises; {TRAINING_FREE!r} is fedavg.walk's")
        self.model, self.update, self.config = model.eval(), update, config
        self.client = client or ClientForward(
            buffers={n: b.detach() for n, b in model.named_buffers()})
        self.buffers = self.client.buffers
        self.direction = update.delta()
        self.direction_norm = sum(squared_norm(t) for t in self.direction.values()).sqrt()
        count = len(labels) if labels is not None else update.config.samples
        self.shape, self.span = (count, *shape), span
        self.features = features if features and config.feature_span else {}
        self.auxiliary = auxiliary
        self.images = self.random_start(0)  # label inference reads dummy images
        self.labels = labels if labels is not None else self._labels(classes)
        self.images = self.start(0)
        self.steps = replayed_steps(update, count, config.seed) if config.method == "sim" \
            else None
        self.images.requires_grad_(True)
        self.surrogate = Surrogate(update, config.method)

    def noise(self, restart: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.config.seed + RESTART_STRIDE * restart)
        return torch.randn(self.shape, generator=generator)

    def start(self, restart: int) -> torch.Tensor:
        """The dummy images restart `restart` begins from (restart 0: the seed's own draw, or
        the class means themselves)."""
        if self.config.start == "random":
            return self.random_start(restart)
        assert self.auxiliary is not None
        means = class_means(*self.auxiliary, self.labels).to(torch.float32)
        images = (means + START_NOISE * self.noise(restart) if restart else means).clamp(0, 1)
        return project_box(self.span, images) if self.span is not None else images

    def random_start(self, restart: int) -> torch.Tensor:
        images = self.noise(restart).clamp(0, 1)
        return project_box(self.span, images) if self.span is not None else images

    def _labels(self, classes: int) -> torch.Tensor:
        if self.config.labels == "known":
            if self.update.labels is None:
                raise ConfigError("labels are declared known, but the client's update carries "
                                  "none: use --labels infer")
            return self.update.labels
        from gradleak.fedavg.labels import infer_label_counts, labels_from_counts

        return labels_from_counts(infer_label_counts(self.model, self.update, self.images,
                                                     classes, self.client))

    def surrogate_gradient(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """∇_w of the dummy set's mean loss at the surrogate point (graph kept for the images)."""
        return self._surrogate_gradient(images)[0]

    def _surrogate_gradient(self, images: torch.Tensor
                            ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The gradient, and the running-statistics mismatch of the same forward pass."""
        def loss(weights: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            value, mismatch = self.client.loss(self.model, weights, images, self.labels)
            return value, mismatch

        gradient, mismatch = grad(loss, has_aux=True)(self.surrogate.point())
        return gradient, mismatch if self.client.running_targets else None

    def replayed_update(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """w0 − w_T of the client's local steps replayed on `images` (graph kept for them)."""
        declared = self.update.config
        assert declared is not None and self.steps is not None
        weights = dict(self.update.w0)
        state = {n: torch.zeros_like(w) for n, w in weights.items()}
        second = {n: torch.zeros_like(w) for n, w in weights.items()}
        for t, index in enumerate(self.steps, start=1):
            def loss(w: dict[str, torch.Tensor], index: np.ndarray = index) -> torch.Tensor:
                return self.client.loss(self.model, w, images[index], self.labels[index])[0]

            weights = local_step(weights, grad(loss)(weights), state, second, declared, t)
        return {n: self.update.w0[n] - weights[n] for n in weights}

    def objective(self) -> tuple[torch.Tensor, dict[str, float]]:
        if self.steps is not None:
            raw, running = self.replayed_update(self.images), None
        else:
            raw, running = self._surrogate_gradient(self.images)
        scaled = self.surrogate.scaled(raw)
        similarity = cosine_distance(scaled, self.direction, self.direction_norm)
        total = similarity + self.config.tv * total_variation(self.images) \
            + self.surrogate.penalties(self.config)
        extra: dict[str, float] = {}
        if running is not None:
            total = total + self.client.running_weight * running
            extra["running_stats"] = float(running.detach())
        if self.features:
            outside = self.feature_gap()
            total = total + self.config.feature_span * outside
            extra["feature_span"] = float(outside.detach())
        if self.config.cls:
            with self.client.mode(self.model):
                logits = functional_call(self.model, (self.update.wT, self.buffers),
                                         (self.client.transform(self.images),))
            total = total + self.config.cls * F.cross_entropy(logits, self.labels)
        if scaled is raw:
            raw_similarity = float(similarity.detach())
        else:
            with torch.no_grad():
                raw_similarity = float(cosine_distance(raw, self.direction, self.direction_norm))
        return total, {"l_sim_raw": raw_similarity, "l_sim_scaled": float(similarity.detach()),
                       **extra}

    def feature_gap(self) -> torch.Tensor:
        """Σ over the spanned Linear layers of the dummy inputs' share outside the span, at w0
        (where a one-step update's gradient was taken)."""
        seen: dict[str, torch.Tensor] = {}
        modules = dict(self.model.named_modules())
        hooks = [modules[name].register_forward_pre_hook(
            lambda _, inputs, name=name: seen.__setitem__(name, inputs[0]))
            for name in self.features]
        try:
            with self.client.mode(self.model):
                functional_call(self.model, (self.update.w0, self.buffers),
                                (self.client.transform(self.images),))
        finally:
            for hook in hooks:
                hook.remove()
        return sum(off_span(seen[name].flatten(1), basis)
                   for name, basis in self.features.items()).float()

    def parameter_groups(self) -> list[dict[str, Any]]:
        lr = self.config.lr_images if self.config.lr_images is not None \
            else START_LR[self.config.start]
        groups = [{"params": [self.images], "lr": lr}]
        if self.surrogate.position.requires_grad:
            groups.append({"params": [self.surrogate.position], "lr": self.config.lr_path})
        if self.surrogate.control is not None:
            groups.append({"params": list(self.surrogate.control.values()),
                           "lr": self.config.lr_control})
        if self.surrogate.scale is not None:
            groups.append({"params": list(self.surrogate.scale.values()),
                           "lr": self.config.lr_scale})
        return groups

    def fit(self, images: torch.Tensor) -> float:
        """1 − cos between the update and the surrogate gradient of `images` (its labels)."""
        with torch.enable_grad():
            gradient = self.surrogate_gradient(images.detach().to(self.images.dtype))
        return float(cosine_distance({n: g.detach() for n, g in gradient.items()},
                                     self.direction, self.direction_norm))

    def run(self, progress: bool = False) -> dict[str, Any]:
        """Each restart's descent; the one that matches the update best (1 − cos, raw)."""
        best: dict[str, Any] | None = None
        matched = []
        for restart in range(self.config.restarts):
            if restart:
                self.images = self.start(restart).requires_grad_(True)
                self.surrogate = Surrogate(self.update, self.config.method)
            result = self.descend(progress)
            matched.append(result["l_sim_raw"])
            if best is None or result["l_sim_raw"] < best["l_sim_raw"]:
                best = {**result, "restart": restart}
        assert best is not None
        return {**best, "restarts_l_sim": matched}

    def descend(self, progress: bool = False) -> dict[str, Any]:
        """Adam with ×0.1 steps at 3/8, 5/8, 7/8 (SME's schedule), box-clamped images."""
        from tqdm import tqdm

        config = self.config
        optimiser = torch.optim.Adam(self.parameter_groups(), fused=True)  # one pass per tensor
        schedule = torch.optim.lr_scheduler.MultiStepLR(
            optimiser, [int(config.iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)], gamma=0.1)
        history = []
        for _ in tqdm(range(config.iterations), disable=not progress, desc=config.method,
                      leave=False):
            optimiser.zero_grad(set_to_none=True)
            total, parts = self.objective()
            total.backward()
            optimiser.step()
            schedule.step()
            with torch.no_grad():
                self.images.copy_(project_box(self.span, self.images) if self.span is not None
                                  else self.images.clamp(0.0, 1.0))
                self.surrogate.position.clamp_(0.0, 1.0)
                for d in (self.surrogate.scale or {}).values():
                    d.clamp_(0.1, 10.0)
            history.append({"loss": float(total.detach()), **parts})
        _, final = self.objective()
        return {"images": self.images.detach().clone(), "history": history, **final,
                "position": float(self.surrogate.position.detach())}
