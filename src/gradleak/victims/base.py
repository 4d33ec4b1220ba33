"""What every victim shares: config, component tags, the flat gradient layout."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.registry import Registry

COMPONENTS = ("cnn", "fc", "heads")


@dataclass
class VictimConfig:
    """The architecture the attacker is told about (white-box threat model)."""

    name: str
    frame_size: int = 64
    num_actions: int = 5
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "victim config") -> VictimConfig:
        missing = {"name", "frame_size", "num_actions"} - set(data)
        if missing:
            raise ConfigError(f"{source}: missing field(s) {', '.join(sorted(missing))}")
        return cls(name=str(data["name"]), frame_size=int(data["frame_size"]),
                   num_actions=int(data["num_actions"]), options=dict(data.get("options", {})))


@dataclass(frozen=True)
class LayerInfo:
    """One parameter tensor's slice of the flat gradient vector."""

    name: str
    shape: tuple[int, ...]
    offset: int
    component: str

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def layers_to_json(layers: list[LayerInfo]) -> str:
    return json.dumps([{"name": layer.name, "shape": list(layer.shape), "offset": layer.offset,
                        "component": layer.component} for layer in layers])


def layers_from_json(text: str) -> list[LayerInfo]:
    rows: list[dict[str, Any]] = json.loads(text)
    return [LayerInfo(row["name"], tuple(row["shape"]), int(row["offset"]), row["component"])
            for row in rows]


class Victim(nn.Module):
    """obs → (logits, value).

    Contract every attack relies on: `policy_head` is an nn.Linear on ReLU features, the policy
    and value heads share no parameters, and `component_of` tags every parameter.
    """

    config: VictimConfig
    policy_head: nn.Linear
    value_head: nn.Linear
    component_prefixes: dict[str, str] = {}

    def forward(self, image: torch.Tensor, goal: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def component_of(self, parameter_name: str) -> str:
        for prefix, component in self.component_prefixes.items():
            if parameter_name.startswith(prefix):
                return component
        raise ConfigError(f"parameter {parameter_name} of victim {self.config.name} has no "
                          "component tag")

    @staticmethod
    def prepare_image(image: torch.Tensor) -> torch.Tensor:
        """(B, H, W, 3) uint8 or float in [0, 255] → (B, 3, H, W) float in [0, 1]."""
        return image.permute(0, 3, 1, 2).to(torch.float32) / 255.0


VICTIMS: Registry[type[Victim]] = Registry("victim")
register_victim = VICTIMS.register


def create_victim(config: VictimConfig | str, **kwargs: Any) -> Victim:
    if isinstance(config, str):
        config = VictimConfig(name=config, **kwargs)
    return VICTIMS.get(config.name)(config)


def layer_table(victim: Victim, components: tuple[str, ...] = COMPONENTS) -> list[LayerInfo]:
    """The layout of a flat gradient holding the chosen components, in parameter order."""
    for component in components:
        if component not in COMPONENTS:
            raise ConfigError(f"component {component!r}: expected some of {', '.join(COMPONENTS)}")
    table, offset = [], 0
    for name, parameter in victim.named_parameters():
        component = victim.component_of(name)
        if component in components:
            table.append(LayerInfo(name, tuple(parameter.shape), offset, component))
            offset += parameter.numel()
    return table
