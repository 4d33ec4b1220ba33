"""`gradleak attack METHOD`: any single-step attack on chosen steps of a capture; the flags of
the optimisation baselines' settings and the attacks a preset offers, shared with `evaluate`."""

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
from gradleak.errors import ConfigError
from gradleak.names import method


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


def single_step_choices(args: argparse.Namespace) -> dict[str, tuple[Any, Any]]:
    """Every single-step attack the preset offers (after --set and the flags), by name."""
    from gradleak.attacks.catalogue import choices

    return choices(preset_from_args(args).attack)


def choice_names() -> str:
    """The names `gradleak attack` and `evaluate --baselines` take, for --help."""
    from gradleak.attacks.catalogue import choices
    from gradleak.presets import AttackConfig

    return ", ".join(sorted(choices(AttackConfig())))


def run(args: argparse.Namespace) -> None:
    from gradleak.evaluation.single_steps import attack_steps
    from gradleak.report.tables import text_table

    args.method = method(args.method)  # "exact" still reads as training-free
    offered = single_step_choices(args)
    if args.method not in offered:
        raise ConfigError(f"attack {args.method!r}: expected one of {', '.join(sorted(offered))}")
    result = attack_steps(args.data, args.index, args.method, offered[args.method][1],
                          Path(args.out), progress=progress(args))
    columns = ["index", "psnr", "ssim", "action", "true_action", *result["columns"]]
    rows = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in step.items()}
            for step in result["steps"]]
    text = (text_table(rows, columns) + f"\n{result['seconds_per_frame']:.2f} s per frame; "
            f"picture: {result['picture']}")
    emit(args, result, text)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("attack", help="invert single steps: training-free, defense-aware, DLG "
                       "or IG")
    common_flags(p)
    p.add_argument("method", help=f"one of {choice_names()} (exact reads as training-free; "
                   "defense-aware needs a capture written by `gradleak defend`)")
    p.add_argument("--data", required=True, help="a capture file")
    p.add_argument("--index", type=int, action="append", required=True,
                   help="a row of the capture (repeatable)")
    p.add_argument("--out", required=True)
    optim_flags(p)
    prior_flag(p)
    p.set_defaults(func=run)
