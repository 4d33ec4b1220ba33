"""The FedAvg client: its update against torch's own optimisers, and the one-step identity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gradleak.errors import ConfigError
from gradleak.fedavg.client import ClientConfig, batch_order, train_client
from gradleak.fedavg.models import FEDAVG_MODELS


def client_data(n: int = 6, channels: int = 1, size: int = 28, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(n, channels, size, size, generator=generator),
            torch.randint(0, 10, (n,), generator=generator))


def fresh(name: str = "lenet-sigmoid", channels: int = 1, size: int = 28) -> torch.nn.Module:
    torch.manual_seed(0)
    return FEDAVG_MODELS.get(name)(channels, size, 10)


@pytest.mark.parametrize(("name", "channels", "size"), [("lenet-sigmoid", 1, 28),
                                                         ("lenet-sigmoid", 3, 32),
                                                         ("cnn", 1, 28), ("cnn", 3, 32)])
def test_models_map_images_to_logits(name: str, channels: int, size: int) -> None:
    images, _ = client_data(2, channels, size)
    assert fresh(name, channels, size)(images).shape == (2, 10)


def test_one_full_batch_step_is_lr_times_the_gradient_at_w0() -> None:
    images, labels = client_data(6)
    model = fresh()
    config = ClientConfig(epochs=1, samples=6, batch=6, lr=0.1)
    update = train_client(model, images, labels, config)
    loss = F.cross_entropy(model(images), labels)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    for (name, _), g in zip(model.named_parameters(), grads, strict=True):
        torch.testing.assert_close(update.delta()[name], 0.1 * g, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("optimiser", ["sgd", "momentum", "adamw"])
def test_the_local_run_matches_torchs_optimiser(optimiser: str) -> None:
    images, labels = client_data(6)
    config = ClientConfig(epochs=3, samples=6, batch=4, lr=0.05, optimiser=optimiser, seed=2)
    update = train_client(fresh(), images, labels, config)
    reference = fresh()
    params = list(reference.parameters())
    torch_optimiser = {"sgd": lambda: torch.optim.SGD(params, lr=0.05),
                       "momentum": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9),
                       "adamw": lambda: torch.optim.AdamW(params, lr=0.05)}[optimiser]()
    for index in batch_order(config):
        torch_optimiser.zero_grad()
        F.cross_entropy(reference(images[index]), labels[index]).backward()
        torch_optimiser.step()
    assert update.steps == 3 * 2  # batches of 4 and 2 per epoch
    for name, p in reference.named_parameters():
        torch.testing.assert_close(update.wT[name], p.detach(), rtol=1e-4, atol=1e-6)


def test_w0_is_left_untouched_and_labels_only_when_known() -> None:
    images, labels = client_data(4)
    model = fresh()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    update = train_client(model, images, labels, ClientConfig(epochs=2, samples=4, batch=2))
    assert update.labels is None  # the server's view by default: w0, w_T, declared settings
    oracle = train_client(fresh(), images, labels, ClientConfig(epochs=2, samples=4, batch=2),
                          labels_known=True)
    assert torch.equal(oracle.labels, labels)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and torch.equal(update.w0[name], before[name])
    assert any(not torch.equal(update.wT[n], before[n]) for n in before)


def test_bad_client_settings_name_the_field() -> None:
    images, labels = client_data(4)
    with pytest.raises(ConfigError, match="client batch 0"):
        train_client(fresh(), images, labels, ClientConfig(samples=4, batch=0))
    with pytest.raises(ConfigError, match="holds 4 images"):
        train_client(fresh(), images, labels, ClientConfig(samples=5))
    with pytest.raises(ConfigError, match="optimiser 'lion'"):
        train_client(fresh(), images, labels, ClientConfig(samples=4, optimiser="lion"))
    with pytest.raises(ConfigError, match="unknown FedAvg model"):
        FEDAVG_MODELS.get("resnet")


def test_batchnorm_in_train_mode_matches_torch_and_updates_its_statistics() -> None:
    images, labels = client_data(4)
    config = ClientConfig(epochs=2, samples=4, batch=2, lr=0.05, batchnorm_train=True)
    update = train_client(fresh("cnn-bn"), images, labels, config)
    reference = fresh("cnn-bn").train()
    optimiser = torch.optim.SGD(reference.parameters(), lr=0.05)
    for index in batch_order(config):
        optimiser.zero_grad()
        F.cross_entropy(reference(images[index]), labels[index]).backward()
        optimiser.step()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(update.wT[name], p.detach(), rtol=1e-4, atol=1e-6)
    for name, b in reference.named_buffers():  # what the client sends beside w_T
        torch.testing.assert_close(update.buffersT[name].float(), b.float(), rtol=1e-4,
                                   atol=1e-6)
        assert not torch.equal(update.buffers0[name], update.buffersT[name])
