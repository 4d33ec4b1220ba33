"""Factored storage (gradleak.capture.layout): a Linear weight seen on one vector a step is kept
as its output gradient and input, and every reader gets the very bits a dense capture holds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import tiny_preset

from gradleak.capture.grads import StepGradients, factorable_weights
from gradleak.capture.layout import FACTORED_ATTR, read_gradients
from gradleak.capture.merge import merge_shards
from gradleak.capture.plan import _factored, example_steps
from gradleak.capture.reader import CaptureFile
from gradleak.capture.run import CaptureJob, run_capture
from gradleak.capture.subset import restrict_components
from gradleak.defenses import parse_defense
from gradleak.defenses.files import defend_capture
from gradleak.errors import CaptureFileError
from gradleak.rl.losses import LossCoefficients
from gradleak.training.data import WindowDataset
from gradleak.victims import VictimConfig, create_victim
from gradleak.victims.base import layer_table


@pytest.fixture(scope="module")
def dense_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`random_capture`'s steps (same victim, seed and scenes), every weight dense."""
    preset = tiny_preset()
    preset.capture.factor_linear = False
    out = tmp_path_factory.mktemp("dense") / "heldout.h5"
    run_capture(CaptureJob(victim="cnn-small", random_init=True, split="heldout", steps=50,
                           out=out, preset=preset, progress=False, seed=3))
    return out


def rows(path: Path, **kwargs) -> np.ndarray:
    with CaptureFile(path) as capture:
        return capture.observation(**kwargs).gradients


def test_factored_rows_are_the_dense_captures_bits_in_fewer_bytes(
        random_capture: Path, dense_capture: Path) -> None:
    with h5py.File(random_capture, "r") as factored, h5py.File(dense_capture, "r") as dense:
        names = json.loads(factored.attrs[FACTORED_ATTR])
        assert FACTORED_ATTR not in dense.attrs
        assert (factored.attrs["format_version"], dense.attrs["format_version"]) == (2, 1)
        assert factored["gradients"].shape[1] < dense["gradients"].shape[1]
        # a window read, a single row, and a column range that cuts through a factored weight
        assert np.array_equal(read_gradients(factored, slice(5, 13)), dense["gradients"][5:13])
        assert np.array_equal(read_gradients(factored, 7), dense["gradients"][7])
        with CaptureFile(random_capture) as capture:
            weight = next(layer for layer in capture.layers if layer.name == names[0])
        cut = slice(weight.offset - 3, weight.offset + weight.size // 2)
        assert np.array_equal(read_gradients(factored, [1, 4, 9], cut),
                              dense["gradients"][[1, 4, 9], cut])
        assert read_gradients(factored, slice(2, 6), slice(5, 5)).shape == (4, 0)
    assert names == ["fc.weight", "policy_head.weight", "value_head.weight"]
    with CaptureFile(random_capture) as capture, CaptureFile(dense_capture) as dense_file:
        assert capture.summary()["factored_weights"] == names  # `gradleak info` says so
        assert dense_file.summary()["factored_weights"] == []
    assert np.array_equal(rows(random_capture), rows(dense_capture))
    assert np.array_equal(rows(random_capture, layers=[names[0]]),
                          rows(dense_capture, layers=[names[0]]))
    assert random_capture.stat().st_size < dense_capture.stat().st_size


def test_training_windows_restricted_defended_and_merged_copies_read_the_same(
        random_capture: Path, dense_capture: Path, tmp_path: Path) -> None:
    windows = [WindowDataset([str(path)], window=4)[3].gradients
               for path in (random_capture, dense_capture)]
    assert torch.equal(*windows)
    for components in (["fc"], ["cnn", "heads"]):
        cuts = [restrict_components(path, components, tmp_path / f"{i}-{'-'.join(components)}.h5")
                for i, path in enumerate((random_capture, dense_capture))]
        assert np.array_equal(rows(Path(cuts[0]["out"])), rows(Path(cuts[1]["out"])))
    noise = parse_defense("noise:0.01")
    for i, path in enumerate((random_capture, dense_capture)):
        defend_capture(path, noise, tmp_path / f"noisy{i}.h5")
    assert np.array_equal(rows(tmp_path / "noisy0.h5"), rows(tmp_path / "noisy1.h5"))
    with h5py.File(tmp_path / "noisy0.h5", "r") as noisy:  # noise is no outer product
        assert FACTORED_ATTR not in noisy.attrs and "gradient_factors" not in noisy
        assert noisy.attrs["format_version"] == 1


@pytest.mark.slow
def test_merged_factored_shards_read_as_the_shards(train_shards: list[Path],
                                                   tmp_path: Path) -> None:
    out = tmp_path / "merged.h5"
    merge_shards(train_shards, out)
    assert np.array_equal(rows(out), np.concatenate([rows(path) for path in train_shards]))


def test_a_factor_dataset_that_does_not_match_is_named(random_capture: Path,
                                                       tmp_path: Path) -> None:
    path = tmp_path / "bad.h5"
    shutil.copy(random_capture, path)
    with h5py.File(path, "a") as handle:
        del handle["gradient_factors"]
    with pytest.raises(CaptureFileError, match="'gradient_factors' is missing, expected "
                       "\\(50, \\d+\\): the output gradients and inputs of the weights in "
                       "attribute 'factored_layers' \\(fc.weight, policy_head.weight, "
                       "value_head.weight\\)"):
        CaptureFile(path)
    with h5py.File(path, "a") as handle:
        handle.attrs[FACTORED_ATTR] = json.dumps(["fc.bias"])
    with pytest.raises(CaptureFileError, match="'factored_layers' names 'fc.bias', which is "
                       "not a 2-D weight"):
        CaptureFile(path)
    with h5py.File(path, "a") as handle:
        handle.attrs["format_version"] = 1
    with pytest.raises(CaptureFileError, match="'factored_layers' needs format_version 2, the "
                       "file says 1"):
        CaptureFile(path)


def test_only_linears_seen_on_one_vector_a_step_factor() -> None:
    """A ViT's token layers see many vectors a step (their gradient is a sum of outer
    products, kept dense; only its heads would factor, and its free position embedding has no
    einsum rule, so a capture takes it by vmap, all dense); a recurrent cell's layers see one
    vector a step (the capture's step starts from its recorded state) and factor."""
    def factored(name: str) -> list[str]:
        victim = create_victim(VictimConfig(name=name, frame_size=32)).eval()
        return factorable_weights(victim, layer_table(victim), example_steps(victim))

    assert factored("vit-tiny-small") == ["policy_head.weight", "value_head.weight"]
    assert factored("cnn-gru-small") == ["fc.weight", "gru.input.weight", "gru.state.weight",
                                         "policy_head.weight", "value_head.weight"]
    victim = create_victim(VictimConfig(name="vit-tiny-small", frame_size=32)).eval()
    assert _factored(victim, layer_table(victim), tiny_preset().capture) == []


@pytest.mark.parametrize("name", ["cnn-small", "cnn-gru-small", "multimodal-small"])
def test_factors_stand_for_the_dense_einsum_rows_bit_for_bit(name: str) -> None:
    """The factored einsum's rows, multiplied out, are the dense einsum's to the bit (each entry
    one float32 product), the factored weights' columns are left out of its dense rows, and
    the output gradient is the layer's bias gradient."""
    torch.manual_seed(0)
    victim = create_victim(VictimConfig(name=name, frame_size=32)).eval()
    layers = layer_table(victim)
    batch = example_steps(victim, 6)
    batch.images = torch.randint(0, 256, batch.images.shape, dtype=torch.uint8)
    batch.advantages = torch.randn(6)
    if batch.hidden is not None:
        batch.hidden = torch.randn_like(batch.hidden)
    names = factorable_weights(victim, layers, batch)
    factored = StepGradients("einsum", 4, names)(victim, batch, LossCoefficients(), layers)
    dense = StepGradients("einsum", 4)(victim, batch, LossCoefficients(), layers)
    assert torch.equal(factored.full(layers), dense)
    assert factored.dense.shape[1] == dense.shape[1] - sum(
        layer.size for layer in layers if layer.name in names)
    bias = next(layer for layer in layers if layer.name == "policy_head.bias")
    assert torch.equal(factored.factors["policy_head.weight"][0],
                       dense[:, bias.offset:bias.offset + bias.size])


@pytest.mark.slow
def test_a_partial_capture_resumes_only_in_its_own_layout(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupted after its first episode (Ctrl-C), a factored capture is resumable; resumed
    with every weight dense it is refused, naming the setting to pass; resumed as it was
    written it completes with the rows of an uninterrupted capture."""
    from gradleak.capture.writer import CaptureWriter

    original = CaptureWriter.append_episode

    def interrupted(self, rows, gradients, factors=None):
        if self.num_episodes == 1:
            raise KeyboardInterrupt
        return original(self, rows, gradients, factors)

    def job(out: Path, resume: bool = False, factor_linear: bool = True) -> CaptureJob:
        preset = tiny_preset()
        preset.capture.factor_linear = factor_linear
        return CaptureJob(victim="cnn-small", random_init=True, split="train", steps=45,
                          out=out, preset=preset, progress=False, seed=3, resume=resume)

    out = tmp_path / "cut.h5"
    with monkeypatch.context() as patch:
        patch.setattr(CaptureWriter, "append_episode", interrupted)
        with pytest.raises(KeyboardInterrupt):
            run_capture(job(out))
    assert (tmp_path / "cut.h5.partial").exists()
    with pytest.raises(CaptureFileError, match="factored_layers differ.*written with "
                       "capture.factor_linear=true"):
        run_capture(job(out, resume=True, factor_linear=False))
    run_capture(job(out, resume=True))
    run_capture(job(tmp_path / "whole.h5"))
    assert np.array_equal(rows(out), rows(tmp_path / "whole.h5"))


def test_compact_rows_are_the_stored_bytes_and_form_the_dense_captures_bits(
        random_capture: Path, dense_capture: Path) -> None:
    """A loader asked for compact rows hands a factored capture's rows on as stored (the
    unfactored columns and the factors), and forming them where they are used gives the bits
    every other reader gets, the dense capture's."""
    from gradleak.training.data import CompactRows, collate

    compact = WindowDataset([random_capture], window=4, compact=True)
    full = WindowDataset([random_capture], window=4)
    assert compact.compact and not full.compact
    chosen = [len(compact) - 1, 0, 5]
    windows = compact.__getitems__(chosen)
    rows = collate(windows).observed.gradients
    assert isinstance(rows, CompactRows)
    expected = torch.stack([full[i].gradients for i in chosen])
    formed = rows.full()
    assert formed.dtype == torch.float32 and torch.equal(formed, expected)
    dense = WindowDataset([dense_capture], window=4)
    assert torch.equal(formed, torch.stack([dense[i].gradients for i in chosen]))
    assert rows.stored.numel() + rows.factors.numel() < expected.numel() / 2
    # collate hands on the batch read in one piece, uncopied
    assert rows.stored.untyped_storage().data_ptr() == \
        windows[0].gradients.stored.untyped_storage().data_ptr()
    assert torch.equal(compact[chosen[2]].gradients.full(), expected[2])  # one window alone
    gradients, images, actions = collate(windows).on("cpu")
    assert torch.equal(gradients, expected) and images.shape[:2] == actions.shape[:2]
    with pytest.raises(ValueError, match=r"expected \(\.\.\., \d+\) and \(\.\.\., \d+\)"):
        compact.layout.expand(rows.stored[..., 1:], rows.factors)


def test_compact_rows_are_asked_in_vain_of_dense_captures_and_defended_windows(
        random_capture: Path, dense_capture: Path, float16_capture: Path) -> None:
    """Nothing to save: a dense capture's rows (float16 ones are never factored), and rows a
    defense forms anew, come full."""
    for data in (WindowDataset([dense_capture], window=4, compact=True),
                 WindowDataset([float16_capture], window=4, compact=True),
                 WindowDataset([random_capture], window=4, compact=True,
                               defense=parse_defense("noise:0.01"))):
        assert not data.compact
        assert isinstance(data[0].gradients, torch.Tensor)
