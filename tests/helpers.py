"""Test helpers: a synthetic Doom PWAD built byte by byte; a fully connected victim's
per-step observation."""

from __future__ import annotations

import re
import shutil
import signal
import struct
import subprocess
from pathlib import Path

import numpy as np
import torch

from gradleak.capture.grads import StepBatch, per_step_gradients
from gradleak.rl.losses import LossCoefficients
from gradleak.threat import Observation
from gradleak.victims import create_victim, layer_table

# Two 512x512 rooms joined by a closed door (a sector whose ceiling meets its floor); room B
# holds a nukage pool, room A a tree (a solid thing) and the player start.
ROOM_A = [(0, 0), (0, 512), (512, 512), (512, 288), (512, 224), (512, 0)]
SECTORS = [  # floor, ceiling, floor texture, special
    (0, 128, b"FLOOR4_8", 0),  # 0: room A
    (0, 0, b"FLAT20", 0),  # 1: closed door
    (0, 128, b"FLOOR4_8", 0),  # 2: room B
    (0, 128, b"NUKAGE1", 0),  # 3: pool inside room B
]


def _lines() -> list[tuple[tuple[int, int], tuple[int, int], int, int]]:
    """(v1, v2, front sector, back sector or -1); the front side is on the right of v1→v2."""
    a = [((0, 0), (0, 512), 0, -1), ((0, 512), (512, 512), 0, -1),
         ((512, 512), (512, 288), 0, -1), ((512, 288), (512, 224), 0, 1),
         ((512, 224), (512, 0), 0, -1), ((512, 0), (0, 0), 0, -1)]
    door = [((576, 224), (512, 224), 1, -1), ((512, 288), (576, 288), 1, -1)]
    b = [((576, 0), (576, 224), 2, -1), ((576, 224), (576, 288), 2, 1),
         ((576, 288), (576, 512), 2, -1), ((576, 512), (1088, 512), 2, -1),
         ((1088, 512), (1088, 0), 2, -1), ((1088, 0), (576, 0), 2, -1)]
    pool = [((800, 200), (800, 300), 3, 2), ((800, 300), (900, 300), 3, 2),
            ((900, 300), (900, 200), 3, 2), ((900, 200), (800, 200), 3, 2)]
    return a + door + b + pool


def write_test_wad(path: Path) -> Path:
    lines = _lines()
    vertices: list[tuple[int, int]] = []
    for v1, v2, _, _ in lines:
        for v in (v1, v2):
            if v not in vertices:
                vertices.append(v)
    linedefs, sidedefs = b"", b""
    for v1, v2, front, back in lines:
        sides = []
        for sector in (front, back):
            if sector < 0:
                sides.append(0xFFFF)
                continue
            sides.append(len(sidedefs) // 30)
            middle = b"-" if back >= 0 else b"STARTAN3"
            sidedefs += struct.pack("<hh8s8s8sH", 0, 0, b"-", b"-", middle, sector)
        flags = 0x0004 if back >= 0 else 0x0001  # two-sided / impassable
        linedefs += struct.pack("<HHHHHHH", vertices.index(v1), vertices.index(v2), flags, 0, 0,
                                *sides)
    vertexes = b"".join(struct.pack("<hh", x, y) for x, y in vertices)
    sectors = b"".join(struct.pack("<hh8s8shhh", f, c, tex, b"CEIL3_5", 192, special, 0)
                       for f, c, tex, special in SECTORS)
    things = (struct.pack("<hhhHH", 96, 96, 0, 1, 7)  # player 1 start
              + struct.pack("<hhhHH", 256, 256, 0, 54, 7))  # a large tree
    lumps = [(b"MAP01", b""), (b"THINGS", things), (b"LINEDEFS", linedefs),
             (b"SIDEDEFS", sidedefs), (b"VERTEXES", vertexes), (b"SECTORS", sectors)]
    body, directory, offset = b"", b"", 12
    for name, data in lumps:
        directory += struct.pack("<ii8s", offset, len(data), name)
        body += data
        offset += len(data)
    path.write_bytes(struct.pack("<4sii", b"PWAD", len(lumps), offset) + body + directory)
    return path


class ColourRoom:
    """A toy RGB Gymnasium environment: the frame's colour encodes the last action."""

    def __new__(cls, *args, **kwargs):  # built lazily so importing helpers needs no gymnasium
        import gymnasium as gym
        import numpy as np

        class _ColourRoom(gym.Env):
            metadata = {"render_modes": []}

            def __init__(self, height: int = 48, width: int = 40) -> None:
                self.observation_space = gym.spaces.Box(0, 255, (height, width, 3), np.uint8)
                self.action_space = gym.spaces.Discrete(4)
                self._t = 0

            def _frame(self, action: int) -> np.ndarray:
                frame = np.zeros(self.observation_space.shape, np.uint8)
                frame[..., action % 3] = 60 * (action + 1)
                frame[: 4 + self._t % 20] += 30  # something that changes over time
                return frame

            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                self._t = 0
                return self._frame(int(self.np_random.integers(4))), {}

            def step(self, action):
                self._t += 1
                return self._frame(int(action)), float(action == 2), self._t >= 15, False, {}

        return _ColourRoom(*args, **kwargs)


# -- a victim with a fully connected first layer, and its per-step observation ----------------


def smooth_frame(size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, 4, 4, generator=generator)
    image = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear")
    return (image[0].permute(1, 2, 0) * 255).round().to(torch.uint8)


def observe(victim: torch.nn.Module, images: torch.Tensor, actions: torch.Tensor,
            advantages: torch.Tensor, returns: torch.Tensor,
            coefficients: LossCoefficients | None = None) -> tuple[Observation, StepBatch]:
    """The per-step gradients a server would see for these steps, as an Observation."""
    coefficients = coefficients or LossCoefficients()
    with torch.no_grad():
        logits, _ = victim(images)
    log_probs = torch.log_softmax(logits, -1).gather(-1, actions[:, None])[:, 0]
    batch = StepBatch(images, actions, advantages, returns, log_probs)
    layers = layer_table(victim)
    gradients = per_step_gradients(victim, batch, coefficients, layers)
    n = len(actions)
    observation = Observation(
        gradients=gradients.numpy(), layers=tuple(layers), victim=victim.config,
        hyperparameters={"algorithm": "ppo", **coefficients.to_dict()},
        episode_ids=np.zeros(n, np.int64), step_in_episode=np.arange(n),
        theta0={k: v.numpy() for k, v in victim.state_dict().items()})
    return observation, batch


def mlp_observation(frames: int = 2, size: int = 12) -> tuple[Observation, torch.Tensor]:
    torch.manual_seed(1)
    victim = create_victim("mlp", frame_size=size, options={"hidden": 32}).eval()
    images = torch.stack([smooth_frame(size, seed) for seed in range(frames)])
    observation, _ = observe(victim, images, torch.arange(frames) % 5,
                             torch.tensor([1.2, -0.7] * (frames // 2))[:frames],
                             torch.tensor([0.4, -0.3] * (frames // 2))[:frames])
    return observation, images


def victim_with_statistics(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """cnn-small at 32×32 whose BatchNorms are far from identity (as a trained victim's are)."""
    torch.manual_seed(2)
    victim = create_victim("cnn-small", frame_size=32).eval()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for module in victim.encoder:
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5, generator=generator)
                module.bias.uniform_(-0.2, 0.2, generator=generator)
                module.running_mean.uniform_(-0.1, 0.1, generator=generator)
                module.running_var.uniform_(0.5, 2.0, generator=generator)
    return victim.to(dtype)


# the cpu-quick preset shrunk to seconds, as `--set` flags (32×32 frames, tiny attackers)
TINY = ["--set", "env.doomnav.frame_size=32", "--set", "env.doomnav.max_steps=20",
        "--set", "env.train_maps=MAP01", "--set", "env.heldout_maps=MAP05",
        "--set", "env.max_regions_per_map=2", "--set", "train.num_envs=2",
        "--set", "train.rollout_steps=16", "--set", "train.updates=1",
        "--set", "train.minibatch=16", "--set", "attack.trace.window=4",
        "--set", "attack.trace.encoder_width=32", "--set", "attack.trace.latent=32",
        "--set", "attack.trace.layers=1", "--set", "attack.trace_fit.epochs=1",
        "--set", "attack.trace_fit.workers=0", "--set", "attack.trace_fit.max_train_windows=8",
        "--set", "attack.trace_fit.max_val_windows=4", "--set", "attack.lti.hidden=32",
        "--set", "attack.lti_fit.epochs=1", "--set", "attack.lti_fit.workers=0",
        "--set", "attack.lti_fit.max_train_windows=32", "--set", "attack.lti_fit.max_val_windows=4"]

# An audit's plumbing at a fraction of its cost (each attack's quality has its own tests): the
# training-free frame solve with one reweighting round (not 4), the defense-aware finish as one
# softplus stage of 8 L-BFGS iterations, IG and DLG 3 iterations
SHORT_AUDIT = ["attack.training_free.solve.rounds=1", "attack.defense_aware.iterations=8",
               "attack.defense_aware.sharpness=30", "attack.ig.iterations=3",
               "attack.dlg.iterations=3"]


def as_flags(overrides: list[str]) -> list[str]:
    """`key=value` overrides as `--set` flags."""
    return [flag for override in overrides for flag in ("--set", override)]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium_flags(tmp_path: Path) -> list[str]:
    # headless, offline (a page that fetched anything would fail to load it), desktop width
    return [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND",
            f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000",
            "--window-size=1366,900", "--hide-scrollbars"]


def render_in_chromium(report: Path, tmp_path: Path) -> tuple[dict[str, str], str]:
    """The data-* counts the report's own script sets on <body> once loaded (tables, images,
    images decoded, elements past the right edge), and the DOM."""
    dom = subprocess.run([*_chromium_flags(tmp_path), "--dump-dom", report.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    body = re.search(r"<body([^>]*)>", dom)
    assert body, dom[:500]
    return dict(re.findall(r'data-([\w-]+)="(\d+)"', body.group(1))), dom


def screenshot_size(report: Path, tmp_path: Path) -> int:
    shot = tmp_path / "report.png"
    subprocess.run([*_chromium_flags(tmp_path), f"--screenshot={shot}", report.as_uri()],
                   capture_output=True, timeout=120, check=True)
    return shot.stat().st_size


def interruptible() -> None:
    """A child process's SIGINT back to the default (pass as `preexec_fn`): a shell starts
    background jobs (`nohup ... &`) with SIGINT ignored, a child inherits that, and Python then
    keeps it ignored, so a test that interrupts a child would pass or fail by how the suite was
    started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
