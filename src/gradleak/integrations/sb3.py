"""Stable-Baselines3 (`pip install gradleak[sb3]`): audit a PPO or A2C `CnnPolicy` agent as it is.

    from stable_baselines3 import PPO
    from gradleak.integrations import sb3

    model = PPO("CnnPolicy", env)          # trained on 64×64 RGB frames, Discrete(K) actions
    sb3.save(model, "runs/sb3-victim")      # then: gradleak capture --victim runs/sb3-victim ...

`victim(model)` is gradleak's `nature-cnn` holding the policy's θ (SB3's NatureCNN, its
`action_net` and `value_net`), and `learning_rule(model)` reads the loss SB3 optimises (vf_coef,
ent_coef, the initial clip_range, gamma, gae_lambda), which `save` declares in the checkpoint, so
a capture computes each step's gradient with SB3's own coefficients. SB3 normalises advantages
per optimiser minibatch of its shuffled rollout buffer; a capture of single steps declares its
own normalisation (per episode by default) instead, and says so in the file.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from gradleak.errors import ConfigError
from gradleak.io import save_victim
from gradleak.victims.base import Victim, VictimConfig, create_victim

# gradleak's nature-cnn parameter ← SB3 ActorCriticCnnPolicy parameter (shared extractor)
PARAMETERS = {"encoder.0": "features_extractor.cnn.0", "encoder.2": "features_extractor.cnn.2",
              "encoder.4": "features_extractor.cnn.4", "fc": "features_extractor.linear.0",
              "policy_head": "action_net", "value_head": "value_net"}


def _policy(model: Any) -> Any:
    from stable_baselines3.common.torch_layers import NatureCNN

    policy = getattr(model, "policy", None)
    extractor = getattr(policy, "features_extractor", None)
    if not isinstance(extractor, NatureCNN):
        raise ConfigError(f"{type(model).__name__}: gradleak audits SB3's CnnPolicy (a NatureCNN "
                          f"features extractor), found {type(extractor).__name__}")
    if not getattr(policy, "share_features_extractor", True):
        raise ConfigError("the policy keeps separate actor and critic extractors "
                          "(share_features_extractor=False), which nature-cnn does not model")
    if policy.mlp_extractor.latent_dim_pi != extractor.features_dim or \
            any(True for _ in policy.mlp_extractor.parameters()):
        raise ConfigError("the policy has hidden layers after the CNN (net_arch): only the "
                          "default CnnPolicy, heads directly on the 512 features, is supported")
    if extractor.features_dim != 512:
        raise ConfigError(f"NatureCNN features_dim {extractor.features_dim}: nature-cnn has 512")
    return policy


def frame_shape(model: Any) -> tuple[int, int]:
    """(frame size, actions) from the policy's spaces: square RGB frames, discrete actions."""
    policy = _policy(model)
    shape = tuple(policy.observation_space.shape)
    channels_first = shape[0] == 3  # SB3 transposes image observations to (C, H, W)
    height, width, channels = (shape[1], shape[2], shape[0]) if channels_first else shape
    if channels != 3 or height != width:
        raise ConfigError(f"observation shape {shape}: nature-cnn reads square RGB frames")
    actions = getattr(policy.action_space, "n", None)
    if actions is None:
        raise ConfigError(f"action space {policy.action_space}: expected Discrete(K)")
    if not policy.normalize_images:
        raise ConfigError("the policy does not divide images by 255 (normalize_images=False)")
    return int(height), int(actions)


def victim(model: Any) -> Victim:
    """gradleak's nature-cnn with the SB3 policy's weights, in eval mode."""
    size, actions = frame_shape(model)
    converted = create_victim(VictimConfig("nature-cnn", size, actions))
    theirs = dict(_policy(model).state_dict())
    state = {}
    for ours, source in PARAMETERS.items():
        for kind in ("weight", "bias"):
            state[f"{ours}.{kind}"] = theirs[f"{source}.{kind}"].detach().to(torch.float32).cpu()
    converted.load_state_dict(state)
    return converted.eval()


def learning_rule(model: Any) -> dict[str, Any]:
    """The loss SB3 optimises, in gradleak's keys, and the algorithm."""
    from stable_baselines3 import A2C, PPO

    if not isinstance(model, (PPO, A2C)):
        raise ConfigError(f"{type(model).__name__}: expected a stable_baselines3 PPO or A2C model")
    ppo = isinstance(model, PPO)
    return {"algorithm": "ppo" if ppo else "a2c", "value": float(model.vf_coef),
            "entropy": float(model.ent_coef),
            "clip": float(model.clip_range(1.0)) if ppo else 0.0,
            "gamma": float(model.gamma), "lam": float(model.gae_lambda)}


def save(model: Any, directory: str | os.PathLike[str]) -> None:
    """A gradleak victim checkpoint that declares SB3's learning rule and frame format."""
    rule = learning_rule(model)
    converted = victim(model)
    size, actions = converted.config.frame_size, converted.config.num_actions
    save_victim(directory, converted, {
        "algorithm": rule["algorithm"], "source": "stable-baselines3",
        "preset": {"name": "stable-baselines3",
                   "env": {"doomnav": {"frame_size": size, "num_actions": actions}},
                   "train": {"victim": "nature-cnn", "algo": rule["algorithm"],
                             "value_coef": rule["value"], "entropy_coef": rule["entropy"],
                             "clip": rule["clip"], "gamma": rule["gamma"],
                             "lam": rule["lam"]}}})
