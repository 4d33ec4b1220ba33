"""What several experiments' cells do: train the preset's victim, capture its gradients, fit an
attacker for the cell's budget, score it on held-out scenes beside the references."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradleak.experiments.base import Cell, Context
from gradleak.io import read_json, write_json

COMPONENTS = {"all": ["cnn", "fc", "heads"], "cnn": ["cnn"], "fc": ["fc"], "heads": ["heads"]}
REFERENCES = ("mean training image", "mean colour (oracle)")
KEEP = ("psnr", "ssim", "lpips", "action_accuracy", "ms_per_frame", "parameters",
        "psnr_gain_over_mean_image", "mean_image_psnr_same_frames")
ATTACK_KINDS = ("learned", "training-free", "optimisation")
MAX_WINDOWS = 64  # held-out windows scored per cell


def trained_victim(context: Context, algorithm: str) -> Path:
    """The preset's victim trained with `algorithm`, once for every cell, shard and experiment
    sharing the root; an interrupted training resumes."""
    from gradleak.rl.trainer import train_victim

    preset = dataclasses.replace(context.preset)
    preset.train = dataclasses.replace(preset.train, algo=algorithm)

    def done(path: Path) -> bool:  # the victim is saved at every update: count them
        meta = path / "trainer.json"
        return meta.is_file() and \
            int(read_json(meta, "trainer state").get("update", 0)) >= preset.train.updates

    return context.shared(f"victim-{algorithm}",
                          lambda path: train_victim(preset, path, resume=path.exists(),
                                                    progress=context.progress), done)


def capture(context: Context, victim: Path, algorithm: str, components: str, split: str,
            seed_offset: int = 0, tag: str = "") -> Path:
    """The victim's captures with only `components`' gradients (train or held-out scenes);
    `seed_offset` draws other episodes of the same scenes (named by `tag`). A part of the
    gradient is cut from the full capture: the same steps, without a second rollout."""
    from gradleak.capture.run import CaptureJob, run_capture
    from gradleak.capture.subset import restrict_components

    preset = context.preset
    steps = preset.capture.steps_train if split == "train" else preset.capture.steps_heldout

    def record(path: Path) -> None:
        run_capture(CaptureJob(victim=str(victim), split=split, steps=steps, out=path,
                               preset=preset, progress=context.progress, resume=True,
                               seed=preset.capture.seed + seed_offset))

    def cut(path: Path) -> None:
        full = capture(context, victim, algorithm, "all", split, seed_offset, tag)
        restrict_components(full, COMPONENTS[components], path, progress=context.progress)

    build = record if components == "all" else cut

    return context.shared(f"capture-{algorithm}-{components}-{split}{tag}.h5", build,
                          lambda path: path.is_file())


def victim_captures(context: Context, algorithm: str, components: str = "all"
                    ) -> tuple[Path, Path, Path]:
    """(victim, training capture, held-out capture) for a cell: what every experiment starts
    from, each built once."""
    victim = trained_victim(context, algorithm)
    train, heldout = (capture(context, victim, algorithm, components, split)
                      for split in ("train", "heldout"))
    return victim, train, heldout


def fit_once(directory: Path, fit: Callable[[bool], dict[str, Any]]) -> dict[str, Any]:
    """`fit(resume)` unless an earlier run of this cell finished it: a time-limited fit stops
    before its epochs, and resuming it would train a second budget. The summary is kept in
    DIR/fit.json, written once the fit is done."""
    marker = directory / "fit.json"
    if marker.is_file():
        return read_json(marker, "fit summary")
    summary = fit((directory / "attacker.json").is_file())
    meta = read_json(directory / "attacker.json", "attacker config")
    summary = {**summary, "train_windows": meta.get("train_windows"),
               "val_windows": meta.get("val_windows")}
    write_json(marker, summary)
    return summary


def fit_and_score(cell: Cell, context: Context, train: Path, heldout: Path,
                  model_changes: dict[str, Any] | None = None, defense: str = "none",
                  **fit_changes: Any) -> dict[str, Any]:
    """TRACE fitted on `train` for the cell's budget (seeded by the cell), scored on `heldout`:
    its row and the reference rows, the capture's gradient size, what the fit ran. Under a
    `defense` the attacker trains on defended gradients (adaptive) and is scored on the
    held-out gradients under the same defense (other noise draws)."""
    from gradleak.training.fit import fit_attacker

    preset = context.preset
    model = dataclasses.replace(preset.attack.trace, **(model_changes or {}))
    fit = dataclasses.replace(preset.attack.trace_fit, seed=int(cell["seed"]),
                              time_limit_minutes=context.budget_minutes,
                              time_limit_clock=context.clock, defense=defense, **fit_changes)
    attacker = context.out / "attackers" / cell.id
    fitted = fit_once(attacker, lambda resume: fit_attacker(
        "trace", model, fit, [str(train)], attacker, resume=resume, progress=context.progress))
    result = score_cell(cell, context, heldout, train, {"TRACE": str(attacker)}, "TRACE",
                        defense=defense)
    return {**result, "epochs": fitted.get("epochs"),
            "fit_cpu_minutes": fitted.get("cpu_minutes")}


def score_cell(cell: Cell, context: Context, heldout: Path, train: Path,
               attackers: dict[str, str], label: str, baselines: dict[str, Any] | None = None,
               baseline_windows: int = 2, defense: str = "none",
               max_windows: int = MAX_WINDOWS) -> dict[str, Any]:
    """Attackers (directories) and baselines scored on `heldout`: the row of the one named
    `label` under "attack" (its name under "method_label"), every attack's under "attacks",
    the reference rows, and the capture's gradient size."""
    from gradleak.capture.reader import CaptureFile
    from gradleak.defenses.base import parse_defense
    from gradleak.evaluation.reconstructions import evaluate

    chain = parse_defense(defense) if defense != "none" else None
    scored = evaluate([heldout], attackers, context.out / "eval" / cell.id,
                      max_windows=max_windows, reference_data=[train], defense=chain,
                      baselines=baselines, baseline_windows=baseline_windows)
    with CaptureFile(heldout) as handle:
        gradient_dim = int(handle.attrs["gradient_dim"])
        theta0 = str(handle.attrs["theta0_sha256"])  # which victim checkpoint was attacked
    rows = scored["methods"]
    attacks = {name: {k: row.get(k) for k in KEEP} for name, row in rows.items()
               if row["kind"] in ATTACK_KINDS}
    return {"gradient_dim": gradient_dim, "theta0_sha256": theta0, "method_label": label,
            "attack": attacks[label],
            "attacks": attacks,
            **{name: {k: rows[name].get(k) for k in ("psnr", "ssim", "lpips")}
               for name in REFERENCES if name in rows}}


def trace_rows(results: list[dict[str, Any]], by: list[str], header: str
               ) -> tuple[dict[str, Any], list[str]]:
    """Per group of `by`: the attack's mean ± std over seeds beside the references, its size
    and speed, and CPU minutes per cell; (summary, Markdown lines after the table's first
    columns `header`)."""
    from gradleak.experiments.runner import grouped, mean_std

    summary: dict[str, Any] = {}
    lines = [f"| {header} | PSNR | SSIM | LPIPS | actions | mean image PSNR (same frames) | "
             "mean colour PSNR | attacker parameters | ms / frame | CPU min / cell |",
             "|" + "---|" * (header.count("|") + 10)]
    for key, group in grouped(results, by).items():
        def values(name: str, metric: str) -> list[float]:
            return [r["result"][name][metric] for r in group
                    if r["result"].get(name, {}).get(metric) is not None]

        entry = {metric: values("attack", metric)
                 for metric in ("psnr", "ssim", "lpips", "action_accuracy")}
        # an attack scored on the leading windows only is set against the mean image on those
        entry["mean_image_psnr"] = [
            r["result"]["attack"].get("mean_image_psnr_same_frames")
            or r["result"]["mean training image"]["psnr"] for r in group
            if r["result"].get("mean training image", {}).get("psnr") is not None]
        entry["mean_colour_psnr"] = values("mean colour (oracle)", "psnr")
        summary["/".join(str(k) for k in key)] = {m: (sum(v) / len(v) if v else None)
                                                  for m, v in entry.items()}
        cpu = sum(r["cpu_minutes"] for r in group) / len(group)
        sizes = sorted(set(values("attack", "parameters")))
        params = ", ".join(f"{int(n):,}" for n in sizes) or "-"  # none: training-free
        speed = values("attack", "ms_per_frame")
        ms = f"{sum(speed) / len(speed):.2f}" if speed else "-"
        lines.append("| " + " | ".join(str(k) for k in key) + " | "
                     f"{mean_std(entry['psnr'])} | {mean_std(entry['ssim'], 3)} | "
                     f"{mean_std(entry['lpips'], 3)} | {mean_std(entry['action_accuracy'], 3)} | "
                     f"{mean_std(entry['mean_image_psnr'])} | "
                     f"{mean_std(entry['mean_colour_psnr'])} | {params} | {ms} | {cpu:.1f} |")
    return summary, lines
