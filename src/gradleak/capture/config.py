"""What a capture reads: its own config, the environment's, and the training rule of a
victim it creates at random init."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from gradleak.envs.config import EnvConfig
from gradleak.rl.config import TrainConfig
from gradleak.victims.base import COMPONENTS


@dataclass
class CaptureConfig:
    steps_train: int = 1024
    steps_heldout: int = 512
    components: list[str] = field(default_factory=lambda: list(COMPONENTS))
    chunk: int = 64  # steps per batched backward (einsum) or vmap call: bounds memory
    # auto: einsum (per-layer rules on one batched backward) where every parameter has a rule,
    # else vmap; or name one of them, or loop (one autograd call per step; the reference)
    gradient_method: str = "auto"
    # what the client sends: float32, the wire format of a PPO/A2C client. float16 is a lossy
    # storage option (it rounds every entry to 2^-11 relative, a quantisation that hides
    # leakage: the recursion through a trained victim's conv stack fails on it)
    gradient_dtype: str = "float32"
    # the engine and rollout in a child process, an episode ahead of the gradients and writer
    overlap: bool = True
    # episodes written (compressed) in a thread while the next one's gradients are formed
    background_write: bool = True
    compression: str = "lz4"  # the HDF5 filter (gradleak.capture.storage): lz4, zstd, lzf, ...
    # Linear weights seen on one vector a step (FC layers, heads) stored as their two factors,
    # read back as the same float32 bits (gradleak.capture.layout): 8x fewer bytes for the paper
    # cnn. float32 by the einsum method only
    factor_linear: bool = True
    seed: int = 0


class CaptureSetup(Protocol):
    """What a `CaptureJob` is given (a `gradleak.presets.Preset` is one)."""

    env: EnvConfig
    train: TrainConfig
    capture: CaptureConfig

    def validate(self) -> Any: ...

    def to_dict(self) -> dict[str, Any]: ...
