"""`context` (the paper's Table 4 / 13 (i)), and where temporal context should pay. TRACE with
windows of T = 1, 8, 16, 32, 64 steps (rotary positions and half the encoder width from T = 16,
as the paper reduces it) on the trained PPO and A2C victims' clean gradients; and T = 1 against
T = 8 under noise:0.01, noise:0.1 and DP-SGD ε = 10, trained on defended gradients (adaptive)
and scored under the same defense: there each step's gradient alone leaves the frame
uncertain, which is where the paper's Theorem 4.5 says context helps. The structured gradient
encoder throughout (2.6× the epochs per CPU-minute of the dense one). Under the same defenses,
gradleak's feature decoder without context (T = 1) against its motion-aware context (T = 8:
the previous reconstruction moved by the recovered action), also trained on defended
gradients."""

from __future__ import annotations

import dataclasses
from typing import Any

from gradleak.experiments.base import Cell, Context, Experiment, register_experiment
from gradleak.experiments.stages import (fit_and_score, fit_once, score_cell, trace_rows,
                                         victim_captures)
from gradleak.names import FEATURE_DECODER

WINDOWS = [1, 8, 16, 32, 64]
DEFENSES = ["none", "noise:0.01", "noise:0.1", "dpsgd:eps=10"]
DEFENDED_WINDOWS = (1, 8)
LONG = 16  # from here: rotary positions, half the encoder width
ATTACKERS = ["trace", "decoder"]
DECODER_CONTEXT = {1: "none", 8: "warp"}  # the decoder's "window": without and with context


@register_experiment("context")
class TemporalContext(Experiment):
    description = __doc__.split("\n\n")[0]

    def axes(self, seeds: int) -> dict[str, list[Any]]:
        return {"victim": ["ppo", "a2c"], "defense": DEFENSES, "attacker": ATTACKERS,
                "window": WINDOWS, "seed": list(range(seeds))}

    def cells(self, seeds: int) -> list[Cell]:
        return [cell for cell in super().cells(seeds)
                if (cell["defense"] == "none" and cell["attacker"] == "trace")
                or (cell["defense"] != "none" and cell["window"] in DEFENDED_WINDOWS)]

    def run_cell(self, cell: Cell, context: Context) -> dict[str, Any]:
        _, train, heldout = victim_captures(context, cell["victim"])
        if cell["attacker"] == "decoder":
            return self._decoder_cell(cell, context, train, heldout)
        window = int(cell["window"])
        model = {"window": window, "projection": "structured"}
        if window >= LONG:
            model.update(rope=True, encoder_width=context.preset.attack.trace.encoder_width // 2)
        result = fit_and_score(cell, context, train, heldout, model_changes=model,
                               defense=str(cell["defense"]))
        return {**result, "model": model}

    @staticmethod
    def _decoder_cell(cell: Cell, context: Context, train: Any, heldout: Any
                      ) -> dict[str, Any]:
        """The feature decoder, fitted on the defended gradients of the training capture's
        own frames (no rendered frames: they have no gradient to defend)."""
        from gradleak.training.decoder_fit import fit_decoder

        preset, defense = context.preset, str(cell["defense"])
        model = dataclasses.replace(preset.attack.decoder,
                                    context=DECODER_CONTEXT[int(cell["window"])])
        config = dataclasses.replace(preset.attack.decoder_fit, seed=int(cell["seed"]),
                                     time_limit_minutes=context.budget_minutes,
                                     time_limit_clock=context.clock, defense=defense,
                                     extra_frames=0)
        directory = context.out / "attackers" / cell.id
        fitted = fit_once(directory, lambda resume: fit_decoder(
            model, config, [str(train)], directory, resume=resume, progress=context.progress))
        label = FEATURE_DECODER
        return {**score_cell(cell, context, heldout, train, {label: str(directory)}, label,
                             defense=defense),
                "epochs": fitted.get("epochs"), "fit_cpu_minutes": fitted.get("cpu_minutes"),
                "model": {"context": model.context}}

    def summarize(self, results: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
        summary, lines = trace_rows(results, ["victim", "defense", "attacker", "window"],
                                    "victim | defense | attacker | T")
        verdicts = []
        for victim in sorted({r["cell"]["victim"] for r in results}):
            for defense in DEFENSES:
                for attacker in ATTACKERS:
                    pair = [summary.get(f"{victim}/{defense}/{attacker}/{t}", {}).get("psnr")
                            for t in DEFENDED_WINDOWS]
                    if None in pair:
                        continue
                    gains = seed_gains(results, victim, defense, attacker)
                    what = "TRACE" if attacker == "trace" else f"the {FEATURE_DECODER}"
                    verdicts.append(f"- {victim}, {defense}, {what}: {verdict(gains)} "
                                    f"({pair[1] - pair[0]:+.2f} dB, means over seeds; "
                                    "per seed " + ", ".join(f"{g:+.2f}" for g in gains) + ")")
        summary["t8_minus_t1"] = verdicts
        return summary, "\n".join(lines) + ("\n\n" + "\n".join(verdicts) if verdicts else "")


def seed_gains(results: list[dict[str, Any]], victim: str, defense: str, attacker: str
               ) -> list[float]:
    """T = 8's PSNR minus T = 1's, seed by seed (each pair attacks one checkpoint)."""
    psnr: dict[tuple[int, int], float] = {}
    for record in results:
        cell = record["cell"]
        if (cell["victim"], cell["defense"], cell["attacker"]) == (victim, defense, attacker):
            psnr[int(cell["window"]), int(cell["seed"])] = record["result"]["attack"]["psnr"]
    seeds = sorted(seed for window, seed in psnr
                   if window == DEFENDED_WINDOWS[0] and (DEFENDED_WINDOWS[1], seed) in psnr)
    return [psnr[DEFENDED_WINDOWS[1], seed] - psnr[DEFENDED_WINDOWS[0], seed] for seed in seeds]


def verdict(gains: list[float]) -> str:
    """T = 8 'beats' T = 1 only where every seed gains, 'does not beat' it where none does."""
    if not gains:
        return "T = 8 and T = 1 share no seed"
    if all(gain > 0 for gain in gains):
        return "T = 8 beats T = 1"
    if all(gain <= 0 for gain in gains):
        return "T = 8 does not beat T = 1"
    return "T = 8 against T = 1 depends on the seed"
