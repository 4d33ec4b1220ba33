"""The feature decoder: exact features and actions from the gradient, a decoder that learns
from frames alone, resumable fits, and clear errors for what it cannot attack."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from test_analytic import synthetic

from gradleak.attacks.analytic import module_input
from gradleak.attacks.feature_decoder import DecoderConfig, FeatureDecoder
from gradleak.capture.reader import CaptureFile
from gradleak.errors import CaptureFileError, ConfigError
from gradleak.io import load_tensors
from gradleak.metrics.images import psnr
from gradleak.training.checkpoint import WEIGHTS, load_attacker
from gradleak.training.decoder_config import DecoderFitConfig
from gradleak.training.decoder_fit import DecoderFit, fit_decoder
from gradleak.training.frames import RENDERED, feature_map_shape, random_walk_frames
from gradleak.victims import create_victim
from gradleak.victims.base import layers_to_json


def decoder_for(observation, channels: int = 16, context: str = "none",  # noqa: ANN001
                camera_motion: list[list[float]] | None = None) -> FeatureDecoder:
    config = DecoderConfig(gradient_dim=observation.gradients.shape[1],
                           frame_size=observation.victim.frame_size,
                           layer_table=layers_to_json(list(observation.layers)),
                           feature_shape=[32, 2, 2], channels=channels, global_channels=4,
                           entropy_coef=float(observation.hyperparameters["entropy"]),
                           context=context, context_channels=4,
                           camera_motion=camera_motion or [])
    decoder = FeatureDecoder(config)
    decoder.set_policy_head(observation.theta0["policy_head.weight"],
                            observation.theta0["policy_head.bias"])
    return decoder


def test_features_and_actions_are_exact_on_float32_captures(float32_capture: Path) -> None:
    with CaptureFile(float32_capture) as capture:
        observation, target = capture.observation(), capture.target()
    from gradleak.victims.base import victim_at_theta0

    decoder = decoder_for(observation)
    gradients = torch.from_numpy(observation.gradients)
    recovered = decoder.recovered_features(gradients).double()
    truth = module_input(victim_at_theta0(observation), "fc",
                         torch.from_numpy(target.images)).detach().flatten(1).double()
    assert float(((recovered - truth).norm(dim=1) / truth.norm(dim=1)).max()) <= 1e-5
    actions = decoder.action_logits(gradients).argmax(-1).numpy()
    np.testing.assert_array_equal(actions, target.actions)


@pytest.mark.parametrize("entropy", [0.0, 0.05])
@pytest.mark.parametrize("peak", [0.0, 7.0])
def test_closed_form_action_for_peaked_policies(entropy: float, peak: float) -> None:
    observation, batch = synthetic(entropy, peak)
    logits = decoder_for(observation).action_logits(torch.from_numpy(observation.gradients))
    np.testing.assert_array_equal(logits.argmax(-1).numpy(), batch.actions.numpy())


@pytest.mark.slow
def test_a_tiny_decoder_overfits_a_tiny_set(train_capture: Path) -> None:
    """From θ0's exact features of 8 frames, the decoder learns those frames (≥ 8 dB better
    than its start), which the mean of the frames cannot do."""
    with CaptureFile(train_capture) as capture:
        observation = capture.observation(slice(0, 8))
        images = torch.from_numpy(capture.target(slice(0, 8)).images)
    from gradleak.victims.base import victim_at_theta0

    torch.manual_seed(0)
    decoder = decoder_for(observation, channels=32)
    features = module_input(victim_at_theta0(observation), "fc", images).flatten(1).detach()
    decoder.fit_normaliser(torch.cat([features, features + 1e-3]))
    truth = images.permute(0, 3, 1, 2).float() / 255.0
    optimiser = torch.optim.Adam(decoder.parameters(), lr=3e-3)
    with torch.no_grad():
        start = float(psnr(decoder(features), truth).mean())
    for _ in range(300):
        optimiser.zero_grad()
        loss = (decoder(features) - truth).pow(2).mean()
        loss.backward()
        optimiser.step()
    with torch.no_grad():
        learned = float(psnr(decoder(features), truth).mean())
    mean = float(psnr(truth.mean(0, keepdim=True).expand_as(truth), truth).mean())
    assert learned > start + 8 and learned > mean + 5


def validation_grids(run: Path) -> list[int]:
    """The epochs at which TensorBoard holds a validation image grid."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    if "validation/truth_then_reconstruction" not in events.Tags()["images"]:
        return []
    return [e.step for e in events.Images("validation/truth_then_reconstruction")]


def tiny_fit(**changes: object) -> DecoderFitConfig:
    return replace(DecoderFitConfig(epochs=2, batch_size=32, extra_frames=40, max_val_frames=16,
                                    lr=1e-3), **changes)


@pytest.mark.slow
@pytest.mark.parametrize("context", ["none", "warp"])
def test_resuming_gives_the_uninterrupted_weights(context: str, train_capture: Path,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model = DecoderConfig(channels=16, global_channels=4, context=context, context_channels=4)
    fit_decoder(model, tiny_fit(epochs=2), [str(train_capture)], tmp_path / "whole",
                progress=False)
    interrupted = DecoderFit(model, tiny_fit(epochs=2), [str(train_capture)],
                             tmp_path / "split", progress=False)
    interrupted.run(session_epochs=1)  # killed after epoch 1
    assert (tmp_path / "split" / RENDERED).is_file()
    with monkeypatch.context() as patch:  # the resumed session reads the frames it cached
        patch.setattr("gradleak.training.frames.random_walk_frames", None)
        result = fit_decoder(model, tiny_fit(epochs=2), [str(train_capture)],
                             tmp_path / "split", resume=True, progress=False)
    assert not (tmp_path / "split" / RENDERED).exists()  # done: only the attacker is kept
    assert result["epochs"] == 2 and result["train_frames"]["rendered"] == 40
    whole = load_tensors(tmp_path / "whole" / WEIGHTS, "weights")
    split = load_tensors(tmp_path / "split" / WEIGHTS, "weights")
    for name, value in whole.items():
        torch.testing.assert_close(split[name], value, rtol=0, atol=0, msg=name)
    decoder, meta = load_attacker(tmp_path / "split")
    assert meta["kind"] == "decoder" and isinstance(decoder, FeatureDecoder)
    assert validation_grids(tmp_path / "whole") == [1, 2]  # truth above the frames, each epoch
    # a finished run resumes to its summary without rendering or training anything again
    monkeypatch.setattr("gradleak.training.decoder_fit.DecoderFit", None)
    again = fit_decoder(model, tiny_fit(epochs=2), [str(train_capture)], tmp_path / "split",
                        resume=True, progress=False)
    assert again.pop("session_minutes") == 0.0  # nothing ran in this session
    assert again == {k: v for k, v in result.items() if k != "session_minutes"}
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="already holds an attacker"):
        fit_decoder(model, tiny_fit(), [str(train_capture)], tmp_path / "whole",
                    progress=False)


def test_rendered_frames_are_seeded(train_capture: Path) -> None:
    from gradleak.presets import EnvConfig, dataclass_from_dict
    from gradleak.training.frames import read_env_config

    with CaptureFile(train_capture) as capture:
        env, scenes = dataclass_from_dict(EnvConfig, read_env_config(capture)), capture.scenes
    (first, actions, starts), (again, _, _) = (random_walk_frames(env, list(scenes), 30, seed=4)
                                               for _ in range(2))
    other, _, _ = random_walk_frames(env, list(scenes), 30, seed=5)
    assert first.shape == (30, 32, 32, 3) and first.dtype == np.uint8
    assert starts[0] and actions.shape == (30,) and set(actions) <= set(range(5))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


@pytest.mark.slow
def test_the_motion_prior_explains_real_camera_motion(train_capture: Path) -> None:
    """Warping each rendered frame by the action taken after it brings it closer to the next
    frame than leaving it in place, for every turn and look."""
    from gradleak.presets import EnvConfig, dataclass_from_dict
    from gradleak.training.frames import read_env_config

    with CaptureFile(train_capture) as capture:
        env, scenes = dataclass_from_dict(EnvConfig, read_env_config(capture)), capture.scenes
    env.doomnav.frame_size = 64
    images, actions, starts = random_walk_frames(env, list(scenes), 400, seed=1)
    follows = ~starts[1:]
    before = torch.from_numpy(images[:-1][follows]).permute(0, 3, 1, 2).float() / 255
    after = torch.from_numpy(images[1:][follows]).permute(0, 3, 1, 2).float() / 255
    taken = torch.from_numpy(actions[:-1][follows])
    from gradleak.envs.actions import action_facts

    observation, _ = synthetic(0.01, 0.0)
    motion = [list(m) for m in action_facts({"backend": "doomnav"}, 5).camera_motion]
    decoder = decoder_for(observation, context="warp", camera_motion=motion)
    warped = decoder.network.warp(before, taken).detach()
    for action in (1, 2, 3, 4):  # RotateLeft, RotateRight, LookDown, LookUp
        chosen = taken == action
        inner = (..., slice(8, -8), slice(8, -8))
        moved = float((warped[chosen] - after[chosen])[inner].pow(2).mean())
        still = float((before[chosen] - after[chosen])[inner].pow(2).mean())
        assert moved < 0.8 * still, (action, moved, still)


@pytest.mark.parametrize("context", ["concat", "warp"])
def test_context_is_causal_and_used(context: str) -> None:
    """Frame t reads steps t − 1 and t: a change at step 3 leaves frames 0–2 exactly as they
    were, and a change at step 1 reaches frame 2 through the context."""
    observation, _ = synthetic(0.01, 0.0)
    torch.manual_seed(0)
    decoder = decoder_for(observation, context=context).eval()
    every = torch.from_numpy(observation.gradients)
    gradients = every[:4][None]
    frames, _ = decoder.attack(gradients)
    late, early = gradients.clone(), gradients.clone()
    late[0, 3], early[0, 1] = every[7], every[9]
    changed_late, _ = decoder.attack(late)
    changed_early, _ = decoder.attack(early)
    torch.testing.assert_close(changed_late[0, :3], frames[0, :3], rtol=0, atol=0)
    assert not torch.equal(changed_late[0, 3], frames[0, 3])
    assert not torch.equal(changed_early[0, 2], frames[0, 2])
    torch.testing.assert_close(changed_early[0, 0], frames[0, 0], rtol=0, atol=0)


def test_captured_frames_link_predecessors_within_episodes(train_capture: Path) -> None:
    from gradleak.training.data import WindowDataset
    from gradleak.training.frames import captured_frames

    data = WindowDataset([train_capture], window=1, stride=1, part="train", expect_split="train")
    frames = captured_frames([str(train_capture)], data.rows)
    with CaptureFile(train_capture) as capture:
        episodes, actions = capture.column("episode_ids"), capture.private_column("actions")
    steps = data.rows[:, 1]
    linked = frames.previous >= 0
    assert linked.sum() == len(frames) - len(np.unique(data.rows[:, 2]))
    np.testing.assert_array_equal(steps[frames.previous[linked]], steps[linked] - 1)
    np.testing.assert_array_equal(episodes[steps[frames.previous[linked]]],
                                  episodes[steps[linked]])
    np.testing.assert_array_equal(frames.actions, actions[steps])


def test_mirrored_actions_swap_left_and_right() -> None:
    from gradleak.envs.actions import mirrored_actions

    assert mirrored_actions(5) == (0, 2, 1, 3, 4)
    ten = mirrored_actions(10)
    assert [ten[i] for i in ten] == list(range(10)) and ten[6] == 7


def test_doomnav_declares_its_action_facts_and_other_environments_none() -> None:
    from gradleak.envs.actions import ActionFacts, action_facts

    doom = action_facts({"backend": "doomnav"}, 5)
    assert doom.mirror == (0, 2, 1, 3, 4)
    assert doom.camera_motion[1] == (1.0, -0.3, 0.0)  # RotateLeft shifts the view
    assert action_facts({"backend": "gym", "gym_id": "X"}, 5) == ActionFacts()


def test_held_out_captures_are_refused_for_training(random_capture: Path, tmp_path: Path
                                                   ) -> None:
    with pytest.raises(CaptureFileError, match="held-out scenes are for testing only"):
        fit_decoder(DecoderConfig(), tiny_fit(), [str(random_capture)], tmp_path / "d",
                    progress=False)
    assert not (tmp_path / "d").exists()


def test_victims_without_the_structure_are_named() -> None:
    observation, _ = synthetic(0.01, 0.0)
    heads_only = [layer for layer in observation.layers if layer.component == "heads"]
    with pytest.raises(ConfigError, match="Linear layer 'fc' with its bias"):
        FeatureDecoder(DecoderConfig(layer_table=layers_to_json(heads_only),
                                     feature_shape=[32, 2, 2]))
    with pytest.raises(ConfigError, match="C·h·w = 128"):
        FeatureDecoder(DecoderConfig(layer_table=layers_to_json(list(observation.layers)),
                                     feature_shape=[32, 4, 4]))
    with pytest.raises(ConfigError, match="no convolutional feature map"):
        feature_map_shape(create_victim("mlp", frame_size=12, options={"hidden": 32}), "fc")


def test_under_aggregation_the_recovered_input_is_an_affine_mix_of_the_steps() -> None:
    """agg:k averages k per-step gradients, so ∇W = (1/k) Σ δ_i x_iᵀ has rank ≤ k. The
    least-squares input is then Σ w_i x_i with w_i = δ·δ_i / ‖δ‖² (δ = Σ δ_i): weights that sum
    to one but may be negative. What the decoder reads under aggregation, exactly."""
    from gradleak.victims.base import victim_at_theta0

    observation, batch = synthetic(0.01, 0.0)
    decoder = decoder_for(observation)
    gradients = torch.from_numpy(observation.gradients[:3]).double()
    weight, bias = decoder.features.feature_layer
    deltas = gradients[:, bias.offset:bias.offset + bias.size]
    inputs = module_input(victim_at_theta0(observation), "fc", batch.images[:3]).detach()
    total = deltas.sum(0)
    mix = (deltas @ total) / total.pow(2).sum()
    recovered = decoder.recovered_features(gradients.mean(0, keepdim=True))[0]
    torch.testing.assert_close(float(mix.sum()), 1.0)
    torch.testing.assert_close(recovered, (mix[:, None] * inputs.flatten(1).double()).sum(0),
                               rtol=1e-4, atol=1e-6)


def test_a_decoder_through_the_conv_stack_reads_the_exact_map(float32_capture: Path,
                                                               tmp_path: Path,
                                                               train_capture: Path) -> None:
    """feature_module=encoder.3: the decoder recovers the second conv's input by the recursion
    (exact on float32 gradients), keeps θ0 frozen across save and load, and counts only its own
    parameters as the attacker's."""
    with CaptureFile(float32_capture) as capture:
        observation, target = capture.observation(), capture.target()
    from gradleak.victims.base import victim_at_theta0

    config = DecoderConfig(gradient_dim=observation.gradients.shape[1], frame_size=32,
                           layer_table=layers_to_json(list(observation.layers)),
                           feature_module="encoder.3", feature_shape=[16, 8, 8], channels=16,
                           global_channels=0)
    decoder = FeatureDecoder(config)
    decoder.set_theta0(observation.theta0)
    recovered = decoder.recovered_features(torch.from_numpy(observation.gradients)).double()
    truth = module_input(victim_at_theta0(observation), "encoder.3",
                         torch.from_numpy(target.images)).detach().flatten(1).double()
    assert float(((recovered - truth).norm(dim=1) / truth.norm(dim=1)).max()) <= 1e-4
    model = DecoderConfig(channels=16, global_channels=0, feature_module="encoder.3")
    result = fit_decoder(model, tiny_fit(epochs=1), [str(train_capture)], tmp_path / "dec",
                         progress=False)
    loaded, _ = load_attacker(tmp_path / "dec")
    own = sum(p.numel() for p in loaded.parameters() if p.requires_grad)
    assert result["parameters"] == own < sum(p.numel() for p in loaded.parameters())
    with CaptureFile(train_capture) as capture:
        theta0 = capture.theta0()
    for name, value in loaded.features.theta0.state_dict().items():
        torch.testing.assert_close(value, torch.from_numpy(np.asarray(theta0[name])), msg=name)
    with pytest.raises(ConfigError, match="determine the inputs of encoder.9, encoder.6, "
                                          "encoder.3 only"):
        FeatureDecoder(replace(config, feature_module="encoder.0", feature_shape=[3, 32, 32]))


@pytest.mark.slow
def test_an_adaptive_decoder_trains_on_what_the_attack_recovers_under_the_defense(
        train_capture: Path, random_capture: Path, tmp_path: Path) -> None:
    """Under noise each captured frame is paired with the features recovered from its own
    defended gradient (keyed noise, the fit's defense seed), not with θ0's exact features; the
    run records its defense, so evaluation under that defense calls it adaptive. The features
    are recomputed here from the layer table, x = ∇Wᵀ∇b/‖∇b‖², not with gradleak's helper."""
    from gradleak.defenses import parse_defense
    from gradleak.defenses.base import row_keys
    from gradleak.evaluation.reconstructions import evaluate
    from gradleak.victims.base import layers_from_json

    model = DecoderConfig(channels=16, global_channels=4)
    config = tiny_fit(epochs=1, extra_frames=0, defense="noise:0.01", defense_seed=3)
    fit = DecoderFit(model, config, [str(train_capture)], tmp_path / "adaptive", progress=False)
    steps = fit.data.windows["train"].rows[:, 1]
    picked = [0, len(steps) // 2, len(steps) - 1]
    with CaptureFile(train_capture) as capture:
        attrs = dict(capture.attrs)
        gradients = torch.stack([torch.from_numpy(capture.observation(slice(s, s + 1))
                                                  .gradients[0].astype(np.float32))
                                 for s in steps[picked]])
        images = torch.from_numpy(capture.target().images[steps[picked]])
    keys = torch.cat([row_keys(attrs, int(s), int(s) + 1) for s in steps[picked]])
    defended = parse_defense("noise:0.01", 3).gradients(gradients, keys)
    table = {layer.name: layer for layer in layers_from_json(attrs["layer_table"])}

    def columns(name: str) -> np.ndarray:
        layer = table[name]
        block = defended[:, layer.offset:layer.offset + layer.size].double().numpy()
        return block.reshape(len(block), *layer.shape)

    weight, bias = columns("fc.weight"), columns("fc.bias")
    expected = torch.from_numpy(np.einsum("no,noi->ni", bias, weight)
                                / (bias ** 2).sum(1, keepdims=True)).float()
    torch.testing.assert_close(torch.from_numpy(fit.frames.features[picked]), expected,
                               rtol=1e-4, atol=1e-6)
    exact = fit.data.features(images, "fc")
    assert float((expected - exact).norm() / exact.norm()) > 1e-2  # the noise is really there
    assert len(fit.frames) == len(steps) and fit.frames.features is not None
    fit.run()
    _, meta = load_attacker(tmp_path / "adaptive")
    assert meta["fit"]["defense"] == "noise:0.01"
    attackers = {"decoder": str(tmp_path / "adaptive")}
    for spec, mode in (("noise:0.01", "adaptive"), ("quant:8", "zero-shot")):
        scored = evaluate([random_capture], attackers, tmp_path / spec.replace(":", "-"),
                          defense=parse_defense(spec), max_windows=2)
        assert scored["methods"]["decoder"]["defense_mode"] == mode


@pytest.mark.parametrize(("changes", "message"), [
    ({"defense": "agg:4", "extra_frames": 0}, "aggregates steps"),
    ({"defense": "noise:0.01", "extra_frames": 40}, "set extra_frames to 0"),
    ({"defense": "nosuch:1", "extra_frames": 0}, "nosuch")])
def test_decoder_fit_defenses_it_cannot_train_under_are_named(
        changes: dict[str, object], message: str, train_capture: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        fit_decoder(DecoderConfig(channels=16), tiny_fit(**changes), [str(train_capture)],
                    tmp_path / "d", progress=False)
    assert not (tmp_path / "d").exists()


@pytest.mark.slow
def test_a_cpu_time_budget_counts_this_process_cpu_not_the_wall_clock(
        train_capture: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Other jobs on the same cores stretch wall time, not CPU time: with clock "cpu" the limit
    reads time.process_time, here 2 minutes later at every reading after the first epoch has
    begun, so the run stops at that epoch's first step; on the wall clock the same limit lets
    both epochs run to the end."""
    readings = iter([0, 0, *range(120, 10_000, 120)])
    monkeypatch.setattr("gradleak.training.loop.time.process_time", lambda: next(readings))
    model = DecoderConfig(channels=16, global_channels=4)
    budgets = {clock: fit_decoder(model, tiny_fit(epochs=2, time_limit_minutes=1.0,
                                                  time_limit_clock=clock),
                                  [str(train_capture)], tmp_path / clock, progress=False)
               for clock in ("cpu", "wall")}
    assert budgets["cpu"]["epochs"] == 1 and budgets["wall"]["epochs"] == 2
    assert budgets["cpu"]["last"]["epoch_fraction"] < 1
    assert budgets["wall"]["last"]["epoch_fraction"] == 1
    assert budgets["cpu"]["last"]["time_limit_reached"]
    assert not budgets["wall"]["last"]["time_limit_reached"]
    with pytest.raises(ConfigError, match="time_limit_clock 'gpu'"):
        fit_decoder(model, tiny_fit(time_limit_clock="gpu"), [str(train_capture)],
                    tmp_path / "gpu", progress=False)


def test_a_decoder_saved_as_one_module_still_loads_into_its_parts(train_capture: Path) -> None:
    """Checkpoints written before the decoder was split into readout, action and network keep
    their flat names (`stem.0.weight`, `policy_bias`, `feature_mean`): they load into the parts
    tensor for tensor, and a name that fits no part is still refused."""
    with CaptureFile(train_capture) as capture:
        observation = capture.observation(slice(0, 2))
    torch.manual_seed(0)
    saved = decoder_for(observation, context="warp")
    flat = {key.split(".", 1)[1]: value for key, value in saved.state_dict().items()}
    assert {"stem.0.weight", "policy_bias", "feature_mean", "motion"} <= set(flat)
    torch.manual_seed(1)
    loaded = decoder_for(observation, context="warp")
    loaded.load_state_dict(flat)
    for key, value in saved.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0, msg=key)
    with pytest.raises(RuntimeError, match="no_such"):
        loaded.load_state_dict({**flat, "no_such.weight": torch.zeros(1)})
