"""`fewshot` (the paper's Tables 2 and 8): how fast a TRACE attacker adapts to unseen scenes.
TRACE trained on the training scenes for the budget (one per victim and seed), then fine-tuned
for the budget on 10 to 50% of the episodes of a second held-out-scene capture (other episodes
of the same held-out scenes, drawn with another seed, so disjoint from the evaluation windows;
0% is the attacker as trained), on trained PPO and A2C victims, scored on the held-out
evaluation capture beside the mean image and mean colour."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from gradleak.experiments.base import Cell, Context, Experiment, register_experiment
from gradleak.experiments.stages import (capture, fit_once, score_cell, trace_rows,
                                         victim_captures)

PERCENTS = [0, 10, 20, 30, 40, 50]
FINETUNE_SEED_OFFSET = 1000  # the fine-tuning capture's episodes differ from the evaluation's


@register_experiment("fewshot")
class FewShot(Experiment):
    description = __doc__.split("\n\n")[0]

    def axes(self, seeds: int) -> dict[str, list[Any]]:
        return {"victim": ["ppo", "a2c"], "percent": PERCENTS, "seed": list(range(seeds))}

    def run_cell(self, cell: Cell, context: Context) -> dict[str, Any]:
        from gradleak.training.fit import fit_attacker

        algorithm, seed = cell["victim"], int(cell["seed"])
        victim, train, heldout = victim_captures(context, algorithm)
        preset = context.preset
        budget = {"seed": seed, "time_limit_minutes": context.budget_minutes,
                  "time_limit_clock": context.clock}
        base = self._base(context, algorithm, seed, train, budget)
        percent = int(cell["percent"])
        if percent == 0:
            return score_cell(cell, context, heldout, train, {"TRACE": str(base)}, "TRACE")
        finetune = capture(context, victim, algorithm, "all", "heldout",
                           seed_offset=FINETUNE_SEED_OFFSET, tag="-finetune")
        config = dataclasses.replace(preset.attack.trace_fit, **budget, init_from=str(base),
                                     data_split="heldout",
                                     train_episode_fraction=percent / 100,
                                     teacher_forcing_epochs=0)
        directory = context.out / "attackers" / cell.id
        fitted = fit_once(directory, lambda resume: fit_attacker(
            "trace", preset.attack.trace, config, [str(finetune)], directory, resume=resume,
            progress=context.progress))
        return {**score_cell(cell, context, heldout, train, {"TRACE": str(directory)}, "TRACE"),
                "finetune_windows": fitted.get("train_windows"),
                "fit_cpu_minutes": fitted.get("cpu_minutes")}

    @staticmethod
    def _base(context: Context, algorithm: str, seed: int, train: Path,
              budget: dict[str, Any]) -> Path:
        """The attacker trained on the training scenes, once per victim and seed."""
        from gradleak.experiments.base import locked
        from gradleak.training.fit import fit_attacker

        directory = context.out / "base" / f"{algorithm}-seed{seed}"
        directory.parent.mkdir(parents=True, exist_ok=True)
        with locked(directory.with_name(f".{directory.name}.lock")):
            config = dataclasses.replace(context.preset.attack.trace_fit, **budget)
            fit_once(directory, lambda resume: fit_attacker(
                "trace", context.preset.attack.trace, config, [str(train)], directory,
                resume=resume, progress=context.progress))
        return directory

    def summarize(self, results: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
        summary, lines = trace_rows(results, ["victim", "percent"], "victim | fine-tuned on %")
        return summary, "\n".join(lines)
