"""The `gradleak` command. Each subcommand is a thin shell around a library function."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from gradleak.errors import ConfigError, GradleakError


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    elif not args.quiet:
        print(text)


def _preset(args: argparse.Namespace, base: str | None = None) -> Any:
    from gradleak.presets import load_preset

    return _apply_env_flags(args, load_preset(args.preset or base or "cpu-quick"))


def _apply_env_flags(args: argparse.Namespace, preset: Any) -> Any:
    """--set overrides, then --wad and --env, which replace the preset's environment."""
    from gradleak.presets import apply_override, validate_preset

    for assignment in getattr(args, "set", None) or []:
        apply_override(preset, assignment)
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


# -- scenes -----------------------------------------------------------------------------------
def cmd_scenes(args: argparse.Namespace) -> None:
    from gradleak.envs.geometry import CELL_AREA_M2
    from gradleak.envs.scenes import SceneCatalog
    from gradleak.report.tables import text_table

    catalog = SceneCatalog(args.wad)
    rows = []
    for split in ("train", "heldout"):
        for map_name in catalog.split_maps(split):
            geometry = catalog.geometry(map_name)
            rows.append({"map": map_name, "split": split, "regions": geometry.num_regions,
                         "largest_region_m2": round(max(geometry.region_sizes(), default=0)
                                                    * CELL_AREA_M2, 1)})
    excluded = catalog.excluded_maps()
    data = {"wad": str(catalog.wad.path), "maps": rows, "excluded": excluded,
            "train_scenes": sum(r["regions"] for r in rows if r["split"] == "train"),
            "heldout_scenes": sum(r["regions"] for r in rows if r["split"] == "heldout")}
    text = (f"{catalog.wad.path}\n" + text_table(rows, ["map", "split", "regions",
                                                        "largest_region_m2"])
            + f"\n{data['train_scenes']} training scenes, {data['heldout_scenes']} held-out "
            f"scenes; excluded maps: {', '.join(excluded) or 'none'}")
    _emit(args, data, text)


# -- train-victim -----------------------------------------------------------------------------
def cmd_train_victim(args: argparse.Namespace) -> None:
    from gradleak.rl.trainer import train_victim

    preset = _preset(args)
    preset.train.algo = args.algo
    if args.victim:
        preset.train.victim = args.victim
    if args.updates is not None:
        preset.train.updates = args.updates
    if args.seed is not None:
        preset.train.seed = args.seed
    result = train_victim(preset, Path(args.out), resume=args.resume,
                          progress=not (args.quiet or args.json))
    text = (f"trained {preset.train.victim} with {preset.train.algo.upper()}: "
            f"{result['updates']} updates, {result['env_steps']} steps, success rate "
            f"{result['final_success_rate']:.2f} (last 20% of updates) -> {args.out}")
    _emit(args, result, text)


# -- capture ----------------------------------------------------------------------------------
def _capture_preset(args: argparse.Namespace) -> Any:
    from gradleak.io import read_json, victim_directory
    from gradleak.presets import load_preset, preset_from_dict

    trained_with = [a for a in args.set or [] if a.strip().startswith("train.")]
    if trained_with and not args.random_init:
        raise ConfigError(f"--set {trained_with[0]}: a checkpoint declares the learning rule it "
                          "was trained with; to capture a client that used another loss, "
                          "declare it with --loss value=...,entropy=...,clip=...")
    if args.random_init or args.preset:
        preset = _preset(args)
    else:  # capture in the environment the checkpoint was trained in
        path = victim_directory(args.victim) / "victim.json"
        meta = read_json(path, "victim config")
        preset = (preset_from_dict(meta["preset"], f"victim config {path}: preset")
                  if "preset" in meta else load_preset("cpu-quick"))
        preset = _apply_env_flags(args, preset)
    if args.components:
        preset.capture.components = [c for c in args.components.split(",") if c]
    return preset


def _declared_norm(args: argparse.Namespace) -> str:
    """The checkpoint's declared advantage normalisation (an SB3 agent's), else per episode."""
    from gradleak.io import read_json, victim_directory

    if args.random_init:
        return "episode"
    path = victim_directory(args.victim) / "victim.json"
    return str(read_json(path, "victim config").get("advantage_norm", "episode")) \
        if path.is_file() else "episode"


def cmd_capture(args: argparse.Namespace) -> None:
    from gradleak.capture.run import CaptureJob, parse_shard, run_capture, shard_output
    from gradleak.rl.losses import parse_loss

    preset = _capture_preset(args)
    job = CaptureJob(victim=args.victim, split=args.scenes, steps=args.steps, out=Path(args.out),
                     preset=preset, random_init=args.random_init, algorithm=args.algo,
                     shard=parse_shard(args.shard), resume=args.resume,
                     overwrite=args.overwrite, progress=not (args.quiet or args.json),
                     seed=args.seed, loss=parse_loss(args.loss) if args.loss is not None
                     else None, advantage_norm=args.advantage_norm or _declared_norm(args))
    start = time.perf_counter()
    result = run_capture(job)
    result["seconds"] = round(time.perf_counter() - start, 2)
    out = shard_output(job.out, job.shard)
    text = f"capture {result['status']}: {out}"
    if result["status"] == "complete":
        text += f" ({result['steps']} steps, {result['episodes']} episodes, " \
                f"{result['seconds']} s)"
    _emit(args, result, text)


# -- info -------------------------------------------------------------------------------------
def cmd_info(args: argparse.Namespace) -> None:
    from gradleak.capture.reader import CaptureFile

    summaries = []
    for path in args.files:
        with CaptureFile(path) as capture:
            summary = capture.summary()
            if not args.no_validate:
                summary["validation"] = capture.validate(progress=not (args.quiet or args.json))
            summaries.append(summary)
    text = "\n\n".join("\n".join(f"{k:>20}: {v}" for k, v in s.items()) for s in summaries)
    _emit(args, summaries if len(summaries) > 1 else summaries[0], text)


# -- recover-actions --------------------------------------------------------------------------
def cmd_recover_actions(args: argparse.Namespace) -> None:
    from gradleak.evaluation import evaluate_action_rules
    from gradleak.report.tables import text_table

    rules = [r for r in args.rule.split(",") if r]
    results = evaluate_action_rules(args.files, rules, args.skip_nonfinite)
    data = results[rules[0]] if len(rules) == 1 else results
    text = _action_table(results) + "\n\n" + text_table(
        [row for row in results[rules[0]]["by_confidence"]], ["by", "low", "high", "n",
                                                             "accuracy"])
    _emit(args, data, text)


def _action_table(results: dict[str, dict[str, Any]]) -> str:
    from gradleak.report.tables import text_table

    rows = [{"rule": rule + (" (oracle sign of A)" if r["oracle_advantage_sign"] else ""),
             "accuracy": r["accuracy"], "n": r["n"]} for rule, r in results.items()]
    return text_table(rows, ["rule", "accuracy", "n"])


# -- learned attackers ------------------------------------------------------------------------
def cmd_train_attacker(args: argparse.Namespace) -> None:
    from gradleak.training.fit import fit_attacker

    preset = _preset(args)
    model = getattr(preset.attack, args.kind)
    fit = getattr(preset.attack, f"{args.kind}_fit")
    if args.epochs is not None:
        fit.epochs = args.epochs
    if args.lpips_weights:
        fit.lpips_weights = args.lpips_weights
    if args.defense is not None:  # an adaptive attacker: it trains under this defense
        fit.defense = _defense(args).spec
        fit.defense_seed = args.defense_seed
    fit.skip_nonfinite = args.skip_nonfinite
    result = fit_attacker(args.kind, model, fit, args.data, Path(args.out), resume=args.resume,
                          progress=not (args.quiet or args.json))
    last = result["last"]
    text = (f"trained {args.kind} ({result['parameters']:,} parameters) for {result['epochs']} "
            f"epochs in {result['minutes']:.1f} min: validation PSNR "
            f"{last.get('val_psnr', float('nan')):.2f} dB -> {args.out}")
    _emit(args, result, text)


def cmd_train_decoder(args: argparse.Namespace) -> None:
    from gradleak.training.auxiliary import fit_decoder

    preset = _preset(args)
    fit = preset.attack.decoder_fit
    for name in ("epochs", "extra_frames"):
        if getattr(args, name) is not None:
            setattr(fit, name, getattr(args, name))
    if args.minutes is not None:
        fit.time_limit_minutes = args.minutes
    if args.defense is not None:  # adaptive: features recovered from defended gradients
        fit.defense, fit.defense_seed = _defense(args).spec, args.defense_seed
    fit.skip_nonfinite = args.skip_nonfinite
    result = fit_decoder(preset.attack.decoder, fit, args.data, Path(args.out),
                         resume=args.resume, progress=not (args.quiet or args.json))
    last = result["last"]
    frames = result["train_frames"]
    text = (f"trained the analytic decoder ({result['parameters']:,} parameters) on "
            f"{frames['captured']:,} captured + {frames['rendered']:,} rendered frames for "
            f"{result['epochs']} epochs in {result['minutes']:.1f} min: validation PSNR "
            f"{last.get('val_psnr', float('nan')):.2f} dB, SSIM "
            f"{last.get('val_ssim', float('nan')):.3f} -> {args.out}")
    _emit(args, result, text)


DISPLAY_NAMES = {"trace": "TRACE", "lti": "LtI", "decoder": "analytic+decoder"}


def _attackers(args: argparse.Namespace) -> dict[str, str]:
    attackers = {}
    for item in args.attacker:
        name, sep, path = item.partition("=")
        if not sep:
            path = name
            from gradleak.io import read_json
            from gradleak.training.checkpoint import META

            name = read_json(Path(path) / META, "attacker config").get("kind", Path(path).name)
            name = DISPLAY_NAMES.get(name, name)
        attackers[name] = path
    baselines = _baseline_names(args)
    if "lti" in baselines and "LtI" not in attackers:
        lti = args.lti or str(Path(args.attacker[0].partition("=")[2] or args.attacker[0])
                              .parent / "lti")
        attackers["LtI"] = lti
    return attackers


def _baseline_names(args: argparse.Namespace) -> list[str]:
    from gradleak.attacks.optim.solve import BASELINES

    names = [b for b in (args.baselines or "").split(",") if b]
    allowed = ["lti", "action-rule", *BASELINES.names()]
    for name in names:
        if name not in allowed:
            raise ConfigError(f"--baselines {name!r}: expected some of {', '.join(allowed)}")
    return names


def _optim_config(args: argparse.Namespace, name: str) -> Any:
    """A baseline's settings: the preset's IG/DLG, then --iters, --time-limit, --restarts."""
    from gradleak.attacks.optim.solve import baseline_config

    preset = _preset(args, "cpu-bench")
    families = {"ig": preset.attack.ig, "dlg": preset.attack.dlg}
    overrides = {key: value for key, value in (("time_limit_s", args.time_limit),
                                               ("restarts", args.restarts),
                                               ("batch", args.batch)) if value is not None}
    return baseline_config(name, families, iterations=args.iters, **overrides)


def cmd_evaluate(args: argparse.Namespace) -> None:
    from gradleak.attacks.optim.solve import BASELINES
    from gradleak.evaluation.reconstructions import evaluate
    from gradleak.report.evaluation import table_columns, table_rows
    from gradleak.report.tables import text_table

    optim = {name.upper().replace("-PROBE", " (probe loss)"): _optim_config(args, name)
             for name in _baseline_names(args) if name in BASELINES}
    defense = _defense(args)
    result = evaluate(args.data, _attackers(args), Path(args.out), args.lpips_weights,
                      args.max_windows, baselines=optim,
                      baseline_windows=args.baseline_windows,
                      progress=not (args.quiet or args.json), defense=defense,
                      skip_nonfinite=args.skip_nonfinite)
    rows = table_rows(result["methods"])
    text = (text_table(rows, table_columns(rows))
            + f"\nLPIPS: {result['lpips']}\noutputs in {args.out}")
    _emit(args, result, text)


def _defense(args: argparse.Namespace) -> Any:
    from gradleak.defenses import parse_defense

    return parse_defense(args.defense, args.defense_seed) if args.defense is not None else None


def cmd_defend(args: argparse.Namespace) -> None:
    from gradleak.defenses.files import defend_capture

    result = defend_capture(args.input, _defense(args), args.out, args.overwrite,
                            progress=not (args.quiet or args.json),
                            skip_nonfinite=args.skip_nonfinite)
    last = result["defenses"][-1]
    extras = "".join(f", {t['name']}: σ = {t['sigma']:.4g}, ε = {t['achieved_eps']:.3g}"
                     for t in last["transforms"] if t["name"] == "dpsgd")
    _emit(args, result, f"{result['rows']} gradients defended with {last['spec']}{extras} -> "
          f"{result['out']}")


def cmd_attack(args: argparse.Namespace) -> None:
    from gradleak.evaluation.baselines import attack_steps
    from gradleak.report.tables import text_table

    result = attack_steps(args.data, args.index, args.method, _optim_config(args, args.method),
                          Path(args.out), progress=not (args.quiet or args.json))
    columns = ["index", "psnr", "ssim", "action", "true_action", "matching_loss"]
    rows = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in step.items()}
            for step in result["steps"]]
    text = (text_table(rows, columns) + f"\n{result['seconds_per_frame']:.2f} s per frame; "
            f"history: {Path(args.out) / 'history.png'}")
    _emit(args, result, text)


def _defense_flags(parser: argparse.ArgumentParser, required: bool, seed: int = 0) -> None:
    parser.add_argument("--defense", required=required, default=None, metavar="SPEC",
                        help="e.g. quant:8, prune:0.1, noise:0.01, dpsgd:eps=5,delta=1e-5,"
                        "clip=1, agg:4, or a chain prune:0.1+noise:0.01")
    parser.add_argument("--defense-seed", type=int, default=seed,
                        help=f"seeds the defense's noise (default {seed})")


def _optim_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None, help="iteration budgets: cpu-quick, "
                        "cpu-bench (default) or paper")
    parser.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                        help="override a preset field, e.g. attack.ig.lr=0.05 (repeatable)")
    parser.add_argument("--iters", type=int, default=None, help="optimisation iterations")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds per batch of frames; stop there and keep where it got")
    parser.add_argument("--restarts", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="frames solved at once")


def cmd_analytic(args: argparse.Namespace) -> None:
    from gradleak.evaluation.analytic import evaluate_analytic

    results = evaluate_analytic(args.files, args.max_rows, args.invert, args.conv,
                                args.skip_nonfinite)
    lines = []
    for path, r in results.items():
        layers = ", ".join(f"{name} {v['median_relative_error']:.2e}"
                           for name, v in r["layer_inputs"].items())
        lines.append(f"{path}: {r['rows']} steps; action {100 * r['action_accuracy']:.2f}%; "
                     f"max |Δπ| {r['probs_max_abs_error']:.2e}, |ΔV| "
                     f"{r['values_max_abs_error']:.2e}, |ΔA| {r['advantage_max_abs_error']:.2e},"
                     f" |ΔR| {r['returns_max_abs_error']:.2e}; layer inputs (median relative "
                     f"error): {layers}")
        if "feature_inversion" in r:
            inv = r["feature_inversion"]
            mean = inv["psnr_of_their_mean_image"]
            lines.append(f"  frames from the FC input by optimisation ({inv['frames']}): PSNR "
                         f"{inv['psnr']:.2f} dB (their mean image {mean:.2f}), SSIM "
                         f"{inv['ssim']:.3f}, {inv['seconds_per_frame']:.2f} s/frame")
        if "conv_stack" in r:
            lines += conv_stack_lines(r["conv_stack"])
    _emit(args, results, "\n".join(lines))


def conv_stack_lines(conv: dict) -> list[str]:
    layers = ", ".join(f"{name} {tuple(v['shape'])} {v['median_relative_error']:.1e}"
                       for name, v in conv["layers"].items())
    return [f"  through the conv stack ({conv['frames']} steps, "
            f"{1000 * conv['recovery_seconds_per_frame']:.0f} ms/frame), conv inputs (median "
            f"relative error): {layers}",
            f"  frames from {conv['frames_from']}'s input: PSNR {conv['psnr']:.2f} dB, SSIM "
            f"{conv['ssim']:.3f} ({conv['frame_seconds_per_frame']:.2f} s/frame); from the true "
            f"map {conv['psnr_from_true_map']:.2f} / {conv['ssim_from_true_map']:.3f}; their "
            f"mean image {conv['psnr_of_their_mean_image']:.2f} / "
            f"{conv['ssim_of_their_mean_image']:.3f}"]


def cmd_fedavg(args: argparse.Namespace) -> None:
    from gradleak.fedavg.attacks import FedAttackConfig
    from gradleak.fedavg.client import ClientConfig
    from gradleak.fedavg.experiment import run_fedavg

    client = ClientConfig(epochs=args.epochs, samples=args.samples, batch=args.batch,
                          lr=args.client_lr, optimiser=args.optimiser,
                          batchnorm_train=args.batchnorm_train, seed=args.seed)
    attack = FedAttackConfig(method=args.attack, iterations=args.iters, cls=args.cls,
                             seed=args.seed)
    result = run_fedavg(args.dataset, args.model, client, attack, Path(args.out),
                        progress=not (args.quiet or args.json))
    text = (f"{args.attack} on {result['dataset']} (E={args.epochs}, N={args.samples}, "
            f"B={args.batch}): PSNR {result['psnr']:.2f} ± {result['psnr_std']:.2f} dB, SSIM "
            f"{result['ssim']:.3f}, L_sim raw {result['l_sim_raw']:.4f}"
            + (f" (scaled {result['l_sim_scaled']:.4f})" if result["l_sim_scaled"] is not None
               else "") + f", {result['seconds']:.1f} s -> {args.out}")
    _emit(args, result, text)


def cmd_report(args: argparse.Namespace) -> None:
    from gradleak.report.html import write_report

    path = write_report(Path(args.run))
    _emit(args, {"report": str(path)}, f"report: {path}")


# -- demo -------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> None:
    from gradleak.demo import run_demo

    preset = _preset(args, "cpu-quick")  # every argument checked before the disk is touched
    progress = not (args.quiet or args.json)
    result = run_demo(preset, Path(args.out), progress=progress)
    _emit(args, result, result.pop("text"))


# -- parser -----------------------------------------------------------------------------------
def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE first: it registers victims, attacks or defenses "
                        "(repeatable; entry points in the group gradleak.plugins load too)")


def _nonfinite_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip-nonfinite", action="store_true",
                        help="leave out steps whose gradient holds NaN/Inf and say how many "
                        "(default: refuse the file, naming the rows)")


def _preset_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None, help="cpu-quick, cpu-bench or paper")
    parser.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                        help="override one preset field, e.g. train.updates=3 (repeatable)")
    parser.add_argument("--wad", default=None, help="another Doom IWAD/PWAD (default: "
                        "freedoom2.wad shipped with vizdoom)")
    parser.add_argument("--env", default=None, help="gym:ENV_ID to use any RGB Gymnasium "
                        "environment instead of DoomNav")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradleak", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="train a small victim, capture, recover actions")
    _common(p)
    p.add_argument("--preset", default="cpu-quick")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE")
    p.add_argument("--out", default="runs/demo")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("scenes", help="list the maps, regions and the train/held-out split")
    _common(p)
    p.add_argument("--wad", default=None)
    p.set_defaults(func=cmd_scenes)

    p = sub.add_parser("train-victim", help="train a victim policy with PPO or A2C")
    _common(p)
    _preset_flags(p)
    p.add_argument("--algo", choices=["ppo", "a2c"], default="ppo")
    p.add_argument("--victim", default=None, help="registry name (default: the preset's)")
    p.add_argument("--updates", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true")
    p.set_defaults(func=cmd_train_victim)

    p = sub.add_parser("capture", help="record per-step gradients at θ0 to HDF5")
    _common(p)
    _preset_flags(p)
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
    p.set_defaults(func=cmd_capture)

    p = sub.add_parser("train-attacker", help="fit TRACE or LtI on training-scene captures")
    _common(p)
    _nonfinite_flag(p)
    _preset_flags(p)
    p.add_argument("--kind", choices=["trace", "lti"], default="trace")
    p.add_argument("--data", nargs="+", required=True, help="training-scene capture files")
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lpips-weights", default=None, help="torchvision AlexNet weights file")
    p.add_argument("--resume", action="store_true")
    _defense_flags(p, required=False, seed=1)
    p.set_defaults(func=cmd_train_attacker)

    p = sub.add_parser("train-decoder", help="fit the analytic decoder on training-scene "
                       "frames: θ0's conv features → frame, no gradients needed")
    _common(p)
    _nonfinite_flag(p)
    _preset_flags(p)
    p.add_argument("--data", nargs="+", required=True,
                   help="training-scene capture files (their frames and scenes are used)")
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--extra-frames", type=int, default=None,
                   help="frames to render on the captures' training scenes (random policy)")
    p.add_argument("--minutes", type=float, default=None,
                   help="stop at the training step that passes this (a partial epoch)")
    p.add_argument("--resume", action="store_true")
    _defense_flags(p, required=False, seed=1)
    p.set_defaults(func=cmd_train_decoder)

    p = sub.add_parser("evaluate", help="score attackers and baselines on held-out captures")
    _common(p)
    _nonfinite_flag(p)
    p.add_argument("--attacker", action="append", required=True,
                   help="an attacker run directory, or NAME=DIR (repeatable)")
    p.add_argument("--data", nargs="+", required=True, help="held-out capture files")
    p.add_argument("--baselines", default="lti,action-rule",
                   help="lti (from --lti, default: the attacker's sibling 'lti' directory), "
                   "action-rule, and the optimisation baselines dlg, ig, dlg-probe, ig-probe")
    p.add_argument("--lti", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--baseline-windows", type=int, default=2,
                   help="windows the optimisation baselines invert (they are slow)")
    p.add_argument("--lpips-weights", default=None)
    _defense_flags(p, required=False)
    _optim_flags(p)
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("defend", help="write a defended copy of a capture file")
    _common(p)
    _nonfinite_flag(p)
    p.add_argument("input", help="a capture file")
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true")
    _defense_flags(p, required=True)
    p.set_defaults(func=cmd_defend)

    p = sub.add_parser("attack", help="invert single steps with DLG or IG; save the history")
    _common(p)
    p.add_argument("method", help="dlg, ig, dlg-probe or ig-probe")
    p.add_argument("--data", required=True, help="a capture file")
    p.add_argument("--index", type=int, action="append", required=True,
                   help="a row of the capture (repeatable)")
    p.add_argument("--out", required=True)
    _optim_flags(p)
    p.set_defaults(func=cmd_attack)

    p = sub.add_parser("analytic", help="closed-form recovery of layer inputs, π, V, a, A, R")
    _common(p)
    _nonfinite_flag(p)
    p.add_argument("files", nargs="+", help="capture files")
    p.add_argument("--max-rows", type=int, default=None)
    p.add_argument("--invert", type=int, default=0, metavar="N",
                   help="also reconstruct N frames from the recovered conv features")
    p.add_argument("--conv", type=int, default=0, metavar="N",
                   help="also recover every determined conv input on N steps, and frames "
                        "from the deepest")
    p.set_defaults(func=cmd_analytic)

    p = sub.add_parser("fedavg", help="simulate a FedAvg client and invert its update")
    _common(p)
    p.add_argument("--dataset", default="digits",
                   help="digits, photos (embedded stand-ins), femnist:PATH or cifar100:PATH")
    p.add_argument("--model", default="cnn", help="cnn (LEAF/SME), cnn-bn or lenet-sigmoid")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--client-lr", type=float, default=0.004)
    p.add_argument("--optimiser", default="sgd", help="the client's: sgd, momentum, adamw")
    p.add_argument("--batchnorm-train", action="store_true",
                   help="the client trains with BatchNorm in train mode (model cnn-bn)")
    p.add_argument("--attack", default="nlsme", help="ig, sme, nlsme, sme-dvec, nlsme-nod")
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--cls", type=float, default=0.0, help="λ_cls (uses the labels)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_fedavg)

    p = sub.add_parser("report", help="write a self-contained report.html for an evaluation")
    _common(p)
    p.add_argument("run")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("info", help="summarise and validate capture files")
    _common(p)
    p.add_argument("files", nargs="+")
    p.add_argument("--no-validate", action="store_true", help="skip the full NaN/Inf scan")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("recover-actions", help="closed-form action recovery and its accuracy")
    _common(p)
    _nonfinite_flag(p)
    p.add_argument("files", nargs="+")
    p.add_argument("--rule", default="odd-sign",
                   help="odd-sign, sign-agnostic, sign-aware (oracle sign), comma-separated")
    p.set_defaults(func=cmd_recover_actions)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from gradleak.plugins import load_plugins

        load_plugins(args.plugin)
        args.func(args)
    except GradleakError as err:
        print(f"gradleak: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.filename is None:  # not about a path the user gave: a real bug, keep its trace
            raise
        print(f"gradleak: error: {err.filename}: {err.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gradleak: interrupted (an interrupted capture resumes with --resume)",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
