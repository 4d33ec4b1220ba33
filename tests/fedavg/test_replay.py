"""Method "sim" (Dimitrov et al.'s attack) replays the client's local steps: on the private
images, in the client's order, the replay is the client's update; the order it uses is never
the client's own draw; and a client it cannot replay is refused before any work."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from user_models import TinyClassifier

from gradleak.errors import ConfigError
from gradleak.fedavg import ClientForward, invert_update
from gradleak.fedavg.attacks import FedAttackConfig, UpdateInversion, replayed_steps
from gradleak.fedavg.client import ClientConfig, ClientUpdate, batch_order, train_client
from gradleak.fedavg.models import FEDAVG_MODELS
from test_invert import data, trained


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    difference = sum(float((a[n] - b[n]).pow(2).sum()) for n in a)
    return math.sqrt(difference / sum(float(b[n].pow(2).sum()) for n in b))


def test_the_replay_on_the_private_images_is_torchs_own_training_loop() -> None:
    """torch.optim.SGD on a BatchNorm model in train mode, 3 epochs of 2 in-order batches:
    the replay of the same images and labels gives the same w0 − w_T."""
    torch.manual_seed(0)
    model = TinyClassifier()
    images, labels = data(4)
    w0, wT = trained(model, images, labels, lr=0.1, steps=6, batch=2)
    names = [n for n, _ in model.named_parameters()]
    declared = ClientConfig(epochs=3, samples=4, batch=2, lr=0.1, batchnorm_train=True,
                            shuffle=False)
    update = ClientUpdate({n: w0[n] for n in names}, {n: wT[n] for n in names}, declared, 6,
                          None)
    client = ClientForward(buffers={n: b for n, b in w0.items() if n not in names
                                    and b.is_floating_point()}, batchnorm="train", batch=2)
    attack = UpdateInversion(model, update, (1, 8, 8), 5, FedAttackConfig(method="sim"),
                             labels=labels, client=client)
    replayed = attack.replayed_update(images)
    assert relative(replayed, update.delta()) < 1e-5
    # and the identity could fail: other images give another update
    assert relative(attack.replayed_update(images.flip(0)), update.delta()) > 1e-2


def test_the_replay_never_uses_the_clients_own_batch_order() -> None:
    """Client and attack seeded alike: the attack's epochs are still its own draws (the
    client's shuffling is private), and a client declared not to shuffle is replayed in order."""
    declared = ClientConfig(epochs=4, samples=10, batch=3, seed=0)
    update = ClientUpdate({}, {}, declared, 16, None)
    client_order = batch_order(declared)
    attack_order = replayed_steps(update, 10, seed=0)
    assert len(attack_order) == len(client_order) == 16
    assert any(not np.array_equal(a, c) for a, c in zip(attack_order, client_order))
    for epoch in range(4):  # each epoch still visits every image once
        visited = np.concatenate(attack_order[epoch * 4:(epoch + 1) * 4])
        assert sorted(visited.tolist()) == list(range(10))
    in_order = ClientConfig(epochs=2, samples=10, batch=3, shuffle=False)
    assert all(np.array_equal(a, c) for a, c in zip(
        replayed_steps(ClientUpdate({}, {}, in_order, 8, None), 10, seed=5),
        batch_order(in_order)))


def test_the_replay_brings_the_dummy_update_towards_the_clients() -> None:
    torch.manual_seed(0)
    model = FEDAVG_MODELS.get("flower-cnn")(1, 28, 10)
    images = torch.rand(2, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([3, 8])
    update = train_client(model, images, labels,
                          ClientConfig(epochs=2, samples=2, batch=1, lr=0.05))
    config = FedAttackConfig(method="sim", iterations=40, lr_images=0.1, tv=0.0, seed=1)
    attack = UpdateInversion(model, update, (1, 28, 28), 10, config, labels=labels)
    start = float(attack.objective()[1]["l_sim_raw"])
    result = attack.run()
    assert result["l_sim_raw"] < 0.5 * start


def test_a_client_the_replay_cannot_follow_is_refused_before_any_work() -> None:
    torch.manual_seed(0)
    model = TinyClassifier()
    images, labels = data(4)
    w0, wT = trained(model, images, labels, lr=0.1, steps=6, batch=2)
    run = dict(samples=4, shape=(1, 8, 8), iterations=1, labels=labels, method="sim")
    with pytest.raises(ConfigError, match="needs its epochs, batch"):
        invert_update(TinyClassifier(), w0, wT, **run, hyperparameters={"lr": 0.1})
    with pytest.raises(ConfigError, match="declared optimiser 'adam'"):
        invert_update(TinyClassifier(), w0, wT, **run, hyperparameters={
            "lr": 0.1, "epochs": 3, "batch": 2, "optimiser": "adam"})
    with pytest.raises(ConfigError, match="batch counter .* says the client took 6 local steps, "
                                          "its declared epochs and batch give 4"):
        invert_update(TinyClassifier(), w0, wT, **run, hyperparameters={
            "lr": 0.1, "epochs": 2, "batch": 2})
    with pytest.raises(ConfigError, match="shuffle='yes'"):
        invert_update(TinyClassifier(), w0, wT, **run, hyperparameters={
            "lr": 0.1, "epochs": 3, "batch": 2, "shuffle": "yes"})
    with pytest.raises(ConfigError, match="method 'sim' replays the client's local steps"):
        UpdateInversion(model, ClientUpdate(w0, wT, None, 6, None), (1, 8, 8), 5,
                        FedAttackConfig(method="sim"), labels=labels)
