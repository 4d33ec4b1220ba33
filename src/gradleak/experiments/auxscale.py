"""`auxscale` (the paper's Table 12): how much auxiliary data the attacker needs. TRACE trained
on 10, 30, 50, 70, 90 and 100% of the training-scene episodes (nested subsets drawn once per
seed; the validation episodes stay the same), on trained PPO and A2C victims' full gradients,
each for the same CPU budget, scored on held-out scenes beside the mean image and mean
colour."""

from __future__ import annotations

from typing import Any

from gradleak.experiments.base import Cell, Context, Experiment, register_experiment
from gradleak.experiments.stages import fit_and_score, trace_rows, victim_captures

FRACTIONS = [0.1, 0.3, 0.5, 0.7, 0.9, 1.0]


@register_experiment("auxscale")
class AuxiliaryScale(Experiment):
    description = __doc__.split("\n\n")[0]

    def axes(self, seeds: int) -> dict[str, list[Any]]:
        return {"victim": ["ppo", "a2c"], "fraction": FRACTIONS, "seed": list(range(seeds))}

    def run_cell(self, cell: Cell, context: Context) -> dict[str, Any]:
        _, train, heldout = victim_captures(context, cell["victim"])
        return fit_and_score(cell, context, train, heldout,
                             train_episode_fraction=float(cell["fraction"]))

    def summarize(self, results: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
        summary, lines = trace_rows(results, ["victim", "fraction"], "victim | episodes")
        return summary, "\n".join(lines)
