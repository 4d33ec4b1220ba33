"""Score the closed-form recovery against the capture's private ground truth."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from gradleak.attacks.analytic import invert_features, module_input, recover_analytically
from gradleak.capture.reader import CaptureFile
from gradleak.errors import ConfigError
from gradleak.inversion.conv_blocks import conv_blocks
from gradleak.inversion.frame_solve import SAME_FRAME_TOLERANCE
from gradleak.metrics.scores import image_scores
from gradleak.threat import Observation, Target
from gradleak.victims.base import VictimConfig, create_victim, rebuildable, victim_at_theta0

CHUNK_ROWS = 128  # rows of gradients held at once, at most
CHUNK_BYTES = 128 * 2**20  # and at most this many bytes of them (float32; the scoring's float64
# copies double it): 128 rows of the paper's cnn (3.7 MB each) peaked at 1.6 GB
# a recovered advantage or return within this relative error counts as exact: the float32
# wire format gives 1e-6, float16 storage about 1e-3 (the audit's "comes back exactly")
EXACT_RELATIVE = 1e-3


def true_layer_inputs(observation: Observation, target: Target, modules: list[str]
                      ) -> dict[str, np.ndarray]:
    """What each Linear module really received for the private frames (forward pre-hooks)."""
    victim = victim_at_theta0(observation)
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
    named = dict(victim.named_modules())
    handles = [named[name].register_forward_pre_hook(
        lambda module, args, name=name: seen[name].append(args[0].detach()))
        for name in modules]
    try:
        with torch.no_grad():
            for start in range(0, len(target.images), 256):
                rows = slice(start, start + 256)
                victim(*(None if part is None else torch.from_numpy(part[rows])
                         for part in (target.images, target.goals, target.hidden_states)))
    finally:
        for handle in handles:
            handle.remove()
    return {name: torch.cat(values).double().numpy() for name, values in seen.items()}


def relative_errors(estimate: np.ndarray, truth: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.linalg.norm(estimate - truth, axis=1) / np.linalg.norm(truth, axis=1)


def row_scores(observation: Observation, target: Target) -> dict[str, np.ndarray]:
    """Per-row errors of the closed form on one chunk of rows: small arrays, kept across chunks
    while the gradients themselves are dropped."""
    result = recover_analytically(observation)
    extras = result.extras
    rows = {}
    if rebuildable(observation.victim):  # the truth needs the model (a wrapped one: its factory)
        truth_inputs = true_layer_inputs(observation, target, list(extras["layer_inputs"]))
        rows = {f"layer:{name}": relative_errors(estimate, truth_inputs[name])
                for name, estimate in extras["layer_inputs"].items()}
    goal_input = observation.roles.goal_input
    if goal_input in extras["layer_inputs"] and target.goals is not None:
        rows.update(goal_errors(extras["layer_inputs"][goal_input], target.goals))
    advantage_error = np.abs(extras["advantages"] - target.advantages)
    return {**rows, "correct": result.actions == target.actions,
            "probs": np.abs(extras["probs"] - target.probs).max(1),
            "values": np.abs(extras["values"] - target.values),
            "advantage": advantage_error,
            "advantage_relative": advantage_error / np.maximum(np.abs(target.advantages), 1e-8),
            "returns": np.abs(extras["returns"] - target.returns),
            "returns_relative": np.abs(extras["returns"] - target.returns)
            / np.maximum(np.abs(target.returns), 1e-8), "misfit": extras["misfit"]}


def goal_errors(estimate: np.ndarray, truth: np.ndarray) -> dict[str, np.ndarray]:
    """Where the agent is heading, in DoomNav's units: the goal is (distance / 10 m, sin, cos)
    of the bearing, so the errors are metres of distance and degrees of bearing."""
    def bearing(goal: np.ndarray) -> np.ndarray:
        return np.degrees(np.arctan2(goal[:, 1], goal[:, 2]))

    turn = (bearing(estimate) - bearing(truth) + 180.0) % 360.0 - 180.0
    return {"goal_distance_m": 10.0 * np.abs(estimate[:, 0] - truth[:, 0]),
            "goal_bearing_deg": np.abs(turn)}


def summarise_rows(chunks: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    joined = {key: np.concatenate([chunk[key] for chunk in chunks]) for key in chunks[0]}
    goal = {f"{key}_median": float(np.median(joined[key])) for key in ("goal_distance_m",
                                                                       "goal_bearing_deg")
            if key in joined}
    layers = {key.removeprefix("layer:"): {
        "median_relative_error": float(np.nanmedian(errors)),
        "max_relative_error": float(np.nanmax(errors)),
        "rows_without_signal": int(np.isnan(errors).sum())}
        for key, errors in joined.items() if key.startswith("layer:")}
    return {"rows": len(joined["correct"]), "action_accuracy": float(joined["correct"].mean()),
            "probs_max_abs_error": float(joined["probs"].max()),
            "values_max_abs_error": float(joined["values"].max()),
            "advantage_max_abs_error": float(joined["advantage"].max()),
            "advantage_median_relative_error": float(np.median(joined["advantage_relative"])),
            "returns_max_abs_error": float(joined["returns"].max()),
            "advantage_exact_fraction": float(np.mean(joined["advantage_relative"]
                                                      <= EXACT_RELATIVE)),
            "returns_exact_fraction": float(np.mean(joined["returns_relative"]
                                                    <= EXACT_RELATIVE)),
            "median_misfit": float(np.nanmedian(joined["misfit"])), "layer_inputs": layers,
            **({"goal": goal} if goal else {})}


def score(observation: Observation, target: Target) -> dict[str, Any]:
    return summarise_rows([row_scores(observation, target)])


def score_inversion(observation: Observation, target: Target, count: int) -> dict[str, Any]:
    """Frames from the recovered FC input alone (optimisation), on `count` evenly spaced steps."""
    from gradleak.metrics.images import to_unit_tensor

    rows = np.linspace(0, len(observation) - 1, count).astype(int)
    module = observation.roles.feature_linear
    features = recover_analytically(observation).extras["layer_inputs"][module][rows]
    start = time.perf_counter()
    frames = invert_features(observation, features, module)
    seconds = (time.perf_counter() - start) / count
    truth, guess = to_unit_tensor(target.images[rows]), to_unit_tensor(frames)
    return {"frames": count, **image_scores(guess, truth), "seconds_per_frame": seconds,
            **mean_image_scores(target.images[rows])}


def score_conv_stack(observation: Observation, target: Target, count: int,
                     rank_frames: int = 0,
                     rows: np.ndarray | None = None,
                     same_frame_tolerance: float = SAME_FRAME_TOLERANCE,
                     say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Recovery through the conv stack on `count` evenly spaced steps (or the given `rows` of
    the observation): each determined conv input against the truth, then frames from the
    first conv's own equations (its outputs and its weight gradient), against the same solve
    from the true first-block output, with the quadratic prior alone, without the
    weight-gradient equations and as if the equations were exact. A scored step whose neighbour in the observation saw the same frame
    (`frame_solve.same_frames` at `same_frame_tolerance`; 0: none) is solved together with it,
    as the attack solves a stream. With `rank_frames`, the rank of the equations of that many
    frames as a fraction of the unknowns (minutes per 84×84 frame)."""
    from gradleak.attacks.conv_inputs import observed_conv_inputs
    from gradleak.attacks.exact import bias_gradient
    from gradleak.inversion.frame_solve import Tie, same_frames

    scored = np.linspace(0, len(observation) - 1, count).astype(int) if rows is None \
        else np.asarray(rows)
    solved = beside(scored, len(observation)) if same_frame_tolerance else scored
    subset = observation.steps(solved)
    start = time.perf_counter()
    say(f"  the conv inputs of {len(solved)} steps, layer by layer")
    found = observed_conv_inputs(subset)
    recovery_seconds = (time.perf_counter() - start) / len(solved)
    deepest = list(found.inputs)[-1]
    tie = same_frames(found.inputs[deepest], subset.episode_ids, subset.step_in_episode,
                      same_frame_tolerance)
    # the scored steps and the neighbours that saw their frames
    kept = torch.isin(tie.group, tie.group[np.searchsorted(solved, scored)])
    found, solved, tie = found.steps(kept), solved[kept.numpy()], Tie.of(tie.group[kept])
    within = np.searchsorted(solved, scored)  # where each scored step is among those solved
    images = target.images[solved]
    victim = victim_at_theta0(observation)
    with torch.no_grad():
        truth = {name: module_input(victim, name, torch.from_numpy(images)).double()
                 for name in found.inputs}
    layers = {name: layer_errors(estimate[within], truth[name][within], found.noise[name][within])
              for name, estimate in found.inputs.items()}
    double = victim_at_theta0(observation).double()
    first = conv_blocks(double)[0]
    part = observation.steps(solved)
    gradient = first.weight_gradient(
        torch.from_numpy(part.block(f"{first.name}.weight").astype(np.float64)))
    solves = frame_solves(double, found, deepest, truth[deepest], gradient,
                          bias_gradient(part, first), images, rank_frames, tie, within, say)
    main = solves.pop("equations")
    return {"frames": len(scored), "layers": layers,
            "recovery_seconds_per_frame": recovery_seconds,
            "same_frame_steps": int((tie.size[within] > 1).sum()), "steps_solved": len(solved),
            "frames_from": deepest, "psnr": main["psnr"], "ssim": main["ssim"],
            **({"lpips": main["lpips"]} if "lpips" in main else {}),
            "frame_seconds_per_frame": main["seconds_per_frame"],
            "equation_residual_median": main["residual_median"],
            "equations_per_unknown": main["equations_per_unknown"],
            **{key: main[key] for key in ("rank_fraction", "rank_frames") if key in main},
            "psnr_from_true_map": solves["from_true_map"]["psnr"],
            "ssim_from_true_map": solves["from_true_map"]["ssim"], "solves": solves,
            **mean_image_scores(images[within])}


def beside(rows: np.ndarray, count: int) -> np.ndarray:
    """The rows and each one's neighbours, within 0 .. count − 1, sorted."""
    return np.unique(np.clip(np.concatenate([rows - 1, rows, rows + 1]), 0, count - 1))


def layer_errors(estimate: torch.Tensor, truth: torch.Tensor, noise: torch.Tensor
                 ) -> dict[str, Any]:
    known = torch.isfinite(noise)  # pixels no conv reads are unknown, not 0
    errors = relative_errors((estimate * known).flatten(1).numpy(),
                             (truth * known).flatten(1).numpy())
    return {"shape": list(estimate.shape[1:]), "median_relative_error": float(np.median(errors)),
            "max_relative_error": float(np.max(errors)),
            "unread_fraction": float(1 - known.double().mean())}


def frame_solves(victim: Any, found: Any, deepest: str, true_map: torch.Tensor,
                 gradient: torch.Tensor, bias: torch.Tensor | None, images: np.ndarray,
                 rank_frames: int = 0, tie: Any = None, scored: np.ndarray | None = None,
                 say: Callable[[str], None] = lambda _: None) -> dict[str, dict[str, float]]:
    """Each way of getting the frame under the first conv, scored against the real frames of
    the `scored` steps (all by default; `tie`: the steps that saw one frame)."""
    from dataclasses import replace

    from gradleak.inversion.first_conv import first_conv_equations
    from gradleak.inversion.frame_solve import FrameSolve, solve_frames

    transform = victim.roles().transform
    output, noise, upstream = found.inputs[deepest], found.noise[deepest], found.upstream[deepest]
    exact = torch.where(torch.isfinite(noise), torch.zeros_like(noise), noise)
    equations = first_conv_equations(victim, output, noise, upstream, gradient,
                                     bias_gradient=bias)
    scored = np.arange(len(images)) if scored is None else scored
    tied = tie is not None and not tie.trivial
    runs = {"equations": lambda: solve_frames(equations, transform, tie=tie),
            # with no step tied it is the solve above: its scores are copied, not solved again
            **({"each_step_alone": lambda: solve_frames(equations, transform)} if tied else {}),
            "quadratic_prior": lambda: solve_frames(equations, transform,
                                                    FrameSolve(rounds=0), tie=tie),
            "without_weight_gradient": lambda: solve_frames(
                replace(equations, weight_gradient=None), transform, tie=tie),
            "as_if_exact": lambda: solve_frames(equations, transform, noise=None, tie=tie),
            "from_true_map": lambda: solve_frames(first_conv_equations(
                victim, true_map, exact, upstream, gradient, bias_gradient=bias), transform,
                tie=tie)}
    scores = {}
    for number, (name, run) in enumerate(runs.items(), start=1):
        say(f"  frames of {len(images)} steps, solve {number} of {len(runs)}: "
            f"{name.replace('_', ' ')}")
        start = time.perf_counter()
        frames, residuals = run()
        seconds = (time.perf_counter() - start) / len(images)
        scores[name] = {**frame_scores(frames[scored], images[scored]),
                        "seconds_per_frame": seconds}
        if residuals is not None:
            scores[name]["residual_median"] = {key: float(value.median())
                                               for key, value in residuals.items()}
    if not tied:
        scores["each_step_alone"] = {**scores["equations"]}
    unknowns = int(np.prod(transform.frame_shape))
    scores["equations"]["equations_per_unknown"] = float(
        (equations.on[scored].flatten(1).sum(1).double().mean() + gradient[0].numel())
        / unknowns)
    if rank_frames:
        from gradleak.attacks.equation_rank import equation_rank

        height, width, channels = transform.frame_shape
        shape = torch.Size((1, channels, height, width))
        fractions = [equation_rank(equations, int(frame), shape) / unknowns
                     for frame in scored[:rank_frames]]
        scores["equations"].update(rank_fraction=float(np.mean(fractions)),
                                   rank_frames=len(fractions))
    return scores


def frame_scores(frames: torch.Tensor, images: np.ndarray) -> dict[str, float]:
    from gradleak.metrics.images import to_unit_tensor

    guess = to_unit_tensor(frames.clamp(0, 255).round().to(torch.uint8).numpy())
    return image_scores(guess, to_unit_tensor(images))


def mean_image_scores(images: np.ndarray) -> dict[str, float]:
    from gradleak.metrics.images import to_unit_tensor

    real = to_unit_tensor(images)
    mean = real.mean(0, keepdim=True).expand_as(real)
    return {f"{key}_of_their_mean_image": value
            for key, value in image_scores(mean, real).items()}


def check_attacks_apply(config: VictimConfig, invert: int, conv: int) -> None:
    """Refuse, naming the reason, an attack the victim's structure does not allow."""
    from gradleak.inversion.conv_blocks import deepest_inputs

    if not invert and not conv:  # the closed form needs only the gradients and θ0
        return
    victim = create_victim(config)
    if invert and victim.roles().feature_linear is None:
        raise ConfigError(f"--invert: victim {config.name} has no Linear layer reading its conv "
                          "features, whose input the closed form recovers")
    if conv:
        deepest_inputs(victim)


def evaluate_analytic(paths: Sequence[str | os.PathLike[str]], max_rows: int | None = None,
                      invert: int = 0, conv: int = 0, skip_nonfinite: bool = False,
                      chunk: int | None = None, say: Callable[[str], None] = lambda _: None
                      ) -> dict[str, dict[str, Any]]:
    """Closed-form recovery scored over whole files, `chunk` rows at a time: peak memory is
    bounded by one chunk's gradients, whatever the number of rows. --invert and --conv read
    only the rows they attack. `say` hears each stage as it starts (the conv stack's frame
    solves take minutes per 84×84 frame)."""
    results = {}
    for path in paths:
        with CaptureFile(path) as capture:
            check_attacks_apply(capture.victim, invert, conv)  # before any row is read
            usable = np.flatnonzero(capture.usable_rows(skip_nonfinite))
            chosen = usable[:max_rows or len(usable)]
            say(f"{path}: the closed form on {len(chosen)} steps")
            rows_at_once = chunk or max(1, min(CHUNK_ROWS, CHUNK_BYTES // (
                4 * int(capture.attrs["gradient_dim"]))))
            parts = [row_scores(*read_rows(capture, chosen[start:start + rows_at_once]))
                     for start in range(0, len(chosen), rows_at_once)]
            result = summarise_rows(parts)
            result["skipped_nonfinite_rows"] = len(capture) - len(usable)
            for count, name, scorer in ((invert, "feature_inversion", score_inversion),
                                        (conv, "conv_stack", score_conv_stack)):
                if count:
                    say(f"{path}: {name.replace('_', ' ')} on {count} steps")
                    spread = np.linspace(0, len(chosen) - 1, count).astype(int)
                    if scorer is score_conv_stack:  # with each step's neighbours (same frames)
                        around = beside(spread, len(chosen))
                        result[name] = scorer(*read_rows(capture, chosen[around]), count,
                                              rows=np.searchsorted(around, spread), say=say)
                    else:
                        result[name] = scorer(*read_rows(capture, chosen[spread]), count)
        results[str(path)] = result
    return results


def read_rows(capture: CaptureFile, rows: np.ndarray) -> tuple[Observation, Target]:
    """A contiguous run of rows is read as a slice: h5py reads a slice far faster than a list."""
    index: Any = slice(int(rows[0]), int(rows[-1]) + 1) \
        if len(rows) and rows[-1] - rows[0] + 1 == len(rows) else rows
    return capture.observation(index), capture.target(index)
