"""Windows stay inside episodes, the split is episode-disjoint, batches split the threat model."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from gradleak.errors import CaptureFileError, ConfigError
from gradleak.threat import ObservedWindows
from gradleak.training.data import WindowDataset, collate


def test_windows_never_cross_an_episode(train_capture: Path) -> None:
    data = WindowDataset([train_capture], window=4, stride=2)
    with h5py.File(train_capture, "r") as handle:
        episodes = handle["episode_ids"][()]
    for _, start, episode in data.rows:
        assert (episodes[start:start + 4] == episode).all()
    assert len({tuple(r[1:]) for r in data.rows}) == len(data)


def test_train_and_validation_episodes_are_disjoint(train_capture: Path) -> None:
    kwargs = dict(window=4, stride=2, val_fraction=0.3, seed=1)
    train = WindowDataset([train_capture], part="train", **kwargs)
    val = WindowDataset([train_capture], part="val", **kwargs)
    whole = WindowDataset([train_capture], part="all", **kwargs)
    assert not set(train.rows[:, 2]) & set(val.rows[:, 2])
    assert len(train) + len(val) == len(whole) and len(val) > 0


def test_a_batch_separates_what_was_observed_from_the_targets(train_capture: Path) -> None:
    data = WindowDataset([train_capture], window=4)
    batch = collate([data[0], data[1]])
    assert isinstance(batch.observed, ObservedWindows)
    assert batch.observed.gradients.shape == (2, 4, data.gradient_dim)
    assert batch.images.shape == (2, 4, 3, 32, 32) and float(batch.images.max()) <= 1.0


def test_a_window_longer_than_every_episode(train_capture: Path) -> None:
    with pytest.raises(ConfigError, match="no 'all' window of T=50.*longest 'all' episode "
                       "has 20 steps.*needs 50"):
        WindowDataset([train_capture], window=50)


def test_the_error_names_the_parts_own_longest_episode(train_capture: Path) -> None:
    """A split's validation episodes may all be shorter than the file's longest: the message
    says which length kept the part empty (the fit's own error on a short capture)."""
    assert len(WindowDataset([train_capture], window=1, part="val")) > 0
    with pytest.raises(ConfigError, match=r"no 'val' window of T=21.*longest 'val' episode has "
                                          r"\d+ steps, the longest of all 20"):
        WindowDataset([train_capture], window=21, part="val")


def test_heldout_scenes_are_refused_as_training_data(random_capture: Path) -> None:
    with pytest.raises(CaptureFileError, match="holds 'heldout' scenes, expected 'train'"):
        WindowDataset([random_capture], window=4, expect_split="train")


def test_mean_image_and_normaliser_rows_come_from_the_dataset(train_capture: Path) -> None:
    """Checked against the capture file read directly: the normaliser's rows are captured
    gradient rows, and over every one-step window the mean image is the mean of exactly the
    training part's frames (not the validation part's)."""
    from gradleak.capture.reader import CaptureFile

    data = WindowDataset([train_capture], window=1, stride=1, part="train")
    with CaptureFile(train_capture) as capture:
        gradients = capture.read("gradients").astype(np.float32)
        images = capture.private_column("images")
    rows = np.concatenate([r.numpy() for r in data.gradient_rows(10)])
    assert rows.shape == (10, data.gradient_dim)
    assert all((gradients == row).all(1).any() for row in rows)
    train_rows = data.rows[:, 1]
    mean = data.mean_image(limit=10 ** 6)
    truth = torch.from_numpy(images[train_rows].astype(np.float64).mean(0) / 255.0)
    torch.testing.assert_close(mean, truth.permute(2, 0, 1).float())
    everything = torch.from_numpy(images.astype(np.float64).mean(0) / 255.0)
    assert len(train_rows) < len(images)  # a validation part exists, and is left out
    assert not torch.allclose(mean, everything.permute(2, 0, 1).float())


@pytest.mark.parametrize("compact", [False, True])
def test_worker_processes_stream_the_same_windows(train_capture: Path, compact: bool) -> None:
    """Full rows, and compact ones (read into shared memory as two tensors), alike."""
    from torch.utils.data import DataLoader

    from gradleak.training.data import full_rows

    data = WindowDataset([train_capture], window=4, compact=compact)
    assert data.compact == compact
    data[0]  # the parent opens its handles first: workers must open their own
    batches = [list(DataLoader(data, batch_size=5, collate_fn=collate, num_workers=workers))
               for workers in (0, 1)]
    for inline, streamed in zip(*batches, strict=True):
        assert torch.equal(full_rows(inline.observed.gradients),
                           full_rows(streamed.observed.gradients))
        assert torch.equal(inline.images, streamed.images)


@pytest.mark.parametrize("fixture", ["train_capture", "float16_capture"])
def test_a_batch_is_read_into_one_tensor_holding_each_windows_rows(
        fixture: str, request: pytest.FixtureRequest) -> None:
    """A DataLoader's batch reads its windows' rows straight into one tensor (factored float32
    rows expanded in place, float16 rows widened by HDF5): the rows each window alone reads,
    and collate hands that tensor on without a copy; a buffer of the wrong shape is refused."""
    from gradleak.capture.layout import read_gradients

    data = WindowDataset([request.getfixturevalue(fixture)], window=4)
    chosen = [len(data) - 1, 0, 3, 1]
    windows = data.__getitems__(chosen)
    batch = collate(windows).observed.gradients
    assert torch.equal(batch, torch.stack([data[i].gradients for i in chosen]))
    assert batch.dtype == torch.float32 and batch.is_contiguous()
    assert batch.untyped_storage().data_ptr() == windows[0].gradients.untyped_storage().data_ptr()
    with h5py.File(data.paths[0], "r") as handle:
        with pytest.raises(ValueError, match="out: expected shape"):
            read_gradients(handle, slice(0, 4), out=np.empty((3, data.gradient_dim), np.float32)) \
                if "gradient_factors" in handle else \
                read_gradients(handle, slice(0, 4), out=np.empty((3, 7), np.float32))


def test_a_ranks_files_hold_those_files_windows_and_no_other_file_is_opened(
        train_shards: list[Path], tmp_path: Path) -> None:
    """One DDP rank's view of a sharded capture: the windows (and the train/val split) of its
    own file are those of the whole capture, and the other rank's file is never opened (here
    it is not even on this machine)."""
    whole = WindowDataset(train_shards, window=4, part="train")
    elsewhere = tmp_path / "on-another-node.h5"
    mine = WindowDataset([elsewhere, train_shards[1]], window=4, part="train", files=[1])
    expected = np.flatnonzero(whole.rows[:, 0] == 1)
    assert len(expected) and np.array_equal(mine.rows, whole.rows[expected])
    for index in (0, len(mine) - 1):
        assert torch.equal(mine[index].gradients, whole[int(expected[index])].gradients)
        assert torch.equal(mine[index].rows, whole[int(expected[index])].rows)
    with pytest.raises(ConfigError, match="positions among the 2 capture files"):
        WindowDataset(train_shards, window=4, files=[2])


def test_a_dataloader_pins_every_tensor_of_a_batch(train_capture: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """pin_memory=True reaches a `WindowBatch` through its own method (torch hands any other
    dataclass on unpinned), full rows and compact ones alike."""
    from torch.utils.data._utils.pin_memory import pin_memory

    pinned: list[int] = []

    def pin(self: torch.Tensor, *args: object) -> torch.Tensor:  # no GPU here to pin for
        copy = self.clone()
        pinned.append(copy.data_ptr())
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    for compact in (False, True):
        data = WindowDataset([train_capture], window=4, compact=compact)
        batch = pin_memory(collate(data.__getitems__([0, 1])))
        gradients = batch.observed.gradients
        tensors = [gradients] if isinstance(gradients, torch.Tensor) else \
            [gradients.stored, gradients.factors]
        tensors += [batch.images, batch.actions, batch.rows]
        assert [t.data_ptr() for t in tensors] == pinned[-len(tensors):]
