"""`gradleak fedavg`: every client and attack setting checked before the client trains."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize("extra, fragment", [
    (["--epochs", "0"], "client epochs 0"),
    (["--samples", "-1"], "client samples -1"),
    (["--batch", "0"], "client batch 0"),
    (["--client-lr", "nan"], "client lr nan"),
    (["--client-lr", "-0.1"], "client lr -0.1"),
    (["--seed", "-1"], "--seed -1"),
    (["--optimiser", "lion"], "client optimiser 'lion'"),
    (["--attack", "gan"], "FedAvg attack 'gan'"),
    (["--model", "resnet"], "'resnet'"),
    (["--iters", "0"], "iterations 0"),
    (["--cls", "-1"], "--cls -1"),
    (["--dataset", "femnist:/nowhere"], "femnist:/nowhere does not exist"),
    (["--dataset", "mnist"], "--dataset 'mnist'"),
    (["--samples", "100000"], "100000 requested"),
])
def test_bad_settings_are_refused_before_training(refused, tmp_path: Path, extra,
                                                  fragment: str) -> None:
    refused(["fedavg", "--iters", "2", "--out", str(tmp_path / "f"), *extra], fragment)


def test_an_output_under_a_file_is_refused(refused, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("mine")
    refused(["fedavg", "--iters", "2", "--out", str(tmp_path / "file" / "f")],
            "is a file, not a directory")
