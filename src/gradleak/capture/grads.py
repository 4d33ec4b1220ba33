"""Per-step gradients of the shared actor-critic loss at θ0, as a distributed client sends them.

Three ways to the same numbers (tested equal): `einsum`, one batched backward of the summed
per-step losses with each layer's per-step weight gradient formed from its saved input and
output gradient (δ_i aᵢᵀ for a Linear, δ_i unfold(a_i)ᵀ for a Conv2d as Opacus' grad-sample
rules write it, formed here by grouped convolutions), for victims whose every parameter sits in
a layer with a rule; `vmap` (torch.func: grad of a functional call, vmapped over steps), for any
victim; and the loop of torch.autograd.grad, the reference. At θ0 in eval mode the steps do not
interact (BatchNorm uses its running statistics), so the batched backward's δ_i is step i's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from gradleak.capture.layout import GradientLayout
from gradleak.rl.losses import LossCoefficients, actor_critic_loss
from gradleak.victims.base import LayerInfo, Victim, side_by_side


@dataclass
class StepBatch:
    """The per-step inputs of the loss: frames and the rollout quantities, as tensors."""

    images: torch.Tensor  # (N, H, W, 3) uint8
    actions: torch.Tensor  # (N,) int64
    advantages: torch.Tensor  # (N,) float32, normalised as the loss uses them
    returns: torch.Tensor  # (N,) float32
    old_log_probs: torch.Tensor  # (N,) float32, log π_θ0(a|s)
    goals: torch.Tensor | None = None  # (N, 3) float32
    hidden: torch.Tensor | None = None  # (N, H): a recurrent victim's recorded pre-step state

    def __len__(self) -> int:
        return len(self.actions)

    def slice(self, start: int, stop: int) -> StepBatch:
        def part(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values[start:stop]

        return StepBatch(self.images[start:stop], self.actions[start:stop],
                         self.advantages[start:stop], self.returns[start:stop],
                         self.old_log_probs[start:stop], part(self.goals), part(self.hidden))


def _check_frozen(victim: Victim) -> None:
    if victim.training:
        raise ValueError("per-step gradients are taken at a frozen θ0: call victim.eval() first "
                         "(BatchNorm must use its running statistics)")


def _mean_loss(victim: Victim, parameters: dict[str, torch.Tensor],
               buffers: dict[str, torch.Tensor], batch: StepBatch,
               coefficients: LossCoefficients, ppo: bool) -> torch.Tensor:
    logits, values = functional_call(victim, (parameters, buffers),
                                     (batch.images, batch.goals, batch.hidden))
    losses = actor_critic_loss(logits, values, batch.actions, batch.advantages, batch.returns,
                               coefficients, batch.old_log_probs if ppo else None)
    return losses.mean()


def flatten(gradients: dict[str, torch.Tensor], layers: list[LayerInfo]) -> torch.Tensor:
    """(N, d): the chosen layers' gradients side by side, in layer-table order."""
    first = gradients[layers[0].name]
    batch = first.shape[0]
    return torch.cat([gradients[layer.name].reshape(batch, -1) for layer in layers], dim=1)


def per_step_gradients(victim: Victim, batch: StepBatch, coefficients: LossCoefficients,
                       layers: list[LayerInfo], ppo: bool = True, chunk: int = 32
                       ) -> torch.Tensor:
    """(N, d) in the victim's dtype (float32 as clients run): one gradient per step, vmapped in
    chunks of `chunk` steps."""
    _check_frozen(victim)
    parameters = {name: p.detach() for name, p in victim.named_parameters()}
    buffers = {name: b.detach() for name, b in victim.named_buffers()}
    wanted = {layer.name for layer in layers}

    def one_step(params, images, actions, advantages, returns, old_log_probs, goals, hidden):
        step = StepBatch(images[None], actions[None], advantages[None], returns[None],
                         old_log_probs[None], None if goals is None else goals[None],
                         None if hidden is None else hidden[None])
        return grad(_mean_loss, argnums=1)(victim, params, buffers, step, coefficients, ppo)

    goal_dim = None if batch.goals is None else 0
    hidden_dim = None if batch.hidden is None else 0
    batched = vmap(one_step, in_dims=(None, 0, 0, 0, 0, 0, goal_dim, hidden_dim))
    dtype = next(iter(parameters.values())).dtype
    output = torch.empty(len(batch), sum(layer.size for layer in layers), dtype=dtype)
    for start in range(0, len(batch), chunk):
        part = batch.slice(start, start + chunk)
        grads = batched(parameters, part.images, part.actions, part.advantages, part.returns,
                        part.old_log_probs, part.goals, part.hidden)
        output[start:start + len(part)] = flatten({k: v for k, v in grads.items()
                                                   if k in wanted}, layers)
    return output


def loop_gradients(victim: Victim, batch: StepBatch, coefficients: LossCoefficients,
                   layers: list[LayerInfo], ppo: bool = True) -> torch.Tensor:
    """The reference: one torch.autograd.grad call per step."""
    _check_frozen(victim)
    named = dict(victim.named_parameters())
    rows = []
    for i in range(len(batch)):
        step = batch.slice(i, i + 1)
        logits, values = victim(step.images, step.goals, step.hidden)
        loss = actor_critic_loss(logits, values, step.actions, step.advantages, step.returns,
                                 coefficients, step.old_log_probs if ppo else None).mean()
        grads = torch.autograd.grad(loss, [named[layer.name] for layer in layers])
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def batch_gradient(victim: Victim, batch: StepBatch, coefficients: LossCoefficients,
                   layers: list[LayerInfo], ppo: bool = True) -> torch.Tensor:
    """(d,): the gradient of the mean loss over the whole batch (what a trainer would apply)."""
    _check_frozen(victim)
    named = dict(victim.named_parameters())
    parameters = {name: p for name, p in named.items()}
    buffers = dict(victim.named_buffers())
    loss = _mean_loss(victim, parameters, buffers, batch, coefficients, ppo)
    grads = torch.autograd.grad(loss, [named[layer.name] for layer in layers])
    return torch.cat([g.reshape(-1) for g in grads])


# -- einsum: per-step weight gradients from each layer's input and output gradient --------------
# A rule writes step i's gradient of each of the layer's parameters into out[name][i] (views of
# the final (N, d) rows, so the gradients are formed where they are sent from, in one pass).
Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], None]


def _linear(module: nn.Linear, a: torch.Tensor, delta: torch.Tensor,
            out: dict[str, torch.Tensor]) -> None:
    n = a.shape[0]
    a, delta = a.reshape(n, -1, a.shape[-1]), delta.reshape(n, -1, delta.shape[-1])
    if a.shape[1] == 1:  # one position: an outer product, which bmm does poorly
        torch.mul(delta[:, 0, :, None], a[:, 0, None, :], out=out["weight"])
    else:
        torch.bmm(delta.transpose(1, 2), a, out=out["weight"])
    if "bias" in out:
        torch.sum(delta, 1, out=out["bias"])


# Kernel area from which the correlation form of the conv rule beats the grouped weight
# gradient. Per-step ms on 64 channels-last steps (as the capture's frames arrive), one thread
# (grouped → correlation): 3×84² k8 s4 0.199 → 0.165 and 3×64² k8 s4 0.107 → 0.071 (the cnns'
# first convs); 32×21² k4 s2 0.156 → 0.316; 16×42² k3 0.185 → 0.808; 3×84² k3 0.41 → 0.49.
# The im2col + bmm form this replaced was within 13% of the better one on the smallest layers
# (64×10² k3 s2) and up to 5.8× slower on larger ones (16×42² k3). Per-step gradients against
# that earlier rule (correlation from an input area of 1024, im2col below), one thread: cnn
# 0.94×, cnn-small 0.87×, nature-cnn 0.95×, impala 0.73×, impala-small 0.70×, cnn-gru-small
# 0.84× (two threads: cnn 0.90×, cnn-small 0.74×, impala-small 0.65×).
CORRELATION_MIN_KERNEL_AREA = 64


def _conv2d(module: nn.Conv2d, a: torch.Tensor, delta: torch.Tensor,
            out: dict[str, torch.Tensor]) -> None:
    kh, kw = module.kernel_size
    if kh * kw >= CORRELATION_MIN_KERNEL_AREA:
        _conv2d_by_correlation(module, a, delta, out)
    else:
        _conv2d_by_grouped_gradient(module, a, delta, out)
    if "bias" in out:
        torch.sum(delta.flatten(2), 2, out=out["bias"])


def _conv2d_by_grouped_gradient(module: nn.Conv2d, a: torch.Tensor, delta: torch.Tensor,
                                out: dict[str, torch.Tensor]) -> None:
    """The chunk's steps side by side as the groups of one convolution, whose weight gradient
    (torch's own kernel) holds each step's own."""
    n = a.shape[0]
    weight = torch.nn.grad.conv2d_weight(
        a.reshape(1, -1, *a.shape[2:]), (n * module.out_channels, *module.weight.shape[1:]),
        delta.reshape(1, -1, *delta.shape[2:]), module.stride, module.padding, module.dilation,
        groups=n)
    out["weight"].copy_(weight.view_as(out["weight"]))


def _conv2d_by_correlation(module: nn.Conv2d, a: torch.Tensor, delta: torch.Tensor,
                           out: dict[str, torch.Tensor]) -> None:
    """Step i's weight gradient is the correlation of its input with its output gradient: one
    convolution for the whole chunk, the steps as groups and the input channels as the batch
    (the roles of stride and dilation swap); no patch matrix is formed, which on a large input
    costs more than the arithmetic."""
    n, channels_in = a.shape[:2]
    channels_out, (kh, kw) = module.out_channels, module.kernel_size
    kernels = delta.reshape(n * channels_out, 1, *delta.shape[2:])
    correlated = F.conv2d(a.transpose(0, 1), kernels, None, stride=module.dilation,
                          padding=module.padding, dilation=module.stride, groups=n)
    # (C_in, N·C_out, ≥kh, ≥kw): the rows the padding or the stride leave over are cut off
    weight = correlated[:, :, :kh, :kw].reshape(channels_in, n, channels_out, kh, kw)
    out["weight"].copy_(weight.permute(1, 2, 0, 3, 4))


def _affine(normalised: torch.Tensor, delta: torch.Tensor, out: dict[str, torch.Tensor]
            ) -> None:
    """A normalisation's scale and shift, given its normalised input: sums over every axis
    after the batch's and the channels' (delta and normalised are (N, C, S))."""
    torch.sum(delta * normalised, 2, out=out["weight"])
    if "bias" in out:
        torch.sum(delta, 2, out=out["bias"])


def _batchnorm(module: nn.BatchNorm2d, a: torch.Tensor, delta: torch.Tensor,
               out: dict[str, torch.Tensor]) -> None:
    shape = (1, -1, 1, 1)
    normalised = (a - module.running_mean.view(shape)) * torch.rsqrt(
        module.running_var.view(shape) + module.eps)
    _affine(normalised.flatten(2), delta.flatten(2), out)


def _groupnorm(module: nn.GroupNorm, a: torch.Tensor, delta: torch.Tensor,
               out: dict[str, torch.Tensor]) -> None:
    normalised = F.group_norm(a, module.num_groups, eps=module.eps)
    _affine(normalised.flatten(2), delta.flatten(2), out)


def _layernorm(module: nn.LayerNorm, a: torch.Tensor, delta: torch.Tensor,
               out: dict[str, torch.Tensor]) -> None:
    n, shape = a.shape[0], module.normalized_shape
    normalised = F.layer_norm(a, shape, eps=module.eps)
    # (N, S, C) → (N, C, S): the positions are summed, the normalised axes kept
    _affine(normalised.reshape(n, -1, *shape).flatten(2).transpose(1, 2),
            delta.reshape(n, -1, *shape).flatten(2).transpose(1, 2),
            {k: v.reshape(n, -1) for k, v in out.items()})


RULES: dict[type, Rule] = {nn.Linear: _linear, nn.Conv2d: _conv2d, nn.BatchNorm2d: _batchnorm,
                           nn.GroupNorm: _groupnorm, nn.LayerNorm: _layernorm}


def _rule_for(module: nn.Module) -> Rule | None:
    if isinstance(module, nn.Conv2d) and (module.groups != 1 or isinstance(module.padding, str)
                                          or module.padding_mode != "zeros"):
        return None
    if isinstance(module, nn.BatchNorm2d) and (module.running_mean is None or module.training):
        return None
    if isinstance(module, nn.LayerNorm) and not module.elementwise_affine:
        return None
    if isinstance(module, nn.GroupNorm) and not module.affine:
        return None
    return RULES.get(type(module))


def _own_parameters(prefix: str, module: nn.Module) -> list[str]:
    return [f"{prefix}.{name}" if prefix else name
            for name, _ in module.named_parameters(recurse=False)]


def einsum_unsupported(victim: Victim, layers: list[LayerInfo]) -> list[str]:
    """The wanted parameters no rule covers (a free nn.Parameter such as a ViT's position
    embedding, a layer type without a rule): empty when `einsum` can take the victim."""
    covered = {name for prefix, module in victim.named_modules()
               if _rule_for(module) is not None for name in _own_parameters(prefix, module)}
    return [layer.name for layer in layers if layer.name not in covered]


def einsum_gradients(victim: Victim, batch: StepBatch, coefficients: LossCoefficients,
                     layers: list[LayerInfo], ppo: bool = True, chunk: int = 64,
                     out: torch.Tensor | None = None,
                     factors: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
                     ) -> torch.Tensor:
    """(N, d): per-step gradients from one batched backward per `chunk` steps (see the module
    docstring), written into `out[:N]` when given (a buffer kept across calls: a fresh
    allocation of N·d floats costs more in page faults than the arithmetic); refuses a victim
    with a parameter no rule covers (use vmap there). `factors` (name → output-gradient and
    input buffers of N rows, for weights `factorable_weights` names) keeps those weights as
    their factors (gradleak.capture.layout): their columns are left out of the rows."""
    _check_frozen(victim)
    missing = einsum_unsupported(victim, layers)
    if missing:
        raise ValueError(f"per-step gradients by einsum: no rule for {', '.join(missing[:3])}"
                         f"{' …' if len(missing) > 3 else ''}; use capture.gradient_method=vmap")
    factors = factors or {}
    modules = {prefix: module for prefix, module in victim.named_modules()
               if _rule_for(module) is not None
               and any(layer.name in _own_parameters(prefix, module) for layer in layers)}
    layers = side_by_side([layer for layer in layers if layer.name not in factors])
    wanted = {layer.name: layer for layer in layers}
    output = _output(victim, len(batch), layers, out)
    for start in range(0, len(batch), chunk):
        part = batch.slice(start, start + chunk)
        rows = output[start:start + len(part)]
        saved = _saved_activations(victim, modules, part, coefficients, ppo)
        calls = {prefix: sum(1 for p, *_ in saved if p == prefix) for prefix in modules}
        written: set[str] = set()  # modules, and below the parameters, given a gradient
        for prefix, module, a, delta in saved:
            weight = f"{prefix}.weight" if prefix else "weight"
            if weight in factors:
                _keep_factors(a, delta, [f[start:start + len(part)] for f in factors[weight]])
            names = [name for name in _own_parameters(prefix, module) if name in wanted]
            views = {name.rsplit(".", 1)[-1]: _block(rows, wanted[name]) for name in names}
            if weight in factors:
                if "bias" in views:
                    torch.sum(delta.reshape(len(part), -1, delta.shape[-1]), 1,
                              out=views["bias"])
            elif calls[prefix] == 1:
                RULES[type(module)](module, a, delta, views)
            else:  # a module applied several times: its contributions add up, as in autograd
                parts = {name: torch.empty_like(view) for name, view in views.items()}
                RULES[type(module)](module, a, delta, parts)
                for name, view in views.items():
                    view.add_(parts[name]) if prefix in written else view.copy_(parts[name])
            written.add(prefix)
            written.update(names)
        for layer in layers:  # a layer the loss did not reach has a zero gradient
            if layer.name not in written:
                _block(rows, layer).zero_()
    return output


def _keep_factors(a: torch.Tensor, delta: torch.Tensor, into: list[torch.Tensor]) -> None:
    into[0].copy_(delta.reshape(len(into[0]), -1))
    into[1].copy_(a.reshape(len(into[1]), -1))


def factorable_weights(victim: Victim, layers: list[LayerInfo],
                       example: StepBatch) -> list[str]:
    """The wanted Linear weights whose per-step gradient is one outer product δ aᵀ: the layer
    is called once per step, on one vector (found on `example`, a step or two of any content:
    a Linear inside a recurrence or over a ViT's tokens is called on many, and stays dense)."""
    _check_frozen(victim)
    wanted = {layer.name for layer in layers}
    modules = {prefix: module for prefix, module in victim.named_modules()
               if isinstance(module, nn.Linear) and _rule_for(module) is not None
               and f"{prefix}.weight" in wanted}
    if not modules:
        return []
    saved = _saved_activations(victim, modules, example, LossCoefficients(), True)
    calls: dict[str, list[torch.Tensor]] = {}
    for prefix, _, a, _ in saved:
        calls.setdefault(prefix, []).append(a)
    return [f"{prefix}.weight" for prefix in modules if len(calls.get(prefix, ())) == 1
            and calls[prefix][0].numel() == len(example) * modules[prefix].in_features]


def _output(victim: Victim, steps: int, layers: list[LayerInfo], out: torch.Tensor | None
            ) -> torch.Tensor:
    dtype = next(victim.parameters()).dtype
    width = sum(layer.size for layer in layers)
    if out is None:
        return torch.empty(steps, width, dtype=dtype)
    if out.dtype != dtype or out.dim() != 2 or out.shape[1] != width or len(out) < steps \
            or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous ({steps}+, {width}) {dtype} buffer, got "
                         f"{tuple(out.shape)} {out.dtype}")
    return out[:steps]


def _block(rows: torch.Tensor, layer: LayerInfo) -> torch.Tensor:
    """(n, *shape): one parameter's columns of the rows, a view."""
    return rows[:, layer.offset:layer.offset + layer.size].view(len(rows), *layer.shape)


def _saved_activations(victim: Victim, modules: dict[str, nn.Module], batch: StepBatch,
                       coefficients: LossCoefficients, ppo: bool
                       ) -> list[tuple[str, nn.Module, torch.Tensor, torch.Tensor]]:
    """(prefix, module, input, output gradient) of every call of `modules` in one forward and
    backward of the summed per-step losses."""
    saved: list[tuple[str, nn.Module, torch.Tensor, torch.Tensor]] = []

    def keep(prefix: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            a = inputs[0].detach()
            out.register_hook(lambda g: saved.append((prefix, module, a, g.detach())))
        return hook

    handles = [module.register_forward_hook(keep(prefix)) for prefix, module in modules.items()]
    try:
        logits, values = victim(batch.images, batch.goals, batch.hidden)
        losses = actor_critic_loss(logits, values, batch.actions, batch.advantages,
                                   batch.returns, coefficients, batch.old_log_probs if ppo
                                   else None)
        # asking for the biases' gradients only makes autograd reach every layer's output
        # without forming the batch's weight gradients, which the rules replace
        targets = [module.bias if getattr(module, "bias", None) is not None else module.weight
                   for module in modules.values()]
        torch.autograd.grad(losses.sum(), targets, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return saved


# -- the methods, by name (capture.gradient_method) ---------------------------------------------
class StepGradients:
    """Per-step gradients by one method, into buffers reused from call to call (the rows
    returned are valid until the next call). `auto`: einsum where every wanted parameter has
    a rule, vmap otherwise. `factored` weights (einsum only) come back as their factors."""

    def __init__(self, method: str, chunk: int = 32, factored: Sequence[str] = ()) -> None:
        if method not in GRADIENT_METHODS:
            raise ValueError(f"gradient method {method!r}: expected one of "
                             f"{', '.join(GRADIENT_METHODS)}")
        self.method, self.chunk, self.factored = method, chunk, list(factored)
        self.buffer: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None  # the factors side by side (layout order)
        self.factor_buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def resolve(self, victim: Victim, layers: list[LayerInfo]) -> str:
        if self.method != "auto":
            return self.method
        return "vmap" if einsum_unsupported(victim, layers) else "einsum"

    def reserve(self, victim: Victim, layers: list[LayerInfo], steps: int) -> None:
        """The einsum method's buffers for episodes of up to `steps` steps, allocated and
        touched now: a capture calls this while it waits for its first episode, whose
        gradients then skip the page faults (the paper cnn's 58 MB buffer, 15-20 ms the first
        time each of its two buffers is filled)."""
        if self.resolve(victim, layers) == "einsum":
            for buffer in self._ensure_buffers(victim, layers, steps):
                buffer.zero_()

    def _ensure_buffers(self, victim: Victim, layers: list[LayerInfo], steps: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' buffer and the factors' (allocated anew when too small or of another
        layout)."""
        layout = GradientLayout(tuple(layers), frozenset(self.factored))
        if self.buffer is None or self.packed is None or len(self.buffer) < steps \
                or self.buffer.shape[1] != layout.stored_width:
            rows = max(steps, 2 * self.chunk)
            dtype = next(victim.parameters()).dtype
            self.buffer = torch.empty(rows, layout.stored_width, dtype=dtype)
            self.packed = torch.empty(rows, layout.factor_width, dtype=dtype)
            self.factor_buffers = {name: (self.packed[:, left], self.packed[:, right])
                                   for name, (left, right) in layout.factor_columns().items()}
        return self.buffer, self.packed

    def __call__(self, victim: Victim, batch: StepBatch, coefficients: LossCoefficients,
                 layers: list[LayerInfo], ppo: bool = True) -> torch.Tensor | FactoredRows:
        method = self.resolve(victim, layers)
        if self.factored and method != "einsum":
            raise ValueError(f"factored weights need the einsum method, not {method}")
        if method == "loop":
            return loop_gradients(victim, batch, coefficients, layers, ppo=ppo)
        if method == "vmap":
            return per_step_gradients(victim, batch, coefficients, layers, ppo=ppo,
                                      chunk=self.chunk)
        self._ensure_buffers(victim, layers, len(batch))
        dense = einsum_gradients(victim, batch, coefficients, layers, ppo=ppo,
                                 chunk=self.chunk, out=self.buffer, factors=self.factor_buffers)
        if not self.factored:
            return dense
        return FactoredRows(dense, self.packed[:len(batch)],
                            {name: (left[:len(batch)], right[:len(batch)])
                             for name, (left, right) in self.factor_buffers.items()})


@dataclass
class FactoredRows:
    """Per-step gradients with some Linear weights as factors (gradleak.capture.layout):
    `dense` holds the other layers' columns in layer-table order."""

    dense: torch.Tensor  # (N, stored width)
    packed: torch.Tensor  # (N, factor width): the rows of the file's `gradient_factors`
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # name → (output grad, input), views

    def full(self, layers: list[LayerInfo]) -> torch.Tensor:
        """(N, d): the dense rows the factors stand for."""
        return GradientLayout(tuple(layers), frozenset(self.factors)).expand(self.dense,
                                                                             self.packed)


GRADIENT_METHODS = ("auto", "einsum", "vmap", "loop")
