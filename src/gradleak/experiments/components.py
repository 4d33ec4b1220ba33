"""`components` (the paper's Table 4 / 13 (ii)): which part of the policy gradient carries the
frames. The client's per-step gradient restricted to the CNN's parameters, the FC layer's,
the heads', or all of them, on trained PPO and A2C victims; TRACE (T = the preset's window)
trained for the same CPU budget on each and scored on held-out scenes, beside the mean image
and mean colour."""

from __future__ import annotations

from typing import Any

from gradleak.experiments.base import Cell, Context, Experiment, register_experiment
from gradleak.experiments.stages import (COMPONENTS, fit_and_score, trace_rows,
                                         victim_captures)


@register_experiment("components")
class Components(Experiment):
    description = __doc__.split("\n\n")[0]

    def axes(self, seeds: int) -> dict[str, list[Any]]:
        return {"victim": ["ppo", "a2c"], "components": list(COMPONENTS),
                "seed": list(range(seeds))}

    def run_cell(self, cell: Cell, context: Context) -> dict[str, Any]:
        _, train, heldout = victim_captures(context, cell["victim"], cell["components"])
        return fit_and_score(cell, context, train, heldout)

    def summarize(self, results: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
        summary, lines = trace_rows(results, ["victim", "components"], "victim | gradients")
        dims = {r["cell"]["components"]: r["result"]["gradient_dim"] for r in results}
        note = "Gradient entries per step: " + ", ".join(f"{k} {v}" for k, v in dims.items())
        return summary, "\n".join(lines) + "\n\n" + note
