"""The defenses of the TRACE paper's Tables 3 and 11, each on one per-step gradient vector."""

from __future__ import annotations

from typing import Any

import torch

from gradleak.defenses.accountant import dp_noise_multiplier
from gradleak.defenses.base import (
    Defense,
    Stream,
    gaussian_like,
    register_defense,
    with_gradients,
)
from gradleak.errors import ConfigError


@register_defense
class Quantize(Defense):
    """Per-vector min–max uniform quantisation to 2^b levels (the paper's quantisation; b ≥ 2).

    b = 1 is the scaled sign of EF-signSGD (Karimireddy et al. 2019): mean|g| · sign(g), so the
    defended vector keeps the clean one's L1 scale.
    """

    name = "quant"
    arguments = {"bits": int}
    usage = "quant:BITS, e.g. quant:8"

    def __init__(self, bits: int) -> None:
        if not 1 <= bits <= 16:
            raise ConfigError(f"defense quant:{bits}: bits must be 1..16")
        self.bits = bits

    def __call__(self, stream: Stream, generator_seed: int) -> Stream:
        g = stream.gradients
        if self.bits == 1:
            return with_gradients(stream, g.abs().mean(1, keepdim=True) * torch.sign(g))
        low, high = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
        levels = 2 ** self.bits - 1
        scale = torch.where(high > low, (high - low) / levels, torch.ones_like(high))
        return with_gradients(stream, torch.round((g - low) / scale) * scale + low)


CAST_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@register_defense
class Cast(Defense):
    """Send the gradient in a lower-precision float: float16 (2^-11 relative rounding, and
    underflow below 6e-8) or bfloat16 (2^-8, float32's range), as a mixed-precision client
    would. A quantisation that keeps each entry's scale; it is also what a float16 capture
    stores, so storing float16 is this defense applied to the stream."""

    name = "cast"
    arguments = {"dtype": str}
    usage = "cast:DTYPE, e.g. cast:bfloat16 (float16 or bfloat16)"

    def __init__(self, dtype: str) -> None:
        if dtype not in CAST_DTYPES:
            raise ConfigError(f"defense cast:{dtype}: expected one of {', '.join(CAST_DTYPES)}")
        self.dtype = dtype

    def __call__(self, stream: Stream, generator_seed: int) -> Stream:
        g = stream.gradients
        return with_gradients(stream, g.to(CAST_DTYPES[self.dtype]).to(g.dtype))


@register_defense
class Prune(Defense):
    """Keep the top `keep` fraction of entries by magnitude, zero the rest (Zhu et al. 2019)."""

    name = "prune"
    arguments = {"keep": float}
    usage = "prune:FRACTION, e.g. prune:0.1"

    def __init__(self, keep: float) -> None:
        if not 0.0 < keep <= 1.0:
            raise ConfigError(f"defense prune:{keep}: the kept fraction must be in (0, 1]")
        self.keep = keep

    def __call__(self, stream: Stream, generator_seed: int) -> Stream:
        g = stream.gradients
        k = max(1, round(self.keep * g.shape[1]))
        # ties at the threshold are broken by position (topk), so exactly k entries survive
        kept = torch.zeros_like(g, dtype=torch.bool).scatter_(1, g.abs().topk(k, dim=1).indices,
                                                              True)
        return with_gradients(stream, torch.where(kept, g, torch.zeros_like(g)))


@register_defense
class Noise(Defense):
    """Add N(0, σ²) to every entry."""

    name = "noise"
    arguments = {"sigma": float}
    usage = "noise:SIGMA, e.g. noise:0.01"

    def __init__(self, sigma: float) -> None:
        if not sigma >= 0.0:
            raise ConfigError(f"defense noise:{sigma}: σ must be >= 0")
        self.sigma = sigma

    def __call__(self, stream: Stream, generator_seed: int) -> Stream:
        return with_gradients(stream, stream.gradients + gaussian_like(stream, self.sigma,
                                                                       generator_seed))


@register_defense
class DPSGD(Defense):
    """Clip each per-step gradient to L2 norm C, add N(0, (σC)²) (Abadi et al. 2016).

    σ comes from Opacus's RDP accountant for (ε, δ), the sample rate q and the number of noisy
    steps; both the σ used and the ε it achieves are recorded.
    """

    name = "dpsgd"
    arguments = {"eps": float, "delta": float, "clip": float, "q": float, "steps": int}
    usage = "dpsgd:eps=E[,delta=D,clip=C,q=Q,steps=S]"

    def __init__(self, eps: float, delta: float = 1e-5, clip: float = 1.0,
                 q: float = 1 / 128, steps: int = 1000) -> None:
        for key, value, ok in (("eps", eps, eps > 0), ("delta", delta, 0 < delta < 1),
                               ("clip", clip, clip > 0), ("q", q, 0 < q <= 1),
                               ("steps", steps, steps >= 1)):
            if not ok:
                raise ConfigError(f"defense dpsgd: {key}={value} is out of range (eps > 0, "
                                  "0 < delta < 1, clip > 0, 0 < q <= 1, steps >= 1)")
        self.eps, self.delta, self.clip, self.q, self.steps = eps, delta, clip, q, steps
        self.sigma, self.achieved_eps = dp_noise_multiplier(eps, delta, q, steps)

    def __call__(self, stream: Stream, generator_seed: int) -> Stream:
        g = stream.gradients
        norms = g.norm(dim=1, keepdim=True)
        clipped = g * torch.clamp(self.clip / (norms + 1e-12), max=1.0)
        noise = gaussian_like(stream, self.sigma * self.clip, generator_seed)
        return with_gradients(stream, clipped + noise)

    def derived(self) -> dict[str, Any]:
        return {"sigma": self.sigma, "achieved_eps": self.achieved_eps,
                "accountant": "opacus rdp"}


@register_defense
class Aggregate(Defense):
    """Average k consecutive steps inside an episode; an episode's last incomplete window is
    dropped (paper Table 11). Each output row lists the k capture rows it averages."""

    name = "agg"
    per_step = False
    arguments = {"k": int}
    usage = "agg:K, e.g. agg:4"

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ConfigError(f"defense agg:{k}: k must be >= 1")
        self.k = self.steps_per_row = k

    def __call__(self, stream: Stream, generator_seed: int) -> Stream:
        starts = []
        episodes = stream.episode_ids.tolist()
        run_start = 0
        for i in range(1, len(episodes) + 1):
            if i == len(episodes) or episodes[i] != episodes[run_start]:
                starts += range(run_start, run_start + (i - run_start) // self.k * self.k,
                                self.k)
                run_start = i
        index = torch.tensor(starts, dtype=torch.int64).view(-1, 1) + torch.arange(self.k)
        return Stream(gradients=stream.gradients[index].mean(1), keys=stream.keys[index[:, -1]],
                      episode_ids=stream.episode_ids[index[:, 0]],
                      sources=stream.sources[index].flatten(1))

