"""`gradleak capture` (per-step gradients at θ0 to HDF5) and `gradleak info` (a capture's
summary and validation)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from gradleak.cli.common import (
    apply_env_flags,
    common_flags,
    emit,
    preset_flags,
    preset_from_args,
    progress,
)
from gradleak.errors import ConfigError


def capture_preset(args: argparse.Namespace) -> Any:
    """A --random-init victim's preset from the flags; a checkpoint's from its own record."""
    from gradleak.io import read_json, victim_directory
    from gradleak.presets import load_preset, preset_from_dict

    trained_with = [a for a in args.set or [] if a.strip().startswith("train.")]
    if trained_with and not args.random_init:
        raise ConfigError(f"--set {trained_with[0]}: a checkpoint declares the learning rule it "
                          "was trained with; to capture a client that used another loss, "
                          "declare it with --loss value=...,entropy=...,clip=...")
    if args.random_init or args.preset:
        preset = preset_from_args(args)
    else:  # capture in the environment the checkpoint was trained in
        path = victim_directory(args.victim) / "victim.json"
        meta = read_json(path, "victim config")
        preset = (preset_from_dict(meta["preset"], f"victim config {path}: preset")
                  if "preset" in meta else load_preset("cpu-quick"))
        preset = apply_env_flags(args, preset)
    if args.components:
        preset.capture.components = [c for c in args.components.split(",") if c]
    return preset


def declared_norm(args: argparse.Namespace) -> str:
    """The checkpoint's declared advantage normalisation (an SB3 agent's), else per episode."""
    from gradleak.io import read_json, victim_directory

    if args.random_init:
        return "episode"
    path = victim_directory(args.victim) / "victim.json"
    return str(read_json(path, "victim config").get("advantage_norm", "episode")) \
        if path.is_file() else "episode"


def run_capture_command(args: argparse.Namespace) -> None:
    from gradleak.capture.plan import CaptureJob, parse_shard, shard_output
    from gradleak.capture.run import run_capture
    from gradleak.rl.losses import parse_loss

    preset = capture_preset(args)
    job = CaptureJob(victim=args.victim, split=args.scenes, steps=args.steps, out=Path(args.out),
                     preset=preset, random_init=args.random_init, algorithm=args.algo,
                     shard=parse_shard(args.shard), resume=args.resume,
                     overwrite=args.overwrite, progress=progress(args), seed=args.seed,
                     loss=parse_loss(args.loss) if args.loss is not None else None,
                     advantage_norm=args.advantage_norm or declared_norm(args))
    start = time.perf_counter()
    result = run_capture(job)
    result["seconds"] = round(time.perf_counter() - start, 2)
    out = shard_output(job.out, job.shard)
    text = f"capture {result['status']}: {out}"
    if result["status"] == "complete":
        text += f" ({result['steps']} steps, {result['episodes']} episodes, " \
                f"{result['seconds']} s)"
    emit(args, result, text)


def run_info(args: argparse.Namespace) -> None:
    from gradleak.capture.reader import CaptureFile

    summaries = []
    for path in args.files:
        with CaptureFile(path) as capture:
            summary = capture.summary()
            if not args.no_validate:
                summary["validation"] = capture.validate(progress=progress(args))
            summaries.append(summary)
    text = "\n\n".join("\n".join(f"{k:>20}: {v}" for k, v in s.items()) for s in summaries)
    emit(args, summaries if len(summaries) > 1 else summaries[0], text)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capture", help="record per-step gradients at θ0 to HDF5")
    common_flags(p)
    preset_flags(p)
    p.add_argument("--victim", required=True, help="checkpoint directory, or a registry name "
                   "with --random-init")
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--algo", choices=["ppo", "a2c"], default="ppo",
                   help="learning rule for --random-init (a checkpoint carries its own)")
    p.add_argument("--scenes", choices=["train", "heldout"], required=True)
    p.add_argument("--steps", type=int, required=True, help="steps in all (split over shards)")
    p.add_argument("--out", required=True)
    p.add_argument("--components", default=None, help="subset of cnn,fc,heads")
    p.add_argument("--shard", default="0/1", help="i/n: this process's part of the capture")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--loss", default=None, metavar="K=V,...",
                   help="the loss the client used: value=,entropy=,clip=,gamma=,lam= (required "
                   "for a checkpoint that declares none; overrides the declared keys)")
    p.add_argument("--advantage-norm", default=None, metavar="episode|none|minibatch:M",
                   help="per-episode (A − mean)/std, the capture protocol (default unless the "
                   "checkpoint declares its own), raw GAE, or per minibatch of M steps")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=run_capture_command)

    p = sub.add_parser("info", help="summarise and validate capture files")
    common_flags(p)
    p.add_argument("files", nargs="+")
    p.add_argument("--no-validate", action="store_true", help="skip the full NaN/Inf scan")
    p.set_defaults(func=run_info)
