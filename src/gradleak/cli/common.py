"""What every command shares: output, the preset from --preset/--set/--wad/--env, flags."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gradleak.errors import ConfigError

DEFAULT_PRESET = "cpu-quick"  # every command's, the optimisation baselines' included


def emit(args: argparse.Namespace, data: Any, text: str) -> None:
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    elif not args.quiet:
        print(text)


def progress(args: argparse.Namespace) -> bool:
    return not (args.quiet or args.json)


def preset_from_args(args: argparse.Namespace) -> Any:
    from gradleak.presets import load_preset

    return apply_env_flags(args, load_preset(getattr(args, "preset", None) or DEFAULT_PRESET))


def apply_env_flags(args: argparse.Namespace, preset: Any) -> Any:
    """--set overrides, then --wad and --env, which replace the preset's environment."""
    from gradleak.presets import apply_override, validate_preset

    for assignment in getattr(args, "set", None) or []:
        apply_override(preset, assignment)
    for keys, value in getattr(args, "shorthands", None) or []:  # the same typed path as --set
        for key in keys:
            apply_override(preset, f"{key.format(**vars(args))}={value}")
    wad = getattr(args, "wad", None)
    if wad:
        if Path(wad).is_dir():
            raise ConfigError(f"--wad {wad} is a directory (expected a Doom IWAD or PWAD file)")
        if not Path(wad).is_file():
            raise ConfigError(f"--wad {wad}: no such file (expected a Doom IWAD or PWAD)")
        preset.env.doomnav.wad = str(Path(wad).resolve())
        preset.env.train_maps, preset.env.heldout_maps = [], []
    env = getattr(args, "env", None)
    if env:
        backend, _, gym_id = env.partition(":")
        apply_override(preset, f"env.backend={backend}")
        preset.env.gym_id = gym_id or None
    return validate_preset(preset)


def defense_from_args(args: argparse.Namespace) -> Any:
    from gradleak.defenses import parse_defense

    return parse_defense(args.defense, args.defense_seed) if args.defense is not None else None


# -- flags ------------------------------------------------------------------------------------
def common_flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """--quiet, --json, and --plugin (returned: what a command run elsewhere needs too)."""
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return [parser.add_argument(
        "--plugin", action="append", default=[], metavar="MODULE",
        help="import MODULE first: it registers victims, attacks or defenses (repeatable; "
        "entry points in the group gradleak.plugins load too)")]


def nonfinite_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip-nonfinite", action="store_true",
                        help="leave out steps whose gradient holds NaN/Inf and say how many "
                        "(default: refuse the file, naming the rows)")


def set_flag(parser: argparse.ArgumentParser) -> argparse.Action:
    return parser.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                        help="override one preset field, e.g. train.updates=3 or "
                        "attack.ig.lr=0.05 (repeatable; typed from the field)")


class _Shorthand(argparse.Action):
    """Records `--flag VALUE` as the --set assignment it names."""

    def __init__(self, *args: Any, keys: tuple[str, ...], **kwargs: Any) -> None:
        self.keys = keys
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        namespace.shorthands = [*(getattr(namespace, "shorthands", None) or []),
                                (self.keys, values)]


def shorthand_flag(parser: argparse.ArgumentParser, flag: str, *keys: str, help: str = ""
                   ) -> None:
    """A flag that is another name for preset fields: `--epochs 3` is `--set KEY=3` for each
    key, typed and checked the same way and applied after every --set. A key may name other
    arguments, e.g. `attack.{kind}_fit.epochs`."""
    same = " and ".join(f"--set {key}=VALUE" for key in keys)
    parser.add_argument(flag, action=_Shorthand, keys=keys, default=None, metavar="VALUE",
                        help=f"{help + '; ' if help else ''}the same as {same}")


def prior_flag(parser: argparse.ArgumentParser) -> None:
    shorthand_flag(parser, "--prior", "attack.training_free.prior",
                   help="the exact attack's learned prior: a directory written by gradleak "
                   "train-prior")


def preset_flags(parser: argparse.ArgumentParser, environment: bool = True
                 ) -> list[argparse.Action]:
    actions = [parser.add_argument("--preset", default=None,
                                   help="cpu-quick (default), cpu-bench or paper"),
               set_flag(parser)]
    if environment:
        actions += [parser.add_argument("--wad", default=None, help="another Doom IWAD/PWAD "
                                        "(default: freedoom2.wad shipped with vizdoom)"),
                    parser.add_argument("--env", default=None, help="gym:ENV_ID to use any "
                                        "RGB Gymnasium environment instead of DoomNav")]
    return actions


def defense_flags(parser: argparse.ArgumentParser, required: bool, seed: int = 0) -> None:
    parser.add_argument("--defense", required=required, default=None, metavar="SPEC",
                        help="e.g. quant:8, prune:0.1, noise:0.01, dpsgd:eps=5,delta=1e-5,"
                        "clip=1, agg:4, or a chain prune:0.1+noise:0.01")
    parser.add_argument("--defense-seed", type=int, default=seed,
                        help=f"seeds the defense's noise (default {seed})")
