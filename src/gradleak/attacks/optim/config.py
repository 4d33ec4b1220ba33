"""The optimisation baselines' settings: one `OptimConfig` per gradient-matching attack, DLG and IG
as their papers ran them, and the named baselines (`BASELINES`) built from them."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from gradleak.attacks.optim.matching import MatchingConfig
from gradleak.errors import ConfigError
from gradleak.registry import Registry

OPTIMISERS = ("adam", "lbfgs")



ACTIONS = ("rule", "soft")



@dataclass
class OptimConfig:
    """One gradient-matching attack. Defaults are IG as the paper ran it."""

    optimiser: str = "adam"
    iterations: int = 4800
    lr: float = 0.1
    signed: bool = True  # inversefed's signed Adam gradients
    lr_decay: bool = True  # ×0.1 at 3/8, 5/8 and 7/8 of the iterations
    action: str = "rule"  # closed-form (odd-sign rule) or a jointly optimised soft action
    restarts: int = 1
    batch: int = 32  # problems (frames × restarts) solved together
    history: int = 100  # L-BFGS memory
    time_limit_s: float | None = None  # per batch of problems: stop there, keep where it got
    seed: int = 0
    snapshots: int = 0  # images kept along the way, for the optimisation-history figure
    matching: MatchingConfig = field(default_factory=lambda: MatchingConfig(tv=0.1))

    def check(self) -> None:
        self.matching.check()
        if self.optimiser not in OPTIMISERS:
            raise ConfigError(f"optimiser {self.optimiser!r}: expected one of "
                              f"{', '.join(OPTIMISERS)}")
        if self.action not in ACTIONS:
            raise ConfigError(f"action {self.action!r}: expected one of {', '.join(ACTIONS)}")
        for name in ("iterations", "restarts", "batch", "history"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} {getattr(self, name)}: expected >= 1")
        if self.lr <= 0:
            raise ConfigError(f"lr {self.lr}: expected > 0")



def inverting_gradients() -> OptimConfig:
    """Geiping et al.: Adam 0.1 (signed), cosine distance, TV 0.1, [0, 1] box, 4,800 steps."""
    return OptimConfig()



def deep_leakage() -> OptimConfig:
    """Zhu et al.: L-BFGS lr 1, squared L2, soft action, no prior, no box. Their 300
    `optimizer.step` calls each run torch's default 20 L-BFGS iterations: 6,000 in all."""
    return OptimConfig(optimiser="lbfgs", iterations=6000, lr=1.0, signed=False,
                       lr_decay=False, action="soft",
                       matching=MatchingConfig(distance="l2", tv=0.0, box="none"))



FAMILIES: dict[str, Callable[[], OptimConfig]] = {"ig": inverting_gradients,
                                                   "dlg": deep_leakage}



@dataclass(frozen=True)
class Baseline:
    family: str  # which preset config it starts from: "ig" or "dlg"
    loss: str  # the dummy loss: "victim", or the public code's "probe"



BASELINES: Registry[Baseline] = Registry("optimisation baseline")
for _family in FAMILIES:
    BASELINES.register(_family)(Baseline(_family, "victim"))
    BASELINES.register(f"{_family}-probe")(Baseline(_family, "probe"))



def baseline_config(name: str, families: dict[str, OptimConfig] | None = None,
                    iterations: int | None = None, **overrides: Any) -> OptimConfig:
    """The named baseline, starting from a preset's IG/DLG settings when `families` gives them."""
    entry = BASELINES.get(name)
    base = (families or {}).get(entry.family)
    config = copy.deepcopy(base) if base is not None else FAMILIES[entry.family]()
    config.matching.loss = entry.loss
    if iterations is not None:
        config.iterations = iterations
    return replace(config, **overrides)
