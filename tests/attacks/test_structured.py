"""The structured gradient input: exact layer inputs as features, trainable end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gradleak.attacks.analytic import layer_input
from gradleak.attacks.encoders import StructuredInput
from gradleak.capture.reader import CaptureFile
from gradleak.errors import ConfigError


def test_structured_features_hold_the_exact_layer_inputs(float32_capture: Path) -> None:
    with CaptureFile(float32_capture) as capture:
        observation = capture.observation()
        table = capture.attrs["layer_table"]
    structured = StructuredInput(observation.gradients.shape[1], table)
    features = structured.select(torch.from_numpy(observation.gradients)).double().numpy()
    fc = layer_input(observation, "fc")
    np.testing.assert_allclose(features[:, :fc.shape[1]], fc, rtol=1e-4, atol=1e-6)
    assert structured.features == features.shape[1] + 1 < observation.gradients.shape[1] / 40


@pytest.mark.slow
def test_a_structured_trace_trains_and_is_far_smaller(train_capture: Path,
                                                      tmp_path: Path) -> None:
    from conftest import tiny_attack_settings

    from gradleak.training.checkpoint import load_attacker
    from gradleak.training.fit import fit_attacker

    model, fit = tiny_attack_settings("trace")
    model.projection, fit.epochs, fit.max_train_windows = "structured", 4, None
    result = fit_attacker("trace", model, fit, [str(train_capture)], tmp_path / "s",
                          progress=False)
    # it learns: a tiny set, every window each epoch (measured when written: 0.50 → 0.27; with
    # the learning rate at 1e-12, 0.53 → 0.53)
    history = json.loads((tmp_path / "s" / "attacker.json").read_text())["history"]
    assert history[-1]["train_loss"] < 0.8 * history[0]["train_loss"]
    reloaded, meta = load_attacker(tmp_path / "s")
    assert meta["model"]["projection"] == "structured"
    dense_model, _ = tiny_attack_settings("trace")
    dense_model.projection, fit.epochs = "dense", 1
    dense = fit_attacker("trace", dense_model, fit, [str(train_capture)], tmp_path / "d",
                         progress=False)
    assert result["parameters"] < dense["parameters"] / 5


def test_a_victim_without_linear_layers_is_refused() -> None:
    table = json.dumps([{"name": "conv.weight", "shape": [4, 3, 3, 3], "offset": 0,
                         "component": "cnn"}])
    with pytest.raises(ConfigError, match="use projection 'dense'"):
        StructuredInput(108, table)


def test_lti_learns_from_the_exact_features(train_capture: Path, tmp_path: Path) -> None:
    from conftest import tiny_attack_settings

    from gradleak.io import read_json
    from gradleak.training.fit import fit_attacker

    model, fit = tiny_attack_settings("lti")
    model.projection, fit.epochs, fit.lr = "structured", 4, 3e-3
    fit_attacker("lti", model, fit, [str(train_capture)], tmp_path / "l", progress=False)
    history = read_json(tmp_path / "l" / "attacker.json", "attacker")["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    model.projection = "dense"
    with pytest.raises(ConfigError, match="LtI projection 'dense'"):
        fit_attacker("lti", model, fit, [str(train_capture)], tmp_path / "x", progress=False)
