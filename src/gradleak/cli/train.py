"""`gradleak train-victim`: a victim policy trained with PPO or A2C."""

from __future__ import annotations

import argparse
from pathlib import Path

from gradleak.cli.common import (
    common_flags,
    emit,
    preset_flags,
    preset_from_args,
    progress,
    shorthand_flag,
)


def run(args: argparse.Namespace) -> None:
    from gradleak.rl.trainer import train_victim

    preset = preset_from_args(args)
    result = train_victim(preset, Path(args.out), resume=args.resume, progress=progress(args))
    text = (f"trained {preset.train.victim} with {preset.train.algo.upper()}: "
            f"{result['updates']} updates, {result['env_steps']} steps, success rate "
            f"{result['final_success_rate']:.2f} (last 20% of updates) -> {args.out}")
    emit(args, result, text)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-victim", help="train a victim policy with PPO or A2C")
    common_flags(p)
    preset_flags(p)
    shorthand_flag(p, "--algo", "train.algo", help="ppo (default) or a2c")
    shorthand_flag(p, "--victim", "train.victim", help="registry name (default: the preset's)")
    shorthand_flag(p, "--updates", "train.updates")
    shorthand_flag(p, "--seed", "train.seed")
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true")
    p.set_defaults(func=run)
