"""The paper's victims through the command line, as a user audits one: capture at random init,
closed-form recovery, and a refusal before any work where an attack does not apply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradleak.cli import main

TINY = ["--set", "env.doomnav.frame_size=32", "--set", "env.doomnav.max_steps=10",
        "--set", "env.heldout_maps=MAP05", "--set", "env.max_regions_per_map=2"]


def capture(root: Path, victim: str, *extra: str) -> Path:
    out = root / f"{victim}.h5"
    assert main(["capture", "--victim", victim, "--random-init", "--scenes", "heldout",
                 "--steps", "20", "--out", str(out), "--seed", "1", "--quiet", *TINY,
                 *extra]) == 0
    return out


@pytest.fixture(scope="module")
def captures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("paper-victims")
    found = {name: capture(root, name) for name in ("vit-tiny-small", "impala-small",
                                                    "impala-wide-small", "multimodal-small")}
    found["cnn-k10-small"] = capture(root, "cnn-k10-small", "--set",
                                     "env.doomnav.num_actions=10")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit-tiny-small", "impala-small", "impala-wide-small",
                                  "multimodal-small", "cnn-k10-small"])
def test_every_action_and_advantage_comes_back_from_a_captured_stream(
        capsys, captures: dict[str, Path], name: str) -> None:
    assert main(["closed-form", str(captures[name]), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)[str(captures[name])]
    assert result["rows"] == 20 and result["action_accuracy"] == 1.0
    assert result["advantage_median_relative_error"] < 1e-2
    if name == "multimodal-small":  # the goal: the goal encoder's first input
        assert result["layer_inputs"]["goal_encoder.0"]["median_relative_error"] < 1e-2
        assert result["goal"]["goal_distance_m_median"] < 0.05  # metres
        assert result["goal"]["goal_bearing_deg_median"] < 1.0


@pytest.mark.parametrize("victim, command, fragment", [
    ("impala-small", ["closed-form", "--conv", "2"], "encoder.0.2, a maxpool: max-pooling"),
    ("vit-tiny-small", ["closed-form", "--invert", "2"], "has no Linear layer reading its conv"),
])
def test_an_attack_the_structure_does_not_allow_is_refused_up_front(
        capsys, tmp_path: Path, captures: dict[str, Path], victim: str, command: list[str],
        fragment: str) -> None:
    out = ["--out", str(tmp_path / "out")] if command[0] == "attack" else []
    assert main([*command, str(captures[victim]), *out, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_a_recurrent_capture_carries_the_state_and_the_closed_form_reads_it_back(
        capsys, tmp_path: Path) -> None:
    """cnn-gru: the state starts at zero in every episode and is the GRU's own update of the
    step before; one step's gradient gives the pre-step state back (its `gru.state` input)."""
    import h5py
    import numpy as np
    import torch

    from gradleak.capture.reader import CaptureFile
    from gradleak.victims import create_victim

    path = capture(tmp_path, "cnn-gru-small", "--set", "capture.gradient_dtype=float32")
    with h5py.File(path, "r") as handle:
        hidden, steps = handle["hidden_states"][:], handle["step_in_episode"][:]
        images, goals = handle["images"][:], handle["goals"][:]
        theta0 = {k: torch.as_tensor(np.asarray(v[()])) for k, v in handle["theta0"].items()}
    assert (hidden[steps == 0] == 0).all() and (hidden[steps > 0] != 0).any()
    with CaptureFile(path) as capture_file:
        victim = create_victim(capture_file.victim)
    victim.load_state_dict(theta0)
    victim.eval()
    with torch.no_grad():
        _, _, following = victim.advance(torch.from_numpy(images), torch.from_numpy(goals),
                                         torch.from_numpy(hidden))
    inside = np.flatnonzero(steps[1:] > 0)  # row i + 1 continues row i's episode
    assert np.allclose(following.numpy()[inside], hidden[inside + 1], atol=1e-5)
    assert main(["closed-form", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)[str(path)]
    assert result["action_accuracy"] == 1.0
    assert result["layer_inputs"]["gru.state"]["median_relative_error"] < 1e-3


def test_the_analytic_decoder_refuses_a_victim_without_conv_features(
        capsys, tmp_path: Path, captures: dict[str, Path]) -> None:
    import shutil

    train = tmp_path / "in" / "train.h5"
    train.parent.mkdir()
    shutil.copyfile(captures["vit-tiny-small"], train)
    assert main(["train-decoder", "--data", str(train), "--out", str(tmp_path / "dec"),
                 "--extra-frames", "0", "--quiet"]) == 2
    assert "no Linear layer reading conv features" in capsys.readouterr().err
    assert not (tmp_path / "dec").exists()


@pytest.mark.parametrize("name", ["multimodal-small", "cnn-gru-small"])
def test_gradient_matching_models_what_the_victim_reads_beside_the_frame(
        tmp_path: Path, name: str) -> None:
    """With the true frame, goal (or pre-step state), action, A and R, the dummy gradient IS
    the observed one; the attack optimises the goal and state jointly with the frame."""
    import numpy as np
    import torch

    from gradleak.attacks.optim.config import baseline_config
    from gradleak.attacks.optim.matching import DummyGradient
    from gradleak.attacks.optim.solve import GradientMatchingAttack
    from gradleak.capture.reader import CaptureFile

    out = capture(tmp_path, name, "--set", "capture.gradient_dtype=float32")
    with CaptureFile(out) as handle:
        observation, target = handle.observation(slice(3, 4)), handle.target(slice(3, 4))
    config = baseline_config("ig")
    dummy = DummyGradient(observation, config.matching)
    goal = torch.from_numpy(target.goals[0]) if dummy.extra_sizes["goal"] else None
    hidden = torch.from_numpy(target.hidden_states[0]) if dummy.extra_sizes["hidden"] else None
    produced = dummy(torch.from_numpy(target.images[0]).float() / 255,
                     torch.tensor(int(target.actions[0])), torch.tensor(target.advantages[0]),
                     torch.tensor(target.returns[0]), goal, hidden)
    observed = dummy.split(torch.from_numpy(observation.gradients[0]))
    for mine, theirs in zip(produced, observed, strict=True):
        assert torch.allclose(mine, theirs, rtol=1e-3, atol=1e-6)
    config.iterations, config.restarts = 3, 1
    result = GradientMatchingAttack(observation, config).reconstruct()
    assert result.images.shape == (1, 32, 32, 3)
    assert result.extras["goals"].shape == (1, 3 if goal is not None else 0)
    if goal is not None:
        assert np.abs(result.extras["goals"]).sum() > 0  # moved: it is optimised
