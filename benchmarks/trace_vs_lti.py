"""TRACE (T = 8) vs TRACE (T = 1) vs LtI vs the closed-form action rule, side by side.

Same training capture, same held-out capture, same metrics (MSE, PSNR, SSIM, LPIPS when its
backbone is present, action accuracy, ms per frame, parameters, training minutes). Prints JSON
and writes benchmarks/results/trace_vs_lti.json plus the evaluation folder's metrics.md.

    python benchmarks/trace_vs_lti.py [--victim runs/victim-ppo-bench] [--minutes 60]
        [--work runs/bench-attack]

Defaults follow the cpu-bench preset: a random-init cnn-small unless --victim names a
checkpoint, 20,000 training steps, 4,000 held-out steps, and at most --minutes of training per
model. Captures and attackers in --work are reused on a second run (resume).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from gradleak.capture.run import CaptureJob, run_capture
from gradleak.evaluation.reconstructions import evaluate
from gradleak.errors import ConfigError
from gradleak.io import atomic_path, check_output
from gradleak.presets import load_preset
from gradleak.training.checkpoint import META
from gradleak.training.fit import fit_attacker

from host import machine

RESULTS = Path(__file__).parent / "results" / "trace_vs_lti.json"


def capture(preset, victim: str | None, split: str, steps: int, out: Path) -> None:
    run_capture(CaptureJob(victim=victim or "cnn-small", random_init=victim is None,
                           split=split, steps=steps, out=out, preset=preset, resume=True,
                           progress=True))


def train(preset, kind: str, window: int | None, minutes: float, data: Path, out: Path
          ) -> dict:
    model = copy.deepcopy(getattr(preset.attack, kind))
    fit = copy.deepcopy(getattr(preset.attack, f"{kind}_fit"))
    if window is not None:  # TRACE at T = 1: the same frames per optimiser step as T = 8
        scale = model.window // window
        model.window = window
        fit.rollout_steps = min(fit.rollout_steps, window - 1)
        fit.stride = 1 if window == 1 else fit.stride
        fit.batch_size *= scale
        fit.max_train_windows = fit.max_train_windows and fit.max_train_windows * scale
    fit.time_limit_minutes = minutes
    return fit_attacker(kind, model, fit, [str(data)], out, resume=(out / META).exists(),
                        progress=True)


def training_record(out: Path) -> dict:
    """Minutes spent in training epochs over every run that built this attacker (resumes
    included) and each epoch's validation PSNR, from its own history."""
    history = json.loads((out / META).read_text())["history"]
    return {"minutes": round(sum(record["train_minutes"] for record in history), 1),
            "val_psnr_by_epoch": [round(record["val_psnr"], 2) for record in history
                                  if "val_psnr" in record]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--victim", default=None, help="a victim checkpoint (default: random-init)")
    parser.add_argument("--preset", default="cpu-bench")
    parser.add_argument("--minutes", type=float, default=60.0, help="training budget per model")
    parser.add_argument("--train-steps", type=int, default=None)
    parser.add_argument("--heldout-steps", type=int, default=None)
    parser.add_argument("--work", type=Path, default=Path("runs/bench-attack"))
    parser.add_argument("--lpips-weights", default=None)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.minutes <= 0:
        parser.error(f"--minutes {args.minutes:g}: expected a positive training budget")
    try:  # before an hour of capturing and training, not after it
        check_output(args.work, "--work", directory=True)
        check_output(args.results, "--results")
        check_output(args.results.with_suffix(".md"), "--results' Markdown")
    except ConfigError as err:
        parser.error(str(err))
    preset = load_preset(args.preset)
    work = args.work
    train_file, heldout_file = work / "train.h5", work / "heldout.h5"
    capture(preset, args.victim, "train", args.train_steps or preset.capture.steps_train,
            train_file)
    capture(preset, args.victim, "heldout", args.heldout_steps or preset.capture.steps_heldout,
            heldout_file)
    runs = {"TRACE (T=8)": ("trace", None), "TRACE (T=1)": ("trace", 1), "LtI": ("lti", None)}
    training = {name: train(preset, kind, window, args.minutes, train_file,
                            work / name.replace(" ", "").replace("(", "-").replace(")", ""))
                for name, (kind, window) in runs.items()}
    attackers = {name: result["out"] for name, result in training.items()}
    result = evaluate([heldout_file], attackers, work / "eval", args.lpips_weights)
    summary = {"preset": args.preset, "victim": args.victim or "cnn-small (random init)",
               "train_steps": args.train_steps or preset.capture.steps_train,
               "heldout_steps": args.heldout_steps or preset.capture.steps_heldout,
               "minutes_budget": args.minutes,
               "training": {name: {"epochs": r["epochs"], "parameters": r["parameters"],
                                   **training_record(Path(r["out"]))}
                            for name, r in training.items()},
               "evaluation": result, "machine": machine()}
    text = json.dumps(summary, indent=2)
    print(text)
    with atomic_path(args.results) as tmp:
        tmp.write_text(text + "\n")
    with atomic_path(args.results.with_suffix(".md")) as tmp:
        tmp.write_text((work / "eval" / "metrics.md").read_text())


if __name__ == "__main__":
    main()
