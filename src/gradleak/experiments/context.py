"""`context` (the paper's Table 4 / 13 (i)), and where temporal context should pay. TRACE with
windows of T = 1, 8, 16, 32, 64 steps (rotary positions and half the encoder width from T = 16,
as the paper reduces it) on the trained PPO and A2C victims' clean gradients; and T = 1 against
T = 8 under noise:0.01, noise:0.1 and DP-SGD ε = 10, trained on defended gradients (adaptive)
and scored under the same defense: there each step's gradient alone leaves the frame
uncertain, which is where the paper's Theorem 4.5 says context helps. The structured gradient
encoder throughout (2.6× the epochs per CPU-minute of the dense one)."""

from __future__ import annotations

from typing import Any

from gradleak.experiments.base import Cell, Context, Experiment, register_experiment
from gradleak.experiments.stages import fit_and_score, trace_rows, victim_captures

WINDOWS = [1, 8, 16, 32, 64]
DEFENSES = ["none", "noise:0.01", "noise:0.1", "dpsgd:eps=10"]
DEFENDED_WINDOWS = (1, 8)
LONG = 16  # from here: rotary positions, half the encoder width


@register_experiment("context")
class TemporalContext(Experiment):
    description = __doc__.split("\n\n")[0]

    def axes(self, seeds: int) -> dict[str, list[Any]]:
        return {"victim": ["ppo", "a2c"], "defense": DEFENSES, "window": WINDOWS,
                "seed": list(range(seeds))}

    def cells(self, seeds: int) -> list[Cell]:
        return [cell for cell in super().cells(seeds)
                if cell["defense"] == "none" or cell["window"] in DEFENDED_WINDOWS]

    def run_cell(self, cell: Cell, context: Context) -> dict[str, Any]:
        _, train, heldout = victim_captures(context, cell["victim"])
        window = int(cell["window"])
        model = {"window": window, "projection": "structured"}
        if window >= LONG:
            model.update(rope=True, encoder_width=context.preset.attack.trace.encoder_width // 2)
        result = fit_and_score(cell, context, train, heldout, model_changes=model,
                               defense=str(cell["defense"]))
        return {**result, "model": model}

    def summarize(self, results: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
        summary, lines = trace_rows(results, ["victim", "defense", "window"],
                                    "victim | defense | T")
        verdicts = []
        for victim in sorted({r["cell"]["victim"] for r in results}):
            for defense in DEFENSES:
                pair = [summary.get(f"{victim}/{defense}/{t}", {}).get("psnr")
                        for t in DEFENDED_WINDOWS]
                if None not in pair:
                    gain = pair[1] - pair[0]
                    said = "beats" if gain > 0 else "does not beat"
                    verdicts.append(f"- {victim}, {defense}: T = 8 {said} T = 1 "
                                    f"({gain:+.2f} dB, means over seeds)")
        summary["t8_minus_t1"] = verdicts
        return summary, "\n".join(lines) + ("\n\n" + "\n".join(verdicts) if verdicts else "")
