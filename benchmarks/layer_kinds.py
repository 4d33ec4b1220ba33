"""The training-free attack on the conv stacks users bring: Conv → BatchNorm → ReLU blocks with
bias-free convs, LeakyReLU, ELU, tanh and sigmoid in the ReLU's place, non-square frames, beside
the paper's Conv → ReLU → BatchNorm order.

Every network is a user's model (`gradleak.wrap`) at random init with cnn-small's shapes, its
BatchNorms' running statistics set by one pass over the frames (as training leaves them, far
from the identity). The steps are the held-out ViZDoom frames, actions, advantages and returns
of a random-init cnn-small capture (`exact_frames.capture`); each network's per-step gradients
are computed on them and stored in float32 (the wire), and the attack reads only those and θ0.
Frames are scored against the private ones beside the mean of the scored frames and each
frame's own mean colour (an oracle). Writes benchmarks/results/layer_kinds.{json,md}.

    python benchmarks/layer_kinds.py [--work runs/layer-kinds] [--frames 16]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import gradleak
from gradleak.attacks.exact import ExactAttack
from gradleak.capture.grads import StepBatch, per_step_gradients
from gradleak.capture.reader import CaptureFile
from gradleak.metrics.scores import image_scores
from gradleak.report.tables import markdown_table
from gradleak.rl.losses import LossCoefficients
from gradleak.threat import Observation
from gradleak.victims import layer_table

from exact_frames import Case, capture
from host import machine, write_results

RESULTS = Path(__file__).parent / "results" / "layer_kinds.json"
SOURCE = Case("cnn-small 64×64, random init", "cnn-small", "cpu-quick", True)
# cnn-small's conv shapes: (out channels, kernel, stride, padding)
SHAPES = ((16, 8, 4, 2), (32, 4, 2, 1), (32, 3, 1, 1), (32, 3, 2, 1))


@dataclass(frozen=True)
class Variant:
    name: str
    order: str  # "relu-norm" (the paper's), "norm-relu" (most image networks')
    activation: str = "relu"  # relu, leaky (slope 0.01), elu, tanh, sigmoid
    height: int = 64  # the frames are cropped to height × 64


VARIANTS = [Variant("Conv → ReLU → BN (the paper's order)", "relu-norm"),
            Variant("Conv (no bias) → BN → ReLU", "norm-relu"),
            Variant("Conv → LeakyReLU(0.01)", "none", "leaky"),
            Variant("Conv → ELU", "none", "elu"),
            Variant("Conv → tanh", "none", "tanh"), Variant("Conv → sigmoid", "none", "sigmoid"),
            Variant("Conv (no bias) → BN → ReLU, 48×64 frames", "norm-relu", height=48)]


class Network(nn.Module):
    """cnn-small's shapes in the variant's order, FC 256 and the two heads."""

    def __init__(self, order: str = "relu-norm", activation: str = "relu", height: int = 64
                 ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels, size = 3, (height, 64)
        for out, kernel, stride, padding in SHAPES:
            act = {"relu": nn.ReLU(), "leaky": nn.LeakyReLU(0.01), "elu": nn.ELU(),
                   "tanh": nn.Tanh(), "sigmoid": nn.Sigmoid()}[activation]
            conv = nn.Conv2d(channels, out, kernel, stride, padding, bias=order != "norm-relu")
            layers += {"relu-norm": [conv, act, nn.BatchNorm2d(out)],
                       "norm-relu": [conv, nn.BatchNorm2d(out), act],
                       "none": [conv, act]}[order]
            channels = out
            size = tuple((s + 2 * padding - kernel) // stride + 1 for s in size)
        self.encoder = nn.Sequential(*layers, nn.Flatten())
        self.fc = nn.Linear(channels * size[0] * size[1], 256)
        self.pi, self.v = nn.Linear(256, 5), nn.Linear(256, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.fc(self.encoder(x)))
        return self.pi(h), self.v(h)


gradleak.register_model_factory("layer-kinds-network")(Network)


def victim_of(variant: Variant, frames: torch.Tensor) -> Any:
    torch.manual_seed(5)
    model = Network(variant.order, variant.activation, variant.height)
    for module in model.modules():  # running statistics as training leaves them
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = None
    model.train()
    with torch.no_grad():
        model.encoder(frames.permute(0, 3, 1, 2).float() / 255)
    return gradleak.wrap(model.eval(), policy_head="pi", value_head="v",
                         frame_shape=(variant.height, 64, 3), factory="layer-kinds-network",
                         factory_kwargs={"order": variant.order,
                                         "activation": variant.activation,
                                         "height": variant.height})


def observation_of(victim: Any, frames: torch.Tensor, steps: dict[str, np.ndarray]
                   ) -> Observation:
    """What the server sees of these steps from this victim: float32 per-step gradients."""
    actions = torch.from_numpy(steps["actions"])
    with torch.no_grad():
        logits, _ = victim(frames)
    log_probs = torch.log_softmax(logits, -1).gather(-1, actions[:, None])[:, 0]
    batch = StepBatch(frames, actions, torch.from_numpy(steps["advantages"]).float(),
                      torch.from_numpy(steps["returns"]).float(), log_probs)
    coefficients = LossCoefficients()
    layers = layer_table(victim)
    gradients = per_step_gradients(victim, batch, coefficients, layers).float()
    n = len(actions)
    return Observation(gradients=gradients.numpy(), layers=tuple(layers), victim=victim.config,
                       hyperparameters={"algorithm": "ppo", **coefficients.to_dict()},
                       episode_ids=steps["episode_ids"], step_in_episode=np.arange(n),
                       theta0={k: v.numpy() for k, v in victim.state_dict().items()})


def scores(guess: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    def as_unit(images: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(images.astype(np.float64) / 255).permute(0, 3, 1, 2)

    return image_scores(as_unit(guess), as_unit(truth))


def run_variant(variant: Variant, images: np.ndarray, steps: dict[str, np.ndarray]
                ) -> dict[str, Any]:
    truth = images[:, (64 - variant.height) // 2:(64 + variant.height) // 2]
    frames = torch.from_numpy(np.ascontiguousarray(truth))
    victim = victim_of(variant, frames)
    observation = observation_of(victim, frames, steps)
    start = time.perf_counter()
    attack = ExactAttack(observation)
    reconstruction = attack.reconstruct()
    seconds = time.perf_counter() - start
    mean = np.broadcast_to(truth.mean(0, keepdims=True).round().astype(np.uint8), truth.shape)
    colour = np.broadcast_to(truth.mean((1, 2), keepdims=True).round().astype(np.uint8),
                             truth.shape)
    return {"variant": variant.name, "shape": list(truth.shape[1:3]),
            "attack": scores(reconstruction.images, truth),
            "actions": float((reconstruction.actions == steps["actions"]).mean()),
            "mean_image": scores(np.ascontiguousarray(mean), truth),
            "mean_colour": scores(np.ascontiguousarray(colour), truth),
            "ms_per_frame": 1000 * seconds / len(truth)}


def markdown(result: dict[str, Any]) -> str:
    def triple(s: dict[str, float]) -> str:
        lpips = f" / {s['lpips']:.3f}" if "lpips" in s else ""
        return f"{s['psnr']:.2f} / {s['ssim']:.3f}{lpips}"

    rows = [{"network": r["variant"], "frames": f"{r['shape'][0]}×{r['shape'][1]}",
             "training-free": triple(r["attack"]), "actions": f"{r['actions']:.2f}",
             "mean image": triple(r["mean_image"]),
             "mean colour (oracle)": triple(r["mean_colour"]),
             "ms / frame": f"{r['ms_per_frame']:.0f}"} for r in result["rows"]]
    return "\n".join([
        f"# The training-free attack on the conv stacks users bring ({result['machine']})", "",
        f"{result['frames']} held-out ViZDoom frames (a random-init cnn-small capture's steps); "
        "each network is a user's model at random init with cnn-small's shapes and its "
        "BatchNorms' statistics from the frames, its per-step gradients stored in float32. "
        "PSNR (dB) / SSIM / LPIPS (lower is closer).", "",
        markdown_table(rows, list(rows[0])), ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="runs/layer-kinds")
    parser.add_argument("--frames", type=int, default=16)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    with CaptureFile(capture(SOURCE, "float32", args.frames, work)) as file:
        rows = np.arange(min(args.frames, len(file)))
        target = file.target(rows)
        steps = {"actions": target.actions.astype(np.int64),
                 "advantages": file.private_column("advantages")[rows].astype(np.float32),
                 "returns": file.private_column("returns")[rows].astype(np.float32),
                 "episode_ids": file.column("episode_ids")[rows].astype(np.int64)}
    results = []
    for variant in VARIANTS:
        print(variant.name, flush=True)
        results.append(run_variant(variant, target.images, steps))
    result = {"machine": machine(), "frames": len(rows), "source": SOURCE.name, "rows": results}
    write_results(RESULTS, result, markdown(result))


if __name__ == "__main__":
    main()
