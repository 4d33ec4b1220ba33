"""Client data for the FedAvg experiments, from local files only (nothing is downloaded).

- `digits`: scikit-learn's bundled 8×8 handwritten digits, resized to 28×28: a FEMNIST
  stand-in, labelled so in every table.
- `photos`: seeded 32×32 crops of the natural photographs bundled with scikit-image and
  scikit-learn, the class being the source photograph: a CIFAR stand-in, labelled so.
- `femnist:PATH`: LEAF's JSON files (`{"users", "user_data": {u: {"x", "y"}}}`), or EMNIST's idx
  files (`*-images-idx3-ubyte[.gz]`, `*-labels-idx1-ubyte[.gz]`).
- `cifar100:PATH`: the python version's `train` (or `test`) file. It is a pickle, read with an
  unpickler that admits only numpy arrays and plain containers, never arbitrary code.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gradleak.errors import ConfigError, DataFileError
from gradleak.safe_pickle import load_arrays

EMBEDDED = ("digits", "photos")
SKIMAGE_PHOTOS = ("astronaut", "chelsea", "coffee", "hubble_deep_field", "immunohistochemistry",
                  "retina", "rocket")


@dataclass(frozen=True)
class ImageSet:
    images: torch.Tensor  # (M, C, H, W) float in [0, 1]
    labels: torch.Tensor  # (M,) int64
    classes: int
    name: str  # how tables name it ("digits (FEMNIST stand-in)")

    def sample(self, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = self._chosen(count, seed)
        return self.images[index], self.labels[index]

    def rest(self, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every image `sample(count, seed)` leaves out: auxiliary data apart from a client's."""
        kept = np.setdiff1d(np.arange(len(self.labels)), self._chosen(count, seed))
        return self.images[kept], self.labels[kept]

    def _chosen(self, count: int, seed: int) -> np.ndarray:
        if count > len(self.labels):
            raise ConfigError(f"{self.name} holds {len(self.labels)} images, {count} requested")
        return np.random.default_rng(seed).choice(len(self.labels), count, replace=False)


def load_dataset(spec: str, seed: int = 0) -> ImageSet:
    kind, _, path = spec.partition(":")
    if kind == "digits" and not path:
        return digits()
    if kind == "photos" and not path:
        return photos(seed)
    if kind == "femnist" and path:
        return femnist(Path(path))
    if kind == "cifar100" and path:
        return cifar100(Path(path))
    raise ConfigError(f"--dataset {spec!r}: expected digits, photos, femnist:PATH or "
                      "cifar100:PATH")


def digits() -> ImageSet:
    from sklearn.datasets import load_digits

    data = load_digits()
    small = torch.from_numpy(data.images).float()[:, None] / 16.0  # (M, 1, 8, 8)
    images = F.interpolate(small, size=(28, 28), mode="bilinear", align_corners=False)
    return ImageSet(images.clamp(0, 1), torch.from_numpy(data.target).long(), 10,
                    "digits (FEMNIST stand-in)")


def photos(seed: int = 0, crops_per_photo: int = 64, size: int = 32) -> ImageSet:
    import skimage.data
    from sklearn.datasets import load_sample_images

    sources = [getattr(skimage.data, name)() for name in SKIMAGE_PHOTOS]
    sources += list(load_sample_images().images)
    rng = np.random.default_rng(seed)
    crops, labels = [], []
    for label, photo in enumerate(sources):
        height, width = photo.shape[:2]
        for _ in range(crops_per_photo):
            # a crop of a quarter of the short side, resized: CIFAR-like content per pixel
            side = min(height, width) // 4
            top, left = rng.integers(0, height - side), rng.integers(0, width - side)
            patch = torch.from_numpy(np.ascontiguousarray(photo[top:top + side,
                                                                 left:left + side, :3]))
            crops.append(F.interpolate(patch.permute(2, 0, 1)[None].float() / 255.0,
                                       size=(size, size), mode="area")[0])
            labels.append(label)
    return ImageSet(torch.stack(crops), torch.tensor(labels), len(sources),
                    "photos (CIFAR stand-in)")


def femnist(path: Path) -> ImageSet:
    if not path.exists():
        raise DataFileError(f"femnist:{path} does not exist: put LEAF's FEMNIST JSON files "
                            "(data/femnist/data/all_data/*.json) or EMNIST's idx files there")
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if files and files[0].suffix == ".json":
        return _leaf_json(files)
    return _emnist_idx(path if path.is_dir() else path.parent)


def _leaf_json(files: list[Path]) -> ImageSet:
    images, labels = [], []
    for file in files:
        try:
            data = json.loads(file.read_text())
            for user in data["users"]:
                record = data["user_data"][user]
                images.append(np.asarray(record["x"], dtype=np.float32).reshape(-1, 1, 28, 28))
                labels.append(np.asarray(record["y"], dtype=np.int64))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DataFileError(f"{file}: not JSON (expected LEAF's FEMNIST layout)") from None
        except (KeyError, TypeError):
            raise DataFileError(f"{file}: expected LEAF's layout {{'users': [...], "
                                "'user_data': {user: {'x': [[784 floats]], 'y': [...]}}}") \
                from None
        except ValueError:
            raise DataFileError(f"{file}: a user's 'x' rows are not 784 = 28×28 values") \
                from None
    if not images:
        raise DataFileError(f"{files[0].parent}: the JSON files hold no users")
    return ImageSet(torch.from_numpy(np.concatenate(images)).clamp(0, 1),
                    torch.from_numpy(np.concatenate(labels)), 62, "FEMNIST")


def _read_idx(path: Path, magic: int) -> np.ndarray:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    if len(raw) < 8 or int.from_bytes(raw[:4], "big") != magic:
        raise DataFileError(f"{path}: not an idx file with magic number {magic}")
    dims = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims)
    if body.size != int(np.prod(shape)):
        raise DataFileError(f"{path}: header says {shape}, the file holds {body.size} values "
                            "(truncated?)")
    return body.reshape(shape)


def _emnist_idx(folder: Path) -> ImageSet:
    images = sorted(folder.glob("*images-idx3-ubyte*"))
    labels = sorted(folder.glob("*labels-idx1-ubyte*"))
    if not images or not labels:
        raise DataFileError(f"{folder}: no LEAF JSON and no EMNIST idx pair "
                            "(*-images-idx3-ubyte[.gz], *-labels-idx1-ubyte[.gz])")
    pixels, targets = _read_idx(images[0], 2051), _read_idx(labels[0], 2049)
    if len(pixels) != len(targets):
        raise DataFileError(f"{images[0]} holds {len(pixels)} images, {labels[0]} "
                            f"{len(targets)} labels")
    # EMNIST stores images transposed relative to MNIST
    tensor = torch.from_numpy(pixels.transpose(0, 2, 1).copy()).float()[:, None] / 255.0
    targets_tensor = torch.from_numpy(targets.astype(np.int64))
    return ImageSet(tensor, targets_tensor, int(targets_tensor.max()) + 1, "EMNIST")


def cifar100(path: Path) -> ImageSet:
    file = path / "train" if path.is_dir() else path
    if not file.is_file():
        raise DataFileError(f"cifar100:{path}: no 'train' file there: put the python version "
                            "of CIFAR-100 (cifar-100-python/train) at that path")
    data = load_arrays(file, f"the CIFAR-100 pickle {file}", DataFileError)
    try:
        pixels = np.asarray(data[b"data"], dtype=np.uint8)
        labels = np.asarray(data[b"fine_labels"], dtype=np.int64)
    except (KeyError, TypeError):
        raise DataFileError(f"{file}: expected a dict with b'data' and b'fine_labels'") from None
    if pixels.ndim != 2 or pixels.shape[1] != 3072 or len(pixels) != len(labels):
        raise DataFileError(f"{file}: b'data' has shape {pixels.shape}, expected (N, 3072) "
                            f"beside {len(labels)} labels")
    images = torch.from_numpy(pixels.reshape(-1, 3, 32, 32).copy()).float() / 255.0
    return ImageSet(images, torch.from_numpy(labels), 100, "CIFAR-100")
