"""`losses` (the paper's Table 4 / 13 (iii)): what each term of TRACE's loss contributes. TRACE
trained for the same CPU budget with its full loss, and without MSE, L1, the action
cross-entropy, LPIPS or the rollout term, on trained PPO and A2C victims' full gradients,
scored on held-out scenes beside the mean image and mean colour."""

from __future__ import annotations

import dataclasses
from typing import Any

from gradleak.experiments.base import Cell, Context, Experiment, register_experiment
from gradleak.experiments.stages import fit_and_score, trace_rows, victim_captures

# the paper's names → LossWeights fields
TERMS = {"none": None, "mse": "mse", "l1": "l1", "action": "action", "lpips": "perceptual",
         "rollout": "rollout"}


@register_experiment("losses")
class Losses(Experiment):
    description = __doc__.split("\n\n")[0]

    def axes(self, seeds: int) -> dict[str, list[Any]]:
        return {"victim": ["ppo", "a2c"], "without": list(TERMS), "seed": list(range(seeds))}

    def run_cell(self, cell: Cell, context: Context) -> dict[str, Any]:
        _, train, heldout = victim_captures(context, cell["victim"])
        weights = context.preset.attack.trace_fit.weights
        field = TERMS[cell["without"]]
        if field is not None:
            weights = dataclasses.replace(weights, **{field: 0.0})
        result = fit_and_score(cell, context, train, heldout, weights=weights)
        return {**result, "weights": weights.to_dict()}

    def summarize(self, results: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
        summary, lines = trace_rows(results, ["victim", "without"], "victim | without")
        return summary, "\n".join(lines)
