"""TRACE's structure: causality, autoregressive = parallel under teacher forcing, the boundary."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradleak.attacks.trace import Trace, TraceConfig
from gradleak.errors import ConfigError
from gradleak.threat import ObservedWindows

D, T, SIZE = 300, 5, 32


def tiny(**overrides) -> Trace:
    torch.manual_seed(0)
    config = TraceConfig(gradient_dim=D, frame_size=SIZE, window=T, encoder_width=32,
                         encoder_blocks=1, latent=32, layers=2, heads=4, image_channels=8,
                         dropout=0.0, **overrides)
    return Trace(config).eval()


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, T, D, generator=g), torch.rand(2, T, 3, SIZE, SIZE, generator=g)


@pytest.mark.parametrize("options", [{}, {"rope": True}, {"projection": "dense"},
                                     {"projection": "lowrank", "rank": 8}])
def test_future_gradients_never_change_past_reconstructions(options) -> None:
    model = tiny(**options)
    gradients, frames = inputs()
    changed = gradients.clone()
    changed[:, 3:] = torch.randn(2, T - 3, D)
    with torch.no_grad():
        for path in (lambda g: model(g, frames), lambda g: model.decode(g)):
            before_frames, before_logits = path(gradients)
            after_frames, after_logits = path(changed)
            assert torch.allclose(before_frames[:, :3], after_frames[:, :3], atol=1e-6)
            assert torch.allclose(before_logits[:, :3], after_logits[:, :3], atol=1e-6)
            assert not torch.allclose(before_frames[:, 3:], after_frames[:, 3:], atol=1e-4)


def test_future_frames_never_reach_the_parallel_path() -> None:
    model = tiny()
    gradients, frames = inputs()
    changed = frames.clone()
    changed[:, 2:] = torch.rand(2, T - 2, 3, SIZE, SIZE)
    with torch.no_grad():
        before, _ = model(gradients, frames)
        after, _ = model(gradients, changed)
    # frame x_3 (index 2) is context for x_4 onwards only
    assert torch.allclose(before[:, :3], after[:, :3], atol=1e-6)
    assert not torch.allclose(before[:, 3:], after[:, 3:], atol=1e-4)


@pytest.mark.parametrize("options", [{}, {"rope": True}])
def test_autoregressive_decoding_with_teacher_context_equals_the_parallel_pass(options) -> None:
    model = tiny(**options)
    gradients, frames = inputs(1)
    with torch.no_grad():
        parallel_frames, parallel_logits = model(gradients, frames)
        step_frames, step_logits = model.decode(gradients, teacher=frames)
    assert torch.allclose(parallel_frames, step_frames, atol=1e-5)
    assert torch.allclose(parallel_logits, step_logits, atol=1e-5)

def test_decoding_encodes_each_frame_a_later_step_reads_and_no_other() -> None:
    model = tiny()
    gradients, _ = inputs()
    encoded: list[int] = []
    model.image_encoder.register_forward_hook(lambda _m, args, _out: encoded.append(len(args[0])))
    with torch.no_grad():
        model.decode(gradients)
    assert encoded == [2] * (T - 1)  # frames x_1 .. x_{T-1}: x_T is no step's context



def test_reconstruct_takes_only_observed_gradients() -> None:
    model = tiny()
    gradients, frames = inputs()
    result = model.reconstruct(ObservedWindows(gradients))
    assert result.images.shape == (2, T, SIZE, SIZE, 3) and result.actions.shape == (2, T)
    assert [f.name for f in dataclasses.fields(ObservedWindows)] == ["gradients"]
    with pytest.raises(TypeError, match="ObservedWindows"):
        model.reconstruct(gradients)


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="projection 'fourier'"):
        tiny(projection="fourier")
    with pytest.raises(ConfigError, match="not divisible by 5 heads"):
        Trace(TraceConfig(gradient_dim=D, latent=32, heads=5))
    model = tiny()
    with pytest.raises(ConfigError, match="gradient width 299"):
        model.decode(torch.zeros(1, 2, D - 1))


def test_the_decoders_wide_linear_is_a_linear_that_follows_its_weight() -> None:
    """Without autograd the wide Linear reads a cached transpose of its weight: the same
    numbers as nn.Linear to rounding, and after the weight changes (an optimiser step, a load)
    the new weight's, never the stale copy's. With autograd, and in its checkpoint, it is
    nn.Linear exactly."""
    from gradleak.attacks.encoders import WideLinear

    torch.manual_seed(0)
    wide, plain = WideLinear(16, 512), torch.nn.Linear(16, 512)
    plain.load_state_dict(wide.state_dict())  # the same keys and shapes
    x = torch.randn(3, 2, 16)
    with torch.no_grad():
        assert torch.allclose(wide(x), plain(x), rtol=1e-5, atol=1e-6)
    assert torch.equal(wide(x), plain(x))  # autograd on: nn.Linear's own path

    optimiser = torch.optim.SGD(wide.parameters(), lr=0.5)
    wide(x).square().sum().backward()
    optimiser.step()  # in place: the cached transpose is now stale
    plain.load_state_dict(wide.state_dict())
    with torch.no_grad():
        assert torch.allclose(wide(x), plain(x), rtol=1e-5, atol=1e-6)
        wide.load_state_dict(torch.nn.Linear(16, 512).state_dict())
        assert not torch.allclose(wide(x), plain(x), rtol=1e-3)
        plain.load_state_dict(wide.state_dict())
        assert torch.allclose(wide(x), plain(x), rtol=1e-5, atol=1e-6)
