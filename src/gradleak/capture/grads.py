"""Per-step gradients of the shared actor-critic loss at θ0, as a distributed client sends them.

Batched with torch.func: vmap over steps of grad of a functional call of the victim. The loop
of torch.autograd.grad is kept as the reference the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import functional_call, grad, vmap

from gradleak.rl.losses import LossCoefficients, actor_critic_loss
from gradleak.victims.base import LayerInfo, Victim


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
