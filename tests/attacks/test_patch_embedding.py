"""The ViT's frame in closed form from its patch embedding and learned position embedding:
exact where Δ has full rank, the rank said where it does not, and a refusal naming the layer
where the identity ∇pos = δ does not hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import observe, smooth_frame

from gradleak.attacks.exact import ExactAttack, not_applicable
from gradleak.attacks.frame_inverse import frame_inverse_for
from gradleak.attacks.patch_embedding import (
    PatchEmbeddingFrames,
    find_patch_embedding,
    solve_patches,
)
from gradleak.errors import ConfigError
from gradleak.victims import VictimConfig, create_victim
from gradleak.victims.vit import SmallViT


def vit_steps(name: str, size: int, dtype: torch.dtype = torch.float32, victim=None):
    torch.manual_seed(0)
    victim = (victim or create_victim(name, frame_size=size)).eval().to(dtype)
    images = torch.stack([smooth_frame(size, seed) for seed in range(3)])
    observation, _ = observe(victim, images.to(dtype) if dtype == torch.float64 else images,
                             torch.tensor([0, 3, 4]), torch.tensor([1.2, -0.7, 0.3]),
                             torch.tensor([0.4, -0.3, 0.1]))
    return victim, observation, images


@pytest.mark.parametrize(("name", "size"), [("vit-tiny-small", 64), ("vit-tiny", 84)])
def test_the_frame_comes_back_from_a_float64_gradient(name: str, size: int) -> None:
    """P = (Δ Δᵀ)⁻¹ Δ ∇W: every pixel of every step to ≤ 1e-5 relative error (measured
    when written: 1e-13)."""
    victim, observation, images = vit_steps(name, size, torch.float64)
    solved = solve_patches(observation, find_patch_embedding(victim))
    frames = observation.roles.transform.invert(solved.inputs)
    truth = images.double()
    assert float((frames - truth).norm() / truth.norm()) <= 1e-5
    assert solved.rank.tolist() == [solved.tokens] * 3
    assert solved.bias_residual is not None and float(solved.bias_residual.max()) <= 1e-10


def test_the_attack_on_a_float32_stream_returns_every_frame_and_action() -> None:
    """The wire format: every pixel back to its stored value (float32 precision is far under
    half a grey level), every action, the route named, and each step's rank reported."""
    _, observation, images = vit_steps("vit-tiny-small", 64)
    result = ExactAttack(observation).reconstruct()
    np.testing.assert_array_equal(result.images, images.numpy())
    np.testing.assert_array_equal(result.actions, [0, 3, 4])
    assert result.extras["route"] == "patch embedding"
    residuals = result.extras["residuals"]
    np.testing.assert_array_equal(residuals["rank"], residuals["tokens"])
    assert not_applicable(VictimConfig("vit-tiny-small")) is None


class FixedPositions(SmallViT):
    """A ViT whose position embedding is a fixed buffer (sinusoidal-style): never sent."""

    def __init__(self, config: VictimConfig) -> None:
        super().__init__(config)
        table = self.pos_embed.detach().clone()
        del self.pos_embed
        self.register_buffer("pos_embed", table)


class NormBeforePositions(SmallViT):
    """A ViT that normalises its patch tokens before adding the positions: ∇pos is then the
    gradient after the norm, not the one reaching the patch embedding."""

    def __init__(self, config: VictimConfig) -> None:
        super().__init__(config)
        self.token_norm = torch.nn.LayerNorm(self.dim)

    def features(self, image, goal=None):
        x = self.patch_embed(self.prepare_image(image)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), self.token_norm(x)], dim=1)
        return self.norm(self.blocks(x + self.pos_embed)[:, 0])


@pytest.mark.parametrize(("victim_class", "reason"), [
    (FixedPositions, "pos_embed is a fixed buffer"),
    (NormBeforePositions, "is not the gradient reaching patch_embed's tokens")])
def test_a_position_embedding_the_closed_form_cannot_read_is_refused_naming_it(
        victim_class: type, reason: str) -> None:
    victim = victim_class(VictimConfig("vit-tiny-small"))
    assert reason in (PatchEmbeddingFrames.unavailable(victim) or "")
    with pytest.raises(ConfigError, match="patch embedding: .*; conv stack: "):
        frame_inverse_for(victim)


class WideGrid(SmallViT):
    """64 patches of 8×8 and a width of 32: more tokens than Δ can have rank."""

    patch, dim, mlp = 8, 32, 64


def test_more_tokens_than_width_keeps_the_equations_and_reports_the_rank() -> None:
    """Δ (64 tokens × 32) has rank 31: every δ_t leaves a LayerNorm's backward, so sums to 0
    over the width. The solve says so, and its frame still satisfies every equation of the
    weight gradient (the part Δ determines), though not the truth."""
    victim = WideGrid(VictimConfig("vit-tiny-small"))
    victim, observation, images = vit_steps("", 64, torch.float64, victim=victim)
    embedding = find_patch_embedding(victim)
    solved = solve_patches(observation, embedding)
    assert solved.tokens == 64 and solved.rank.tolist() == [31] * 3
    delta = torch.from_numpy(observation.block("pos_embed")).reshape(3, -1, 32)[:, 1:]
    weight = torch.from_numpy(observation.block("patch_embed.weight")).flatten(2)
    patches = torch.nn.functional.unfold(solved.inputs, 8, stride=8).transpose(1, 2)
    assert torch.allclose(delta.transpose(1, 2) @ patches, weight, rtol=1e-8, atol=1e-12)
    truth = observation.roles.transform.apply(images.double())
    assert float((solved.inputs - truth).norm() / truth.norm()) > 1e-2


def test_a_perturbed_stream_gets_the_smoothest_frame_within_its_noise(monkeypatch) -> None:
    """Under noise:1e-4 least squares amplifies the noise by Δ's condition number; the
    smoothest frame that fits as well as the noise allows is closer to the truth (measured
    when written: 19.5 → 28.5 dB on four such frames), and a clean stream keeps the exact solve (weight 0)."""
    import gradleak.attacks.patch_embedding as patch_embedding
    from gradleak.defenses import parse_defense

    victim, observation, images = vit_steps("vit-tiny-small", 64)
    embedding = find_patch_embedding(victim.double())
    assert solve_patches(observation, embedding).prior_weight.tolist() == [0.0] * 3
    noisy = parse_defense("noise:0.0001", seed=0).gradients(
        torch.from_numpy(observation.gradients), np.arange(3)).numpy()
    observation = observation.steps(np.arange(3))
    observation = type(observation)(**{**observation.__dict__, "gradients": noisy})
    truth = observation.roles.transform.apply(images.double())
    smooth = solve_patches(observation, embedding)
    monkeypatch.setattr(patch_embedding, "PRIOR_WEIGHTS", ())
    plain = solve_patches(observation, embedding)
    assert bool((smooth.prior_weight > 0).all())

    def error(x: torch.Tensor) -> torch.Tensor:
        return (x - truth).flatten(1).norm(dim=1) / truth.flatten(1).norm(dim=1)

    better, worse = error(smooth.inputs), error(plain.inputs)  # measured: 0.06-0.11, 0.07-0.27
    assert bool((better < worse).all()) and float(better.mean()) <= 0.5 * float(worse.mean())


class UserViT(torch.nn.Module):
    """A user's own ViT, as `gradleak.wrap` takes it: its own names, the position embedding a
    2-D parameter of the model itself with no class token, a stack of 4 grayscale frames,
    torch's TransformerEncoder, the tokens mean-pooled into the heads."""

    def __init__(self) -> None:
        super().__init__()
        self.to_patch = torch.nn.Conv2d(4, 48, 12, 12)  # 48×48 frames: 16 tokens
        self.position_embeddings = torch.nn.Parameter(torch.randn(16, 48) * 0.02)
        self.encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(
            48, 4, 96, dropout=0.0, batch_first=True), 1, enable_nested_tensor=False)
        self.pi, self.v = torch.nn.Linear(48, 3), torch.nn.Linear(48, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.to_patch(x).flatten(2).transpose(1, 2) + self.position_embeddings
        h = self.encoder(tokens).mean(1)
        return self.pi(h), self.v(h)


def test_a_users_own_vit_wrapped_gives_back_every_frame() -> None:
    """Through `gradleak.wrap`, with nothing named for the attack: the model's own position
    embedding is the victim's (its per-step gradient is captured), and every frame comes
    back."""
    import warnings

    import gradleak
    from gradleak.victims.transform import InputTransform

    torch.manual_seed(0)
    victim = gradleak.wrap(UserViT(), policy_head="pi", value_head="v",
                           transform=InputTransform(48, 48, 4, stack=4))
    frames = torch.stack([smooth_frame(48, seed) for seed in range(4)]).permute(3, 1, 2, 0)
    frames = frames.reshape(3, 48, 48, 4)  # 3 stacks of 4 grey frames, from smooth colours
    with warnings.catch_warnings():  # vmap has no batching rule for CPU flash attention
        warnings.simplefilter("ignore", UserWarning)
        observation, _ = observe(victim, frames, torch.tensor([0, 2, 1]),
                                 torch.tensor([1.0, -0.5, 0.7]), torch.tensor([0.2, 0.1, -0.3]))
    result = ExactAttack(observation).reconstruct()
    assert result.extras["route"] == "patch embedding"
    np.testing.assert_array_equal(result.images, frames.numpy())
    np.testing.assert_array_equal(result.actions, [0, 2, 1])


def test_a_capture_without_the_position_embedding_is_refused_before_any_row() -> None:
    """The route reads two layers' gradients; a capture that left them out is refused at once,
    naming them."""
    from dataclasses import replace as replaced

    from gradleak.victims.base import LayerInfo

    _, observation, _ = vit_steps("vit-tiny-small", 64)
    kept, columns, offset = [], [], 0
    for layer in observation.layers:
        if layer.name.startswith(("pos_embed", "patch_embed")):
            continue
        kept.append(LayerInfo(layer.name, layer.shape, offset, layer.component))
        columns.extend(range(layer.offset, layer.offset + layer.size))
        offset += layer.size
    partial = replaced(observation, layers=tuple(kept),
                       gradients=observation.gradients[:, columns])
    with pytest.raises(ConfigError, match="patch embedding route reads the gradient of "
                                          "patch_embed.weight, pos_embed"):
        ExactAttack(partial)
