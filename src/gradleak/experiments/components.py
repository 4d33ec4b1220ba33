"""`components` (the paper's Table 4 / 13 (ii)): which part of the policy gradient carries the
frames. The client's per-step gradient restricted to the CNN's parameters, the FC layer's,
the heads', or all of them, on trained PPO and A2C victims; TRACE (T = the preset's window)
trained for the same CPU budget on each and scored on held-out scenes, beside the mean image
and mean colour."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from gradleak.experiments.base import Cell, Context, Experiment, register_experiment
from gradleak.experiments.runner import grouped, mean_std

COMPONENTS = {"all": ["cnn", "fc", "heads"], "cnn": ["cnn"], "fc": ["fc"], "heads": ["heads"]}
REFERENCES = ("mean training image", "mean colour (oracle)")


def trained_victim(context: Context, algorithm: str) -> Path:
    """The preset's victim trained with `algorithm`, once for every cell and shard."""
    from gradleak.rl.trainer import train_victim

    preset = dataclasses.replace(context.preset)
    preset.train = dataclasses.replace(preset.train, algo=algorithm)
    return context.shared(f"victim-{algorithm}",
                          lambda path: train_victim(preset, path, resume=path.exists(),
                                                    progress=context.progress),
                          lambda path: (path / "victim.json").is_file())


def capture(context: Context, victim: Path, algorithm: str, components: str, split: str
            ) -> Path:
    """The victim's captures with only `components`' gradients (train or held-out scenes)."""
    from gradleak.capture.run import CaptureJob, run_capture

    preset = dataclasses.replace(context.preset)
    preset.capture = dataclasses.replace(preset.capture, components=COMPONENTS[components])
    steps = preset.capture.steps_train if split == "train" else preset.capture.steps_heldout

    def build(path: Path) -> None:
        run_capture(CaptureJob(victim=str(victim), split=split, steps=steps, out=path,
                               preset=preset, progress=context.progress, resume=True))

    return context.shared(f"capture-{algorithm}-{components}-{split}.h5", build,
                          lambda path: path.is_file())


@register_experiment("components")
class Components(Experiment):
    description = __doc__.split("\n\n")[0]
    max_windows = 64  # held-out windows scored per cell

    def axes(self, seeds: int) -> dict[str, list[Any]]:
        return {"victim": ["ppo", "a2c"], "components": list(COMPONENTS),
                "seed": list(range(seeds))}

    def run_cell(self, cell: Cell, context: Context) -> dict[str, Any]:
        from gradleak.capture.reader import CaptureFile
        from gradleak.evaluation.reconstructions import evaluate
        from gradleak.training.fit import fit_attacker

        victim = trained_victim(context, cell["victim"])
        train, heldout = (capture(context, victim, cell["victim"], cell["components"], split)
                          for split in ("train", "heldout"))
        preset = context.preset
        fit = dataclasses.replace(preset.attack.trace_fit, seed=int(cell["seed"]),
                                  time_limit_minutes=context.budget_minutes,
                                  time_limit_clock=context.clock)
        attacker = context.out / "attackers" / cell.id
        fitted = fit_attacker("trace", preset.attack.trace, fit, [str(train)], attacker,
                              resume=(attacker / "attacker.json").is_file(),
                              progress=context.progress)
        scored = evaluate([heldout], {"TRACE": str(attacker)}, context.out / "eval" / cell.id,
                          max_windows=self.max_windows, reference_data=[train])
        with CaptureFile(heldout) as handle:
            gradient_dim = int(handle.attrs["gradient_dim"])
        rows = scored["methods"]
        keep = ("psnr", "ssim", "lpips", "action_accuracy", "ms_per_frame", "parameters",
                "psnr_gain_over_mean_image")
        return {"gradient_dim": gradient_dim, "epochs": fitted.get("epochs"),
                "fit_cpu_minutes": fitted.get("cpu_minutes"),
                "TRACE": {k: rows["TRACE"].get(k) for k in keep},
                **{name: {k: rows[name].get(k) for k in ("psnr", "ssim", "lpips")}
                   for name in REFERENCES if name in rows}}

    def summarize(self, results: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
        summary: dict[str, Any] = {}
        lines = ["| victim | gradients | dim | TRACE PSNR | SSIM | LPIPS | actions | mean image "
                 "PSNR | mean colour PSNR | CPU min / cell |", "|---|---|---|---|---|---|---|---|"
                 "---|---|"]
        for (victim, components), group in grouped(results, ["victim", "components"]).items():
            def values(name: str, key: str) -> list[float]:
                return [r["result"][name][key] for r in group
                        if r["result"].get(name, {}).get(key) is not None]

            entry = {key: values("TRACE", key) for key in ("psnr", "ssim", "lpips",
                                                            "action_accuracy")}
            entry["mean_image_psnr"] = values("mean training image", "psnr")
            entry["mean_colour_psnr"] = values("mean colour (oracle)", "psnr")
            summary[f"{victim}/{components}"] = {k: (sum(v) / len(v) if v else None)
                                                 for k, v in entry.items()}
            cpu = sum(r["cpu_minutes"] for r in group) / len(group)
            lines.append(f"| {victim} | {components} | {group[0]['result']['gradient_dim']} | "
                         f"{mean_std(entry['psnr'])} | {mean_std(entry['ssim'], 3)} | "
                         f"{mean_std(entry['lpips'], 3)} | "
                         f"{mean_std(entry['action_accuracy'], 3)} | "
                         f"{mean_std(entry['mean_image_psnr'])} | "
                         f"{mean_std(entry['mean_colour_psnr'])} | {cpu:.1f} |")
        return summary, "\n".join(lines)
