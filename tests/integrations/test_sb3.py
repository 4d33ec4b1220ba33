"""Stable-Baselines3, as a user of it calls gradleak: the victim is SB3's network under SB3's own
parameter names (CnnPolicy, MlpPolicy on frames, MultiInputPolicy on frame + goal), the
captured per-step gradient is SB3's own PPO or A2C loss gradient for a minibatch of one, and a
saved agent is captured and attacked from the plain CLI with SB3's coefficients."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import stable_baselines3 as sb3
import torch
import torch.nn.functional as F

from gradleak.capture.grads import StepBatch, per_step_gradients
from gradleak.errors import ConfigError
from gradleak.integrations import sb3 as integration
from gradleak.rl.losses import LossCoefficients
from gradleak.victims import layer_table


@pytest.fixture(autouse=True)
def sb3_logs_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SB3's `learn` makes a log folder under /tmp unless told where: keep it in the test's."""
    monkeypatch.setenv("SB3_LOGDIR", str(tmp_path / "sb3-logs"))


class Frames(gym.Env):
    """64×64 RGB frames that change with the action: enough for SB3 to build a CnnPolicy."""

    observation_space = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
    action_space = gym.spaces.Discrete(5)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return self.np_random.integers(0, 256, (64, 64, 3), dtype=np.uint8), {}

    def step(self, action):
        self._t += 1
        frame = self.np_random.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        return frame, float(action == 1), self._t >= 16, False, {}


class FramesAndGoal(Frames):
    """The same frames beside a goal vector: SB3's MultiInputPolicy."""

    observation_space = gym.spaces.Dict({
        "image": gym.spaces.Box(0, 255, (64, 64, 3), np.uint8),
        "goal": gym.spaces.Box(-1.0, 1.0, (3,), np.float32)})

    def _with_goal(self, frame):
        return {"image": frame, "goal": self.np_random.uniform(-1, 1, 3).astype(np.float32)}

    def reset(self, *, seed=None, options=None):
        frame, info = super().reset(seed=seed)
        return self._with_goal(frame), info

    def step(self, action):
        frame, *rest = super().step(action)
        return self._with_goal(frame), *rest


POLICIES = {"CnnPolicy": Frames, "MlpPolicy": Frames, "MultiInputPolicy": FramesAndGoal}


def model_of(kind: str, policy: str = "CnnPolicy"):
    algorithm = {"ppo": sb3.PPO, "a2c": sb3.A2C}[kind]
    extra = {"n_steps": 16, "batch_size": 16} if kind == "ppo" else {"n_steps": 8}
    model = algorithm(policy, POLICIES[policy](), seed=0, device="cpu", vf_coef=0.25,
                      ent_coef=0.02, gamma=0.98, gae_lambda=0.9,
                      **({"clip_range": 0.1} if kind == "ppo" else {}), **extra)
    model.learn(32)  # θ away from its initialisation
    return model


def as_sb3_obs(images: np.ndarray, goals: np.ndarray | None = None):
    """What SB3's policy reads: channel-first frames (VecTransposeImage), beside the goal."""
    frames = torch.as_tensor(images.transpose(0, 3, 1, 2))
    return frames if goals is None else {"image": frames, "goal": torch.as_tensor(goals)}


def sb3_gradient(model, image: np.ndarray, action: int, advantage: float, ret: float,
                 kind: str, goal: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """SB3's own loss (ppo.py / a2c.py train()) on a minibatch of one, at the policy's θ."""
    policy = model.policy
    policy.set_training_mode(False)
    obs = as_sb3_obs(image[None], None if goal is None else goal[None])
    actions = torch.tensor([action])
    values, log_prob, entropy = policy.evaluate_actions(obs, actions)
    advantages, returns = torch.tensor([advantage]), torch.tensor([ret])
    if kind == "ppo":
        ratio = torch.exp(log_prob - log_prob.detach())
        clip = model.clip_range(1.0)
        policy_loss = -torch.min(advantages * ratio,
                                 advantages * torch.clamp(ratio, 1 - clip, 1 + clip)).mean()
    else:
        policy_loss = -(advantages * log_prob).mean()
    loss = (policy_loss + model.ent_coef * -torch.mean(entropy)
            + model.vf_coef * F.mse_loss(returns, values.flatten()))
    named = dict(policy.named_parameters())
    grads = torch.autograd.grad(loss, list(named.values()))
    return dict(zip(named, grads, strict=True))


@pytest.mark.parametrize("kind, policy", [("ppo", "CnnPolicy"), ("a2c", "CnnPolicy"),
                                          ("ppo", "MlpPolicy"), ("a2c", "MultiInputPolicy")])
def test_the_captured_gradient_is_sb3s_own_loss_gradient(kind: str, policy: str) -> None:
    model = model_of(kind, policy)
    victim = integration.victim(model)
    rule = integration.learning_rule(model)
    assert rule["algorithm"] == kind and rule["value"] == 0.25 and rule["entropy"] == 0.02
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (4, 64, 64, 3), dtype=np.uint8)
    goals = rng.uniform(-1, 1, (4, 3)).astype(np.float32) if policy == "MultiInputPolicy" \
        else None
    with torch.no_grad():  # the same network: SB3's logits and values
        logits, values = victim(torch.from_numpy(images),
                                None if goals is None else torch.from_numpy(goals))
        obs = as_sb3_obs(images, goals)
        theirs = model.policy.get_distribution(obs).distribution.logits
        assert torch.allclose(logits.log_softmax(-1), theirs, atol=1e-5)
        assert torch.allclose(values, model.policy.predict_values(obs).flatten(), atol=1e-5)
    actions, advantages = torch.tensor([0, 3, 1, 4]), torch.tensor([1.3, -0.6, 0.2, -2.0])
    returns = torch.tensor([0.5, -0.2, 1.1, 0.0])
    old = logits.log_softmax(-1).gather(-1, actions[:, None])[:, 0]
    layers = layer_table(victim)
    ours = per_step_gradients(victim, StepBatch(
        torch.from_numpy(images), actions, advantages, returns, old,
        None if goals is None else torch.from_numpy(goals)), LossCoefficients(
        value=rule["value"], entropy=rule["entropy"], clip=rule["clip"]), layers,
        ppo=kind == "ppo")
    assert {layer.name for layer in layers} == {n for n, _ in model.policy.named_parameters()}
    for i in range(4):
        reference = sb3_gradient(model, images[i], int(actions[i]), float(advantages[i]),
                                 float(returns[i]), kind, None if goals is None else goals[i])
        flat = torch.cat([reference[layer.name].flatten() for layer in layers])
        error = float((ours[i] - flat).norm() / flat.norm())
        assert error <= 1e-5, (i, error)


def test_the_roles_are_sb3s_layers() -> None:
    cnn = integration.victim(model_of("ppo")).roles()
    assert cnn.policy_head == "action_net" and cnn.feature_linear == "features_extractor.linear.0"
    assert cnn.conv_chain and cnn.shared_features and cnn.transform.scale == 1 / 255
    mlp = integration.victim(model_of("ppo", "MlpPolicy")).roles()
    assert not mlp.shared_features  # SB3's MlpPolicy: separate pi and vf networks
    assert mlp.frame_linear == "mlp_extractor.policy_net.0"  # it reads the frame itself
    multi = integration.victim(model_of("a2c", "MultiInputPolicy")).roles()
    assert multi.feature_linear == "features_extractor.extractors.image.linear.0"
    assert multi.extra_inputs == ("goal",)


def test_a_saved_agent_is_captured_with_sb3s_coefficients(capsys, tmp_path: Path) -> None:
    from gradleak.cli import main

    model = model_of("ppo")
    integration.save(model, tmp_path / "victim")
    out = tmp_path / "heldout.h5"
    assert main(["capture", "--victim", str(tmp_path / "victim"), "--scenes", "heldout",
                 "--steps", "12", "--out", str(out), "--seed", "1", "--quiet",
                 "--set", "env.heldout_maps=MAP05", "--set", "env.max_regions_per_map=1",
                 "--set", "env.doomnav.max_steps=6"]) == 0
    import h5py

    with h5py.File(out, "r") as handle:
        loss = json.loads(handle.attrs["loss"])
    assert (loss["value"], loss["entropy"], loss["clip"]) == (0.25, 0.02, 0.1)
    # SB3's PPO normalises per minibatch of batch_size: the checkpoint says so, the capture does
    assert loss["advantage_normalisation"] == "per minibatch of 16 consecutive steps, sample std"
    assert main(["closed-form", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)[str(out)]
    assert result["action_accuracy"] == 1.0


def test_a_policy_gradleak_cannot_audit_is_named() -> None:
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

    class Custom(BaseFeaturesExtractor):
        def __init__(self, space):
            super().__init__(space, 8)
            self.linear = torch.nn.Linear(3 * 64 * 64, 8)

        def forward(self, obs):
            return self.linear(obs.flatten(1))

    model = sb3.PPO("CnnPolicy", Frames(), seed=0, device="cpu", n_steps=16, batch_size=16,
                    policy_kwargs={"features_extractor_class": Custom})
    with pytest.raises(ConfigError, match="features extractor Custom"):
        integration.victim(model)


@pytest.mark.slow
@pytest.mark.parametrize("kind, policy", [("ppo", "CnnPolicy"), ("a2c", "CnnPolicy"),
                                          ("ppo", "MultiInputPolicy")])
def test_a_callback_records_what_the_client_sends_during_learn(capsys, tmp_path: Path,
                                                                kind: str, policy: str) -> None:
    import h5py

    from gradleak.cli import main
    from gradleak.integrations.sb3 import GradleakCapture

    model = model_of(kind, policy)
    callback = GradleakCapture(tmp_path / "train-{rollout}.h5", every=2)
    model.learn(4 * model.n_steps, callback=callback, reset_num_timesteps=False)
    assert [Path(p).name for p in callback.written] == ["train-0.h5", "train-2.h5"]
    last = callback.written[-1]
    assert main(["info", last, "--json"]) == 0  # a valid capture, every chunk decoded
    assert json.loads(capsys.readouterr().out)["rows"] == model.n_steps
    # the rollout after the last recorded one changed θ, so check the file against its own θ0
    with h5py.File(last, "r") as handle:
        image, action = handle["images"][3], int(handle["actions"][3])
        goal = handle["goals"][3] if policy == "MultiInputPolicy" else None
        advantage, ret = float(handle["advantages"][3]), float(handle["returns"][3])
        row = torch.from_numpy(handle["gradients"][3])
        theta0 = {k: torch.as_tensor(np.asarray(v[()])) for k, v in handle["theta0"].items()}
        loss = json.loads(handle.attrs["loss"])
    assert loss["advantage_normalisation"] == "none (raw GAE)" and loss["value"] == 0.25
    # SB3's own names: θ0 loads as it is (the shared extractor's aliases are the same tensors)
    missing, unexpected = model.policy.load_state_dict(theta0, strict=False)
    assert not unexpected and all(key.startswith(("pi_", "vf_")) for key in missing)
    reference = sb3_gradient(model, image, action, advantage, ret, kind, goal)
    layers = layer_table(integration.victim(model))
    flat = torch.cat([reference[layer.name].flatten() for layer in layers])
    assert float((row - flat).norm() / flat.norm()) <= 1e-5


def test_frames_are_reordered_with_one_copy_and_the_same_rows() -> None:
    from gradleak.integrations.sb3_capture import frames_in_order

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (5, 3, 4, 6, 7), dtype=np.uint8)  # (T, N, C, H, W)
    order = rng.permutation(15)
    expected = frames.transpose(0, 1, 3, 4, 2).reshape(15, 6, 7, 4)[order]
    found = frames_in_order(frames, order, chunk=4)
    assert found.flags["C_CONTIGUOUS"] and np.array_equal(found, expected)
