"""The conv stacks users bring fall to the training-free attack as the paper's do: Conv →
BatchNorm → ReLU blocks (most image networks' order, bias-free convs included: the BatchNorm
before the ReLU is folded into the conv, and a victim and its folded twin give the same conv
inputs and frames), non-square frames, LeakyReLU, ELU and tanh, in-place ReLUs."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import observe, smooth_frame
from torch import nn

from gradleak.attacks.analytic import module_input
from gradleak.attacks.conv_inputs import observed_conv_inputs
from gradleak.attacks.exact import ExactAttack
from gradleak.inversion.conv_blocks import conv_blocks
from gradleak.victims import create_victim
from gradleak.victims.base import VICTIMS, victim_at_theta0
from gradleak.victims.cnn import SmallCNN

ORDERED, FOLDED = "test-conv-bn-relu", "test-conv-relu-twin"


class ConvNormReLU(SmallCNN):
    """cnn-small's shapes as bias-free Conv → BatchNorm → ReLU blocks."""

    def __init__(self, config) -> None:  # noqa: ANN001
        super().__init__(config)
        layers = []
        for module in self.encoder:
            if isinstance(module, nn.Conv2d):
                layers += [nn.Conv2d(module.in_channels, module.out_channels, module.kernel_size,
                                     module.stride, module.padding, bias=False),
                           nn.BatchNorm2d(module.out_channels), nn.ReLU()]
        self.encoder = nn.Sequential(*layers)


class ConvReLU(SmallCNN):
    normalise = False  # Conv → ReLU blocks: the folded twin


@pytest.fixture(scope="module")
def twins():
    """A Conv → BatchNorm → ReLU victim with statistics far from identity (one channel's gain
    negative) and the Conv → ReLU victim with those BatchNorms folded into its convs."""
    VICTIMS.register(ORDERED)(ConvNormReLU)
    VICTIMS.register(FOLDED)(ConvReLU)
    try:
        torch.manual_seed(4)
        ordered = create_victim(ORDERED, frame_size=32).eval()
        generator = torch.Generator().manual_seed(9)
        with torch.no_grad():
            for module in ordered.encoder:
                if isinstance(module, nn.BatchNorm2d):
                    module.weight.uniform_(0.5, 1.5, generator=generator)
                    module.weight[0] = -0.8
                    module.bias.uniform_(-0.2, 0.2, generator=generator)
                    module.running_mean.uniform_(-0.1, 0.1, generator=generator)
                    module.running_var.uniform_(0.5, 2.0, generator=generator)
        folded = create_victim(FOLDED, frame_size=32).eval()
        convs = [m for m in ordered.encoder if isinstance(m, nn.Conv2d)]
        norms = [m for m in ordered.encoder if isinstance(m, nn.BatchNorm2d)]
        with torch.no_grad():
            for target, conv, norm in zip([m for m in folded.encoder
                                           if isinstance(m, nn.Conv2d)], convs, norms):
                gain = norm.weight / (norm.running_var + norm.eps).sqrt()
                target.weight.copy_(conv.weight * gain[:, None, None, None])
                target.bias.copy_(norm.bias - gain * norm.running_mean)
            for name in ("fc", "policy_head", "value_head"):
                folded.get_submodule(name).load_state_dict(
                    ordered.get_submodule(name).state_dict())
        images = torch.stack([smooth_frame(32, seed) for seed in range(6)])
        args = (images.double(), torch.arange(6) % 5,
                torch.linspace(-1.5, 1.5, 6, dtype=torch.float64),
                torch.linspace(-0.5, 0.8, 6, dtype=torch.float64))
        yield observe(ordered.double(), *args)[0], observe(folded.double(), *args)[0], images
    finally:
        VICTIMS.drop(ORDERED)
        VICTIMS.drop(FOLDED)


def test_the_norm_before_the_relu_is_folded_into_the_conv(twins) -> None:
    ordered, _, _ = twins
    blocks = conv_blocks(victim_at_theta0(ordered).double())
    assert [block.name for block in blocks] == ["encoder.0", "encoder.3", "encoder.6",
                                                "encoder.9"]
    assert all(block.scale is not None and block.bias_source[0].endswith(".bias")
               and block.bias_source[0] != f"{block.name}.bias" for block in blocks)


def test_every_determined_conv_input_of_a_conv_norm_relu_victim_is_exact(twins) -> None:
    ordered, _, images = twins
    assert_exact(ordered, observed_conv_inputs(ordered), images.double())


def test_a_victim_and_its_folded_twin_give_the_same_frames(twins) -> None:
    ordered, folded, images = twins
    frames = [ExactAttack(observation).inverse.frames(observation)[0]
              for observation in (ordered, folded)]
    truth = torch.from_numpy(images.numpy().astype(np.float64))
    assert float((frames[0] - frames[1]).abs().max()) <= 0.05  # grey levels of 255
    mse = ((frames[0].clamp(0, 255) - truth) ** 2).mean()
    assert float(10 * torch.log10(255 ** 2 / mse)) >= 30.0


@contextlib.contextmanager
def users_victim(factory: type[nn.Module], model: nn.Module, frame_shape: tuple[int, int, int],
                 **kwargs):  # noqa: ANN003, ANN201
    """`model` wrapped as a user would (its factory registered for the capture), float64;
    the factory is forgotten afterwards."""
    import gradleak
    from gradleak.victims.factories import MODEL_FACTORIES

    name = f"test-{factory.__name__.lower()}"
    gradleak.register_model_factory(name)(factory)
    try:
        yield gradleak.wrap(model, policy_head="pi", value_head="v", frame_shape=frame_shape,
                            factory=name, **kwargs).double()
    finally:
        MODEL_FACTORIES.drop(name)


def observed(victim, images: torch.Tensor):  # noqa: ANN001, ANN201
    """The float64 per-step gradients of len(images) steps, and what the walk recovers."""
    count = len(images)
    observation, _ = observe(victim, images, torch.arange(count) % 4,
                             torch.tensor([1.0, -0.5, 0.7, -1.2], dtype=torch.float64)[:count],
                             torch.tensor([0.3, -0.2, 0.1, 0.4], dtype=torch.float64)[:count])
    return observation, observed_conv_inputs(observation)


def assert_exact(observation, found, images: torch.Tensor) -> None:  # noqa: ANN001
    """Every conv input the walk recovered equals the victim's own, to float64 rounding."""
    double = victim_at_theta0(observation).double()
    for name, estimate in found.inputs.items():
        with torch.no_grad():
            truth = module_input(double, name, images)
        assert float(((estimate - truth).norm() / truth.norm())) <= 1e-8, name


def frame_psnr(observation, images: torch.Tensor) -> float:  # noqa: ANN001
    frames = ExactAttack(observation).inverse.frames(observation)[0]
    return float(10 * torch.log10(255 ** 2 / ((frames.clamp(0, 255) - images) ** 2).mean()))


def smooth_frames(count: int) -> torch.Tensor:
    return torch.stack([smooth_frame(32, seed) for seed in range(count)]).double()


class RectangularPolicy(nn.Module):
    """A user's network on 48×40 frames: bias-free Conv → BatchNorm → ReLU blocks."""

    def __init__(self) -> None:
        super().__init__()
        blocks = []
        for c_in, c_out, kernel, stride, padding in ((3, 16, 4, 4, 0), (16, 32, 3, 1, 1),
                                                     (32, 32, 3, 1, 1)):
            blocks += [nn.Conv2d(c_in, c_out, kernel, stride, padding, bias=False),
                       nn.BatchNorm2d(c_out), nn.ReLU()]
        self.body = nn.Sequential(*blocks, nn.Flatten())
        self.proj = nn.Linear(32 * 12 * 10, 64)
        self.pi, self.v = nn.Linear(64, 4), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.proj(self.body(x)))
        return self.pi(h), self.v(h)


def test_a_users_rectangular_frames_come_back_through_conv_norm_relu_blocks() -> None:
    """48×40 frames (the walk's maps are 12×10): every determined conv input exact in float64,
    the frames close to the private ones."""
    torch.manual_seed(6)
    model = RectangularPolicy()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5, generator=generator)
                module.running_var.uniform_(0.5, 2.0, generator=generator)
    coarse = torch.rand(4, 3, 4, 4, generator=generator)
    images = (F.interpolate(coarse, size=(48, 40), mode="bilinear").permute(0, 2, 3, 1)
              * 255).round().double()
    with users_victim(RectangularPolicy, model, (48, 40, 3)) as victim:
        observation, found = observed(victim, images)
        assert list(found.inputs) == ["body.6", "body.3"]
        assert all(estimate.shape[-2:] == (12, 10) for estimate in found.inputs.values())
        assert_exact(observation, found, images)
        assert frame_psnr(observation, images) >= 30.0


class LeakyPolicy(nn.Module):
    """A user's network whose blocks use a one-to-one activation instead of a ReLU."""

    def __init__(self, activation: str = "leaky") -> None:
        super().__init__()
        blocks = []
        for c_in, c_out, kernel, stride, padding in ((3, 16, 4, 4, 0), (16, 32, 3, 1, 1),
                                                     (32, 32, 3, 1, 1)):
            blocks += [nn.Conv2d(c_in, c_out, kernel, stride, padding),
                       {"leaky": nn.LeakyReLU(0.1), "elu": nn.ELU(0.7),
                        "tanh": nn.Tanh()}[activation]]
        self.body = nn.Sequential(*blocks, nn.Flatten())
        self.proj = nn.Linear(32 * 8 * 8, 64)
        self.pi, self.v = nn.Linear(64, 4), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.proj(self.body(x)))
        return self.pi(h), self.v(h)


@pytest.mark.parametrize("activation", ["leaky", "elu", "tanh"])
def test_leaky_relu_and_elu_blocks_give_every_unit_and_the_frame(activation: str) -> None:
    """LeakyReLU, ELU and tanh are one-to-one: the walk reads every pre-activation (no on/off
    decision), the conv inputs come back exact in float64 and the frame from the first conv's
    equations at every unit (1,792 of them for 3,072 pixels: the prior decides the rest)."""
    torch.manual_seed(8)
    images = smooth_frames(4)
    with users_victim(LeakyPolicy, LeakyPolicy(activation), (32, 32, 3),
                      factory_kwargs={"activation": activation}) as victim:
        observation, found = observed(victim, images)
        assert all(bool(mask.all()) for mask in found.masks.values())  # none decided off
        assert_exact(observation, found, images)
        assert frame_psnr(observation, images) >= 35.0


class InPlacePolicy(nn.Module):
    """Conv → ReLU(inplace=True) blocks, as many codebases write them."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 4, 4), nn.ReLU(inplace=True),
                                  nn.Conv2d(16, 32, 3, 1, 1), nn.ReLU(inplace=True),
                                  nn.Conv2d(32, 32, 3, 1, 1), nn.ReLU(inplace=True),
                                  nn.Flatten())
        self.proj = nn.Linear(32 * 8 * 8, 64)
        self.pi, self.v = nn.Linear(64, 4), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.proj(self.body(x)))
        return self.pi(h), self.v(h)


def test_in_place_relus_are_walked_like_any_other() -> None:
    """An in-place ReLU rewrites the conv output it follows: the roles are read from copies
    taken as each module runs, so the stack still composes, and its conv inputs come back
    exact (before, the walk refused it as 'a function between them')."""
    torch.manual_seed(10)
    images = smooth_frames(3)
    with users_victim(InPlacePolicy, InPlacePolicy(), (32, 32, 3)) as victim:
        assert victim.roles().conv_chain
        observation, found = observed(victim, images)
        assert list(found.inputs) == ["body.4", "body.2"]
        assert_exact(observation, found, images)


class FunctionalPolicy(nn.Module):
    """Convs whose ReLUs the forward code applies as functions (F.relu, torch.relu)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 16, 4, 4), nn.Conv2d(16, 32, 3, 1, 1)
        self.c3 = nn.Conv2d(32, 32, 3, 1, 1)
        self.proj = nn.Linear(32 * 8 * 8, 64)
        self.pi, self.v = nn.Linear(64, 4), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.relu(self.c2(F.relu(self.c1(x))))
        h = F.relu(self.proj(F.relu(self.c3(x)).flatten(1)))
        return self.pi(h), self.v(h)


def test_relus_applied_as_functions_are_found_and_walked() -> None:
    """The roles see a ReLU between two modules that is no module (the next reads relu of
    what the last gave) as a functional step; the walk passes it, the conv inputs come back
    exact, and the roles survive the capture's JSON."""
    from gradleak.victims.roles import Roles

    torch.manual_seed(12)
    images = smooth_frames(3)
    with users_victim(FunctionalPolicy, FunctionalPolicy(), (32, 32, 3)) as victim:
        roles = victim.roles()
        assert roles.conv_chain and [(s.module, s.functional) for s in roles.conv_stack] == [
            ("c1", False), ("c1:relu", True), ("c2", False), ("c2:relu", True), ("c3", False),
            ("c3:relu", True)]
        assert Roles.from_json(roles.to_json(), "roles") == roles
        assert roles.conv_modules() == ["c1", "c2", "c3"]
        observation, found = observed(victim, images)
        assert list(found.inputs) == ["c3", "c2"]
        assert_exact(observation, found, images)
