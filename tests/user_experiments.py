"""An experiment a user registers in their own module (loaded with --plugin user_experiments):
cheap cells whose value depends on the cell, and a log of which cells ran."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from gradleak.experiments import Experiment, grouped, mean_std, register_experiment


def build_table(path: Path) -> None:
    """Shared work that costs CPU (0.3 s), so the runner's accounting of it can be seen."""
    start = time.process_time()
    while time.process_time() - start < 0.3:
        pass
    path.write_text(json.dumps({"a": 0, "b": 1, "c": 2}))


@register_experiment("toy")
class Toy(Experiment):
    description = "cells that cost nothing: value = 10 · setting index + seed"

    def axes(self, seeds: int) -> dict[str, list]:
        return {"setting": ["a", "b", "c"], "seed": list(range(seeds))}

    def run_cell(self, cell, context) -> dict:
        shared = context.shared("table.json", build_table, lambda path: path.exists())
        with (context.out / "ran.log").open("a") as log:
            log.write(cell.id + "\n")
        index = json.loads(Path(shared).read_text())[cell["setting"]]
        # a stand-in for the victim checkpoint: each run folder builds its own
        theta0 = hashlib.sha256(str(shared).encode()).hexdigest()
        return {"value": 10.0 * index + cell["seed"], "budget": context.budget_minutes,
                "theta0_sha256": theta0}

    def summarize(self, results: list[dict]) -> tuple[dict, str]:
        rows = {key[0]: [r["result"]["value"] for r in group]
                for key, group in grouped(results, ["setting"]).items()}
        lines = ["| setting | value |", "|---|---|"]
        lines += [f"| {k} | {mean_std(v)} |" for k, v in rows.items()]
        return {k: sum(v) / len(v) for k, v in rows.items()}, "\n".join(lines)
