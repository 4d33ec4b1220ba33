"""TRACE: a causal transformer over interleaved gradient and frame tokens (the paper's §4).

Sequence (2T tokens): [z_1, e_0, z_2, e_1, ..., z_T, e_{T-1}], where z_t encodes gradient g_t,
e_0 is a learned start token and e_t (t ≥ 1) encodes frame x_t. Frame x_t and action a_t are
read out at token e_{t-1}: under the causal mask it sees g_1..g_t and frames x_1..x_{t-1}, and
nothing later. During training the frames are ground truth (teacher forcing) or, with
probability β, the model's own earlier outputs (scheduled sampling); at attack time they are
always the model's own outputs (autoregressive decoding).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradleak.attacks.attacker import WindowAttacker
from gradleak.attacks.encoders import (
    GradientEncoder,
    GradientInput,
    ImageDecoder,
    ImageEncoder,
    StructuredInput,
    subsample_index,
)
from gradleak.errors import ConfigError


@dataclass
class TraceConfig:
    gradient_dim: int = 0  # set from the training capture
    frame_size: int = 64
    num_actions: int = 5
    window: int = 8  # T
    projection: str = "subsample"  # dense (the paper), lowrank, subsample, structured
    layer_table: str = ""  # set from the training capture: the structured projection reads it
    rank: int = 256  # lowrank only
    subsample_fraction: float = 0.1  # subsample only
    encoder_width: int = 512  # d_enc
    encoder_blocks: int = 2
    latent: int = 256  # D
    layers: int = 2
    heads: int = 4
    rope: bool = False  # rotary positions instead of learned absolute ones (long T)
    dropout: float = 0.1
    image_channels: int = 16  # c: image encoder/decoder widths are c, 2c, 4c
    seed: int = 0  # picks the subsample coordinates

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def rope(x: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Rotary position embedding over the token axis of (B, heads, L, head_dim), whose tokens
    sit at positions first, first + 1, ..."""
    length, dim = x.shape[-2], x.shape[-1]
    inverse = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=x.device, dtype=x.dtype) / dim))
    angles = torch.arange(first, first + length, device=x.device,
                          dtype=x.dtype)[:, None] * inverse[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    return x * cos + rotate_half(x) * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TraceConfig) -> None:
        super().__init__()
        if config.latent % config.heads:
            raise ConfigError(f"latent {config.latent} is not divisible by {config.heads} heads")
        self.heads, self.use_rope = config.heads, config.rope
        self.qkv = nn.Linear(config.latent, 3 * config.latent)
        self.proj = nn.Linear(config.latent, config.latent)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None
                ) -> torch.Tensor:
        """`cache`: the keys and values of the tokens before x, extended here by x's (a decoder
        adding a token at a time attends to them rather than running its prefix again)."""
        b, length, width = x.shape  # (B, L, D)
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, width // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, L, head_dim)
        before = cache[0].shape[2] if cache else 0
        if self.use_rope:
            q, k = rope(q, before), rope(k, before)
        if cache is not None:
            if cache:
                k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            cache[:] = [k, v]
        dropout = self.dropout if self.training else 0.0
        if before:  # query i sits at position before + i: it sees keys up to there
            mask = torch.ones(length, before + length, dtype=torch.bool,
                              device=x.device).tril(before)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(b, length, width))


class GatedBlock(nn.Module):
    """x ← x + σ(α_attn)·Attn(LN(x)); x ← x + σ(α_ffn)·FFN(LN(x)), with learnable α."""

    def __init__(self, config: TraceConfig) -> None:
        super().__init__()
        d = config.latent
        self.norm_attn, self.norm_ffn = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(config)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d),
                                 nn.Dropout(config.dropout))
        self.alpha_attn = nn.Parameter(torch.zeros(()))
        self.alpha_ffn = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None
                ) -> torch.Tensor:
        x = x + torch.sigmoid(self.alpha_attn) * self.attn(self.norm_attn(x), cache)
        return x + torch.sigmoid(self.alpha_ffn) * self.ffn(self.norm_ffn(x))


def gradient_input(config: TraceConfig) -> GradientInput:
    if config.projection == "structured":
        return StructuredInput(config.gradient_dim, config.layer_table)
    index = (subsample_index(config.gradient_dim, config.subsample_fraction, config.seed)
             if config.projection == "subsample" else None)
    return GradientInput(config.gradient_dim, index)


class Trace(WindowAttacker):
    name = "TRACE"

    @property
    def window(self) -> int:
        return self.config.window

    @property
    def gradient_input(self) -> GradientInput:
        return self.gradient_encoder.input

    def __init__(self, config: TraceConfig) -> None:
        super().__init__()
        self.config = config
        d = config.latent
        self.gradient_encoder = GradientEncoder(
            gradient_input(config), config.projection, config.encoder_width,
            d, config.encoder_blocks, config.rank, config.dropout)
        self.image_encoder = ImageEncoder(d, config.image_channels)
        self.start = nn.Parameter(torch.zeros(d))
        self.token_type = nn.Parameter(torch.zeros(2, d))  # 0: gradient, 1: frame
        self.position = None if config.rope else nn.Parameter(torch.zeros(2 * config.window, d))
        self.blocks = nn.ModuleList(GatedBlock(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(d)
        self.decoder = ImageDecoder(d, config.frame_size, config.image_channels)
        self.action_head = nn.Linear(d, config.num_actions)
        nn.init.normal_(self.start, std=0.02)
        nn.init.normal_(self.token_type, std=0.02)
        if self.position is not None:
            nn.init.normal_(self.position, std=0.02)

    # -- pieces ----------------------------------------------------------------------------------
    def encode_gradients(self, gradients: torch.Tensor) -> torch.Tensor:
        return self.gradient_encoder(gradients)  # (B, T, d) → (B, T, D)

    def encode_frames(self, frames: torch.Tensor) -> torch.Tensor:
        """(B, n, 3, H, W) in [0, 1] → (B, n, D)."""
        b, n = frames.shape[:2]
        return self.image_encoder(frames.flatten(0, 1)).view(b, n, -1)

    def _context(self, frames: torch.Tensor | None, batch: int, steps: int) -> torch.Tensor:
        """[e_0, e_1, ..., e_{steps-1}] from frames x_1..x_{steps-1}."""
        start = self.start.expand(batch, 1, -1)
        if steps == 1:
            return start
        return torch.cat([start, self.encode_frames(frames[:, :steps - 1])], dim=1)

    def _run(self, z: torch.Tensor, e: torch.Tensor, last_only: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Transformer over [z_1, e_0, ..., z_n, e_{n-1}]; read out at every e token (or only
        the last: autoregressive steps need one new frame, and decoding is the costly part)."""
        return self._read_out(self._through_blocks(z, e, 0), last_only)

    def _through_blocks(self, z: torch.Tensor, e: torch.Tensor, first: int,
                        caches: list[list[torch.Tensor]] | None = None) -> torch.Tensor:
        """The blocks' output at the tokens of steps first + 1 .. first + n, given (`caches`,
        which they extend) the keys and values of the steps before."""
        b, n, d = z.shape
        if first + n > self.config.window and self.position is not None:
            raise ConfigError(f"{first + n} steps exceed the attacker's window "
                              f"T={self.config.window}")
        tokens = torch.stack([z + self.token_type[0], e + self.token_type[1]], dim=2)
        x = tokens.reshape(b, 2 * n, d)  # interleaved: z_1, e_0, z_2, e_1, ...
        if self.position is not None:
            x = x + self.position[2 * first: 2 * (first + n)]
        for index, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[index])
        return x

    def _read_out(self, x: torch.Tensor, last_only: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x)[:, 1::2]  # (B, n, D) at the e tokens
        if last_only:
            h = h[:, -1:]
        frames = self.decoder(h.flatten(0, 1)).view(len(h), h.shape[1], 3, *self.decoder_shape)
        return frames, self.action_head(h)

    @property
    def decoder_shape(self) -> tuple[int, int]:
        return (self.config.frame_size, self.config.frame_size)

    # -- the two paths ---------------------------------------------------------------------------
    def forward(self, gradients: torch.Tensor, context_frames: torch.Tensor,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Parallel path (training): context_frames (B, T, 3, H, W) are x_1..x_T (the last is
        never used). Returns frames (B, T, 3, H, W) in [0, 1] and action logits (B, T, K), or
        only the last step's with `last_only`."""
        b, steps = gradients.shape[:2]
        z = self.encode_gradients(gradients)
        return self._run(z, self._context(context_frames, b, steps), last_only)

    def decode(self, gradients: torch.Tensor, teacher: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Autoregressive path: each generated frame becomes the next step's context. With
        `teacher` frames (B, T, 3, H, W) the context is those instead (a test of equivalence)."""
        b, steps = gradients.shape[:2]
        z = self.encode_gradients(gradients)
        context = self.start.expand(b, -1)
        # each step's keys and values are kept: a step runs its own two tokens, not the prefix
        # (the causal mask leaves the earlier tokens' outputs as they were)
        caches: list[list[torch.Tensor]] = [[] for _ in self.blocks]
        frames, logits = [], []
        for t in range(steps):
            x = self._through_blocks(z[:, t:t + 1], context[:, None], t, caches)
            out_frames, out_logits = self._read_out(x)
            frames.append(out_frames[:, -1])
            logits.append(out_logits[:, -1])
            if t + 1 < steps:  # the last frame is no step's context
                source = teacher[:, t] if teacher is not None else out_frames[:, -1]
                context = self.image_encoder(source)
        return torch.stack(frames, dim=1), torch.stack(logits, dim=1)

    def attack(self, gradients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode(gradients)  # autoregressive: no ground truth ever enters
