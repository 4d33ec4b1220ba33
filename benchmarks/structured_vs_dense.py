"""Structured vs dense gradient input, on the cpu-bench captures of benchmarks/trace_vs_lti.py.

Trains, each for at most --minutes on the same training capture: TRACE with the paper's dense
projection, TRACE with the structured input (exact Linear-layer inputs, deltas, conv-channel
norms), LtI with the structured input (a learned decoder of the recovered features, trained on
gradients), and for --decoder-minutes each the feature decoder (the FC input recovered in
closed form, decoded by a conv decoder trained on auxiliary frames only: no stored gradient)
without temporal context, with the previous reconstruction, and with it warped by the recovered
action, and the decoder of the second conv's input recovered through the whole conv stack
(decoder-conv). Scores them with the subsample TRACE and LtI already in --work, plus feature
inversion by optimisation on --invert held-out frames. With --defenses, every attacker is also
scored zero-shot under each listed defense (the robustness of the identities). Writes
benchmarks/results/structured_vs_dense.{json,md}.

    python benchmarks/structured_vs_dense.py [--work runs/bench-attack] [--minutes 60]
        [--decoder-minutes 20] [--variants TRACE-dense,TRACE-structured,LtI-structured,
        decoder,decoder-concat,decoder-warp,decoder-conv]
        [--defenses "quant:8;noise:0.01;prune:0.1"] [--max-windows N] [--clock cpu]
        [--stage all|train|evaluate]

On two cores, train the variants side by side with equal CPU budgets, one process each
(--stage train --variants NAME --clock cpu, OMP_NUM_THREADS=1), then --stage evaluate.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

from gradleak.defenses import parse_defense
from gradleak.evaluation.analytic import evaluate_analytic
from gradleak.evaluation.reconstructions import evaluate
from gradleak.io import atomic_path, read_json
from gradleak.presets import load_preset
from gradleak.report.tables import fixed, markdown_table
from gradleak.training.checkpoint import META
from gradleak.training.decoder_fit import fit_decoder
from gradleak.training.fit import fine_tune_under_defense, fit_attacker

RESULTS = Path(__file__).parent / "results" / "structured_vs_dense.json"
VARIANTS = {"TRACE-dense": ("trace", "dense"), "TRACE-structured": ("trace", "structured"),
            "LtI-structured": ("lti", "structured")}
# name: (label, context, model overrides, fit overrides)
DECODERS: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "decoder": ("feature decoder", "none", {}, {}),
    "decoder-concat": ("feature decoder (previous frame)", "concat", {}, {}),
    "decoder-warp": ("feature decoder (previous frame, warped)", "warp", {}, {}),
    # the second conv's 16×16×16 input, recovered through the conv stack: a 16× larger map
    # than the FC input, so a narrower decoder with no dense path, for 3 epochs
    "decoder-conv": ("feature decoder (conv stack)", "none",
                     {"feature_module": "encoder.3", "global_channels": 0, "channels": 32},
                     {"epochs": 3})}
EXISTING = {"TRACE (T=8, subsample)": "TRACE-T=8", "LtI (subsample)": "LtI"}
SUMMARY = ("psnr", "ssim", "mse", "action_accuracy", "psnr_gain_over_mean_image", "parameters",
           "ms_per_frame")


def train_variant(preset: Any, name: str, minutes: float, train: Path, work: Path,
                  context_epochs: int | None = None, clock: str = "wall") -> dict[str, Any]:
    out = work / name
    if name in DECODERS:
        model = copy.deepcopy(preset.attack.decoder)
        fit = copy.deepcopy(preset.attack.decoder_fit)
        _, model.context, model_changes, fit_changes = DECODERS[name]
        fit.time_limit_minutes, fit.time_limit_clock = minutes, clock
        for target, changes in ((model, model_changes), (fit, fit_changes)):
            for field, value in changes.items():
                setattr(target, field, value)
        if model.context != "none":  # a step also decodes the predecessor: about twice the cost
            fit.epochs = context_epochs or max(1, fit.epochs // 2)
        return fit_decoder(model, fit, [str(train)], out, resume=(out / META).exists(),
                           progress=True)
    kind, projection = VARIANTS[name]
    model = copy.deepcopy(getattr(preset.attack, kind))
    fit = copy.deepcopy(getattr(preset.attack, f"{kind}_fit"))
    model.projection, fit.time_limit_minutes, fit.time_limit_clock = projection, minutes, clock
    return fit_attacker(kind, model, fit, [str(train)], out, resume=(out / META).exists(),
                        progress=True)


def slug(spec: str) -> str:
    return spec.replace(":", "-")


def adaptive_dir(work: Path, name: str, spec: str) -> Path:
    return work / "defenses-structured" / slug(spec) / name


def ended(out: Path) -> bool:
    """A run that stopped at its time limit is not trained again: resuming it would spend a
    second budget. (Runs that did all their epochs return at once when resumed.)"""
    if not (out / META).exists():
        return False
    last = (read_json(out / META, "attacker config").get("history") or [{}])[-1]
    return last.get("time_limit_reached", last.get("epoch_fraction", 1) < 1)


def trained(out: Path) -> dict[str, Any]:
    """The training record of a finished run, read back for the results."""
    meta_path = out / META
    if not meta_path.exists():
        raise SystemExit(f"{meta_path} is missing: train it first (--stage train)")
    meta = read_json(meta_path, "attacker config")
    history, fit = meta.get("history") or [{}], meta.get("fit", {})
    return {"epochs": sum(r.get("epoch_fraction", 1.0) for r in history),
            "scheduled_epochs": fit.get("epochs"), "last": history[-1],
            "budget_minutes": fit.get("time_limit_minutes"),
            "budget_clock": fit.get("time_limit_clock", "wall"),
            "minutes": sum(r.get("train_minutes", 0.0) for r in history),
            "cpu_minutes": sum(r.get("train_cpu_minutes", 0.0) for r in history) or None}


def rows(defense: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"defense": defense, "method": name, **{k: row.get(k) for k in SUMMARY}}
            for name, row in result["methods"].items()
            if row["kind"] in ("learned", "rule") or name == "mean training image"]


def training_markdown(training: dict[str, dict[str, Any]]) -> str:
    cells = [{"attacker": name, "epochs run": fixed(t["epochs"], 2),
              "of scheduled": t["scheduled_epochs"],
              "budget": "-" if t["budget_minutes"] is None
              else f"{t['budget_minutes']:g} {t['budget_clock']} min",
              "wall min": fixed(t["minutes"], 1), "CPU min": fixed(t["cpu_minutes"], 1),
              "final lr": fixed(t["last"].get("lr"), 6)} for name, t in training.items()]
    return markdown_table(cells, list(cells[0])) if cells else ""


def markdown(table: list[dict[str, Any]]) -> str:
    cells = [{
        "defense": r["defense"], "method": r["method"], "PSNR": fixed(r["psnr"], 2),
        "SSIM": fixed(r["ssim"], 3), "gain (dB)": fixed(r["psnr_gain_over_mean_image"], 2),
        "action acc.": fixed(r["action_accuracy"], 3),
        "parameters": None if r["parameters"] is None else f"{r['parameters']:,}",
        "ms/frame": fixed(r["ms_per_frame"], 2)} for r in table]
    return markdown_table(cells, list(cells[0])) if cells else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("runs/bench-attack"))
    parser.add_argument("--preset", default="cpu-bench")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--decoder-minutes", type=float, default=20.0)
    parser.add_argument("--variants", default=",".join([*VARIANTS, *DECODERS]))
    parser.add_argument("--context-epochs", type=int, default=None,
                        help="epochs of the context decoders (default: half the preset's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="what --minutes counts: cpu (this process's CPU time) keeps the "
                        "budgets equal when other jobs share the cores")
    parser.add_argument("--invert", type=int, default=32)
    parser.add_argument("--defenses", default="", help="zero-shot robustness; ';'-separated")
    parser.add_argument("--adaptive-minutes", type=float, default=0.0,
                        help="fine-tune each trained TRACE/LtI variant this long under each "
                        "--defenses entry (not agg) and score it there as adaptive")
    parser.add_argument("--max-windows", type=int, default=None)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--stage", choices=["all", "train", "evaluate"], default="all",
                        help="train: fit the variants and stop (one process per variant runs "
                        "them side by side); evaluate: score what --work already holds")
    args = parser.parse_args()
    preset = load_preset(args.preset)
    train, heldout = args.work / "train.h5", args.work / "heldout.h5"
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS) - set(DECODERS))
    if unknown:
        parser.error(f"unknown variants {unknown}: expected some of "
                     f"{', '.join([*VARIANTS, *DECODERS])}")
    specs = [s for s in args.defenses.split(";") if s]
    adaptive_specs = [s for s in specs if args.adaptive_minutes > 0 and parse_defense(s).per_step]
    training = {}
    for name in names:
        if args.stage != "evaluate":
            minutes = args.decoder_minutes if name in DECODERS else args.minutes
            if not ended(args.work / name):
                train_variant(preset, name, minutes, train, args.work, args.context_epochs,
                              args.clock)
            for spec in adaptive_specs if name in VARIANTS else []:
                if not ended(adaptive_dir(args.work, name, spec)):
                    kind = VARIANTS[name][0]
                    fine_tune_under_defense(
                        kind, copy.deepcopy(getattr(preset.attack, kind)),
                        copy.deepcopy(getattr(preset.attack, f"{kind}_fit")), args.work / name,
                        spec, args.adaptive_minutes, [str(train)],
                        adaptive_dir(args.work, name, spec), args.clock)
        training[name] = trained(args.work / name)
        for spec in adaptive_specs if name in VARIANTS else []:
            training[f"{name} @ {spec}"] = trained(adaptive_dir(args.work, name, spec))
    if args.stage == "train":
        print(json.dumps(training, indent=2))
        return
    attackers = {DECODERS[name][0] if name in DECODERS else name: str(args.work / name)
                 for name in names}
    existing = {name: folder for name, folder in EXISTING.items()
                if (args.work / folder / META).exists()}
    attackers.update({name: str(args.work / folder) for name, folder in existing.items()})
    training.update({name: trained(args.work / folder) for name, folder in existing.items()})
    clean = evaluate([heldout], attackers, args.work / "eval-structured",
                     max_windows=args.max_windows)
    table = rows("none", clean)
    robustness = {}
    for spec in specs:
        adaptive = {f"{name} (adaptive)": str(adaptive_dir(args.work, name, spec))
                    for name in names if spec in adaptive_specs and name in VARIANTS}
        decoder = args.work / f"decoder@{slug(spec)}"  # from benchmarks/adaptive_decoders.py
        if "decoder" in names and (decoder / META).exists():
            adaptive[f"{DECODERS['decoder'][0]} (adaptive)"] = str(decoder)
        result = evaluate([heldout], {**attackers, **adaptive},
                          args.work / "eval-structured" / slug(spec),
                          max_windows=args.max_windows, defense=parse_defense(spec))
        robustness[spec] = result["methods"]
        table += rows(spec, result)
    analytic = evaluate_analytic([heldout], invert=args.invert)[str(heldout)]
    summary = {"preset": args.preset, "training": training,
               "evaluation": clean, "robustness_zero_shot": robustness, "analytic": analytic,
               "rows": table}
    with atomic_path(args.results) as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
    inversion = analytic.get("feature_inversion")
    note = "" if not inversion else (
        f"\n\nFeature inversion by optimisation ({inversion['frames']} frames): PSNR "
        f"{inversion['psnr']:.2f}, SSIM {inversion['ssim']:.3f}, "
        f"{inversion['seconds_per_frame']:.2f} s per frame (their mean image: "
        f"{inversion['psnr_of_their_mean_image']:.2f} dB).")
    with atomic_path(args.results.with_suffix(".md")) as tmp:
        tmp.write_text(markdown(table) + note + "\n\nTraining (CPU minutes count this "
                       "process's threads, not its data-loader worker):\n\n"
                       + training_markdown(training) + "\n")
    print(json.dumps(training, indent=2))


if __name__ == "__main__":
    main()
