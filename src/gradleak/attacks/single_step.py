"""Single-step attacks: frames and actions from each step's gradient, one registry for all.

An attack is one module and one decorator: `@single_step(...)` on the function that builds it
declares its name, its settings class, the kind its rows have in every table, what it reads of
the threat model (`needs`, checked here before any compute, as LeakPro checks an attack's
requirements) and the choices a preset offers of it. The audit, `evaluate --baselines`,
`gradleak attack` and the experiments reach every single-step attack through this registry,
by way of `attacks.catalogue`, which imports the modules that register gradleak's own.

The learned attackers are the other kind: `training.checkpoint.MODELS` and `training.fit`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gradleak.errors import ConfigError
from gradleak.registry import Registry
from gradleak.threat import Observation, Reconstruction
from gradleak.victims.base import create_victim


class Attack(Protocol):
    def reconstruct(self) -> Reconstruction: ...


@dataclass(frozen=True)
class Context:
    """What the framework hands an attack beside the observation: whether to report progress,
    and the learned prior its settings name, loaded and checked against θ0 by the caller."""

    progress: bool = False
    prior: Any = None


def _every_layer(observation: Observation) -> bool:
    held = {layer.name for layer in observation.layers}
    return all(name in held for name, _ in create_victim(observation.victim).named_parameters())


# what an attack may read of the threat model: its description, and whether an observation
# holds it (the per-step gradients and the architecture every observation has)
CAPABILITIES: dict[str, tuple[str, Callable[[Observation], bool]]] = {
    "theta0": ("θ0, the parameters the server broadcast", lambda o: bool(o.theta0)),
    "loss": ("the declared loss coefficients (value, entropy)",
             lambda o: {"value", "entropy"} <= set(o.hyperparameters)),
    "every layer": ("every parameter's gradient (a capture of every component)", _every_layer),
    "declared defense": ("a defense the stream went through, declared (its kind and parameters, "
                         "as a capture `gradleak defend` wrote holds them)",
                         lambda o: bool(o.defense)),
}
KINDS = ("training-free", "optimisation")


@dataclass(frozen=True)
class SingleStepAttack:
    name: str
    build: Callable[[Observation, Any, Context], Attack]
    settings: type  # its settings class: each settings object names its attack
    kind: str  # its rows' kind in the tables (KINDS)
    needs: tuple[str, ...]  # of CAPABILITIES
    # a preset's attack section → {choice name: settings} (`--baselines`, `gradleak attack`)
    choices: Callable[[Any], dict[str, Any]]
    # its row name in the tables for a choice and its settings
    label: Callable[[str, Any], str] = lambda choice, settings: choice
    # why it cannot run on this observation beyond `needs` (its architecture, its defense)
    refuses: Callable[[Observation], str | None] = lambda observation: None
    # the learned prior's directory its settings name ("": none), which the framework loads
    prior: Callable[[Any], str] = lambda settings: ""

    def missing(self, observation: Observation) -> str | None:
        """Why it cannot run on `observation` (what it needs and does not get), or None."""
        lacking = [CAPABILITIES[need][0] for need in self.needs
                   if not CAPABILITIES[need][1](observation)]
        if lacking:
            return f"the {self.name} attack reads {'; '.join(lacking)}: the observation has none"
        return self.refuses(observation)

    def returned(self, result: Reconstruction, observation: Observation) -> Reconstruction:
        """Its result, checked to hold what every table reads (an action and a uint8 frame of
        the stored shape per step), before anything is scored or written."""
        steps, shape = len(observation), tuple(observation.roles.transform.frame_shape)
        images, actions = result.images, result.actions
        problem = None
        if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or \
                images.shape[:1] + images.shape[-3:] != (steps, *shape):
            problem = (f"images {getattr(images, 'dtype', type(images).__name__)} "
                       f"{getattr(images, 'shape', '')}, expected uint8 ({steps}, "
                       f"{', '.join(map(str, shape))})")
        elif np.shape(actions) != (steps,):
            problem = f"actions of shape {np.shape(actions)}, expected ({steps},)"
        if problem:
            raise ConfigError(f"the {self.name} attack returned {problem}")
        return result

    def check(self, settings: Any) -> None:
        if not isinstance(settings, self.settings):
            raise ConfigError(f"the {self.name} attack takes {self.settings.__name__} settings, "
                              f"not {type(settings).__name__}")
        settings.check()


SINGLE_STEP: Registry[SingleStepAttack] = Registry("single-step attack")


def single_step(name: str, settings: type, kind: str, needs: tuple[str, ...],
                choices: Callable[[Any], dict[str, Any]], **optional: Any
                ) -> Callable[[Callable[[Observation, Any, Context], Attack]],
                              Callable[[Observation, Any, Context], Attack]]:
    """Registers the decorated builder `(observation, settings, context) -> attack`."""
    if kind not in KINDS:
        raise ConfigError(f"single-step attack {name!r}: kind {kind!r}, expected one of "
                          f"{', '.join(KINDS)}")
    unknown = sorted(set(needs) - set(CAPABILITIES))
    if unknown:
        raise ConfigError(f"single-step attack {name!r} needs {', '.join(unknown)}: expected "
                          f"some of {', '.join(CAPABILITIES)}")
    if not dataclasses.is_dataclass(settings):  # saved as JSON beside every result
        raise ConfigError(f"single-step attack {name!r}: its settings {settings.__name__} must "
                          "be a dataclass")
    taken = [entry for entry in map(SINGLE_STEP.get, SINGLE_STEP) if entry.settings is settings]
    if taken and taken[0].name != name:
        raise ConfigError(f"settings {settings.__name__} already name the {taken[0].name} attack")

    def register(build: Callable[[Observation, Any, Context], Attack]
                 ) -> Callable[[Observation, Any, Context], Attack]:
        SINGLE_STEP.register(name)(SingleStepAttack(name, build, settings, kind, needs, choices,
                                                    **optional))
        return build

    return register
