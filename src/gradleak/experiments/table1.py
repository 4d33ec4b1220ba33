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
from gradleak.names import FEATURE_DECODER, TRAINING_FREE

LEARNED = {"trace": "TRACE", "lti": "LtI", "decoder": FEATURE_DECODER}
OPTIMISED = ("dlg", "ig")  # single-step attacks by their registered names
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
        from gradleak.attacks.catalogue import choices

        name = method if method in OPTIMISED else TRAINING_FREE  # the cell key "exact"
        attack, config = choices(preset.attack)[name]
        if attack.kind == "optimisation":
            config = dataclasses.replace(config, seed=seed)
        label = attack.label(name, config)
        windows = OPTIMISED_WINDOWS if attack.kind == "optimisation" else EXACT_WINDOWS
        return score_cell(cell, context, heldout, train, {}, label, baselines={label: config},
                          baseline_windows=windows)

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
