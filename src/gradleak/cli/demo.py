"""`gradleak demo`: the whole pipeline on the embedded default, in one command."""

from __future__ import annotations

import argparse
from pathlib import Path

from gradleak.cli.common import common_flags, emit, preset_from_args, progress, set_flag


def run(args: argparse.Namespace) -> None:
    from gradleak.demo import run_demo

    preset = preset_from_args(args)  # every argument checked before the disk is touched
    result = run_demo(preset, Path(args.out), progress=progress(args),
                      say=print if progress(args) else lambda text: None)
    emit(args, result, result.pop("text"))


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train a small victim, capture, recover actions")
    common_flags(p)
    p.add_argument("--preset", default=None, help="cpu-quick (default), cpu-bench or paper")
    set_flag(p)
    p.add_argument("--out", default="runs/demo")
    p.set_defaults(func=run)
