"""The paper's Tiny ViT victim (its Table 9): 14×14 patches, 128-d, 2 pre-norm blocks of 4 heads
and an MLP of 512, the class token into the heads. 477,830 parameters at 84×84 with K = 5."""

from __future__ import annotations

import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.victims.base import Victim, VictimConfig, register_victim


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        # written out, not F.scaled_dot_product_attention: vmap over steps traces it everywhere
        weights = torch.softmax(q @ k.transpose(-2, -1) / (c // self.heads) ** 0.5, dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, n, c))  # (B, N, C)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(Victim):
    # The block's Linear layers act on every token: their gradient sums over tokens, so the
    # closed form x = ∇Wᵀ∇b/‖∇b‖² does not give an input. Only the heads read one vector.
    component_prefixes = {"patch_embed.": "cnn", "cls_token": "cnn", "pos_embed": "cnn",
                          "blocks.": "cnn", "norm.": "cnn", "policy_head.": "heads",
                          "value_head.": "heads"}
    patch, dim, depth, heads, mlp = 14, 128, 2, 4, 512

    def __init__(self, config: VictimConfig) -> None:
        super().__init__()
        self.config = config
        if config.frame_size % self.patch:
            raise ConfigError(f"victim {config.name}: frame_size {config.frame_size} is not a "
                              f"multiple of its {self.patch}-pixel patches")
        tokens = (config.frame_size // self.patch) ** 2
        self.patch_embed = nn.Conv2d(3, self.dim, self.patch, self.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, self.dim))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, self.dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(self.dim, self.heads, self.mlp)
                                      for _ in range(self.depth)])
        self.norm = nn.LayerNorm(self.dim)
        self.policy_head = nn.Linear(self.dim, config.num_actions)
        self.value_head = nn.Linear(self.dim, 1)

    def features(self, image: torch.Tensor, goal: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """The normalised class token: what both heads read (not non-negative, unlike a CNN's)."""
        x = self.patch_embed(self.prepare_image(image)).flatten(2).transpose(1, 2)  # (B, N, C)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed
        return self.norm(self.blocks(x)[:, 0])


@register_victim("vit-tiny")
class PaperViT(TinyViT):
    """477,830 parameters at 84×84 with K = 5 (36 patches)."""


@register_victim("vit-tiny-small")
class SmallViT(TinyViT):
    """16×16 patches, 64-d, MLP 256: the CPU size for 64×64 frames (16 patches)."""

    patch, dim, mlp = 16, 64, 256
