"""Every single-step attack, registered: gradleak's own modules imported here (a plugin's
register on its own import), and how the framework finds and builds one."""

from __future__ import annotations

import time
from typing import Any

from gradleak.attacks import defense_aware as _defense_aware  # noqa: F401  (defense-aware)
from gradleak.attacks import exact as _exact  # noqa: F401  (training-free)
from gradleak.attacks.optim import solve as _solve  # noqa: F401  (gradient matching)
from gradleak.attacks.single_step import SINGLE_STEP, Attack, Context, SingleStepAttack
from gradleak.errors import ConfigError
from gradleak.threat import Observation, Reconstruction


def attack_for(settings: Any) -> SingleStepAttack:
    """The registered attack these settings belong to."""
    for name in SINGLE_STEP:
        if isinstance(settings, SINGLE_STEP.get(name).settings):
            return SINGLE_STEP.get(name)
    raise ConfigError(f"{type(settings).__name__} names no single-step attack; registered: "
                      f"{', '.join(SINGLE_STEP)}")


def choices(section: Any) -> dict[str, tuple[SingleStepAttack, Any]]:
    """Every choice a preset's attack section offers, by name: its attack and its settings."""
    offered: dict[str, tuple[SingleStepAttack, Any]] = {}
    for name in SINGLE_STEP:
        entry = SINGLE_STEP.get(name)
        for choice, settings in entry.choices(section).items():
            if choice in offered:
                raise ConfigError(f"single-step choice {choice!r} is offered by both the "
                                  f"{offered[choice][0].name} and the {name} attacks")
            offered[choice] = (entry, settings)
    return offered


def build(observation: Observation, settings: Any, context: Context | None = None) -> Attack:
    """The attack its settings name, on `observation`, refused first if it cannot run there."""
    entry = attack_for(settings)
    entry.check(settings)
    reason = entry.missing(observation)
    if reason:
        raise ConfigError(reason)
    return entry.build(observation, settings, context or Context())


def run(observation: Observation, settings: Any, context: Context | None = None
        ) -> tuple[Reconstruction, float]:
    """The attack its settings name, run on `observation`: its result, checked to hold what
    the tables read, and the seconds it took."""
    attack = build(observation, settings, context)
    start = time.perf_counter()
    result = attack.reconstruct()
    return attack_for(settings).returned(result, observation), time.perf_counter() - start
