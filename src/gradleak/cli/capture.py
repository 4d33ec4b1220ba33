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


def run_capture_plan(args: argparse.Namespace) -> None:
    from gradleak.capture.plan import CaptureJob, plan_capture, shard_output
    from gradleak.capture.schedule import job_lines, slurm_script, write_script
    from gradleak.rl.losses import parse_loss

    if args.shards < 1 or args.steps < args.shards:
        raise ConfigError(f"--shards {args.shards}: expected 1 to --steps ({args.steps})")
    if args.slurm is not None:
        from gradleak.io import check_output

        check_output(args.slurm, "--slurm")
        if Path(args.slurm).exists():
            raise ConfigError(f"--slurm {args.slurm} already exists: name a new file")
    # every argument checked as the shards will check it, before anyone runs them
    plan_capture(CaptureJob(victim=args.victim, split=args.scenes, steps=args.steps,
                            out=Path(args.out), preset=capture_preset(args),
                            random_init=args.random_init, algorithm=args.algo,
                            shard=(0, args.shards), seed=args.seed,
                            loss=parse_loss(args.loss) if args.loss is not None else None,
                            advantage_norm=args.advantage_norm or declared_norm(args)))
    lines, merge = job_lines(args, args.capture_actions, args.shards)
    shards = [str(shard_output(Path(args.out), (i, args.shards))) for i in range(args.shards)]
    result = {"commands": lines, "merge": merge, "shards": shards}
    if args.slurm is not None:
        write_script(Path(args.slurm), slurm_script(args, args.capture_actions, args.shards))
        result["slurm"] = args.slurm
    emit(args, result, "\n".join([*lines, f"# then: {merge}"]))


def run_merge(args: argparse.Namespace) -> None:
    from gradleak.capture.merge import merge_shards

    result = merge_shards(args.shards, args.out)
    emit(args, result, f"merged {len(result['shards'])} shards ({result['rows']} steps) into "
         f"{result['out']}")


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


def capture_flags(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The flags that say what a capture records (all but --shard): `capture` and
    `capture-plan` share them; returns them so a plan can write them out again."""
    return [
        p.add_argument("--victim", required=True, help="checkpoint directory, or a registry "
                       "name with --random-init"),
        p.add_argument("--random-init", action="store_true"),
        p.add_argument("--algo", choices=["ppo", "a2c"], default="ppo",
                       help="learning rule for --random-init (a checkpoint carries its own)"),
        p.add_argument("--scenes", choices=["train", "heldout"], required=True),
        p.add_argument("--steps", type=int, required=True,
                       help="steps in all (split over shards)"),
        p.add_argument("--out", required=True),
        p.add_argument("--components", default=None, help="subset of cnn,fc,heads"),
        p.add_argument("--seed", type=int, default=None),
        p.add_argument("--loss", default=None, metavar="K=V,...",
                       help="the loss the client used: value=,entropy=,clip=,gamma=,lam= "
                       "(required for a checkpoint that declares none; overrides the declared "
                       "keys)"),
        p.add_argument("--advantage-norm", default=None, metavar="episode|none|minibatch:M",
                       help="per-episode (A − mean)/std, the capture protocol (default unless "
                       "the checkpoint declares its own), raw GAE, or per minibatch of M "
                       "steps")]


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capture", help="record per-step gradients at θ0 to HDF5")
    common_flags(p)
    preset_flags(p)
    capture_flags(p)
    p.add_argument("--shard", default="0/1", help="i/n: this process's part of the capture")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=run_capture_command)

    p = sub.add_parser("capture-plan", help="a capture as a job array of N shards: one "
                       "`gradleak capture ... --shard i/N` line each (and a Slurm script), "
                       "then `gradleak merge`")
    flags = [*common_flags(p), *preset_flags(p), *capture_flags(p)]
    p.add_argument("--shards", type=int, required=True, help="N: processes or machines")
    p.add_argument("--slurm", default=None, metavar="FILE",
                   help="also write a Slurm array script (one task per shard) to FILE")
    p.set_defaults(func=run_capture_plan, capture_actions=flags)

    p = sub.add_parser("merge", help="shards of one capture as one file, without copying "
                       "(HDF5 virtual datasets)")
    common_flags(p)
    p.add_argument("shards", nargs="+", help="every shard file of the capture")
    p.add_argument("--out", required=True)
    p.set_defaults(func=run_merge)

    p = sub.add_parser("info", help="summarise and validate capture files")
    common_flags(p)
    p.add_argument("files", nargs="+")
    p.add_argument("--no-validate", action="store_true", help="skip the full NaN/Inf scan")
    p.set_defaults(func=run_info)
