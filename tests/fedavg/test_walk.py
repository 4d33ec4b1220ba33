"""Method "training-free" on a FedAvg update: one image's single step comes back to the
wire's precision through the models the walk passes, the label with it (no rate declared),
and every model or client it cannot invert is refused, naming why, before any work."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradleak.errors import ConfigError
from gradleak.fedavg import FitWarning, Normalize, invert_update
from gradleak.fedavg.forward import identity
from gradleak.fedavg.labels import single_label
from gradleak.fedavg.models import FEDAVG_MODELS
from gradleak.fedavg.walk import plan_walk, walk_update
from gradleak.metrics.images import psnr


def image(seed: int, shape: tuple[int, ...] = (1, 28, 28)) -> torch.Tensor:
    """A smooth image in [0, 1] (blurred noise), like a digit or a photo's crop."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.rand(1, *shape, generator=generator)
    return F.avg_pool2d(noise, 5, 1, 2, count_include_pad=False).clamp(0, 1)


def one_step(model: nn.Module, x: torch.Tensor, label: int, *, lr: float = 0.05,
             steps: int = 1, transform=identity, optimiser: str = "sgd"):
    """The client's own torch loop: (w0, w_T) state dicts."""
    w0 = copy.deepcopy(model.state_dict())
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=lr),
            "momentum": lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9),
            "adamw": lambda p: torch.optim.AdamW(p, lr=lr)}[optimiser]
    optimiser_ = make(model.parameters())
    for _ in range(steps):
        optimiser_.zero_grad()
        F.cross_entropy(model(transform(x)), torch.tensor([label])).backward()
        optimiser_.step()
    return w0, copy.deepcopy(model.state_dict())


def bias_free_bn_cnn() -> nn.Module:
    """A user's pool-free CNN: Conv (no bias) → BatchNorm → ReLU, strided convs, two heads."""
    return nn.Sequential(nn.Conv2d(1, 32, 5, 2, 2, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Conv2d(32, 64, 5, 2, 2), nn.ReLU(), nn.Conv2d(64, 64, 3, 1, 1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(64 * 7 * 7, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def with_statistics(model: nn.Module) -> nn.Module:
    """BatchNorm running statistics and affine parameters away from their defaults, eval mode."""
    generator = torch.Generator().manual_seed(3)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            count = module.num_features
            module.running_mean.copy_(0.1 * torch.randn(count, generator=generator))
            module.running_var.copy_(0.5 + torch.rand(count, generator=generator))
            module.weight.data.copy_(0.5 + torch.rand(count, generator=generator))
            module.bias.data.copy_(0.1 * torch.randn(count, generator=generator))
    return model.eval()


CASES = {  # name → (model, input transform, the largest pixel error allowed)
    "DLG's LeNet (sigmoid), Normalize(0.5, 0.5)":
        (lambda: FEDAVG_MODELS.get("lenet-sigmoid")(1, 28, 10), Normalize(0.5, 0.5), 1e-3),
    "Conv → BatchNorm (eval) → ReLU, no pooling":
        (lambda: with_statistics(bias_free_bn_cnn()), identity, 1e-3),
    "an MLP": (lambda: FEDAVG_MODELS.get("mlp")(1, 28, 10), identity, 1e-4),
    "Conv → GroupNorm → ReLU, no pooling (each block's statistics solved)":
        (lambda: FEDAVG_MODELS.get("cnn-strided-gn")(1, 28, 10), Normalize(0.5, 0.5), 1e-3),
    "a user's GroupNorm CNN, 24 → 48 channels in 4 groups (a scale the first solve misses)":
        (lambda: nn.Sequential(nn.Conv2d(1, 24, 5, 2, 2), nn.GroupNorm(4, 24), nn.ReLU(),
                               nn.Conv2d(24, 48, 3, 2, 1), nn.GroupNorm(4, 48), nn.ReLU(),
                               nn.Flatten(), nn.Linear(48 * 7 * 7, 10)), identity, 1e-3),
}
SLOW = {"a user's GroupNorm CNN, 24 → 48 channels in 4 groups (a scale the first solve misses)"}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in SLOW
                                  else case for case in CASES])
def test_one_images_single_step_comes_back_to_the_wires_precision(case: str) -> None:
    factory, transform, tolerance = CASES[case]
    torch.manual_seed(0)
    model, x = factory(), image(1)
    w0, wT = one_step(model, x, 7, transform=transform)
    torch.manual_seed(1)  # the server's copy of the architecture: other weights, w0 loaded
    result = invert_update(factory(), w0, wT, samples=1, shape=(1, 28, 28),
                           input_transform=transform, batchnorm="eval",
                           method="training-free")  # nothing declared: no rate, no steps
    assert (result.images - x).abs().max() < tolerance
    assert result.labels.tolist() == [7] and result.labels_inferred
    assert result.l_sim < 1e-4  # the image's own gradient at w0 is the update
    assert result.walk["rank_ratio"] < 1e-4


def test_the_image_does_not_depend_on_the_clients_rate_or_a_first_momentum_step() -> None:
    """Every quantity the walk reads is a ratio of gradients: η cancels (in float64, where
    the wire's rounding, relative to η's step, would differ between the two); and a float64
    update gives the image to a relative error of 1e-5."""
    torch.manual_seed(0)
    model, x = FEDAVG_MODELS.get("lenet-sigmoid")(1, 28, 10).double(), image(2).double()
    walk = plan_walk(model, (1, 28, 28), identity, 1, 1, "momentum", "eval")
    images = []
    for lr, optimiser in ((0.01, "sgd"), (0.3, "momentum")):
        w0, wT = one_step(copy.deepcopy(model), x, 3, lr=lr, optimiser=optimiser)
        images.append(walk_update(walk, w0, wT).image)
    assert (images[0] - images[1]).abs().max() < 1e-6
    assert float((images[0] - x).norm() / x.norm()) < 1e-5  # the solve's smoothness prior


def test_one_images_label_from_any_number_of_sgd_or_momentum_steps() -> None:
    torch.manual_seed(0)
    model, x = FEDAVG_MODELS.get("flower-cnn")(1, 28, 10), image(3)
    for label, optimiser in ((2, "sgd"), (9, "momentum")):
        w0, wT = one_step(copy.deepcopy(model), x, label, steps=5, optimiser=optimiser)
        assert single_label(model, w0, wT, 10).tolist() == [label]


@pytest.mark.parametrize("model, settings, says", [
    ("flower-cnn", {}, "cannot pass 2, a maxpool: max-pooling"),
    ("resnet8", {}, "cannot pass"),
    ("lenet-sigmoid", {"samples": 2}, "declares 2 images"),
    ("lenet-sigmoid", {"steps": 3}, "took 3 local steps"),
    ("lenet-sigmoid", {"optimiser": "adamw"}, "rescales each entry"),
    ("cnn-bn", {"batchnorm": "train"}, "cannot pass 3, a maxpool"),
])
def test_what_the_walk_cannot_invert_is_refused_before_any_work(model, settings, says) -> None:
    built = FEDAVG_MODELS.get(model)(1, 28, 10)
    arguments = {"samples": 1, "steps": 1, "optimiser": "sgd", "batchnorm": "eval", **settings}
    with pytest.raises(ConfigError, match=says):
        plan_walk(built, (1, 28, 28), identity, arguments["samples"], arguments["steps"],
                  arguments["optimiser"], arguments["batchnorm"])


def test_dropout_a_transform_not_per_pixel_and_a_cumulative_batchnorm_are_refused() -> None:
    dropping = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Dropout(0.2),
                             nn.Linear(32, 10))
    with pytest.raises(ConfigError, match="3 drops units at random"):
        plan_walk(dropping, (1, 28, 28), identity, 1, 1, "sgd", "eval")
    model = with_statistics(bias_free_bn_cnn())
    with pytest.raises(ConfigError, match="per pixel"):
        plan_walk(model, (1, 28, 28), lambda x: x.flip(-1), 1, 1, "sgd", "eval")
    model[1].momentum = None
    with pytest.raises(ConfigError, match="1 trained in train mode with momentum=None"):
        plan_walk(model, (1, 28, 28), identity, 1, 1, "sgd", "train")


def grouped(first: nn.Module, activation: nn.Module, after: int = 7) -> nn.Module:
    return nn.Sequential(first, nn.GroupNorm(4, 16), activation, nn.Conv2d(16, 32, 5, 2, 2),
                         nn.GroupNorm(4, 32), nn.ReLU(), nn.Flatten(),
                         nn.Linear(32 * after * after, 10))


def zero_gain(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        model[4].weight[5] = 0.0
    return model


@pytest.mark.parametrize("model, says", [
    (lambda: grouped(nn.Conv2d(1, 16, 5, 2, 2, bias=False), nn.ReLU()),
     "cannot pass 1: a conv without a bias under GroupNorm"),
    (lambda: grouped(nn.Conv2d(1, 16, 5, 2, 2), nn.Tanh()),
     "passes a GroupNorm followed by a ReLU; 1 is followed by a tanh"),
    (lambda: zero_gain(grouped(nn.Conv2d(1, 16, 5, 2, 2), nn.ReLU())),
     r"cannot pass 4: its GroupNorm has γ = 0 on channels \[5\]"),
    (lambda: grouped(nn.Conv2d(1, 16, 3, 4, 1), nn.ReLU(), after=4),
     r"about 536 equations \(half the units on\) for 792 unknowns"),
])
def test_a_groupnorm_the_walk_cannot_solve_is_refused_naming_it(model, says) -> None:
    with pytest.raises(ConfigError, match=says):
        plan_walk(model(), (1, 28, 28), identity, 1, 1, "sgd", "eval")


def train_mode_cnn() -> nn.Module:
    """BatchNorm both ways a user writes it, the client training in train mode: Conv (no
    bias) → BatchNorm → ReLU, and Conv → ReLU → BatchNorm."""
    return nn.Sequential(nn.Conv2d(1, 32, 5, 2, 2, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Conv2d(32, 64, 5, 2, 2), nn.ReLU(), nn.BatchNorm2d(64),
                         nn.Conv2d(64, 64, 3, 1, 1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(64 * 7 * 7, 10))


def trained_in_train_mode(dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor, dict, dict]:
    """The model (at w0), the image, and the state dicts before and after torch's own
    train-mode step (the buffers moved)."""
    torch.manual_seed(0)
    model = with_statistics(train_mode_cnn()).to(dtype)
    x = image(6).to(dtype)
    w0 = copy.deepcopy(model.state_dict())
    trained = copy.deepcopy(model).train()
    optimiser = torch.optim.SGD(trained.parameters(), lr=0.05)
    F.cross_entropy(trained(x), torch.tensor([4])).backward()
    optimiser.step()
    return model, x, w0, trained.state_dict()


def test_batchnorm_in_train_mode_normalises_the_image_by_its_own_statistics() -> None:
    """One image in train mode: the step's statistics read off the running buffers' change,
    the gradient carried through them. Float64: to the solve's prior; the float32 wire,
    through invert_update: ≥ 40 dB."""
    model, x, w0, wT = trained_in_train_mode(torch.float64)
    walk = plan_walk(model, (1, 28, 28), identity, 1, 1, "sgd", "train")
    split = [({n: v for n, v in state.items() if n in dict(model.named_parameters())},
              {n: v for n, v in state.items() if n in dict(model.named_buffers())})
             for state in (w0, wT)]
    walked = walk_update(walk, split[0][0], split[1][0], split[0][1], split[1][1])
    assert float((walked.image.double() - x).norm() / x.norm()) < 1e-5
    model, x, w0, wT = trained_in_train_mode(torch.float32)
    result = invert_update(train_mode_cnn(), w0, wT, samples=1, shape=(1, 28, 28),
                           method="training-free", batchnorm="train")
    assert float(psnr(result.images, x)[0]) >= 40.0
    assert result.labels.tolist() == [4]


def test_an_update_of_two_images_declared_as_one_is_refused_by_its_rank() -> None:
    torch.manual_seed(0)
    model = FEDAVG_MODELS.get("lenet-sigmoid")(1, 28, 10)
    w0 = copy.deepcopy(model.state_dict())
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05)
    F.cross_entropy(model(torch.cat([image(4), image(5)])), torch.tensor([1, 6])).backward()
    optimiser.step()
    with pytest.raises(ConfigError, match="rank > 1"):
        invert_update(FEDAVG_MODELS.get("lenet-sigmoid")(1, 28, 10), w0, model.state_dict(),
                      samples=1, shape=(1, 28, 28), method="training-free", batchnorm="eval")


def test_a_walk_whose_equations_do_not_hold_says_so() -> None:
    """A train-mode client declared as eval mode: one image, one step (the rank check passes),
    but the statistics the walk uses are the wrong ones; the image is not passed off as a
    result without a FitWarning naming the residual."""
    _, x, w0, wT = trained_in_train_mode(torch.float32)
    with pytest.warns(FitWarning, match="the first conv's equations miss its image"):
        result = invert_update(train_mode_cnn(), w0, wT, samples=1, shape=(1, 28, 28),
                               method="training-free", batchnorm="eval")
    assert result.walk["residuals"]["outputs"] > 0.1
    assert any("the walk did not hold" in note for note in result.warnings)
