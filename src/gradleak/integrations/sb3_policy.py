"""An SB3 policy as a gradleak victim (the public names are `gradleak.integrations.sb3`'s).

`victim(model)` is `gradleak.wrap` of a copy of the policy (heads `action_net` and
`value_net`), fed frames the way SB3 feeds them (channel-first, divided by 255 inside the
policy when it normalises images). It is rebuilt from a JSON description of the policy (its
class, spaces and constructor arguments): SB3's own zip files hold cloudpickled objects, which
gradleak never loads. `learning_rule(model)` reads the loss SB3 optimises (vf_coef, ent_coef,
the initial clip_range, gamma, gae_lambda, normalize_advantage).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.io import save_victim
from gradleak.victims.base import Victim
from gradleak.victims.factories import register_forward, register_model_factory
from gradleak.victims.transform import InputTransform
from gradleak.victims.wrapped import wrap

POLICIES = ("ActorCriticPolicy", "ActorCriticCnnPolicy", "MultiInputActorCriticPolicy")
EXTRACTORS = ("NatureCNN", "FlattenExtractor", "CombinedExtractor")
KWARGS = ("net_arch", "share_features_extractor", "normalize_images", "ortho_init")
ACTIVATIONS = tuple(nn.modules.activation.__all__)  # the classes a description may name
MAX_OBSERVATION = 1 << 24  # values in one observation a description may declare
MAX_WIDTH = 1 << 16  # units in one layer of a description's net_arch or extractor
FACTORY = "sb3-policy"  # the registered names a wrapped SB3 victim's capture holds


@register_forward(FACTORY)
def actor_critic_outputs(policy: nn.Module, obs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, value) of an SB3 ActorCriticPolicy, as its evaluate_actions computes them."""
    features = policy.extract_features(obs)
    if policy.share_features_extractor:
        latent_pi, latent_vf = policy.mlp_extractor(features)
    else:
        latent_pi = policy.mlp_extractor.forward_actor(features[0])
        latent_vf = policy.mlp_extractor.forward_critic(features[1])
    return policy.action_net(latent_pi), policy.value_net(latent_vf)


def _space_to_dict(space: Any) -> dict[str, Any]:
    import gymnasium as gym

    if isinstance(space, gym.spaces.Dict):
        return {"type": "dict", "spaces": {k: _space_to_dict(v) for k, v in space.spaces.items()}}
    if isinstance(space, gym.spaces.Discrete):
        return {"type": "discrete", "n": int(space.n)}
    if isinstance(space, gym.spaces.Box):
        return {"type": "box", "shape": list(space.shape), "dtype": str(space.dtype),
                "low": float(np.min(space.low)), "high": float(np.max(space.high))}
    raise ConfigError(f"observation or action space {space}: gradleak audits Box, Dict of Box "
                      "observations and Discrete actions")


def _space_from_dict(data: dict[str, Any]) -> Any:
    import gymnasium as gym

    kind = data.get("type")
    if kind == "dict":
        return gym.spaces.Dict({k: _space_from_dict(v) for k, v in data["spaces"].items()})
    if kind == "discrete":
        return gym.spaces.Discrete(int(data["n"]))
    if kind == "box":
        shape = tuple(data["shape"])
        if not all(isinstance(n, int) and n > 0 for n in shape) or \
                int(np.prod(shape)) > MAX_OBSERVATION:
            raise ConfigError(f"SB3 policy description: observation shape {list(shape)[:8]}: "
                              f"expected positive sizes, at most {MAX_OBSERVATION:,} values")
        return gym.spaces.Box(data["low"], data["high"], shape, np.dtype(data["dtype"]))
    raise ConfigError(f"SB3 policy description: space {data!r} is not box, dict or discrete")


def describe(policy: Any) -> dict[str, Any]:
    """The JSON a policy is rebuilt from: class, spaces, constructor arguments."""
    name = type(policy).__name__
    parameters = policy._get_constructor_parameters()
    extractor = parameters["features_extractor_class"].__name__
    activation = parameters["activation_fn"].__name__
    if name not in POLICIES or extractor not in EXTRACTORS:
        raise ConfigError(f"SB3 policy {name} with features extractor {extractor}: gradleak "
                          f"rebuilds {', '.join(POLICIES)} with {', '.join(EXTRACTORS)}")
    if activation not in ACTIVATIONS:
        raise ConfigError(f"SB3 policy activation {activation}: expected a torch.nn activation")
    extractor_kwargs = dict(parameters.get("features_extractor_kwargs") or {})
    for key, value in extractor_kwargs.items():
        if not isinstance(value, (int, float, bool, str)):
            raise ConfigError(f"SB3 features_extractor_kwargs[{key!r}] = {value!r}: only plain "
                              "numbers and strings can be described")
    return {"policy": name, "observation_space": _space_to_dict(policy.observation_space),
            "action_space": _space_to_dict(policy.action_space), "extractor": extractor,
            "extractor_kwargs": extractor_kwargs, "activation": activation,
            **{key: parameters[key] for key in KWARGS if key in parameters},
            "share_features_extractor": bool(policy.share_features_extractor)}


@register_model_factory(FACTORY)
def rebuild(**description: Any) -> nn.Module:
    """An SB3 policy from `describe`'s JSON (the factory a wrapped SB3 victim names): only the
    classes named in POLICIES, EXTRACTORS and ACTIVATIONS can be built."""
    from stable_baselines3.common import policies, torch_layers

    if description.get("policy") not in POLICIES or description.get("extractor") not in \
            EXTRACTORS or description.get("activation") not in ACTIVATIONS:
        raise ConfigError(f"SB3 policy description {str(description)[:200]}: unknown policy, "
                          "extractor or activation")
    widths = [description.get("net_arch"), description.get("extractor_kwargs")]
    while widths:  # a description's layer sizes: bounded before anything is built
        value = widths.pop()
        if isinstance(value, dict):
            widths += list(value.values())
        elif isinstance(value, list):
            widths += value
        elif isinstance(value, int) and not isinstance(value, bool) and not 0 < value <= \
                MAX_WIDTH:
            raise ConfigError(f"SB3 policy description: a layer size {value} (expected 1 to "
                              f"{MAX_WIDTH:,})")
    try:
        spaces = (_space_from_dict(description["observation_space"]),
                  _space_from_dict(description["action_space"]))
        return getattr(policies, description["policy"])(
            *spaces, lambda _: 0.0, net_arch=description.get("net_arch"),
            activation_fn=getattr(nn, description["activation"]),
            features_extractor_class=getattr(torch_layers, description["extractor"]),
            features_extractor_kwargs=description.get("extractor_kwargs") or None,
            share_features_extractor=description.get("share_features_extractor", True),
            normalize_images=description.get("normalize_images", True),
            ortho_init=description.get("ortho_init", True))
    except (KeyError, TypeError, ValueError, AttributeError, AssertionError) as error:
        raise ConfigError(f"SB3 policy description {str(description)[:200]}: SB3 cannot build "
                          f"it ({type(error).__name__}: {str(error)[:200]})") from None


def _policy(model: Any) -> Any:
    from stable_baselines3 import A2C, PPO

    if not isinstance(model, (PPO, A2C)):
        raise ConfigError(f"{type(model).__name__}: expected a stable_baselines3 PPO or A2C model")
    if getattr(model.policy, "use_sde", False):
        raise ConfigError("the policy uses gSDE exploration (use_sde=True): its noise is "
                          "stochastic at capture time")
    return model.policy


def _image_key(space: dict[str, Any]) -> tuple[str | None, dict[str, Any], str | None]:
    """(image key, the image space, goal key) of a Box or Dict observation space."""
    if space["type"] == "box":
        return None, space, None
    images = [k for k, v in space["spaces"].items() if len(v["shape"]) == 3]
    others = [k for k, v in space["spaces"].items() if len(v["shape"]) != 3]
    if len(images) != 1 or len(others) > 1 or (others and space["spaces"][others[0]]["shape"]
                                                != [3]):
        raise ConfigError(f"dict observation space with keys {sorted(space['spaces'])}: "
                          "gradleak audits one image and at most one goal vector of 3")
    return images[0], space["spaces"][images[0]], (others[0] if others else None)


def victim(model: Any) -> Victim:
    """The SB3 policy's network as a gradleak victim, in eval mode: a copy rebuilt from its
    description holding the policy's current θ."""
    policy = _policy(model)
    description = describe(policy)
    image_key, image_space, goal_key = _image_key(description["observation_space"])
    channels, height, width = image_space["shape"]  # SB3 feeds images channel-first
    if image_space["dtype"] != "uint8" or channels not in (1, 3, 4, 12):
        raise ConfigError(f"observation {image_space}: expected uint8 image frames, channel-first "
                          "as SB3 transposes them")
    stack = 1 if channels in (1, 3) else (4 if channels in (4, 12) else 1)
    transform = InputTransform(height, width, channels, stack,
                               scale=1 / 255 if description.get("normalize_images", True)
                               else 1.0)
    copy = rebuild(**description)
    copy.load_state_dict({k: v.detach().cpu() for k, v in policy.state_dict().items()})
    return wrap(copy, policy_head="action_net", value_head="value_net", transform=transform,
                forward=actor_critic_outputs, feed="frames-chw", image_key=image_key,
                goal_key=goal_key, factory=FACTORY,
                factory_kwargs=description, label=f"sb3-{description['policy']}")


def learning_rule(model: Any) -> dict[str, Any]:
    """The loss SB3 optimises, in gradleak's keys, the algorithm and its advantage
    normalisation (PPO: per minibatch of batch_size, when normalize_advantage; A2C: none
    unless normalize_advantage, then per rollout)."""
    from stable_baselines3 import PPO

    _policy(model)
    ppo = isinstance(model, PPO)
    normalise = bool(getattr(model, "normalize_advantage", False))
    norm = (f"minibatch:{model.batch_size}" if ppo else "rollout") if normalise else "none"
    return {"algorithm": "ppo" if ppo else "a2c", "value": float(model.vf_coef),
            "entropy": float(model.ent_coef),
            "clip": float(model.clip_range(1.0)) if ppo else 0.0,
            "gamma": float(model.gamma), "lam": float(model.gae_lambda),
            "advantage_norm": norm}


def save(model: Any, directory: str | os.PathLike[str]) -> None:
    """A gradleak victim checkpoint that declares SB3's learning rule and frame format."""
    rule = learning_rule(model)
    converted = victim(model)
    transform = converted.input_transform
    save_victim(directory, converted, {
        "algorithm": rule["algorithm"], "source": "stable-baselines3",
        "preset": {"name": "stable-baselines3",
                   "env": {"doomnav": {"frame_size": transform.height,
                                       "num_actions": converted.config.num_actions}},
                   "train": {"victim": "wrapped", "algo": rule["algorithm"],
                             "value_coef": rule["value"], "entropy_coef": rule["entropy"],
                             "clip": rule["clip"], "gamma": rule["gamma"],
                             "lam": rule["lam"]}},
        "advantage_norm": rule["advantage_norm"]})
