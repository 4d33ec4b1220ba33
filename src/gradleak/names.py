"""One name per thing, for the command line, the tables and the docs (docs/cli.md, "Names").

- **training-free**: the attack that needs no training, only θ0 and the gradient (the conv stack
  walked down, then the first conv's own equations, or a ViT's patch embedding). It is exact
  only where those equations determine the frame; elsewhere a prior decides, so "exact" is not
  its name. Its settings are `attack.training_free`.
- **closed form**: what the gradient gives without any solve or prior: the inputs of biased
  Linear layers, π, V, the action, A and R (`gradleak closed-form`).
- **learned prior**: the network fitted on the training-free attack's own frames of auxiliary
  captures and applied after it (`gradleak train-prior`, `attack.prior`, `attack.prior_fit`,
  and the checkpoint path `attack.training_free.prior`).
- **feature decoder**: a network trained on auxiliary frames that maps θ0's conv features,
  recovered from the gradient, to the frame (`gradleak train-decoder`, `attack.decoder`).

The old spellings stay accepted where a user may have scripts or saved files: the aliases
below map each to its name.
"""

from __future__ import annotations

from typing import Any

TRAINING_FREE = "training-free"
WITH_PRIOR = "training-free + learned prior"
DEFENSE_AWARE = "training-free (defense-aware)"
FEATURE_DECODER = "feature decoder"

# table and report rows written before the names were settled → their names now
DISPLAY_ALIASES = {"exact (training-free)": TRAINING_FREE, "exact + learned prior": WITH_PRIOR,
                   "exact (defense-aware)": DEFENSE_AWARE, "analytic decoder": FEATURE_DECODER}
# benchmark labels that began with the feature decoder's old name
DISPLAY_PREFIXES = {"analytic+conv-stack decoder": FEATURE_DECODER + " (conv stack)",
                    "analytic+decoder": FEATURE_DECODER}
# single-step methods (`gradleak attack METHOD`, `evaluate --baselines`)
METHOD_ALIASES = {"exact": TRAINING_FREE}
# commands
COMMAND_ALIASES = {"closed-form": ["analytic"]}
# preset sections (`--set SECTION.FIELD=...`, a saved config.json's keys)
SECTION_ALIASES = {"attack.exact": "attack.training_free", "attack.refiner": "attack.prior",
                   "attack.refiner_fit": "attack.prior_fit"}
# the frame solve's settings (inversion.frame_solve.FrameSolve), once restated one by one in the
# training-free attack's section and now nested there as `solve`
SOLVE_FIELDS = ("smoothness", "iterations", "rounds", "round_iterations", "edge_scale",
                "inequalities", "precision", "chroma", "colour_power")


def display(name: str) -> str:
    """A method's row name as the tables print it now (old result files keep old names)."""
    if name in DISPLAY_ALIASES:
        return DISPLAY_ALIASES[name]
    for old, new in DISPLAY_PREFIXES.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def method(name: str) -> str:
    """A single-step method named on the command line, old spellings accepted."""
    return METHOD_ALIASES.get(name, name)


def section_path(path: str) -> str:
    """`attack.exact.prior` → `attack.training_free.prior`, `attack.exact.rounds` →
    `attack.training_free.solve.rounds`; other paths unchanged."""
    for old, new in SECTION_ALIASES.items():
        if path == old or path.startswith(old + "."):
            path = new + path[len(old):]
            break
    section, _, name = path.rpartition(".")
    return f"{section}.solve.{name}" if section == "attack.training_free" \
        and name in SOLVE_FIELDS else path


def renamed_sections(attack: dict[str, Any]) -> dict[str, Any]:
    """A saved config's `attack` object with the names of now: its sections renamed, and the
    frame solve's settings moved into `training_free.solve`."""
    attack = {section_path(f"attack.{key}").removeprefix("attack."): value
              for key, value in attack.items()}
    free = attack.get("training_free")
    if isinstance(free, dict) and any(name in free for name in SOLVE_FIELDS):
        solve = {name: free.pop(name) for name in SOLVE_FIELDS if name in free}
        free["solve"] = {**solve, **(free.get("solve") or {})}
    return attack
