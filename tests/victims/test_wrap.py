"""`gradleak.wrap`: a model nobody here wrote is audited by naming its heads, from Python and
from the CLI; what cannot be audited is refused, naming the module."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import user_models
from torch import nn

import gradleak
from gradleak.attacks.analytic import recover_analytically
from gradleak.capture.reader import CaptureFile
from gradleak.capture.record import record
from gradleak.cli import main
from gradleak.errors import CaptureFileError, ConfigError
from gradleak.victims.transform import InputTransform

LOSS = {"value": 0.5, "entropy": 0.01, "clip": 0.2, "gamma": 0.99, "lam": 0.95}


def rollouts(shape: tuple[int, ...], steps: int = 12, actions: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"images": rng.integers(0, 256, (steps, *shape), dtype=np.uint8),
            "actions": np.arange(steps) % actions, "advantages": rng.normal(size=steps) + 0.1,
            "returns": rng.normal(size=steps), "episode_ids": np.repeat([0, 1, 2], steps // 3)}


def conv_victim(factory: bool = True) -> gradleak.victims.Victim:
    torch.manual_seed(0)
    return gradleak.wrap(user_models.build_conv_policy(), policy_head="pi", value_head="v",
                         frame_shape=(32, 32, 3),
                         factory="conv-policy" if factory else None)


def test_roles_are_found_from_the_users_own_names() -> None:
    victim = conv_victim()
    roles = victim.roles()
    assert [name for name, _ in victim.named_parameters()][:2] == ["body.0.weight", "body.0.bias"]
    assert roles.linears == ("proj", "pi", "v") and roles.feature_linear == "proj"
    assert [step.kind for step in roles.conv_stack] == ["conv", "relu", "conv", "relu", "flatten"]
    assert roles.conv_chain and roles.shared_features
    assert victim.component_of("body.2.weight") == "cnn" and victim.component_of("pi.bias") == \
        "heads" and victim.component_of("proj.weight") == "fc"


@pytest.mark.slow
def test_a_wrapped_model_is_audited_from_python_and_from_the_cli(capsys, tmp_path: Path) -> None:
    victim = conv_victim()
    data = rollouts((32, 32, 3))
    out = tmp_path / "mine.h5"
    record(victim, out, loss=LOSS, **data)
    with CaptureFile(out) as capture:
        assert capture.roles == victim.roles()  # stored, and read back the same
        assert capture.summary()["roles"] == (
            "heads pi / v; closed form proj, pi, v; 2 convs into proj")
        observation = capture.observation(with_theta0=True)
    recovered = recover_analytically(observation)
    assert np.array_equal(recovered.actions, data["actions"])
    with torch.no_grad():
        truth = victim.body(victim.input_transform.apply(torch.from_numpy(data["images"])))
    error = np.abs(recovered.extras["layer_inputs"]["proj"] - truth.numpy()).max()
    assert error < 1e-4
    # the CLI rebuilds the model from the factory the capture names, loaded as a plugin
    assert main(["closed-form", str(out), "--conv", "2", "--plugin", "user_models", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)[str(out)]
    assert scores["action_accuracy"] == 1.0
    assert scores["conv_stack"]["layers"]["body.2"]["median_relative_error"] < 1e-3


def test_the_factory_must_be_loaded_and_a_model_object_cannot_be_rebuilt(
        capsys, tmp_path: Path) -> None:
    out = tmp_path / "a.h5"
    record(conv_victim(), out, loss=LOSS, **rollouts((32, 32, 3)))
    from gradleak.victims.factories import MODEL_FACTORIES

    entry = MODEL_FACTORIES.get("conv-policy")
    MODEL_FACTORIES.drop("conv-policy")  # as in a process that did not load the plugin
    try:
        assert main(["closed-form", str(out), "--conv", "1"]) == 2
    finally:
        MODEL_FACTORIES.register("conv-policy")(entry)
    err = capsys.readouterr().err
    assert "factory = 'conv-policy' is not a registered model factory" in err
    assert "--plugin MODULE" in err
    plain = tmp_path / "b.h5"
    record(conv_victim(factory=False), plain, loss=LOSS, **rollouts((32, 32, 3)))
    assert main(["closed-form", str(plain), "--json"]) == 0  # the closed form needs no model
    assert json.loads(capsys.readouterr().out)[str(plain)]["action_accuracy"] == 1.0
    from gradleak.victims import wrapped

    wrapped._SESSION.clear()  # as in another process: only this one kept the model's copy
    assert main(["closed-form", str(plain), "--conv", "1"]) == 2
    assert "without a registered factory=" in capsys.readouterr().err


def test_separate_actor_and_critic_on_stacked_grayscale_non_square_frames(tmp_path: Path
                                                                          ) -> None:
    torch.manual_seed(0)
    transform = InputTransform(height=12, width=20, channels=4, stack=4)
    inputs = 12 * 20 * 4
    victim = gradleak.wrap(actor=user_models.Actor(inputs, 3),
                           critic=user_models.Critic(inputs), policy_head="net.3",
                           value_head="net.3", transform=transform)
    roles = victim.roles()
    assert not roles.shared_features and roles.frame_linear in ("actor.net.1", "critic.net.1")
    data = rollouts((12, 20, 4), actions=3)
    out = tmp_path / "stack.h5"
    record(victim, out, loss=LOSS, **data)
    with CaptureFile(out) as capture:
        assert capture.private_column("images").shape == (12, 12, 20, 4)  # stored as given
        observation, target = capture.observation(), capture.target()
    recovered = recover_analytically(observation)
    assert np.array_equal(recovered.actions, data["actions"])
    assert np.abs(recovered.extras["values"] - target.values).max() < 1e-4  # the critic's h
    frames = recovered.extras["layer_inputs"][roles.frame_linear] * 255  # the frame itself
    assert np.abs(frames - data["images"].transpose(0, 3, 1, 2).reshape(12, -1)).max() < 0.05


@pytest.mark.parametrize("build, settings, fragment", [
    (user_models.ConvPolicy, {"policy_head": "body.0"}, "body.0' is a Conv2d"),
    (user_models.ConvPolicy, {"policy_head": "logits"},
     "no such module (its Linear layers are proj, pi, v)"),
    ("without bias", {}, "'pi' has no bias"),
    (user_models.NoisyHead, {"frame_shape": (2, 2, 3)}, "module pi reads different inputs"),
    (user_models.ConvPolicy, {"frame_shape": (30, 32, 3)},
     "fails on example frames of the declared shape (30, 32, 3)"),
    ("scaled", {"transform": InputTransform(32, 32, scale=1.0), "feed": "frames-chw",
                "frame_shape": None}, "does not give what body.0 reads"),
])
def test_what_cannot_be_audited_is_refused_naming_the_module(build, settings: dict,
                                                            fragment: str) -> None:
    model = {"without bias": _without_bias, "scaled": lambda: _ScaledPolicy()}.get(
        build, build)()
    options = {"policy_head": "pi", "value_head": "v", "frame_shape": (32, 32, 3), **settings}
    with pytest.raises(ConfigError) as error:
        gradleak.wrap(model, **options)
    assert fragment in str(error.value)


class _ScaledPolicy(user_models.ConvPolicy):
    """Divides by 255 itself, unlike what a transform of scale 1 declares."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(x / 255.0)


def _without_bias() -> nn.Module:
    model = user_models.ConvPolicy()
    model.pi = nn.Linear(64, 4, bias=False)
    return model


def test_roles_that_do_not_fit_the_layer_table_are_refused_on_read(tmp_path: Path) -> None:
    import h5py

    out = tmp_path / "a.h5"
    record(conv_victim(), out, loss=LOSS, **rollouts((32, 32, 3)))
    with h5py.File(out, "a") as handle:
        roles = json.loads(handle.attrs["roles"])
        roles["policy_head"], roles["linears"] = "body.0", ["body.0", *roles["linears"]]
        handle.attrs["roles"] = json.dumps(roles)
    with pytest.raises(CaptureFileError, match="role layer body.0 has a weight of shape"):
        CaptureFile(out)


def test_a_saved_wrapped_model_is_captured_in_doomnav_from_the_cli(capsys, tmp_path: Path
                                                                   ) -> None:
    """The user's checkpoint (their architecture by factory, θ as safetensors) plays DoomNav
    and is captured and attacked with the plain CLI: no adapter, no gradleak subclass."""
    from gradleak.io import save_victim

    torch.manual_seed(0)
    victim = gradleak.wrap(user_models.ConvPolicy(actions=5), policy_head="pi", value_head="v",
                           frame_shape=(32, 32, 3), factory=user_models.build_conv_policy,
                           factory_kwargs={"actions": 5})
    save_victim(tmp_path / "victim", victim)
    out = tmp_path / "c.h5"
    assert main(["capture", "--victim", str(tmp_path / "victim"), "--plugin", "user_models",
                 "--scenes", "heldout", "--steps", "12", "--out", str(out), "--seed", "1",
                 "--quiet", "--loss", "value=0.5,entropy=0.01,clip=0.2,gamma=0.99,lam=0.95",
                 "--set", "env.doomnav.frame_size=32",
                 "--set", "env.doomnav.max_steps=6", "--set", "env.heldout_maps=MAP05",
                 "--set", "env.max_regions_per_map=1"]) == 0
    assert main(["closed-form", str(out), "--plugin", "user_models", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)[str(out)]
    assert scores["action_accuracy"] == 1.0
    assert scores["layer_inputs"]["proj"]["median_relative_error"] < 1e-2


def test_gradient_matching_runs_on_a_users_model_and_learned_attackers_refuse_stacks(
        capsys, tmp_path: Path) -> None:
    from gradleak.attacks.optim.config import baseline_config
    from gradleak.attacks.optim.solve import GradientMatchingAttack

    out = tmp_path / "rgb.h5"
    record(conv_victim(), out, loss=LOSS, **rollouts((32, 32, 3)))
    assert main(["attack", "ig", "--data", str(out), "--index", "0", "--iters", "2",
                 "--out", str(tmp_path / "ig"), "--plugin", "user_models", "--quiet"]) == 0
    torch.manual_seed(0)
    stacked = user_models.ConvPolicy(channels=4)
    victim = gradleak.wrap(stacked, policy_head="pi", value_head="v",
                           transform=InputTransform(32, 32, 4, stack=4))
    gray = tmp_path / "gray" / "train.h5"
    record(victim, gray, loss=LOSS, **rollouts((32, 32, 4)))
    with CaptureFile(gray) as capture:
        observation = capture.observation(slice(0, 1))
    config = baseline_config("ig")
    config.iterations, config.restarts = 2, 1
    assert GradientMatchingAttack(observation, config).reconstruct().images.shape == (
        1, 32, 32, 4)  # frames in the stored format
    assert main(["train-attacker", "--data", str(gray), "--out", str(tmp_path / "att"),
                 "--quiet"]) == 2
    assert "the learned attackers reconstruct square RGB frames" in capsys.readouterr().err
    assert not (tmp_path / "att").exists()


class TiedTwice(nn.Module):
    """One Linear applied twice per step (weights tied, as in a recurrent refinement)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2)
        self.mix = nn.Linear(36, 36)
        self.pi, self.v = nn.Linear(36, 3), nn.Linear(36, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.conv(x)).flatten(1)
        h = torch.tanh(self.mix(torch.tanh(self.mix(h))))
        return self.pi(h), self.v(h).squeeze(-1)


def test_einsum_adds_up_a_layer_applied_twice_as_autograd_does() -> None:
    from gradleak.capture.grads import StepBatch, einsum_gradients, loop_gradients
    from gradleak.rl.losses import LossCoefficients
    from gradleak.victims import layer_table

    torch.manual_seed(0)
    victim = gradleak.wrap(TiedTwice(), policy_head="pi", value_head="v", frame_shape=(8, 8, 3))
    n, generator = 5, torch.Generator().manual_seed(1)
    batch = StepBatch(torch.randint(0, 256, (n, 8, 8, 3), dtype=torch.uint8,
                                    generator=generator), torch.arange(n) % 3,
                      torch.randn(n, generator=generator), torch.randn(n, generator=generator),
                      -torch.rand(n, generator=generator) - 1)
    layers = layer_table(victim)
    looped = loop_gradients(victim, batch, LossCoefficients(), layers)
    summed = einsum_gradients(victim, batch, LossCoefficients(), layers, chunk=2)
    assert torch.allclose(summed, looped, rtol=1e-5, atol=1e-7)
