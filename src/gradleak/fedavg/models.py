"""FedAvg victim classifiers, in a registry: image (B, C, H, W) in [0, 1] → logits."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from gradleak.registry import Registry
from gradleak.victims.resnet import BasicBlock

FEDAVG_MODELS: Registry[Callable[..., nn.Module]] = Registry("FedAvg model")


@FEDAVG_MODELS.register("lenet-sigmoid")
def lenet_sigmoid(channels: int, size: int, classes: int) -> nn.Module:
    """DLG's LeNet: sigmoid activations, no pooling; twice differentiable everywhere, so
    gradient matching on it is the sanity check of every inversion paper."""
    def block(c_in: int, c_out: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 5, stride=stride, padding=2), nn.Sigmoid()]

    after = (size - 1) // 2 + 1  # two stride-2 convolutions with padding 2, kernel 5
    after = (after - 1) // 2 + 1
    model = nn.Sequential(*block(channels, 12, 2), *block(12, 12, 2), *block(12, 12, 1),
                          nn.Flatten(), nn.Linear(12 * after * after, classes))
    # DLG's initialisation, U(−0.5, 0.5): with torch's default the sigmoids sit in their
    # linear range and IG matches the gradient (L_sim ~ 1e-6) yet recovers only 13 dB
    for parameter in model.parameters():
        nn.init.uniform_(parameter, -0.5, 0.5)
    return model


@FEDAVG_MODELS.register("cnn")
def small_cnn(channels: int, size: int, classes: int) -> nn.Module:
    """LEAF's FEMNIST CNN (Caldas et al. 2018), the kind SME attacks: two 5×5 conv + max-pool
    blocks (32, 64 channels), a 2048-unit hidden layer. Also used for 3×32×32 photos."""
    pooled = size // 4
    return nn.Sequential(nn.Conv2d(channels, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * pooled * pooled, 2048), nn.ReLU(),
                         nn.Linear(2048, classes))


@FEDAVG_MODELS.register("cnn-bn")
def small_cnn_batchnorm(channels: int, size: int, classes: int) -> nn.Module:
    """`cnn` with BatchNorm after each convolution: for the BatchNorm robustness setting."""
    pooled = size // 4
    return nn.Sequential(nn.Conv2d(channels, 32, 5, padding=2), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(32, 64, 5, padding=2), nn.BatchNorm2d(64),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64 * pooled * pooled, 2048), nn.ReLU(),
                         nn.Linear(2048, classes))


@FEDAVG_MODELS.register("cnn-strided")
def strided_cnn(channels: int, size: int, classes: int) -> nn.Module:
    """A CNN that downsamples by strided convolutions, not pooling (32 and 64 channels, 5×5
    stride 2, then 3×3), a 256-unit hidden layer: the kind whose one-image, one-step update the
    training-free walk inverts (fedavg.walk)."""
    after = ((size - 1) // 2) // 2 + 1  # two stride-2 convolutions with padding 2, kernel 5
    return nn.Sequential(nn.Conv2d(channels, 32, 5, 2, 2), nn.ReLU(), nn.Conv2d(32, 64, 5, 2, 2),
                         nn.ReLU(), nn.Conv2d(64, 64, 3, 1, 1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(64 * after * after, 256), nn.ReLU(), nn.Linear(256, classes))


@FEDAVG_MODELS.register("cnn-strided-bn")
def strided_cnn_batchnorm(channels: int, size: int, classes: int) -> nn.Module:
    """`cnn-strided` with each convolution bias-free and followed by BatchNorm (Conv → BN →
    ReLU, as most image networks): the train-mode BatchNorm client of `fedavg_walk`."""
    after = ((size - 1) // 2) // 2 + 1
    layers: list[nn.Module] = []
    for c_in, c_out, kernel, stride in ((channels, 32, 5, 2), (32, 64, 5, 2), (64, 64, 3, 1)):
        layers += [nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, bias=False),
                   nn.BatchNorm2d(c_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(64 * after * after, 256), nn.ReLU(),
                         nn.Linear(256, classes))


@FEDAVG_MODELS.register("cnn-strided-gn")
def strided_cnn_groupnorm(channels: int, size: int, classes: int) -> nn.Module:
    """`cnn-strided` with GroupNorm (8 groups) between each convolution and its ReLU, as
    federated clients normalise without batch statistics (Hsieh et al., ICML 2020)."""
    after = ((size - 1) // 2) // 2 + 1
    layers: list[nn.Module] = []
    for c_in, c_out, kernel, stride in ((channels, 32, 5, 2), (32, 64, 5, 2), (64, 64, 3, 1)):
        layers += [nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2), nn.GroupNorm(8, c_out),
                   nn.ReLU()]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(64 * after * after, 256), nn.ReLU(),
                         nn.Linear(256, classes))


@FEDAVG_MODELS.register("mlp")
def mlp(channels: int, size: int, classes: int) -> nn.Module:
    """A two-layer perceptron on the flattened image (256 hidden units): its first layer's update
    spans the client's images exactly (fedavg.span)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(channels * size * size, 256), nn.ReLU(),
                         nn.Linear(256, classes))


@FEDAVG_MODELS.register("flower-cnn")
def flower_cnn(channels: int, size: int, classes: int) -> nn.Module:
    """Flower's PyTorch template CNN: 5×5 conv 6 → ReLU → 2×2 max-pool → 5×5 conv 16 → ReLU →
    max-pool → 120 → 84 → classes (28×28 digits or 32×32 photos)."""
    pooled = ((size - 4) // 2 - 4) // 2
    return nn.Sequential(nn.Conv2d(channels, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * pooled * pooled, 120), nn.ReLU(), nn.Linear(120, 84),
                         nn.ReLU(), nn.Linear(84, classes))


@FEDAVG_MODELS.register("resnet8")
def resnet8(channels: int, size: int, classes: int) -> nn.Module:
    """A CIFAR ResNet-8 as federated clients train it: Conv → BatchNorm → ReLU stem, three
    stages of one basic block (16, 32, 64 channels; the later two halve the map), global
    average pooling, Linear. Any input size; BatchNorm in train mode with `--batchnorm-train`."""
    return nn.Sequential(nn.Conv2d(channels, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                         nn.ReLU(), BasicBlock(16, 16, 1), BasicBlock(16, 32, 2),
                         BasicBlock(32, 64, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, classes))
