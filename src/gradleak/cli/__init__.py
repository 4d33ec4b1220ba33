"""The `gradleak` command: one module per command family; each adds its subcommands to the
parser and runs a library function. `main` loads plugins, runs the command, and turns every
`GradleakError` (and an OSError naming a path) into one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import os
import sys

from gradleak.cli import (
    actions,
    analytic,
    attackers,
    audit,
    capture,
    defend,
    demo,
    evaluate,
    experiment,
    fedavg,
    fedavg_invert,
    optim,
    scenes,
    train,
)
from gradleak.errors import GradleakError
from gradleak.io import is_disk_full

# in the order `gradleak --help` lists them
COMMAND_MODULES = (demo, audit, scenes, train, capture, attackers, evaluate, experiment, defend,
                   optim, analytic, fedavg, fedavg_invert, actions)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradleak",
                                     description="measure how much a gradient stream leaks")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from gradleak.plugins import load_plugins

        load_plugins(args.plugin)
        status = args.func(args)  # a command may ask for another status (audit's --fail-if)
    except GradleakError as err:
        print(f"gradleak: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if is_disk_full(err):
            print(f"gradleak: error: no space left on the device of "
                  f"{err.filename or getattr(args, 'out', None) or 'an output'}", file=sys.stderr)
            return 2
        if err.filename is None:  # not about a path the user gave: a real bug, keep its trace
            raise
        print(f"gradleak: error: {err.filename}: {err.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gradleak: interrupted (an interrupted capture resumes with --resume)",
              file=sys.stderr)
        return 130
    return status or 0


def entry() -> None:
    """The console script: exits with main's status. A capture whose HDF5 file met a full disk
    mid-write leaves without the interpreter's exit, which would crash in HDF5 as it tried
    once more to write that file's cache (everything of ours is closed by then)."""
    status = main()
    from gradleak.capture.writer import ABANDONED

    if ABANDONED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
