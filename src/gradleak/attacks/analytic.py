"""Exact recovery from one per-step gradient and θ0, in closed form.

Every biased Linear layer applied once per sample gives its input (`closed_form.linear_input`):
x = ∇Wᵀ ∇b / ‖∇b‖². That gives the conv features' Linear layer its input (the flattened conv
features of the frame) and the heads' input h. With θ0, h gives the logits, π and V. The
policy head's bias gradient is A (π − e_a) + c_e π ⊙ (log π + H): remove the known entropy
term, then the taken action is the one whose (π − e_a) explains the rest with no residual, and
A is the fitted scale. The value head's bias gradient 2 c_v (V − R) gives the return R.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gradleak.errors import ConfigError
from gradleak.inversion.closed_form import head_features, linear_input
from gradleak.threat import Observation, Reconstruction
from gradleak.victims.base import victim_at_theta0


@dataclass(frozen=True)
class LinearLayer:
    name: str  # the module's name, e.g. "fc"
    weight: np.ndarray  # θ0's W (out, in)
    bias: np.ndarray  # θ0's b (out,)


def linear_layers(observation: Observation) -> list[str]:
    """The victim's closed-form Linear layers (its roles: biased, applied once per sample)
    whose weight and bias gradients the observation holds."""
    names = {layer.name for layer in observation.layers}
    return [module for module in observation.roles.linears
            if f"{module}.weight" in names and f"{module}.bias" in names]


def layer_input(observation: Observation, module: str) -> np.ndarray:
    """(N, in): x = ∇Wᵀ ∇b / ‖∇b‖² per step (NaN where ∇b is exactly zero)."""
    weight = torch.from_numpy(observation.block(f"{module}.weight").astype(np.float64))
    bias = torch.from_numpy(observation.block(f"{module}.bias").astype(np.float64))
    return linear_input(weight, bias).numpy()


def _head(observation: Observation, module: str) -> LinearLayer:
    try:
        return LinearLayer(module, np.asarray(observation.theta0[f"{module}.weight"], np.float64),
                           np.asarray(observation.theta0[f"{module}.bias"], np.float64))
    except KeyError:
        raise ConfigError(f"analytic recovery needs θ0's {module}.weight and {module}.bias "
                          "(read the observation with with_theta0=True)") from None


def check_supported(observation: Observation) -> None:
    layers = set(linear_layers(observation))
    missing = {observation.roles.policy_head, observation.roles.value_head} - layers
    if missing:
        raise ConfigError(f"victim {observation.victim.name}: analytic recovery needs Linear "
                          f"heads with a bias, and the gradients of {', '.join(sorted(missing))}"
                          " (capture with --components including 'heads')")
    if "value" not in observation.hyperparameters or "entropy" not in \
            observation.hyperparameters:
        raise ConfigError("analytic recovery needs the declared loss coefficients (value, "
                          "entropy) in the observation's hyperparameters")


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(1, keepdims=True))
    return shifted / shifted.sum(1, keepdims=True)


def action_and_advantage(residual_gradient: np.ndarray, probs: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """r = A (π − e_a): for each candidate a the least-squares A, and the a leaving the least
    residual. Returns (actions, advantages, relative residual)."""
    n, k = probs.shape
    best_residual = np.full(n, np.inf)
    actions, advantages = np.zeros(n, np.int64), np.zeros(n)
    for a in range(k):
        direction = probs.copy()
        direction[:, a] -= 1.0
        scale = (residual_gradient * direction).sum(1) / (direction ** 2).sum(1)
        residual = ((residual_gradient - scale[:, None] * direction) ** 2).sum(1)
        better = residual < best_residual
        actions[better], advantages[better], best_residual[better] = a, scale[better], \
            residual[better]
    size = (residual_gradient ** 2).sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return actions, advantages, np.sqrt(best_residual / size)


def actions_from_policy_bias(policy_bias: np.ndarray, probs: np.ndarray, entropy_coef: float
                             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The policy head's bias gradient is A (π − e_a) + c_e π ⊙ (log π + H): remove the known
    entropy term, then fit A (π − e_a). Returns (actions, advantages, relative residual)."""
    log_probs = np.log(np.clip(probs, 1e-300, None))
    entropy = -(probs * log_probs).sum(1, keepdims=True)
    return action_and_advantage(policy_bias - entropy_coef * probs * (log_probs + entropy),
                                probs)


def recover_analytically(observation: Observation) -> Reconstruction:
    """Actions, and in extras: every Linear layer's input, h, π, V, A, R, the fit residual."""
    check_supported(observation)
    roles = observation.roles
    inputs = {module: layer_input(observation, module) for module in linear_layers(observation)}
    policy, value = _head(observation, roles.policy_head), _head(observation, roles.value_head)
    features, value_features = (h.numpy() for h in head_features(
        torch.from_numpy(inputs[roles.policy_head]), torch.from_numpy(inputs[roles.value_head]),
        roles.shared_features))
    probs = softmax(features @ policy.weight.T + policy.bias)
    values = (value_features @ value.weight.T + value.bias)[:, 0]
    value_coef = float(observation.hyperparameters["value"])
    actions, advantages, misfit = actions_from_policy_bias(
        observation.block(f"{roles.policy_head}.bias").astype(np.float64), probs,
        float(observation.hyperparameters["entropy"]))
    returns = values - observation.block(f"{roles.value_head}.bias").astype(np.float64)[:, 0] \
        / (2.0 * value_coef)
    return Reconstruction(actions=actions, extras={
        "layer_inputs": inputs, "features": features, "value_features": value_features,
        "probs": probs, "values": values,
        "advantages": advantages, "returns": returns, "misfit": misfit})


class _Captured(Exception):
    """Stops the victim's forward pass once the wanted module's input is in hand."""


def module_input(victim: torch.nn.Module, module: str, images: torch.Tensor) -> torch.Tensor:
    """The input `module` receives when the victim sees `images` (the rest is not run)."""
    captured: list[torch.Tensor] = []

    def grab(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        captured.append(args[0])
        raise _Captured

    modules = dict(victim.named_modules())
    if module not in modules:
        linears = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear)]
        raise ConfigError(f"victim {type(victim).__name__} has no module {module!r} (its Linear "
                          f"layers: {', '.join(linears)})")
    handle = modules[module].register_forward_pre_hook(grab)
    try:
        victim(images)
    except _Captured:
        pass
    finally:
        handle.remove()
    return captured[0]


def invert_features(observation: Observation, features: np.ndarray, module: str,
                    iterations: int = 600, lr: float = 0.01, tv: float = 0.3,
                    seed: int = 0) -> np.ndarray:
    """Frames whose `module` input matches the recovered one: Adam on the pixels, relative
    squared error plus anisotropic TV, clamped to [0, 1]. Frames are independent (the loss is a
    sum over them and Adam is element-wise), so a batch solves them all at once.

    The TV weight is strong because the 4×4×32 feature map alone does not pin the frame down
    (the sweep that chose it: docs/training-free.md, "Measured choices")."""
    victim = victim_at_theta0(observation)
    for parameter in victim.parameters():
        parameter.requires_grad_(False)
    target = torch.from_numpy(features).float()
    shape = (len(target), *observation.roles.transform.frame_shape)
    generator = torch.Generator().manual_seed(seed)
    images = torch.full(shape, 0.5).add_(0.05 * torch.randn(shape, generator=generator))
    images.requires_grad_(True)
    optimiser = torch.optim.Adam([images], lr=lr)
    scale = target.pow(2).sum(1).clamp_min(1e-12)
    for _ in range(iterations):
        optimiser.zero_grad(set_to_none=True)
        produced = module_input(victim, module, images * 255.0).flatten(1)
        mismatch = ((produced - target) ** 2).sum(1) / scale
        variation = ((images[:, 1:] - images[:, :-1]).abs().mean((1, 2, 3))
                     + (images[:, :, 1:] - images[:, :, :-1]).abs().mean((1, 2, 3)))
        (mismatch + tv * variation).sum().backward()
        optimiser.step()
        with torch.no_grad():
            images.clamp_(0.0, 1.0)
    return (images.detach() * 255).round().to(torch.uint8).numpy()
