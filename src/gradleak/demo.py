"""`gradleak demo`: the whole pipeline, for real, on the embedded default (freedoom2).

A short PPO training of the victim; a capture on training scenes and one on held-out scenes;
closed-form action recovery on the held-out capture; TRACE and LtI fitted on the training
capture; both evaluated with the action rule and the reference rows on the held-out capture;
an offline HTML report.
"""

from __future__ import annotations

import platform
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from gradleak.attacks.action_rules import policy_weight, recover_actions
from gradleak.attacks.exact import ExactAttack
from gradleak.capture.reader import CaptureFile
from gradleak.capture.run import CaptureJob, run_capture
from gradleak.envs.actions import action_set
from gradleak.errors import ConfigError
from gradleak.evaluation import evaluate_action_rules
from gradleak.evaluation.reconstructions import evaluate
from gradleak.io import check_output, read_json, write_json
from gradleak.presets import Preset
from gradleak.report.html import write_report
from gradleak.report.plots import plot_action_recovery
from gradleak.report.scores import table_columns, table_rows
from gradleak.report.tables import text_table
from gradleak.rl.trainer import train_victim
from gradleak.training.fit import fit_attacker

EXACT_WINDOWS = 4  # windows the training-free attack inverts (about 0.8 s per frame)

DEMO_RULES = ("odd-sign", "sign-agnostic", "sign-aware")
MARKER = ".gradleak-demo.json"  # says: this directory is a demo's output, these names its own
CAPTURE_FILES = tuple(f"{split}.h5{suffix}" for split in ("train", "heldout")
                      for suffix in ("", ".json", ".partial", ".lock"))
DEMO_ENTRIES = ("config.json", "results.json", "victim-ppo", "eval", "trace", "lti",
                *CAPTURE_FILES)


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


def run_demo(preset: Preset, out: Path, progress: bool = True) -> dict[str, Any]:
    start = time.perf_counter()
    prepare_output(out)
    write_json(out / "config.json", preset.to_dict())
    victim_dir = out / "victim-ppo"
    training = train_victim(preset, victim_dir, progress=progress)
    captures = {}
    for split, steps in (("train", preset.capture.steps_train),
                         ("heldout", preset.capture.steps_heldout)):
        path = out / f"{split}.h5"
        tick = time.perf_counter()
        result = run_capture(CaptureJob(victim=str(victim_dir), split=split, steps=steps,
                                        out=path, preset=preset, progress=progress))
        with CaptureFile(path) as capture:
            summary = capture.summary()
        captures[split] = {**result, "seconds": round(time.perf_counter() - tick, 2),
                           "success_rate": summary["success_rate"],
                           "scenes": summary["scenes"], "size_mb": summary["size_mb"]}
    recovery = evaluate_action_rules([out / "heldout.h5"], DEMO_RULES)
    evaluation_dir = out / "eval"
    picture = evaluation_dir / "heldout_actions.png"
    _action_picture(out / "heldout.h5", preset, picture)
    attackers = {}
    for kind, label in (("trace", "TRACE"), ("lti", "LtI")):
        attackers[label] = fit_attacker(kind, getattr(preset.attack, kind),
                                        getattr(preset.attack, f"{kind}_fit"),
                                        [str(out / "train.h5")], out / kind, progress=progress)
    # the training-free attack leads: one gradient and θ0 per frame, no attacker training
    evaluation = evaluate([out / "heldout.h5"], {label: str(out / kind) for kind, label in
                                                 (("trace", "TRACE"), ("lti", "LtI"))},
                          evaluation_dir, baselines={ExactAttack.name: preset.attack.exact},
                          baseline_windows=EXACT_WINDOWS)
    report = write_report(evaluation_dir)
    result = {"preset": preset.name, "out": str(out), "training": training,
              "captures": captures, "action_recovery_heldout": recovery,
              "attackers": attackers, "evaluation": evaluation, "report": str(report),
              "picture": str(picture), "seconds": round(time.perf_counter() - start, 1),
              "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads"}
    write_json(out / "results.json", result)
    result["text"] = _text(result, preset)
    return result


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


def _text(result: dict[str, Any], preset: Preset) -> str:
    training, captures = result["training"], result["captures"]
    rows = [{"rule": rule + (" *" if r["oracle_advantage_sign"] else ""),
             "accuracy": r["accuracy"], "steps": r["n"]}
            for rule, r in result["action_recovery_heldout"].items()]
    capture_rows = [{"split": split, "steps": c["steps"], "episodes": c["episodes"],
                     "scenes": c["scenes"], "success": c["success_rate"],
                     "steps/s": round(c["steps"] / c["seconds"], 1), "MB": c["size_mb"]}
                    for split, c in captures.items()]
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
        "closed-form action recovery on the held-out capture:",
        text_table(rows, ["rule", "accuracy", "steps"]),
        "* given the true sign of each advantage (an oracle: the paper's rule needs it)",
        "",
        f"reconstruction on the held-out capture ({result['evaluation']['windows']} windows of "
        f"T = {result['evaluation']['window']}; attackers trained "
        + ", ".join(f"{label} {a['minutes']:.1f} min" for label, a in
                    result["attackers"].items()) + "):",
        text_table(table_rows(result["evaluation"]["methods"]),
                   table_columns(table_rows(result["evaluation"]["methods"]))),
        f"LPIPS: {result['evaluation']['lpips']}",
        "",
        f"done in {result['seconds']} s; report: {result['report']}",
    ])
