"""Structured vs dense gradient input, on the cpu-bench captures of benchmarks/trace_vs_lti.py.

Trains, each for at most --minutes on the same training capture: TRACE with the paper's dense
projection, TRACE with the structured input (exact Linear-layer inputs, deltas, conv-channel
norms), LtI with the structured input (a learned decoder of the recovered features, trained on
gradients), and for --decoder-minutes each the analytic decoder (the FC input recovered in
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
from gradleak.io import atomic_path
from gradleak.presets import load_preset
from gradleak.report.tables import fixed, markdown_table
from gradleak.training.auxiliary import fit_decoder
from gradleak.training.checkpoint import META
from gradleak.training.fit import fit_attacker

RESULTS = Path(__file__).parent / "results" / "structured_vs_dense.json"
VARIANTS = {"TRACE-dense": ("trace", "dense"), "TRACE-structured": ("trace", "structured"),
            "LtI-structured": ("lti", "structured")}
# name: (label, context, model overrides, fit overrides)
DECODERS: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "decoder": ("analytic+decoder", "none", {}, {}),
    "decoder-concat": ("analytic+decoder (previous frame)", "concat", {}, {}),
    "decoder-warp": ("analytic+decoder (previous frame, warped)", "warp", {}, {}),
    # the second conv's 16×16×16 input, recovered through the conv stack: a 16× larger map
    # than the FC input, so a narrower decoder with no dense path, for 3 epochs
    "decoder-conv": ("analytic+conv-stack decoder", "none",
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


def rows(defense: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"defense": defense, "method": name, **{k: row.get(k) for k in SUMMARY}}
            for name, row in result["methods"].items()
            if row["kind"] in ("learned", "rule") or name == "mean training image"]


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
    parser.add_argument("--max-windows", type=int, default=None)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    preset = load_preset(args.preset)
    train, heldout = args.work / "train.h5", args.work / "heldout.h5"
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS) - set(DECODERS))
    if unknown:
        parser.error(f"unknown variants {unknown}: expected some of "
                     f"{', '.join([*VARIANTS, *DECODERS])}")
    training = {}
    for name in names:
        minutes = args.decoder_minutes if name in DECODERS else args.minutes
        result = train_variant(preset, name, minutes, train, args.work, args.context_epochs,
                               args.clock)
        training[name] = {k: result[k] for k in ("epochs", "minutes", "parameters")}
        training[name]["last"] = result["last"]
    attackers = {DECODERS[name][0] if name in DECODERS else name: str(args.work / name)
                 for name in names}
    attackers.update({name: str(args.work / folder) for name, folder in EXISTING.items()
                      if (args.work / folder / META).exists()})
    clean = evaluate([heldout], attackers, args.work / "eval-structured",
                     max_windows=args.max_windows)
    table = rows("none", clean)
    robustness = {}
    for spec in [s for s in args.defenses.split(";") if s]:
        result = evaluate([heldout], attackers, args.work / "eval-structured" / spec.replace(
            ":", "-"), max_windows=args.max_windows, defense=parse_defense(spec))
        robustness[spec] = result["methods"]
        table += rows(spec, result)
    analytic = evaluate_analytic([heldout], invert=args.invert)[str(heldout)]
    summary = {"preset": args.preset, "minutes_budget": args.minutes, "clock": args.clock,
               "decoder_minutes_budget": args.decoder_minutes, "training": training,
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
        tmp.write_text(markdown(table) + note + "\n")
    print(json.dumps(training, indent=2))


if __name__ == "__main__":
    main()
