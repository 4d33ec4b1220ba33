"""Telling an MLP client's images apart inside its span (fedavg.separate): every image back to
the wire's precision from a multi-step update, only true hyperplanes kept, and every refusal
said before any work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.fedavg import invert_update
from gradleak.fedavg.attacks import FedAttackConfig
from gradleak.fedavg.client import ClientConfig
from gradleak.fedavg.experiment import simulate_client
from gradleak.fedavg.datasets import digits as digits_stand_in
from gradleak.fedavg.forward import identity
from gradleak.fedavg.models import FEDAVG_MODELS
from gradleak.fedavg.scoring import hungarian_match
from gradleak.fedavg.separate import (Separation, SeparationConfig, _Rows, box_repair,
                                      raw_rows, separate_update)
from gradleak.fedavg.span import image_span, pixel_affine


def mlp_client(samples: int = 12, epochs: int = 3, batch: int = 4, seed: int = 0):
    client = simulate_client("digits", "mlp", ClientConfig(epochs=epochs, samples=samples,
                                                           batch=batch, seed=seed))
    auxiliary, _ = client.data.rest(samples, seed=seed)  # the dataset without the client's
    return client.model, client.images, client.labels, client.update, auxiliary[:300]


def true_normals(span, images: torch.Tensor) -> np.ndarray:
    """(N, N) unit normals: row n orthogonal to every private image but n, in span coordinates."""
    points = torch.cat([images.flatten(1).double(), torch.ones(len(images), 1,
                                                               dtype=torch.float64)], 1)
    coordinates = (points @ span.basis.T).numpy()
    normals = np.linalg.inv(coordinates).T
    return normals / np.linalg.norm(normals, axis=1, keepdims=True)


def test_every_image_of_a_multi_step_update_comes_back_to_the_wire_precision() -> None:
    model, images, _, update, auxiliary = mlp_client()
    assert update.steps == 9  # three epochs of three batches: no single gradient
    span, why = image_span(model, update.w0, update.wT, (1, 28, 28), 12, identity)
    assert span is not None, why
    result = separate_update(span, update.w0, update.wT, identity, auxiliary)
    assert result.complete and result.hyperplanes == 12
    assert result.images is not None
    recovered = result.images[hungarian_match(result.images, images)]
    assert float((recovered - images).abs().max()) < 1e-3  # float32 wire: exact images
    # every hyperplane kept is a true one: orthogonal to all private images but one
    truth = torch.cat([images.flatten(1).double(), torch.ones(12, 1, dtype=torch.float64)], 1)
    products = np.abs(result.normals @ (truth @ span.basis.T).numpy().T)
    products /= products.max(1, keepdims=True)
    assert np.sort(products, 1)[:, -2].max() < 1e-3
    assert sorted(products.argmax(1).tolist()) == list(range(12))


def test_only_true_hyperplanes_pass_the_certificate() -> None:
    model, images, _, update, _ = mlp_client()
    span, _ = image_span(model, update.w0, update.wT, (1, 28, 28), 12, identity)
    affine = pixel_affine(identity, span.shape)
    rows = _Rows(span, raw_rows(update.w0["1.weight"], update.w0["1.bias"], affine),
                 raw_rows(update.wT["1.weight"], update.wT["1.bias"], affine), SeparationConfig())
    normals = true_normals(span, images)
    refit = [rows.refine(normal, None) for normal in normals]
    assert all(rows.certified(normal) for normal in refit)
    # a mix of two true hyperplanes holds only the rows of units off for both images
    mixed = normals[0] + normals[1]
    assert not rows.certified(rows.refine(mixed / np.linalg.norm(mixed), None))
    # a random direction holds almost none
    random = np.random.default_rng(0).standard_normal(12)
    assert len(rows.on(random / np.linalg.norm(random))) < 12


def test_the_box_repair_turns_a_mix_of_two_images_back_into_one() -> None:
    pixels = np.eye(6)  # six pixels, coordinates are the pixels themselves
    first = np.array([0.0, 0.0, 0.4, 0.9, 0.2, 0.0])
    second = np.array([0.7, 0.3, 0.0, 0.0, 0.5, 0.0])
    images = np.stack([second, 0.5 * first + 0.5 * second])
    repaired, moved = box_repair(pixels, images.copy())
    assert moved == 0  # too few pixels to clear the bar of ten more at 0 or 1
    wide = np.kron(np.eye(1), np.eye(60))
    first, second = np.tile(first, 10), np.tile(second, 10)
    repaired, moved = box_repair(wide, np.stack([second, 0.5 * first + 0.5 * second]))
    assert moved == 1
    assert np.allclose(repaired[1], first, atol=1e-9)
    assert np.allclose(repaired[0], second)


def test_invert_update_separates_and_says_so() -> None:
    model, images, _, update, auxiliary = mlp_client()
    result = invert_update(model, update.w0, update.wT, samples=12, shape=(1, 28, 28),
                           method="separate", auxiliary=auxiliary, iterations=5,
                           hyperparameters={"lr": 0.004, "epochs": 3, "batch": 4})
    assert result.separation["complete"] and result.separation["hyperplanes"] == 12
    recovered = result.images[hungarian_match(result.images, images)]
    assert float((recovered - images).abs().max()) < 1e-3
    assert result.method == "separate" and result.labels_inferred
    assert np.isnan(result.l_sim)  # no matching loss: the images come from the algebra


def test_an_incomplete_separation_falls_back_and_warns(monkeypatch) -> None:
    import gradleak.fedavg.invert as invert

    model, images, _, update, auxiliary = mlp_client()
    incomplete = Separation(None, 7, 12, 40, 0, 0.1, np.zeros((7, 12)))
    monkeypatch.setattr(invert, "separate_update", lambda *args, **kwargs: incomplete)
    with pytest.warns(UserWarning, match="found 7 of 12 hyperplanes.*sme's"):
        result = invert_update(model, update.w0, update.wT, samples=12, shape=(1, 28, 28),
                               method="separate", auxiliary=auxiliary, iterations=5,
                               hyperparameters={"lr": 0.004, "epochs": 3, "batch": 4})
    assert not result.separation["complete"] and result.separation["hyperplanes"] == 7
    assert result.images.shape == images.shape and np.isfinite(result.l_sim)


def test_refusals_name_what_is_missing_before_any_work() -> None:
    model, _, _, update, auxiliary = mlp_client(samples=4, epochs=1, batch=4)
    declared = {"lr": 0.004, "epochs": 1, "batch": 4}
    with pytest.raises(ConfigError, match="auxiliary"):
        invert_update(model, update.w0, update.wT, samples=4, shape=(1, 28, 28),
                      method="separate", hyperparameters=declared)
    with pytest.raises(ConfigError, match=r"auxiliary: expected a tensor \(M >= 1, 1, 28, 28\)"):
        invert_update(model, update.w0, update.wT, samples=4, shape=(1, 28, 28),
                      method="separate", auxiliary=torch.zeros(3, 1, 8, 8),
                      hyperparameters=declared)
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 26 * 26, 10))
    state = conv.state_dict()
    with pytest.raises(ConfigError, match="no image span|none: its first layer"):
        invert_update(conv, state, {k: v + 0.01 for k, v in state.items()}, samples=4,
                      shape=(1, 28, 28), method="separate", auxiliary=auxiliary,
                      hyperparameters=declared)


def test_a_client_that_normalises_its_inputs_is_separated_in_raw_pixels() -> None:
    """torch's own loop on Normalize(0.5, 0.5) inputs: the update is a sum over [a·x + c, 1],
    and its rows are read back over raw [x, 1] before the hyperplanes are sought."""
    import copy

    import torch.nn.functional as F

    from gradleak.fedavg import Normalize

    data = digits_stand_in()
    images, labels = data.sample(10, seed=3)
    auxiliary, _ = data.rest(10, seed=3)
    torch.manual_seed(3)
    model = FEDAVG_MODELS.get("mlp")(1, 28, data.classes)
    transform = Normalize(0.5, 0.5)
    w0 = copy.deepcopy(model.state_dict())
    optimiser = torch.optim.SGD(model.parameters(), lr=0.004)
    for _ in range(3):  # three epochs of two batches, in order
        for start in (0, 5):
            optimiser.zero_grad()
            F.cross_entropy(model(transform(images[start:start + 5])),
                            labels[start:start + 5]).backward()
            optimiser.step()
    wT = model.state_dict()
    span, why = image_span(model, w0, wT, (1, 28, 28), 10, transform)
    assert span is not None, why
    result = separate_update(span, w0, wT, transform, auxiliary[:300])
    assert result.complete
    recovered = result.images[hungarian_match(result.images, images)]
    assert float((recovered - images).abs().max()) < 1e-3


def test_the_experiment_refuses_separate_before_training_a_client_it_cannot_separate(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import gradleak.fedavg.experiment as experiment

    def trained(*_args, **_kwargs):
        raise AssertionError("the client was trained before the refusal")

    monkeypatch.setattr(experiment, "train_client", trained)
    attack = FedAttackConfig(method="separate")
    with pytest.raises(ConfigError, match="model cnn gives no image span .*Conv2d, not Linear"):
        experiment.run_fedavg("digits", "cnn", ClientConfig(), attack, out=tmp_path / "out")
    with pytest.raises(ConfigError, match="optimiser \\(adamw\\) rescales each entry"):
        experiment.run_fedavg("digits", "mlp", ClientConfig(optimiser="adamw"), attack)
    assert not (tmp_path / "out").exists()
