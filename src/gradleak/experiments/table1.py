"""`table1` (the paper's Table 1): every attack on the same held-out windows of trained PPO and
A2C victims. TRACE and LtI (the paper's learned attacks) and gradleak's feature decoder, each
trained for the same CPU budget; the training-free attack (the conv-stack recursion and the
first conv's equations, deterministic: one seed); DLG and Inverting Gradients (the victim's
exact loss, on the first held-out window, seeded); beside the mean image and mean colour."""

from __future__ import annotations

import dataclasses
from typing import Any

from gradleak.experiments.base import Cell, Context, Experiment, register_experiment
from gradleak.experiments.stages import fit_once, score_cell, trace_rows, victim_captures
from gradleak.names import FEATURE_DECODER

LEARNED = {"trace": "TRACE", "lti": "LtI", "decoder": FEATURE_DECODER}
OPTIMISED = {"dlg": "DLG", "ig": "IG"}
METHODS = [*LEARNED, "exact", *OPTIMISED]
OPTIMISED_WINDOWS = 1  # DLG and IG take seconds to minutes a frame on the CPU
EXACT_WINDOWS = 4


@register_experiment("table1")
class Table1(Experiment):
    description = __doc__.split("\n\n")[0]

    def axes(self, seeds: int) -> dict[str, list[Any]]:
        return {"victim": ["ppo", "a2c"], "method": METHODS, "seed": list(range(seeds))}

    def cells(self, seeds: int) -> list[Cell]:
        return [c for c in super().cells(seeds) if c["method"] != "exact" or c["seed"] == 0]

    def run_cell(self, cell: Cell, context: Context) -> dict[str, Any]:
        _, train, heldout = victim_captures(context, cell["victim"])
        method, preset, seed = cell["method"], context.preset, int(cell["seed"])
        if method in LEARNED:
            label = LEARNED[method]
            directory = context.out / "attackers" / cell.id
            fitted = self._fit(method, context, seed, str(train), directory)
            return {**score_cell(cell, context, heldout, train, {label: str(directory)}, label),
                    "epochs": fitted.get("epochs"), "fit_cpu_minutes": fitted.get("cpu_minutes")}
        if method == "exact":
            from gradleak.attacks.exact import NAME

            return score_cell(cell, context, heldout, train, {}, NAME,
                              baselines={NAME: preset.attack.training_free},
                              baseline_windows=EXACT_WINDOWS)
        from gradleak.attacks.optim.config import baseline_config

        config = baseline_config(method, {"ig": preset.attack.ig, "dlg": preset.attack.dlg})
        if any(f.name == "seed" for f in dataclasses.fields(config)):
            config = dataclasses.replace(config, seed=seed)
        label = OPTIMISED[method]
        return score_cell(cell, context, heldout, train, {}, label, baselines={label: config},
                          baseline_windows=OPTIMISED_WINDOWS)

    @staticmethod
    def _fit(method: str, context: Context, seed: int, train: str, directory: Any
             ) -> dict[str, Any]:
        preset = context.preset
        budget = {"seed": seed, "time_limit_minutes": context.budget_minutes,
                  "time_limit_clock": context.clock}
        if method == "decoder":
            from gradleak.training.decoder_fit import fit_decoder

            config = dataclasses.replace(preset.attack.decoder_fit, **budget)
            return fit_once(directory, lambda resume: fit_decoder(
                preset.attack.decoder, config, [train], directory, resume=resume,
                progress=context.progress))
        from gradleak.training.fit import fit_attacker

        model, fit = preset.attack.learned(method)
        config = dataclasses.replace(fit, **budget)
        return fit_once(directory, lambda resume: fit_attacker(
            method, model, config, [train], directory, resume=resume,
            progress=context.progress))

    def summarize(self, results: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
        summary, lines = trace_rows(results, ["victim", "method"], "victim | method")
        return summary, "\n".join(lines)
