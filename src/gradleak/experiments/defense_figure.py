"""`defense-figure` (the paper's Fig. 6): one held-out sequence of the trained PPO victim
reconstructed under each defense by the best adapted attacker. Per defense, TRACE and LtI are
trained on defended gradients for the same CPU budget (Learning to Invert's adaptive attacker)
and the training-free attack runs on the defended stream; the attacker with the highest mean
PSNR over the scored windows draws the defense's row of the picture."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from gradleak.errors import ConfigError
from gradleak.experiments.base import Cell, Context, Experiment, register_experiment
from gradleak.experiments.runner import grouped, mean_std
from gradleak.experiments.stages import (REFERENCES, fit_once, score_cell,
                                         victim_captures)

DEFENSES = ["none", "quant:8", "prune:0.1", "noise:0.01", "dpsgd:eps=10"]
LEARNED = {"trace": "TRACE", "lti": "LtI"}
SCORED_WINDOWS = 4  # the training-free attack's windows: it costs seconds a frame under noise
FIGURE_SEED = 0


@register_experiment("defense-figure")
class DefenseFigure(Experiment):
    description = __doc__.split("\n\n")[0]

    def axes(self, seeds: int) -> dict[str, list[Any]]:
        return {"victim": ["ppo"], "defense": DEFENSES, "seed": list(range(seeds))}

    def run_cell(self, cell: Cell, context: Context) -> dict[str, Any]:
        from gradleak.attacks.exact import NAME
        from gradleak.training.fit import fit_attacker

        _, train, heldout = victim_captures(context, cell["victim"])
        defense, preset = str(cell["defense"]), context.preset
        attackers, fits = {}, {}
        for method, label in LEARNED.items():
            directory = context.out / "attackers" / cell.id / method
            model, fit = preset.attack.learned(method)
            config = dataclasses.replace(
                fit, seed=int(cell["seed"]), defense=defense,
                time_limit_minutes=context.budget_minutes, time_limit_clock=context.clock)

            def run(resume: bool, kind: str = method, model: Any = model, config: Any = config,
                    directory: Any = directory) -> dict[str, Any]:
                return fit_attacker(kind, model, config, [str(train)], directory, resume=resume,
                                    progress=context.progress)

            fits[label] = fit_once(directory, run)
            attackers[label] = str(directory)
        result = score_cell(cell, context, heldout, train, attackers, "TRACE",
                            baselines={NAME: preset.attack.training_free},
                            baseline_windows=SCORED_WINDOWS, defense=defense,
                            max_windows=SCORED_WINDOWS)
        best = max(result["attacks"], key=lambda name: result["attacks"][name]["psnr"])
        return {**result, "best": best,
                "fit_cpu_minutes": {k: v.get("cpu_minutes") for k, v in fits.items()},
                "epochs": {k: v.get("epochs") for k, v in fits.items()}}

    def summarize(self, results: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
        names = sorted({name for r in results for name in r["result"]["attacks"]})
        summary: dict[str, Any] = {}
        lines = ["| defense | " + " | ".join(f"{n} PSNR" for n in names)
                 + " | best (most seeds) | best SSIM | best LPIPS | best's parameters | best's "
                 "ms / frame | mean image PSNR | mean colour PSNR | CPU min / cell |",
                 "|" + "---|" * (len(names) + 9)]
        for (defense,), group in grouped(results, ["defense"]).items():
            def values(name: str, metric: str) -> list[float]:
                return [r["result"]["attacks"][name][metric] for r in group
                        if name in r["result"]["attacks"]]

            bests = [r["result"]["best"] for r in group]
            best = max(set(bests), key=bests.count)
            entry = {n: {m: values(n, m) for m in ("psnr", "ssim", "lpips")} for n in names}
            entry["best"] = best
            for key, reference in zip(("mean_image_psnr", "mean_colour_psnr"), REFERENCES,
                                      strict=True):
                entry[key] = [r["result"][reference]["psnr"] for r in group]
            entry["cpu_minutes"] = [r["cpu_minutes"] for r in group]
            summary[defense] = entry
            size = next(iter(values(best, "parameters")), None)
            speed = values(best, "ms_per_frame")
            lines.append(f"| {defense} | " + " | ".join(mean_std(entry[n]["psnr"])
                                                        for n in names)
                         + f" | {best} | {mean_std(entry[best]['ssim'], 3)} | "
                         f"{mean_std(entry[best]['lpips'], 3)} | "
                         f"{'-' if size is None else f'{int(size):,}'} | "  # none: training-free
                         f"{sum(speed) / len(speed):.1f} | "
                         f"{mean_std(entry['mean_image_psnr'])} | "
                         f"{mean_std(entry['mean_colour_psnr'])} | "
                         f"{sum(entry['cpu_minutes']) / len(group):.1f} |")
        return summary, "\n".join(lines)

    def figures(self, results: list[dict[str, Any]], out: Path, folder: Path) -> list[Path]:
        rows = [r for r in results if int(r["cell"]["seed"]) == FIGURE_SEED]
        if not rows:
            return []
        path = folder / "defense-figure.png"
        draw_defense_rows([(self.cell_of(r), r) for r in rows], out, path)
        return [path]


def draw_defense_rows(rows: list[tuple[Cell, dict[str, Any]]], out: Path, path: Path) -> None:
    """Ground truth of the first held-out window, then per defense the best attacker's frames
    of it, labelled with the defense, the attacker and its PSNR on that window."""
    from gradleak.metrics.images import psnr, to_unit_tensor
    from gradleak.report.scores import load_samples, plot_reconstructions

    truth, pictured = None, {}
    for cell, record in rows:
        samples = out / "eval" / cell.id / "samples.npz"
        if not samples.is_file():
            raise ConfigError(f"{samples} is missing: rerun cell {cell.id} (its evaluation "
                              "keeps the frames the figure is drawn from)")
        window_truth, methods = load_samples(samples)
        truth = window_truth[:1] if truth is None else truth
        best = record["result"]["best"]
        frames = methods[best][:1]
        score = float(psnr(to_unit_tensor(frames[0]), to_unit_tensor(window_truth[0])).mean())
        pictured[f"{record['cell']['defense']}\n{best}\n{score:.1f} dB"] = frames
    plot_reconstructions(truth, pictured, path, sequences=1)
