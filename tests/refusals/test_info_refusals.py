"""`gradleak info` and the capture reader: every attribute parsed and every chunk decoded, with
the attribute, dataset and rows named when one is not what it should be."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradleak.cli import main

from .conftest import copy_capture, corrupt_chunk, poison_rows, set_attribute


@pytest.mark.parametrize("name, value, fragment", [
    ("layer_table", "[{not json", "attribute 'layer_table'"),
    ("layer_table", '[{"name": "w"}]', "attribute 'layer_table'"),
    ("victim_config", "{oops", "attribute 'victim_config' is not valid JSON"),
    ("victim_config", '{"name": "cnn-small", "frame_size": "big", "num_actions": 5}',
     "field 'frame_size' is 'big'"),
    ("scenes", "not json", "attribute 'scenes' is not valid JSON"),
    ("scenes", '{"a": 1}', "attribute 'scenes' holds a dict"),
    ("components", "[1, 2]", "attribute 'components' is not a list of names"),
    ("gradient_dim", "many", "attribute 'gradient_dim' is 'many'"),
    ("format_version", "one", "attribute 'format_version' is 'one'"),
    ("loss", "{", "attribute 'loss' is not valid JSON"),
])
def test_malformed_attributes_are_named(refused, tmp_path: Path, random_capture: Path, name,
                                        value, fragment) -> None:
    path = set_attribute(copy_capture(random_capture, tmp_path / "in"), name, value)
    refused(["info", str(path)], str(path), fragment)
    refused(["recover-actions", str(path)], fragment)


def test_a_corrupt_image_chunk_fails_info_and_the_attacks_that_read_it(
        refused, tmp_path: Path, random_capture: Path) -> None:
    path = corrupt_chunk(copy_capture(random_capture, tmp_path / "in"), "images", 5)
    refused(["info", str(path)], "dataset 'images' rows", "cannot be read")
    refused(["closed-form", str(path)], "dataset 'images' rows", "cannot be read")
    assert main(["info", str(path), "--no-validate", "--quiet"]) == 0  # the header is fine


def test_a_corrupt_gradient_chunk_names_its_rows(refused, tmp_path: Path,
                                                random_capture: Path) -> None:
    path = corrupt_chunk(copy_capture(random_capture, tmp_path / "in"), "gradients", 7)
    refused(["info", str(path)], "dataset 'gradients' rows 0-49", "cannot be read")


def test_non_finite_rows_are_named_by_info(refused, tmp_path: Path,
                                           random_capture: Path) -> None:
    path = poison_rows(copy_capture(random_capture, tmp_path / "in"), [3, 4, 5, 17])
    refused(["info", str(path)], "NaN/Inf in 4 row(s): 3-5, 17")


def test_a_directory_given_as_a_capture_is_called_a_directory(refused, tmp_path: Path) -> None:
    (tmp_path / "dir.h5").mkdir()
    refused(["info", str(tmp_path / "dir.h5")], "is a directory")
    refused(["closed-form", str(tmp_path / "dir.h5")], "is a directory")
