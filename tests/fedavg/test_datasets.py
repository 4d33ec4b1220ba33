"""Dataset parsers on small fixture files, the embedded stand-ins, and every bad-input path."""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from gradleak.errors import ConfigError, DataFileError
from gradleak.fedavg.datasets import load_dataset


def test_embedded_stand_ins_are_labelled_as_such() -> None:
    digits = load_dataset("digits")
    assert digits.images.shape[1:] == (1, 28, 28) and digits.name.endswith("stand-in)")
    assert 0.0 <= float(digits.images.min()) and float(digits.images.max()) <= 1.0
    photos = load_dataset("photos")
    assert photos.images.shape[1:] == (3, 32, 32) and "CIFAR stand-in" in photos.name
    assert photos.classes == int(photos.labels.max()) + 1
    first, _ = photos.sample(4, seed=1)
    again, _ = load_dataset("photos").sample(4, seed=1)
    assert torch.equal(first, again)  # seeded crops and sampling


def test_leaf_json(tmp_path: Path) -> None:
    pixels = np.linspace(0, 1, 784).tolist()
    data = {"users": ["f0", "f1"], "num_samples": [2, 1],
            "user_data": {"f0": {"x": [pixels, pixels], "y": [3, 61]},
                          "f1": {"x": [pixels], "y": [0]}}}
    (tmp_path / "all_data_0.json").write_text(json.dumps(data))
    images = load_dataset(f"femnist:{tmp_path}")
    assert images.images.shape == (3, 1, 28, 28) and images.labels.tolist() == [3, 61, 0]
    assert images.images[0, 0, 0, 1] == pytest.approx(1 / 783)


def write_idx(path: Path, magic: int, array: np.ndarray, compress: bool) -> None:
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)


@pytest.mark.parametrize("compress", [True, False])
def test_emnist_idx(tmp_path: Path, compress: bool) -> None:
    suffix = ".gz" if compress else ""
    pixels = np.zeros((2, 28, 28), np.uint8)
    pixels[0, 0, 5] = 255  # row 0, column 5 in EMNIST's transposed storage
    write_idx(tmp_path / f"emnist-train-images-idx3-ubyte{suffix}", 2051, pixels, compress)
    write_idx(tmp_path / f"emnist-train-labels-idx1-ubyte{suffix}", 2049, np.array([4, 9]),
              compress)
    images = load_dataset(f"femnist:{tmp_path}")
    assert images.labels.tolist() == [4, 9] and images.images[0, 0, 5, 0] == 1.0


def test_cifar100_pickle(tmp_path: Path) -> None:
    pixels = np.arange(2 * 3072, dtype=np.int64).reshape(2, 3072) % 256
    data = {b"data": pixels.astype(np.uint8), b"fine_labels": [7, 99], b"coarse_labels": [1, 2]}
    (tmp_path / "train").write_bytes(pickle.dumps(data))
    images = load_dataset(f"cifar100:{tmp_path}")
    assert images.images.shape == (2, 3, 32, 32) and images.labels.tolist() == [7, 99]
    assert images.images[0, 0, 0, 1] == pytest.approx(1 / 255)


class Exploit:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("echo pwned",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    (tmp_path / "train").write_bytes(pickle.dumps({b"data": Exploit(), b"fine_labels": []}))
    with pytest.raises(DataFileError, match="refers to (posix|os).system"):
        load_dataset(f"cifar100:{tmp_path}")


@pytest.mark.parametrize(("spec", "setup", "message"), [
    ("femnist:{}/missing", None, "does not exist: put LEAF's FEMNIST JSON"),
    ("cifar100:{}", None, "no 'train' file there"),
    ("femnist:{}", ("bad.json", b"{not json"), "not JSON"),
    ("femnist:{}", ("x.json", b'{"users": ["a"]}'), "expected LEAF's layout"),
    ("femnist:{}", ("x.json", b'{"users": ["a"], "user_data": {"a": {"x": [[1, 2]], "y": [1]}}}'),
     "not 784"),
    ("cifar100:{}", ("train", b"\x80\x04truncated"), "CIFAR-100 pickle .* not a readable"),
    ("femnist:{}", ("emnist-images-idx3-ubyte", b"\x00\x00\x08\x01junk"), "magic number 2051"),
    ("mnist", None, "expected digits, photos"),
])
def test_bad_inputs_name_the_file_and_what_was_expected(tmp_path: Path, spec: str, setup,
                                                        message: str) -> None:
    if setup:
        (tmp_path / setup[0]).write_bytes(setup[1])
        if setup[0].startswith("emnist"):
            (tmp_path / "emnist-labels-idx1-ubyte").write_bytes(b"")
    with pytest.raises((DataFileError, ConfigError), match=message):
        load_dataset(spec.format(tmp_path))


def test_the_rest_is_every_image_a_sample_leaves_out() -> None:
    from gradleak.fedavg.datasets import digits

    data = digits()
    images, _ = data.sample(5, seed=3)
    rest, rest_labels = data.rest(5, seed=3)
    assert len(rest) == len(rest_labels) == len(data.labels) - 5
    # the sample and the rest make the whole set: the same multiset of per-image sums
    together = torch.cat([images, rest]).double().flatten(1).sum(1).sort().values
    torch.testing.assert_close(together, data.images.double().flatten(1).sum(1).sort().values)
