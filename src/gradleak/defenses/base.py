"""Defenses as pure, seeded transforms of the per-step gradient stream, parsed from spec
strings that compose left to right: `prune:0.1+noise:0.01`, `dpsgd:eps=5,delta=1e-5`, `agg:4`.

Randomness never depends on how the stream is batched: each row draws its noise from a
generator seeded by (defense seed, position in the chain, the row's key), where the key names
the capture file and the row in it. Defending a file in one pass, in chunks, or window by window
inside an evaluation gives the same gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch

from gradleak.errors import ConfigError
from gradleak.registry import Registry


@dataclass(frozen=True)
class Stream:
    """Gradients in the order the server receives them, and where each one came from."""

    gradients: torch.Tensor  # (N, d) float32
    keys: torch.Tensor  # (N,) int64: each row's key (`row_keys`: capture and row; seeds noise)
    episode_ids: torch.Tensor  # (N,)
    sources: torch.Tensor  # (N, k): the capture rows each gradient averages (k = 1 per step)

    @classmethod
    def of(cls, gradients: torch.Tensor | np.ndarray, keys: Any = None,
           episode_ids: Any = None) -> Stream:
        gradients = torch.as_tensor(gradients, dtype=torch.float32)
        n = len(gradients)
        keys = torch.arange(n) if keys is None else torch.as_tensor(keys, dtype=torch.int64)
        episodes = (torch.zeros(n, dtype=torch.int64) if episode_ids is None
                    else torch.as_tensor(episode_ids, dtype=torch.int64))
        return cls(gradients, keys, episodes, keys[:, None].clone())


class Defense:
    """One transform. Subclasses set `name`, parse their arguments, and transform a stream."""

    name: ClassVar[str]
    per_step: ClassVar[bool] = True  # False: it changes which rows exist (aggregation)
    arguments: ClassVar[dict[str, type]] = {}  # the spec's arguments, the first positional
    usage: ClassVar[str] = ""  # shown when the first argument is missing
    steps_per_row: int = 1  # capture steps behind one output row

    @classmethod
    def parse(cls, arguments: str, spec: str) -> Defense:
        first = next(iter(cls.arguments))
        values = parse_arguments(arguments, spec, first, cls.arguments)
        if first not in values:
            raise ConfigError(f"defense {spec!r}: expected {cls.usage}")
        return cls(**values)

    def __call__(self, stream: Stream, generator_seed: int) -> Stream:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """The name, the arguments as parsed, and anything derived (DP-SGD's σ and ε)."""
        return {"name": self.name, **{key: getattr(self, key) for key in self.arguments},
                **self.derived()}

    def derived(self) -> dict[str, Any]:
        return {}


DEFENSES: Registry[type[Defense]] = Registry("defense")


def register_defense(cls: type[Defense]) -> type[Defense]:
    DEFENSES.register(cls.name)(cls)
    return cls


ROW_BITS = 40  # a row key: the capture's identity in the high bits, the row in the low ones


def capture_key(attrs: dict[str, Any]) -> int:
    """A stable 23-bit identity of one capture file (split, capture seed, shard): a training and
    a held-out file never share noise realisations, whatever their row numbers."""
    text = f"{attrs.get('split')}/{attrs.get('seed')}/{attrs.get('shard', '0/1')}"
    digest = np.frombuffer(text.encode(), dtype=np.uint8)
    return int(np.random.SeedSequence(digest.tolist()).generate_state(1)[0]) >> 9


def row_keys(attrs: dict[str, Any], start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop, dtype=torch.int64) + (capture_key(attrs) << ROW_BITS)


def row_generator(seed: int, key: int) -> torch.Generator:
    state = np.random.SeedSequence([seed, key]).generate_state(2)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def gaussian_like(stream: Stream, std: float, seed: int) -> torch.Tensor:
    """N(0, std²) per entry, each row from its own keyed generator."""
    noise = torch.empty_like(stream.gradients)
    for i, key in enumerate(stream.keys.tolist()):
        noise[i] = torch.randn(stream.gradients.shape[1], generator=row_generator(
            seed, key)) * std
    return noise


@dataclass(frozen=True)
class Chain:
    """Defenses applied left to right, each with its own slice of the seed."""

    spec: str
    defenses: tuple[Defense, ...]
    seed: int = 0

    def apply(self, stream: Stream) -> Stream:
        for position, defense in enumerate(self.defenses):
            stream = defense(stream, int(np.random.SeedSequence([self.seed, position])
                                         .generate_state(1)[0]))
        return stream

    def gradients(self, gradients: torch.Tensor | np.ndarray, keys: Any = None
                  ) -> torch.Tensor | np.ndarray:
        """Per-step chains only: defended rows for rows; numpy in, numpy out."""
        if not self.per_step:
            raise ConfigError(f"defense {self.spec!r} aggregates steps: apply it to a stream "
                              "with episode ids (Chain.apply)")
        out = self.apply(Stream.of(gradients, keys)).gradients
        return out.numpy() if isinstance(gradients, np.ndarray) else out

    @property
    def per_step(self) -> bool:
        return all(d.per_step for d in self.defenses)

    @property
    def span(self) -> int:
        """Capture steps behind one defended row (the product of the chain's agg:k)."""
        return int(np.prod([d.steps_per_row for d in self.defenses], dtype=np.int64))

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec, "seed": self.seed,
                "transforms": [d.describe() for d in self.defenses]}


NONE = ("none",)


def parse_defense(spec: str, seed: int = 0) -> Chain:
    """`quant:8`, `prune:0.1+noise:0.01`, `dpsgd:eps=5,delta=1e-5,clip=1`, or `none`."""
    text = spec.strip()
    if text.lower() in NONE:
        return Chain("none", (), seed)
    if not text:
        raise ConfigError("defense '': expected a spec such as quant:8, prune:0.1+noise:0.01 "
                          "or none")
    defenses = []
    for part in text.split("+"):
        name, _, arguments = part.strip().partition(":")
        if not name.strip():
            raise ConfigError(f"defense {spec!r}: an empty step in the chain (expected "
                              "NAME:ARGS joined by '+')")
        defenses.append(DEFENSES.get(name.strip()).parse(arguments.strip(), part.strip()))
    return Chain(text, tuple(defenses), seed)


def parse_arguments(arguments: str, spec: str, positional: str, allowed: dict[str, type]
                    ) -> dict[str, Any]:
    """`0.1` (the positional argument) or `k=v,k=v`, typed by `allowed`; each argument once,
    and every number finite (noise:inf would write a file that no reader accepts)."""
    values: dict[str, Any] = {}
    for item in [a for a in arguments.split(",") if a.strip()]:
        key, sep, value = item.partition("=")
        key, value = (key.strip(), value.strip()) if sep else (positional, key.strip())
        if key not in allowed:
            raise ConfigError(f"defense {spec!r}: unknown argument {key!r}; expected "
                              f"{', '.join(allowed)}")
        if key in values:
            raise ConfigError(f"defense {spec!r}: argument {key!r} is given twice (chain "
                              "defenses with '+', e.g. prune:0.1+prune:0.2)")
        try:
            values[key] = allowed[key](value)
        except ValueError:
            raise ConfigError(f"defense {spec!r}: {key}={value!r} is not a "
                              f"{allowed[key].__name__}") from None
        if isinstance(values[key], float) and not np.isfinite(values[key]):
            raise ConfigError(f"defense {spec!r}: {key}={value!r} is not a finite number")
    return values


def with_gradients(stream: Stream, gradients: torch.Tensor) -> Stream:
    return replace(stream, gradients=gradients)
