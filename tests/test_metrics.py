"""Image metrics against known values, and LPIPS loaded offline (or reported unavailable)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradleak.errors import CheckpointError
from gradleak.metrics.images import mse, psnr, ssim, to_unit_tensor
from gradleak.metrics.lpips import ALEXNET_CONVS, LPIPS, unavailable_reason


def test_psnr_of_a_known_mse() -> None:
    a = torch.zeros(2, 3, 16, 16)
    b = torch.full((2, 3, 16, 16), 0.1)  # MSE = 0.01 → 20 dB
    assert mse(a, b) == pytest.approx([0.01, 0.01])
    assert psnr(a, b) == pytest.approx([20.0, 20.0], abs=1e-4)


def test_ssim_of_identical_images_is_one_and_drops_with_noise() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.rand(3, 3, 32, 32, generator=g)
    noisy = (a + 0.2 * torch.randn(a.shape, generator=g)).clamp(0, 1)
    assert ssim(a, a) == pytest.approx([1.0] * 3, abs=1e-5)
    assert (ssim(a, noisy) < 0.9).all()
    assert ssim(a, noisy) == pytest.approx(ssim(noisy, a), abs=1e-6)


def test_ssim_of_constant_images_follows_the_luminance_term() -> None:
    a, b = torch.full((1, 3, 16, 16), 0.2), torch.full((1, 3, 16, 16), 0.6)
    c1 = 0.01**2
    expected = (2 * 0.2 * 0.6 + c1) / (0.2**2 + 0.6**2 + c1)  # σ terms are zero
    assert ssim(a, b).item() == pytest.approx(expected, rel=1e-3)  # float32 variances


def test_uint8_frames_become_unit_tensors() -> None:
    frames = torch.full((2, 8, 8, 3), 255, dtype=torch.uint8).numpy()
    tensor = to_unit_tensor(frames)
    assert tensor.shape == (2, 3, 8, 8) and float(tensor.max()) == 1.0


def fake_alexnet(path: Path) -> Path:
    """A backbone file with torchvision's AlexNet shapes and random weights."""
    state, channels = {}, 3
    g = torch.Generator().manual_seed(0)
    for index, out, kernel, _, _ in ALEXNET_CONVS:
        state[f"features.{index}.weight"] = torch.randn(out, channels, kernel, kernel,
                                                        generator=g) * 0.05
        state[f"features.{index}.bias"] = torch.zeros(out)
        channels = out
    state["classifier.1.weight"] = torch.zeros(4, 4)  # ignored: only `features` is read
    torch.save(state, path)
    return path


def test_lpips_loads_a_backbone_file_and_behaves_like_a_distance(tmp_path: Path) -> None:
    metric = LPIPS(fake_alexnet(tmp_path / "alexnet.pth"))
    g = torch.Generator().manual_seed(1)
    a, b = torch.rand(2, 3, 64, 64, generator=g), torch.rand(2, 3, 64, 64, generator=g)
    assert metric(a, a) == pytest.approx([0.0, 0.0], abs=1e-6)
    d = metric(a, b)
    assert (d > 0).all() and torch.allclose(d, metric(b, a))


def test_lpips_without_a_backbone_says_where_the_file_goes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.delenv("GRADLEAK_LPIPS_WEIGHTS", raising=False)
    reason = unavailable_reason()
    assert reason is not None and "alexnet-owt-7be5be79.pth" in reason
    assert str(tmp_path / "hub" / "checkpoints") in reason
    with pytest.raises(CheckpointError, match="LPIPS unavailable"):
        LPIPS()


def test_lpips_backbone_of_the_wrong_shape(tmp_path: Path) -> None:
    path = tmp_path / "bad.pth"
    torch.save({"features.0.weight": torch.zeros(1)}, path)
    with pytest.raises(CheckpointError, match="features.0.weight.*wrong shape"):
        LPIPS(path)
