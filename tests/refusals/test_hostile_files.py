"""A file from a client never runs code: the model a capture or an update file names is looked up
among registered factories, and anything else is refused, naming the entry, before any call."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import user_models

import gradleak
from gradleak.capture.record import record
from gradleak.errors import ConfigError
from gradleak.fedavg.update_file import write_update

LOSS = {"value": 0.5, "entropy": 0.01, "clip": 0.2, "gamma": 0.99, "lam": 0.95}


@pytest.fixture(scope="module")
def wrapped_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A held-out capture of a wrapped model whose factory is registered (`conv-policy`)."""
    torch.manual_seed(0)
    victim = gradleak.wrap(user_models.build_conv_policy(), policy_head="pi", value_head="v",
                           frame_shape=(32, 32, 3), factory="conv-policy")
    rng = np.random.default_rng(0)
    out = tmp_path_factory.mktemp("wrapped") / "heldout.h5"
    record(victim, out, loss=LOSS, images=rng.integers(0, 256, (24, 32, 32, 3), dtype=np.uint8),
           actions=np.arange(24) % 4, advantages=rng.normal(size=24) + 0.1,
           returns=rng.normal(size=24), episode_ids=np.repeat([0, 1], 12), split="heldout")
    return out


def naming(source: Path, folder: Path, **options: object) -> Path:
    """A copy of the capture whose victim options are changed as a hostile client would."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "hostile.h5"
    target.write_bytes(source.read_bytes())
    with h5py.File(target, "r+") as handle:
        config = json.loads(handle.attrs["victim_config"])
        config["options"].update(options)
        handle.attrs["victim_config"] = json.dumps(config)
    return target


COMMANDS = {
    "closed-form": lambda path, out: ["closed-form", str(path), "--conv", "1"],
    "attack training-free": lambda path, out: ["attack", "training-free", "--data", str(path),
                                               "--index", "0", "--out", str(out)],
    "audit": lambda path, out: ["audit", "--capture", str(path), "--out", str(out),
                                "--defenses", "none"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("options, fragment", [
    ({"factory": "os:system", "factory_kwargs": {"command": "touch MARKER"}},
     "factory = 'os:system' is not a registered model factory"),
    ({"forward": "os:system"}, "forward = 'os:system' is not a registered forward function"),
    ({"factory_kwargs": {"command": "touch MARKER"}},
     "factory_kwargs: model factory 'conv-policy' takes (actions, channels)"),
    ({"factory_kwargs": {"actions": "4; touch MARKER"}}, "factory_kwargs['actions']"),
])
def test_a_capture_naming_unregistered_code_is_refused_before_any_call(
        refused, wrapped_capture: Path, tmp_path: Path, command: str, options: dict,
        fragment: str) -> None:
    marker = tmp_path / "ran"
    options = json.loads(json.dumps(options).replace("MARKER", str(marker)))
    hostile = naming(wrapped_capture, tmp_path / "in", **options)
    refused(COMMANDS[command](hostile, tmp_path / "out"), fragment)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_registered_factory_still_rebuilds_the_victim(capsys, wrapped_capture: Path) -> None:
    from gradleak.cli import main

    assert main(["closed-form", str(wrapped_capture), "--conv", "1", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)[str(wrapped_capture)]
    assert scores["conv_stack"]["layers"]["body.2"]["median_relative_error"] < 1e-3


@pytest.fixture
def update_file(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = user_models.TinyClassifier()
    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    wT = {k: v + 0.01 if v.is_floating_point() else v.clone() for k, v in w0.items()}
    return write_update(tmp_path / "node-7.safetensors", w0, wT,
                        {"round": 1, "node_id": 7, "num_examples": 4, "shape": [1, 8, 8],
                         "hyperparameters": {"lr": 0.1, "epochs": 1, "batch": 4},
                         "model": "tiny-classifier"})


def with_model(path: Path, model: str) -> Path:
    from gradleak.fedavg.update_file import read_update

    update = read_update(path)
    return write_update(path, update.w0, update.wT, {**update.meta, "model": model})


@pytest.mark.parametrize("model", ["sys:exit", "tempfile:mkdtemp", "os:getpid",
                                   "user_models:ConvPolicy"])
def test_an_update_naming_unregistered_code_is_refused(refused, update_file: Path,
                                                       tmp_path: Path, monkeypatch,
                                                       model: str) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where mkdtemp would create one
    refused(["fedavg-invert", "--update", str(with_model(update_file, model)), "--iters", "2",
             "--out", str(tmp_path / "out")],
            f"metadata 'model' = '{model}' is not a registered model factory")
    assert not any(scratch.iterdir())


@pytest.mark.parametrize("model, fragment", [
    ("collections:OrderedDict", "--model = 'collections:OrderedDict' is not a registered"),
    ("conv-policy", "w0 lacks 10 of ConvPolicy's parameters"),  # registered, another model
])
def test_a_model_flag_naming_unregistered_code_is_refused(refused, update_file: Path,
                                                          tmp_path: Path, model: str,
                                                          fragment: str) -> None:
    refused(["fedavg-invert", "--update", str(update_file), "--model", model, "--iters", "2",
             "--out", str(tmp_path / "out")], fragment)


def test_wrap_refuses_what_a_capture_could_not_rebuild() -> None:
    model = user_models.build_conv_policy()
    shape = {"policy_head": "pi", "value_head": "v", "frame_shape": (32, 32, 3)}
    with pytest.raises(ConfigError, match="'nonexistent_pkg:build' is not a registered"):
        gradleak.wrap(model, factory="nonexistent_pkg:build", **shape)
    with pytest.raises(ConfigError, match="factory=.*ConvPolicy.* is not registered"):
        gradleak.wrap(model, factory=user_models.ConvPolicy, **shape)
    with pytest.raises(ConfigError, match=r"factory_kwargs\['actions'\] = 'four'"):
        gradleak.wrap(model, factory="conv-policy", factory_kwargs={"actions": "four"}, **shape)
    with pytest.raises(ConfigError, match="forward=.* is not registered"):
        gradleak.wrap(model, factory="conv-policy", forward=lambda m, obs: m(obs), **shape)
    with pytest.raises(ConfigError, match="model= is a function, expected a torch.nn.Module"):
        gradleak.wrap(lambda x: x, **shape)
    victim = gradleak.wrap(model, factory=user_models.build_conv_policy, **shape)
    assert victim.config.options["factory"] == "conv-policy"  # the name, not the code


@pytest.mark.parametrize("change, fragment", [
    ({"shape": [1, -8, 8]}, "shape [1, -8, 8]: expected [C, H, W] of positive sizes"),
    ({"num_examples": "four"}, "num_examples 'four': expected an integer >= 1"),
    ({"num_examples": 10**9}, "num_examples 1,000,000,000 of shape [1, 8, 8] is 64,000,000,000 "
                              "values to invert"),
    ({"batchnorm": "sometimes"}, "batchnorm 'sometimes'"),
    ({"hyperparameters": [1]}, "hyperparameters [1]: expected an object"),
    ({"model": ["tiny-classifier"]}, "model ['tiny-classifier']"),
    ({"input_transform": {"kind": "normalize", "mean": None}}, "mean and std must be numbers"),
])
def test_update_metadata_is_checked_before_any_work(refused, update_file: Path, tmp_path: Path,
                                                    change: dict, fragment: str) -> None:
    from gradleak.fedavg.update_file import read_update
    from gradleak.io import save_tensors

    update = read_update(update_file)  # rewritten as a client could, past write_update's checks
    tensors = {**{f"w0/{k}": v for k, v in update.w0.items()},
               **{f"wT/{k}": v for k, v in update.wT.items()}}
    save_tensors(update_file, tensors, {"gradleak": json.dumps({**update.meta, **change})})
    refused(["fedavg-invert", "--update", str(update_file), "--iters", "2",
             "--out", str(tmp_path / "out")], str(update_file), fragment)


@pytest.mark.parametrize("change, fragment", [
    ({"net_arch": [10**9]}, "a layer size 1000000000"),
    ({"activation": "Linear"}, "unknown policy, extractor or activation"),
    ({"observation_space": {"type": "box", "shape": [4096, 4096, 3], "low": 0, "high": 255,
                            "dtype": "uint8"}}, "at most 16,777,216 values"),
    ({"observation_space": "x"}, "SB3 cannot build it"),
])
def test_an_sb3_description_is_bounded_before_anything_is_built(change: dict,
                                                                fragment: str) -> None:
    pytest.importorskip("stable_baselines3")
    from gradleak.integrations.sb3 import rebuild

    description = {"policy": "ActorCriticPolicy", "extractor": "FlattenExtractor",
                   "activation": "Tanh", "net_arch": [8],
                   "observation_space": {"type": "box", "shape": [4], "low": -1.0,
                                         "high": 1.0, "dtype": "float32"},
                   "action_space": {"type": "discrete", "n": 2}}
    assert isinstance(rebuild(**description), torch.nn.Module)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        rebuild(**{**description, **change})
