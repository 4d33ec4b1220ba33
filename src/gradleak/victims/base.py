"""What every victim shares: config, component tags, the flat gradient layout."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.registry import Registry
from gradleak.victims.roles import Roles, discover
from gradleak.victims.transform import InputTransform

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
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected an object, found {type(data).__name__}")
        missing = {"name", "frame_size", "num_actions"} - set(data)
        if missing:
            raise ConfigError(f"{source}: missing field(s) {', '.join(sorted(missing))}")
        for key in ("frame_size", "num_actions"):
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{source}: field {key!r} is {value!r}, expected a positive "
                                  "integer")
        if not isinstance(data["name"], str) or not isinstance(data.get("options", {}), dict):
            raise ConfigError(f"{source}: field 'name' must be a string and 'options' an object")
        return cls(name=data["name"], frame_size=data["frame_size"],
                   num_actions=data["num_actions"], options=dict(data.get("options", {})))


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
    """Raises ValueError, TypeError or KeyError on a malformed table; readers name the file."""
    rows: list[dict[str, Any]] = json.loads(text)
    if not isinstance(rows, list):
        raise TypeError("not a list")
    layers = []
    for row in rows:
        shape = tuple(int(n) for n in row["shape"])
        if not isinstance(row["name"], str) or any(n < 0 for n in shape):
            raise ValueError(f"entry {row!r}")
        layers.append(LayerInfo(row["name"], shape, int(row["offset"]), str(row["component"])))
    return layers


class Victim(nn.Module):
    """frames (and a goal, a pre-step state) → (logits, value).

    A victim names its two Linear heads (and the layers reading a recurrent state or a goal);
    `roles()` finds the rest with one forward pass (gradleak.victims.roles), and attacks read
    only those roles. `component_of` tags every parameter.
    """

    config: VictimConfig
    policy_head_role = "policy_head"
    value_head_role = "value_head"
    recurrent_state_role: str | None = None
    goal_input_role: str | None = None
    component_prefixes: dict[str, str] = {}
    recurrent = False  # carries a hidden state through the episode (victims/recurrent.py)
    extra_inputs: tuple[str, ...] = ()  # private inputs beside the frame, e.g. ("goal",)

    def features(self, image: torch.Tensor, goal: torch.Tensor | None = None) -> torch.Tensor:
        """h(s): what both heads read."""
        raise NotImplementedError

    def forward(self, image: torch.Tensor, goal: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden`: a recurrent victim's pre-step state (a detached input); others ignore it."""
        h = self.features(image, goal)
        return self.policy_head(h), self.value_head(h).squeeze(-1)

    def initial_state(self, batch: int) -> torch.Tensor | None:
        """The state an episode starts from: None for a feed-forward victim."""
        return None

    def advance(self, image: torch.Tensor, goal: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(logits, value, next state) of one step: what a rollout needs."""
        logits, values = self(image, goal, hidden)
        return logits, values, None

    @property
    def hidden_size(self) -> int:
        return 0

    @property
    def label(self) -> str:
        """How messages name it (the walk's `inversion.network.Network`)."""
        return f"victim {self.config.name}"

    @classmethod
    def rebuildable(cls, config: VictimConfig) -> bool:
        """Can `create_victim(config)` rebuild it here (a wrapped model needs its factory)?"""
        return True

    def component_of(self, parameter_name: str) -> str:
        for prefix, component in self.component_prefixes.items():
            if parameter_name.startswith(prefix):
                return component
        if not self.component_prefixes:
            return self.roles().component_of(parameter_name)
        raise ConfigError(f"parameter {parameter_name} of victim {self.config.name} has no "
                          "component tag")

    @property
    def input_transform(self) -> InputTransform:
        """Stored frames → network input: square RGB frames divided by 255 unless a victim
        says otherwise."""
        return InputTransform(self.config.frame_size, self.config.frame_size)

    def prepare_image(self, image: torch.Tensor) -> torch.Tensor:
        """(B, H, W, C) uint8 or float in frame units → (B, C, H, W) network input."""
        return self.input_transform.apply(image)

    def example_inputs(self, batch: int = 4, seed: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Random frames (and goals, states) of the right shape: the input of `roles()`."""
        generator = torch.Generator().manual_seed(seed)
        frames = torch.randint(0, 256, (batch, *self.input_transform.frame_shape),
                               generator=generator, dtype=torch.uint8)
        goals = torch.rand(batch, 3, generator=generator) if "goal" in self.extra_inputs \
            else None
        hidden = torch.rand(batch, self.hidden_size, generator=generator) - 0.5 \
            if self.recurrent else None
        return frames, goals, hidden

    def roles(self) -> Roles:
        """The roles every attack reads (found once, on example inputs, in eval mode)."""
        cached = self.__dict__.get("_roles")
        if cached is None:
            frames, goals, hidden = self.example_inputs()
            if next(self.parameters()).dtype == torch.float64:  # e.g. the recursion's copy
                frames, goals, hidden = (None if x is None else x.double()
                                         for x in (frames, goals, hidden))
            mode = self.training
            self.eval()
            try:
                cached = discover(self, lambda: self(frames, goals, hidden), frames,
                                  self.input_transform, policy_head=self.policy_head_role,
                                  value_head=self.value_head_role,
                                  recurrent_state=self.recurrent_state_role,
                                  goal_input=self.goal_input_role,
                                  extra_inputs=tuple(self.extra_inputs))
            finally:
                self.train(mode)
            self.__dict__["_roles"] = cached
        return cached


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


def side_by_side(layers: list[LayerInfo] | tuple[LayerInfo, ...]) -> list[LayerInfo]:
    """The layers with offsets counted from 0, in order: the table of a gradient holding just
    their columns (a component's cut, a file's unfactored columns)."""
    table, offset = [], 0
    for layer in layers:
        table.append(LayerInfo(layer.name, layer.shape, offset, layer.component))
        offset += layer.size
    return table


def rebuildable(config: VictimConfig) -> bool:
    return config.name in VICTIMS and VICTIMS.get(config.name).rebuildable(config)


def victim_at_theta0(observation: Any) -> Victim:
    """The victim of an observation (`gradleak.threat.Observation`: its config and θ0), in eval
    mode: the white-box model every attack that runs the network rebuilds."""
    if not observation.theta0:
        raise ConfigError("this attack needs θ0: read the observation with with_theta0=True "
                          "(the capture stores it in its 'theta0' group)")
    victim = create_victim(observation.victim)
    state = {name: torch.as_tensor(np.asarray(value)) for name, value in
             observation.theta0.items()}
    missing, unexpected = victim.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"θ0 does not fit victim {observation.victim.name}: missing "
                          f"{missing[:3]}, unexpected {unexpected[:3]}")
    if getattr(observation, "roles", None) is not None:  # the capture's roles are the ones read
        victim.__dict__["_roles"] = observation.roles  # (kept through .double())
    return victim.eval()
