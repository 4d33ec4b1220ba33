"""The surrogate identities: NL-SME at the midpoint is SME, SME at α = 0 is IG."""

from __future__ import annotations

import pytest
import torch

from gradleak.errors import ConfigError
from gradleak.fedavg.attacks import FedAttackConfig, UpdateInversion, cosine_distance
from gradleak.fedavg.client import ClientConfig, train_client
from gradleak.fedavg.models import FEDAVG_MODELS


@pytest.fixture(scope="module")
def client():
    torch.manual_seed(0)
    model = FEDAVG_MODELS.get("lenet-sigmoid")(1, 16, 10)
    generator = torch.Generator().manual_seed(1)
    images = torch.rand(4, 1, 16, 16, generator=generator)
    labels = torch.tensor([1, 3, 3, 7])
    update = train_client(model, images, labels, ClientConfig(epochs=3, samples=4, batch=2,
                                                               lr=0.1), labels_known=True)
    return model, images, labels, update


def image_gradient(model, update, labels, method: str, position: float, **overrides):
    config = FedAttackConfig(labels="known", method=method, tv=0.0, lambda_control=0.0,
                             lambda_scale=0.0,
                             seed=4, **overrides)
    attack = UpdateInversion(model, update, (1, 16, 16), 10, config)
    with torch.no_grad():
        attack.surrogate.position.fill_(position)
    total, _ = attack.objective()
    (gradient,) = torch.autograd.grad(total, attack.images)
    return gradient, total


def test_nlsme_at_the_midpoint_with_unit_scale_is_sme_at_alpha_t(client) -> None:
    model, _, labels, update = client
    sme, sme_loss = image_gradient(model, update, labels, "sme", 0.3)
    nlsme, nlsme_loss = image_gradient(model, update, labels, "nlsme-nod", 0.3)
    # the two points differ only by float rounding of (1 − t)² w0 + 2 (1 − t) t mid + t² w_T
    atol = 1e-5 * float(sme.abs().max())
    torch.testing.assert_close(nlsme, sme, rtol=1e-4, atol=atol)
    torch.testing.assert_close(nlsme_loss, sme_loss)
    scaled, _ = image_gradient(model, update, labels, "nlsme", 0.3)  # d = 1 at the start
    torch.testing.assert_close(scaled, sme, rtol=1e-4, atol=atol)


def test_sme_at_alpha_zero_is_ig_on_the_update(client) -> None:
    model, _, labels, update = client
    ig, _ = image_gradient(model, update, labels, "ig", 0.0)
    sme, _ = image_gradient(model, update, labels, "sme", 0.0)
    torch.testing.assert_close(sme, ig, rtol=1e-6, atol=1e-10)
    moved, _ = image_gradient(model, update, labels, "sme", 0.7)
    assert not torch.allclose(moved, ig)  # the identity could fail


@pytest.mark.slow
def test_ig_recovers_one_image_from_a_one_step_update() -> None:
    torch.manual_seed(0)
    model = FEDAVG_MODELS.get("lenet-sigmoid")(1, 16, 10)
    coarse = torch.rand(1, 1, 4, 4, generator=torch.Generator().manual_seed(3))
    image = torch.nn.functional.interpolate(coarse, size=(16, 16), mode="bilinear")
    label = torch.tensor([4])
    update = train_client(model, image, label, ClientConfig(epochs=1, samples=1, batch=1,
                                                            lr=0.01), labels_known=True)
    config = FedAttackConfig(labels="known", method="ig", iterations=400, lr_images=0.1, tv=1e-4)
    result = UpdateInversion(model, update, (1, 16, 16), 10, config).run()
    mse = float((result["images"] - image).pow(2).mean())
    assert 10 * torch.log10(torch.tensor(1.0 / mse)) >= 30.0
    assert result["l_sim_raw"] < 1e-3


def test_an_unknown_method_is_named(client) -> None:
    model, _, labels, update = client
    with pytest.raises(ConfigError, match="FedAvg attack 'fedleak'"):
        UpdateInversion(model, update, (1, 16, 16), 10,
                        FedAttackConfig(labels="known", method="fedleak"))


def test_cosine_distance_is_one_minus_the_cosine_of_the_flattened_parameters() -> None:
    generator = torch.Generator().manual_seed(5)
    a = {"w": torch.randn(3, 4, generator=generator), "b": torch.randn(3, generator=generator)}
    b = {"w": torch.randn(3, 4, generator=generator), "b": torch.randn(3, generator=generator)}
    flat_a, flat_b = (torch.cat([t["w"].flatten(), t["b"]]).double() for t in (a, b))
    expected = 1 - flat_a @ flat_b / (flat_a.norm() * flat_b.norm())
    b_norm = flat_b.norm().float()
    for distance in (cosine_distance(a, b), cosine_distance(a, b, b_norm)):
        torch.testing.assert_close(distance.double(), expected, rtol=1e-6, atol=1e-7)


def test_the_scale_vector_stays_in_its_box(client) -> None:
    """d has no clamp in the graph (it would cost two passes per weight): the in-place clamp
    after each step must keep it in [0.1, 10], even with a step size that overshoots."""
    model, _, labels, update = client
    config = FedAttackConfig(labels="known", method="sme-dvec", iterations=3, lr_scale=100.0,
                             seed=2)
    attack = UpdateInversion(model, update, (1, 16, 16), 10, config)
    attack.run()
    scales = torch.cat([d.detach().flatten() for d in attack.surrogate.scale.values()])
    assert float(scales.min()) >= 0.1 - 1e-7 and float(scales.max()) <= 10.0
    at_bounds = torch.isclose(scales, torch.tensor(0.1)) | (scales == 10.0)
    assert bool(at_bounds.any())  # the step did overshoot, so the clamp was tested


def test_labels_are_inferred_from_the_update_when_not_declared() -> None:
    """The default: the server reads the label multiset off the output layer's bias update
    (exact here, as on every digits and photos setting tried when written, N up to 50, E up
    to 20), and an update made for inference carries no labels for it to peek at."""
    from gradleak.fedavg.datasets import load_dataset
    from gradleak.fedavg.experiment import run_fedavg

    client = ClientConfig(epochs=5, samples=20, batch=10)
    result = run_fedavg("digits", "cnn", client, FedAttackConfig(method="ig", iterations=1))
    assert result["labels"] == "inferred from the output layer's bias update"
    assert result["label_count_l1"] == 0
    data = load_dataset("digits", seed=0)
    images, labels = data.sample(20, seed=0)
    model = FEDAVG_MODELS.get("cnn")(images.shape[1], images.shape[-1], data.classes)
    hidden = train_client(model, images, labels, client, labels_known=False)
    assert hidden.labels is None
    with pytest.raises(ConfigError, match="declared known, but the client's update carries"):
        UpdateInversion(model, hidden, tuple(images.shape[1:]), data.classes,
                        FedAttackConfig(method="ig", labels="known"))
    momentum = train_client(model, images, labels, ClientConfig(epochs=1, samples=20, batch=10,
                                                                optimiser="momentum"),
                            labels_known=False)
    with pytest.raises(ConfigError, match="plain-SGD update; this client used 'momentum'"):
        UpdateInversion(model, momentum, tuple(images.shape[1:]), data.classes,
                        FedAttackConfig(method="ig"))


def test_restarts_keep_the_start_that_matches_the_update_best(client) -> None:
    model, _, _, update = client
    config = FedAttackConfig(labels="known", method="sme", iterations=8, restarts=3, seed=2)
    attack = UpdateInversion(model, update, (1, 16, 16), 10, config)
    assert not torch.equal(attack.start(0), attack.start(1))
    result = attack.run()
    assert len(result["restarts_l_sim"]) == 3
    assert result["l_sim_raw"] == min(result["restarts_l_sim"])
    assert result["restart"] == result["restarts_l_sim"].index(result["l_sim_raw"])
    single = UpdateInversion(model, update, (1, 16, 16), 10,
                             FedAttackConfig(labels="known", method="sme", iterations=8, seed=2))
    assert single.run()["l_sim_raw"] == result["restarts_l_sim"][0]  # restart 0: the seed's own
    with pytest.raises(ConfigError, match="restarts 0: expected an integer >= 1"):
        FedAttackConfig(restarts=0).check()


@pytest.mark.parametrize("model", ["cnn-bn", "resnet8"])
def test_a_simulated_batchnorm_train_client_is_replayed_in_train_mode(model: str) -> None:
    """`gradleak fedavg --batchnorm-train`: the server's replay normalises each minibatch by
    itself, as the client did, so the true images explain a one-step update exactly; replayed
    in eval mode they would not (cosine 0.46 here), and the attack would be blind to them."""
    from gradleak.fedavg.experiment import run_fedavg, simulate_client
    from gradleak.fedavg.forward import ClientForward

    config = ClientConfig(epochs=1, samples=4, batch=4, lr=0.05, batchnorm_train=True, seed=3)
    simulated = simulate_client("digits", model, config)
    delta = simulated.update.delta()
    shape = tuple(simulated.images.shape[1:])

    def cosine(client: ClientForward) -> float:
        attack = UpdateInversion(simulated.model, simulated.update, shape, 10,
                                 FedAttackConfig(method="ig"), client=client,
                                 labels=simulated.labels)
        gradient = attack.surrogate_gradient(simulated.images)
        return 1.0 - float(cosine_distance(gradient, delta))

    assert cosine(simulated.forward()) > 0.9999
    eval_mode = ClientForward(buffers=dict(simulated.update.buffers0))
    assert cosine(eval_mode) < 0.9
    result = run_fedavg("digits", model, config, FedAttackConfig(method="ig", iterations=1))
    assert result["batchnorm"] == "train"


def test_the_class_mean_start_begins_at_each_used_labels_mean_auxiliary_image(client) -> None:
    """The label-conditioned prior: restart 0 starts exactly at the mean auxiliary image of
    each label the attack uses; later restarts perturb it; without labelled auxiliary images
    it is refused before any work."""
    from gradleak.fedavg.scoring import class_means

    model, _images, labels, update = client
    generator = torch.Generator().manual_seed(7)
    auxiliary = torch.rand(30, 1, 16, 16, generator=generator)
    auxiliary_labels = torch.arange(30) % 10
    config = FedAttackConfig(labels="known", method="ig", start="class-mean", seed=2)
    attack = UpdateInversion(model, update, (1, 16, 16), 10, config,
                             auxiliary=(auxiliary, auxiliary_labels))
    expected = class_means(auxiliary, auxiliary_labels, labels)
    assert torch.equal(attack.images.detach(), expected.clamp(0, 1))
    assert torch.equal(attack.images[1], attack.images[2])  # two images of label 3
    again = attack.start(1)
    assert not torch.equal(again, expected) and float((again - expected).abs().mean()) < 0.2
    with pytest.raises(ConfigError, match="start 'class-mean' begins from each label's mean"):
        UpdateInversion(model, update, (1, 16, 16), 10, config)
    with pytest.raises(ConfigError, match="one label per image"):
        UpdateInversion(model, update, (1, 16, 16), 10, config,
                        auxiliary=(auxiliary, auxiliary_labels[:5]))


@pytest.mark.slow
def test_the_class_mean_start_ends_above_the_class_means_on_a_one_step_client() -> None:
    """Flower's template CNN, four digits, one step: gradient matching from the class means
    ends closer to the images than the class means themselves (it uses the update)."""
    from gradleak.fedavg.experiment import simulate_client
    from gradleak.fedavg.scoring import score_recovery

    simulated = simulate_client("digits", "flower-cnn", ClientConfig(
        epochs=1, samples=4, batch=4, lr=0.05, seed=1))
    auxiliary, auxiliary_labels = simulated.data.rest(4, seed=1)
    attacked = simulated.attack(FedAttackConfig(method="ig", start="class-mean", iterations=300,
                                                seed=1))
    scored = score_recovery(attacked.result["images"], simulated.images, auxiliary,
                            reference_labels=auxiliary_labels, labels=attacked.labels)
    assert scored["attack"]["psnr"] > scored["class_mean"]["psnr"] + 0.5
