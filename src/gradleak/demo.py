"""`gradleak demo`: the whole pipeline, for real, on the embedded default (freedoom2).

In the order a newcomer should read it: a short PPO training of the victim and its captures
(training scenes, held-out scenes); the actions read off single held-out gradients; frames from
the training-free attack (a step's gradient and θ0, with its neighbours' gradients where they saw
the same frame; no attacker training), printed within
the demo's first two minutes; then TRACE and LtI fitted on the training capture; and last
`gradleak audit` of the held-out capture with those attackers, IG and a small defense grid,
whose report.html opens with the verdict.
"""

from __future__ import annotations

import platform
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gradleak.attacks.action_rules import policy_weight, recover_actions
from gradleak.attacks.exact import ExactAttack
from gradleak.capture.reader import CaptureFile
from gradleak.capture.run import CaptureJob, run_capture
from gradleak.capture.schema import OWN_SUFFIXES
from gradleak.envs.actions import action_set
from gradleak.errors import ConfigError
from gradleak.evaluation import evaluate_action_rules
from gradleak.auditing import Audit, AuditConfig
from gradleak.evaluation.reconstructions import evaluate
from gradleak.io import check_output, read_json, write_json
from gradleak.presets import Preset
from gradleak.report.audit import write_audit_report
from gradleak.report.plots import plot_action_recovery
from gradleak.report.scores import table_columns, table_rows
from gradleak.report.tables import text_table
from gradleak.rl.trainer import train_victim
from gradleak.training.fit import fit_attacker

EXACT_WINDOWS = 4  # windows the training-free attack inverts (about 0.2 s per frame)
# the audit's grid in the demo: a quantiser, pruning and a DP guarantee, seconds each (under
# plain noise the training-free attack takes seconds per frame: the full grid is the audit's)
DEMO_DEFENSES = ["quant:8", "prune:0.1", "dpsgd:eps=1"]
AUDIT_WINDOWS = 32  # held-out windows the learned attackers and the references score

DEMO_RULES = ("odd-sign", "sign-agnostic", "sign-aware")
MARKER = ".gradleak-demo.json"  # says: this directory is a demo's output, these names its own
CAPTURE_FILES = tuple(f"{split}.h5{suffix}" for split in ("train", "heldout")
                      for suffix in OWN_SUFFIXES)
DEMO_ENTRIES = ("config.json", "results.json", "victim-ppo", "eval", "exact", "trace", "lti",
                "audit", "heldout_actions.png", *CAPTURE_FILES)


def prepare_output(out: Path) -> None:
    """A new or empty directory, or a previous demo's: then only the demo's own entries (those
    its marker names) are removed; anything else the user put there stays."""
    check_output(out, "--out", directory=True)
    marker = out / MARKER
    if out.exists() and any(out.iterdir()):
        if not marker.is_file():
            raise ConfigError(f"--out {out} is not empty and is not a previous demo's output (it "
                              f"has no {MARKER}): choose a new or empty directory")
        owned = read_json(marker, "demo marker").get("entries")
        if not isinstance(owned, list) or not all(isinstance(n, str) and n in DEMO_ENTRIES
                                                  for n in owned):
            raise ConfigError(f"{marker}: field 'entries' is not a list of the demo's own "
                              "outputs; remove the directory by hand if it is a demo's")
        for name in owned:
            _remove(out / name)
    write_json(marker, {"format": "gradleak-demo", "entries": list(DEMO_ENTRIES)})


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def run_demo(preset: Preset, out: Path, progress: bool = True,
             say: Callable[[str], None] = lambda text: None) -> dict[str, Any]:
    """`say` prints each finding as soon as it is measured (the demo leads with them)."""
    start = time.perf_counter()
    prepare_output(out)
    write_json(out / "config.json", preset.to_dict())
    victim_dir = out / "victim-ppo"
    training = train_victim(preset, victim_dir, progress=progress)
    captures = {split: _capture(preset, victim_dir, out / f"{split}.h5", split, steps, progress)
                for split, steps in (("train", preset.capture.steps_train),
                                     ("heldout", preset.capture.steps_heldout))}
    heldout = out / "heldout.h5"
    recovery = evaluate_action_rules([heldout], DEMO_RULES)
    _action_picture(heldout, preset, out / "heldout_actions.png")
    say(actions_text(recovery) + f"\n({_minutes(start)} into the demo)\n")
    exact = evaluate([heldout], {}, out / "exact", max_windows=EXACT_WINDOWS,
                     baselines={ExactAttack.name: preset.attack.training_free},
                     baseline_windows=EXACT_WINDOWS, reference_data=[out / "train.h5"])
    exact_seconds = time.perf_counter() - start
    say(exact_text(exact) + f"\n({_minutes(start)} into the demo)\n")
    attackers = {}
    for kind, label in (("trace", "TRACE"), ("lti", "LtI")):
        attackers[label] = fit_attacker(kind, *preset.attack.learned(kind),
                                        [str(out / "train.h5")], out / kind, progress=progress)
    audit = Audit(audit_config(heldout, out, preset), progress, preset=preset).run()
    report = write_audit_report(out / "audit",
                                [(out / "heldout_actions.png", ACTIONS_CAPTION)])
    clean = audit["stages"]["defense none"]["result"]
    result = {"preset": preset.name, "out": str(out), "training": training,
              "captures": captures, "action_recovery_heldout": recovery,
              "exact": exact, "exact_seconds_into_demo": round(exact_seconds, 1),
              "attackers": attackers, "evaluation": clean, "verdict": audit["verdict"],
              "report": str(report), "picture": str(out / "heldout_actions.png"),
              "seconds": round(time.perf_counter() - start, 1),
              "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads"}
    write_json(out / "results.json", result)
    result["text"] = _text(result, preset)
    return result


def audit_config(heldout: Path, out: Path, preset: Preset) -> AuditConfig:
    """The demo's audit: its attackers, IG and the small grid. Its defense stages run whatever
    the clock says (the grid is sized to finish in minutes): on a busy machine a budget would
    skip them, and the verdict would then say nothing about defenses."""
    return AuditConfig(capture=str(heldout), out=str(out / "audit"), preset=preset.name,
                       attackers={label: str(out / kind) for kind, label in
                                  (("trace", "TRACE"), ("lti", "LtI"))},
                       defenses=list(DEMO_DEFENSES), budget_minutes=10.0,
                       max_windows=AUDIT_WINDOWS, training_free_windows=EXACT_WINDOWS,
                       optimisation=["ig"], defenses_within_budget=False)


ACTIONS_CAPTION = ("Actions read off single gradients: above each private frame, the action "
                   "the agent took → the action the odd-sign rule recovered")


def _minutes(start: float) -> str:
    return f"{(time.perf_counter() - start) / 60:.1f} min"


def _capture(preset: Preset, victim_dir: Path, path: Path, split: str, steps: int,
             progress: bool) -> dict[str, Any]:
    tick = time.perf_counter()
    result = run_capture(CaptureJob(victim=str(victim_dir), split=split, steps=steps, out=path,
                                    preset=preset, progress=progress))
    with CaptureFile(path) as capture:
        summary = capture.summary()
    return {**result, "seconds": round(time.perf_counter() - tick, 2),
            "success_rate": summary["success_rate"], "scenes": summary["scenes"],
            "size_mb": summary["size_mb"]}


def _action_picture(path: Path, preset: Preset, picture: Path, steps: int = 10) -> None:
    """First steps of the first held-out episode: private frames, true and recovered actions."""
    with CaptureFile(path) as capture:
        rows = slice(0, min(steps, capture.num_rows))
        observation = capture.observation(rows, layers=[policy_weight(capture.roles)],
                                          with_theta0=False)
        target = capture.target(rows)
        scene = capture.scenes[int(capture.column("scene_ids", 0))]
    recovered = recover_actions(observation, "odd-sign").actions
    names = ([a.name for a in action_set(preset.env.doomnav.num_actions)]
             if preset.env.backend == "doomnav" else [str(k) for k in range(len(target.probs[0]))])
    plot_action_recovery(target.images, target.actions, recovered, names, picture,
                         f"held-out scene {scene}: true action → action recovered from the "
                         "per-step gradient alone (odd-sign rule)")


def actions_text(recovery: dict[str, Any]) -> str:
    rows = [{"rule": rule + (" *" if r["oracle_advantage_sign"] else ""),
             "accuracy": r["accuracy"], "steps": r["n"]} for rule, r in recovery.items()]
    return "\n".join(["actions read off single held-out gradients (closed form, no training):",
                      text_table(rows, ["rule", "accuracy", "steps"]),
                      "* given the true sign of each advantage (an oracle: the paper's rule "
                      "needs it)"])


def exact_text(exact: dict[str, Any]) -> str:
    methods = exact["methods"]
    row, mean = methods[ExactAttack.name], methods["mean training image"]
    lpips = (f" / LPIPS {row['lpips']:.3f} (mean image {mean['lpips']:.3f})"
             if "lpips" in row else "")
    return (f"frames from the held-out gradients, training-free ({row['frames']} frames, "
            f"{row['ms_per_frame']:.0f} ms each): PSNR {row['psnr']:.2f} dB "
            f"({row['psnr_gain_over_mean_image']:+.2f} over the mean training image) / SSIM "
            f"{row['ssim']:.3f}{lpips}")


def _text(result: dict[str, Any], preset: Preset) -> str:
    training, captures = result["training"], result["captures"]
    capture_rows = [{"split": split, "steps": c["steps"], "episodes": c["episodes"],
                     "scenes": c["scenes"], "success": c["success_rate"],
                     "steps/s": round(c["steps"] / c["seconds"], 1), "MB": c["size_mb"]}
                    for split, c in captures.items()]
    evaluation = result["evaluation"]
    rows = table_rows(evaluation["methods"])
    return "\n".join([
        f"gradleak demo: preset {preset.name}, {result['machine']}",
        f"victim {preset.train.victim} ({preset.env.doomnav.frame_size}x"
        f"{preset.env.doomnav.frame_size}, K={preset.env.doomnav.num_actions}) trained with "
        f"{preset.train.algo.upper()} for {training['updates']} updates "
        f"({training['env_steps']} steps): success rate {training['final_success_rate']:.2f}",
        "",
        "captures (one gradient per step at the frozen θ0):",
        text_table(capture_rows, ["split", "steps", "episodes", "scenes", "success", "steps/s",
                                  "MB"]),
        "",
        actions_text(result["action_recovery_heldout"]),
        "",
        exact_text(result["exact"]) + f" — {result['exact_seconds_into_demo'] / 60:.1f} min "
        "into the demo",
        "",
        f"every attack on the held-out capture ({evaluation['windows']} windows of "
        f"T = {evaluation['window']}; attackers trained "
        + ", ".join(f"{label} {a['minutes']:.1f} min" for label, a in
                    result["attackers"].items()) + "):",
        text_table(rows, table_columns(rows)),
        f"LPIPS: {evaluation['lpips']}",
        "",
        "verdict (gradleak audit):",
        *(f"- {line}" for line in result["verdict"]["headline"]),
        "",
        f"done in {result['seconds'] / 60:.1f} min; report: {result['report']}",
    ])
