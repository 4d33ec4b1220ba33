"""The span a first Linear layer's update determines: it holds every private image whatever E
and B are, projecting onto it never moves an estimate away from them, and it is refused, with
the reason, wherever it does not exist."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from gradleak.fedavg import Normalize, invert_update
from gradleak.fedavg.client import ClientConfig, train_client
from gradleak.fedavg.forward import identity
from gradleak.fedavg.models import FEDAVG_MODELS
from gradleak.fedavg.span import feature_spans, first_linear, image_span, off_span, project_box


def client(samples: int = 6, epochs: int = 5, batch: int = 2, optimiser: str = "sgd",
           dtype: torch.dtype = torch.float64, lr: float = 0.05):
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(samples, 1, 6, 6, generator=generator, dtype=dtype)
    labels = torch.randint(0, 3, (samples,), generator=generator)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.ReLU(), nn.Linear(16, 3)).to(dtype)
    config = ClientConfig(epochs=epochs, samples=samples, batch=batch, lr=lr,
                          optimiser=optimiser)
    return model, images, train_client(model, images, labels, config)


def torch_sgd(model: nn.Module, images, labels, lr: float, batches: list[slice],
              transform=identity) -> tuple[dict, dict]:
    """torch's own loop, as a user's client runs it: (w0, w_T) state dicts."""
    w0 = copy.deepcopy(model.state_dict())
    optimiser = torch.optim.SGD(model.parameters(), lr=lr)
    for index in batches:
        optimiser.zero_grad()
        F.cross_entropy(model(transform(images[index])), labels[index]).backward()
        optimiser.step()
    return w0, model.state_dict()


@pytest.mark.parametrize("optimiser", ["sgd", "momentum"])
def test_the_span_holds_every_private_image_after_many_local_steps(optimiser: str) -> None:
    model, images, update = client(optimiser=optimiser)
    assert update.steps == 15
    span, why = image_span(model, update.w0, update.wT, (1, 6, 6), 6, identity)
    assert span is not None, why
    assert span.rank == 6 and span.layer == "1"
    assert float(span.distance(images).max()) <= 1e-8
    # a random image is far from it: the span is a real constraint, not the whole space
    assert float(span.distance(torch.rand(1, 1, 6, 6, dtype=torch.float64)).max()) > 1e-2


def test_one_image_is_the_span_itself() -> None:
    model, images, update = client(samples=1, epochs=3, batch=1)
    span, _ = image_span(model, update.w0, update.wT, (1, 6, 6), 1, identity)
    guess = torch.rand(1, 1, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(span.project(guess), images, rtol=0, atol=1e-10)


def test_projection_never_moves_an_estimate_away_from_the_truth() -> None:
    model, images, update = client()
    span, _ = image_span(model, update.w0, update.wT, (1, 6, 6), 6, identity)
    generator = torch.Generator().manual_seed(1)
    for scale in (0.01, 0.3, 3.0):
        guess = images + scale * torch.randn(images.shape, generator=generator,
                                             dtype=torch.float64)
        before = (guess - images).flatten(1).norm(dim=1)
        after = (project_box(span, guess) - images).flatten(1).norm(dim=1)
        assert (after <= before + 1e-12).all()
        assert after.sum() < before.sum()


def test_a_normalised_input_maps_the_span_back_to_pixels() -> None:
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(3, 1, 6, 6, generator=generator, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    transform = Normalize(0.5, 0.25)
    w0, wT = torch_sgd(model, images, labels, 0.1, [slice(0, 2), slice(2, 3)] * 2, transform)
    span, why = image_span(model, w0, wT, (1, 6, 6), 3, transform)
    assert span is not None, why
    assert float(span.distance(images).max()) <= 1e-8


@pytest.mark.parametrize("model, reason", [
    (nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(64, 3)), "Conv2d, not Linear"),
    (nn.Sequential(nn.Flatten(), nn.BatchNorm1d(36), nn.Linear(36, 3)), "BatchNorm1d"),
    (nn.Sequential(nn.Flatten(), nn.Linear(36, 3, bias=False)), "no bias"),
])
def test_no_span_where_the_first_layer_is_not_a_linear_map_of_the_image(model, reason) -> None:
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    wT = {n: p + 0.01 for n, p in w0.items()}
    span, why = image_span(model, w0, wT, (1, 6, 6), 2, identity)
    assert span is None and reason in why


def test_the_probe_stops_before_any_layer_runs() -> None:
    model = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(36), nn.Linear(36, 3)).train()
    first_linear(model, (1, 6, 6), identity)
    assert int(model[1].num_batches_tracked) == 0


def test_an_adamw_client_leaves_no_span_and_says_why() -> None:
    model, _, update = client(optimiser="adamw", dtype=torch.float32, lr=0.01)
    span, why = image_span(model, update.w0, update.wT, (1, 6, 6), 6, identity)
    assert span is None and "AdamW" in why


def test_a_non_affine_transform_leaves_no_span() -> None:
    model, _, update = client()
    span, why = image_span(model, update.w0, update.wT, (1, 6, 6), 6, torch.sqrt)
    assert span is None and "a·x + c" in why


def test_invert_update_keeps_an_mlp_clients_images_in_the_span() -> None:
    """Through the user-facing call: four images, one step, labels inferred; the span is used
    and reported, the images lie in it, and they come back far closer than without it."""
    torch.manual_seed(0)
    model = FEDAVG_MODELS.get("mlp")(1, 8, 4)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(4, 1, 8, 8, generator=generator)
    w0, wT = torch_sgd(model, images, torch.tensor([0, 1, 2, 3]), 0.01, [slice(0, 4)])
    errors = {}
    for kept in (True, False):
        result = invert_update(model, w0, wT, samples=4, shape=(1, 8, 8), method="ig",
                               hyperparameters={"lr": 0.01, "epochs": 1, "batch_size": 4},
                               iterations=200, span=kept)
        matched = ((result.images[:, None] - images[None]) ** 2).flatten(2).mean(2)
        errors[kept] = float(matched.min(0).values.max())
        if kept:
            assert result.span["rank"] == 4
    assert errors[True] < 1e-4 and errors[False] > 10 * errors[True], errors  # ≥ 40 dB


def one_step_cnn(samples: int, steps: int = 1):
    generator = torch.Generator().manual_seed(2)
    images = torch.rand(samples, 1, 28, 28, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    torch.manual_seed(0)
    model = FEDAVG_MODELS.get("flower-cnn")(1, 28, 10).double()
    config = ClientConfig(epochs=steps, samples=samples, batch=samples, lr=0.05)
    return model, images, train_client(model, images, labels, config)


def test_a_one_step_update_spans_every_linear_layers_inputs_on_the_private_images() -> None:
    model, images, update = one_step_cnn(3)
    spans = feature_spans(model, update.w0, update.wT, 3)
    assert set(spans) == {"7", "9", "11"}  # Flower's template: its three Linear layers
    seen = {}
    hooks = [model[int(name)].register_forward_pre_hook(
        lambda _, inputs, name=name: seen.__setitem__(name, inputs[0])) for name in spans]
    with torch.no_grad():
        functional_call(model, update.w0, (images,))
        truth = {name: float(off_span(seen[name], spans[name])) for name in spans}
        functional_call(model, update.w0, (torch.rand(3, 1, 28, 28, dtype=torch.float64),))
        other = {name: float(off_span(seen[name], spans[name])) for name in spans}
    for hook in hooks:
        hook.remove()
    assert max(truth.values()) <= 1e-12
    assert other["7"] > 1e-3  # the first Linear layer's span rules out other images


def test_the_attack_uses_feature_spans_only_for_a_one_step_update() -> None:
    for steps, expected in ((1, ["11", "7", "9"]), (2, [])):
        model, images, update = one_step_cnn(2, steps)
        result = invert_update(model.float(), {k: v.float() for k, v in update.w0.items()},
                               {k: v.float() for k, v in update.wT.items()}, samples=2,
                               shape=(1, 28, 28), method="ig", iterations=2,
                               hyperparameters={"lr": 0.05, "epochs": steps, "batch": 2})
        assert result.span["feature_spans"] == expected


def test_a_declared_adamw_client_gets_no_span_at_all() -> None:
    """One AdamW step is about η·sign(g): no layer's update spans its inputs, even where a
    rank gap happens to show, so a declared AdamW client gets neither kind of span."""
    model, images, update = one_step_cnn(2)
    w0 = {k: v.float() for k, v in update.w0.items()}
    wT = {k: v.float() for k, v in update.wT.items()}
    result = invert_update(model.float(), w0, wT, samples=2, shape=(1, 28, 28), method="ig",
                           iterations=2, labels=[0, 1],
                           hyperparameters={"lr": 0.05, "steps": 1, "optimiser": "AdamW"})
    assert result.span["feature_spans"] == [] and "rescales each entry" in result.span["unused"]
