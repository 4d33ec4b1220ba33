"""`gradleak attack dlg|ig`: gradient matching on single steps, with its history picture;
the optimisation baselines' flags and settings, shared with `evaluate`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gradleak.cli.common import (
    common_flags,
    emit,
    preset_flags,
    preset_from_args,
    prior_flag,
    progress,
    shorthand_flag,
)
from gradleak.names import TRAINING_FREE, method


def optim_config(args: argparse.Namespace, name: str) -> Any:
    """A baseline's settings: the preset's IG or DLG (after --set and the flags below)."""
    from gradleak.attacks.optim.config import baseline_config

    preset = preset_from_args(args)
    return baseline_config(name, {"ig": preset.attack.ig, "dlg": preset.attack.dlg})


def optim_flags(parser: argparse.ArgumentParser, presets: bool = True) -> None:
    """Shorthands for fields of both families' settings (attack.ig, attack.dlg)."""
    if presets:
        preset_flags(parser, environment=False)
    for flag, field, text in (
            ("--iters", "iterations", "optimisation iterations"),
            ("--time-limit", "time_limit_s",
             "seconds per batch of frames; stop there and keep where it got"),
            ("--restarts", "restarts", ""), ("--batch", "batch", "frames solved at once")):
        shorthand_flag(parser, flag, f"attack.ig.{field}", f"attack.dlg.{field}", help=text)


def run_optimisation(args: argparse.Namespace) -> tuple[dict[str, Any], list[str], str]:
    from gradleak.evaluation.single_steps import attack_steps

    result = attack_steps(args.data, args.index, args.method, optim_config(args, args.method),
                          Path(args.out), progress=progress(args))
    return result, ["matching_loss"], "history.png"


def run_training_free(args: argparse.Namespace) -> tuple[dict[str, Any], list[str], str]:
    from gradleak.evaluation.single_steps import exact_steps

    result = exact_steps(args.data, args.index, preset_from_args(args).attack.training_free,
                         Path(args.out))
    return result, ["residual_weight_gradient"], "reconstructions.png"


# the methods that are not optimisation baselines (those take their names from BASELINES)
METHODS = {TRAINING_FREE: run_training_free}


def run(args: argparse.Namespace) -> None:
    from gradleak.report.tables import text_table

    args.method = method(args.method)  # "exact" still reads as training-free
    result, extra, picture = METHODS.get(args.method, run_optimisation)(args)
    columns = ["index", "psnr", "ssim", "action", "true_action", *extra]
    rows = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in step.items()}
            for step in result["steps"]]
    text = (text_table(rows, columns) + f"\n{result['seconds_per_frame']:.2f} s per frame; "
            f"picture: {Path(args.out) / picture}")
    emit(args, result, text)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("attack", help="invert single steps: training-free, DLG or IG")
    common_flags(p)
    p.add_argument("method", help="training-free (no training: the conv stack and the first "
                   "conv's equations, or a ViT's patch embedding; also read as exact), dlg, "
                   "ig, dlg-probe or ig-probe")
    p.add_argument("--data", required=True, help="a capture file")
    p.add_argument("--index", type=int, action="append", required=True,
                   help="a row of the capture (repeatable)")
    p.add_argument("--out", required=True)
    optim_flags(p)
    prior_flag(p)
    p.set_defaults(func=run)
