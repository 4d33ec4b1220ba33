"""A Flower app as a user writes it (Flower 1.42's Message API, its PyTorch template's CNN and
Normalize(0.5, 0.5)), with gradleak's AuditStrategy around its FedAvg. No gradleak code runs
on the clients."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from torch import nn



class Net(nn.Module):
    """Flower's template CNN, sized for 1×16×16 inputs."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 5)
        self.bn1 = nn.BatchNorm2d(4) if batchnorm else nn.Identity()
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(4 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class BatchNormNet(Net):
    def __init__(self) -> None:
        super().__init__(batchnorm=True)


class SigmoidNet(nn.Module):
    """DLG's kind of tiny CNN: sigmoids, strided convolutions, U(−0.5, 0.5) weights."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 6, 5, stride=2, padding=2), nn.Sigmoid(),
                                      nn.Conv2d(6, 6, 5, stride=2, padding=2), nn.Sigmoid())
        self.classifier = nn.Linear(6 * 4 * 4, 10)
        for parameter in self.parameters():
            nn.init.uniform_(parameter, -0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def normalize(images: torch.Tensor) -> torch.Tensor:
    return (images - 0.5) / 0.5


def partition(pid: int, count: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The client's private data: smooth 16×16 images, seeded by the partition id."""
    generator = torch.Generator().manual_seed(100 + pid)
    coarse = torch.rand(count, 1, 4, 4, generator=generator)
    images = F.interpolate(coarse, size=(16, 16), mode="bilinear", align_corners=False)
    return images, torch.randint(0, 10, (count,), generator=generator)


def local_training(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, lr: float,
                   seed: int, epochs: int = 2, batch: int = 2) -> float:
    model.train()
    optimiser = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    loss = torch.zeros(())
    for _ in range(epochs):
        order = torch.randperm(len(images), generator=generator)
        for start in range(0, len(images), batch):
            index = order[start:start + batch]
            optimiser.zero_grad()
            loss = F.cross_entropy(model(normalize(images[index])), labels[index])
            loss.backward()
            optimiser.step()
    return float(loss.detach())


def client_app(model_class: type[nn.Module] = Net, mods: list | None = None, count: int = 2,
               epochs: int = 2, batch: int = 2) -> ClientApp:
    app = ClientApp(mods=mods or [])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = model_class()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        pid = int(context.node_config["partition-id"])
        images, labels = partition(pid, count)
        loss = local_training(model, images, labels, float(msg.content["config"]["lr"]),
                              seed=pid, epochs=epochs, batch=batch)
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                              "metrics": MetricRecord({"train_loss": loss,
                                                       "num-examples": len(images)})})
        return Message(content=content, reply_to=msg)

    return app


def server_app(strategy_fn, model_class: type[nn.Module] = Net, rounds: int = 1,
               lr: float = 0.05) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = strategy_fn(FedAvg(fraction_train=1.0, fraction_evaluate=0.0))
        torch.manual_seed(0)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(model_class().state_dict()),
                       num_rounds=rounds, train_config=ConfigRecord({"lr": lr}))

    return app
