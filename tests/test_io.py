"""Files are replaced whole: a duplicate keeps its bytes when the original is rewritten."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from gradleak.io import duplicate_file, load_tensors, save_tensors


@pytest.mark.parametrize("links", [True, False])
def test_a_duplicate_keeps_its_bytes_when_the_original_is_saved_again(
        links: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The best checkpoint is a hard link to the epoch's weights (or a copy where the file
    system has no links); the next epoch's save replaces the weights by rename, so the best
    one still holds the epoch it was taken at, and nothing temporary is left behind."""
    if not links:
        def no_links(*args: object) -> None:
            raise OSError("hard links are not supported here")
        monkeypatch.setattr(os, "link", no_links)
    weights, best = tmp_path / "attacker.safetensors", tmp_path / "best.safetensors"
    save_tensors(weights, {"w": torch.arange(4.0)})
    duplicate_file(weights, best)
    assert best.read_bytes() == weights.read_bytes()
    assert (os.stat(best).st_ino == os.stat(weights).st_ino) is links
    save_tensors(weights, {"w": -torch.arange(4.0)})
    assert torch.equal(load_tensors(best, "best")["w"], torch.arange(4.0))
    assert torch.equal(load_tensors(weights, "weights")["w"], -torch.arange(4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([best.name, weights.name])
