"""`gradleak fedavg-invert` on an update file, as a server operator runs it."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from user_models import TinyClassifier

from gradleak.cli import main
from gradleak.fedavg.update_file import write_update


def recorded_update(tmp_path):
    torch.manual_seed(0)
    model = TinyClassifier()
    generator = torch.Generator().manual_seed(1)
    images = torch.rand(4, 1, 8, 8, generator=generator)
    labels = torch.tensor([0, 1, 1, 3])
    w0 = copy.deepcopy(model.state_dict())
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for start in (0, 2, 0, 2):  # 2 epochs of batch 2
        optimiser.zero_grad()
        F.cross_entropy(model((images[start:start + 2] - 0.5) / 0.5),
                        labels[start:start + 2]).backward()
        optimiser.step()
    meta = {"round": 1, "node_id": 7, "num_examples": 4, "shape": [1, 8, 8],
            "config": {"lr": 0.1}, "hyperparameters": {"batch": 2}, "batchnorm": "train",
            "input_transform": {"kind": "normalize", "mean": [0.5], "std": [0.5]},
            "model": "tiny-classifier"}
    path = write_update(tmp_path / "node-7.safetensors", w0, model.state_dict(), meta)
    save_file({"images": images, "labels": labels}, str(tmp_path / "truth.safetensors"))
    save_file({"images": torch.rand(16, 1, 8, 8, generator=generator),
               "labels": torch.arange(16) % 4}, str(tmp_path / "aux.safetensors"))
    return path, labels


@pytest.mark.filterwarnings("ignore::gradleak.fedavg.FitWarning")
def test_the_cli_inverts_a_recorded_update_and_scores_it(tmp_path, capsys) -> None:
    path, labels = recorded_update(tmp_path)
    out = tmp_path / "out"
    code = main(["fedavg-invert", "--update", str(path), "--plugin", "user_models",
                 "--method", "ig", "sme", "--iters", "20", "--truth",
                 str(tmp_path / "truth.safetensors"), "--reference",
                 str(tmp_path / "aux.safetensors"), "--out", str(out), "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary) == {"ig", "sme"}
    assert summary["sme"]["labels_inferred_right"] == 4  # steps read off the BN counter
    audit = json.loads((out / "audit.json").read_text())
    assert audit["rows"][0]["training"]["steps_used"] == 4
    assert {r["batchnorm"] for r in audit["rows"]} == {"train"}
    assert summary["sme"]["mean_image_psnr"] > 0  # the reference row, on the same images
    # the auxiliary images are labelled: each used label's mean is scored, and judged
    assert summary["sme"]["class_mean"]["psnr"] > 0 and "class_mean_leaks" in summary["sme"]
    assert "the labels alone, no optimisation" in (out / "report.html").read_text()
    assert (out / "report.html").is_file() and (out / "node-7-sme.png").is_file()


def test_the_cli_names_what_is_wrong(tmp_path, capsys) -> None:
    path, _ = recorded_update(tmp_path)
    out = tmp_path / "out"
    assert main(["fedavg-invert", "--update", str(path), "--model", "their_models:Net",
                 "--out", str(out)]) == 2
    assert "--model = 'their_models:Net' is not a registered model factory" in \
        capsys.readouterr().err
    assert main(["fedavg-invert", "--update", str(path), "--model", "user_models:Nope",
                 "--out", str(out)]) == 2
    assert "Nope" in capsys.readouterr().err
    assert main(["fedavg-invert", "--update", str(path), "--plugin", "user_models",
                 "--input-transform", "scale:2", "--out", str(out)]) == 2
    assert "expected none or normalize:MEAN,STD" in capsys.readouterr().err
    assert main(["fedavg-invert", "--update", str(path), "--plugin", "user_models",
                 "--truth", str(tmp_path / "truth.safetensors"), "--reference", "digits",
                 "--out", str(out)]) == 2
    assert "--reference images are (1, 28, 28), the truth's (1, 8, 8)" in \
        capsys.readouterr().err
    assert main(["fedavg-invert", "--update", str(tmp_path / "truth.safetensors"),
                 "--plugin", "user_models", "--out", str(out)]) == 2
    assert "no 'gradleak' metadata" in capsys.readouterr().err
    # BatchNorm declared frozen: no batch counter, and the file declares no step count
    assert main(["fedavg-invert", "--update", str(path), "--plugin", "user_models",
                 "--batchnorm", "eval", "--out", str(out)]) == 2
    assert "needs the client's local step count: declare --lr and --epochs" in \
        capsys.readouterr().err
    assert not out.exists()


@pytest.mark.filterwarnings("ignore::gradleak.fedavg.FitWarning")
def test_two_rounds_of_one_node_keep_their_own_rows_and_files(tmp_path, capsys) -> None:
    """Flower's layout names a node's file the same in every round: neither round may
    overwrite the other's JSON or picture, nor share its row name."""
    paths = []
    for round_ in (1, 2):
        folder = tmp_path / f"round-{round_:03d}"
        folder.mkdir()
        path, _ = recorded_update(folder)
        paths.append(str(path))
    out = tmp_path / "out"
    assert main(["fedavg-invert", "--update", *paths, "--iters", "2", "--truth",
                 str(tmp_path / "round-001" / "truth.safetensors"), "--out", str(out)]) == 0
    rows = json.loads((out / "audit.json").read_text())["rows"]
    assert [r["update"] for r in rows] == ["round-001-node-7", "round-002-node-7"]
    for name in ("round-001-node-7", "round-002-node-7"):
        assert (out / f"{name}.json").is_file() and (out / f"{name}-sme.png").is_file()
    capsys.readouterr()
    assert main(["fedavg-invert", "--update", paths[0], paths[0], "--out",
                 str(tmp_path / "twice")]) == 2
    assert "names " + paths[0] + " twice" in capsys.readouterr().err


def test_a_replay_the_file_cannot_drive_is_refused_before_any_method_runs(tmp_path,
                                                                          capsys) -> None:
    """The file declares lr and batch, not epochs: "sim" is refused before "sme" computes."""
    path, _ = recorded_update(tmp_path)
    out = tmp_path / "out"
    assert main(["fedavg-invert", "--update", str(path), "--plugin", "user_models",
                 "--method", "sme", "sim", "--steps", "4", "--out", str(out)]) == 2
    assert f"{path}: method 'sim' replays the client's local steps and needs its epochs" in \
        capsys.readouterr().err
    assert main(["fedavg-invert", "--update", str(path), "--plugin", "user_models",
                 "--method", "sme", "sim", "--epochs", "3", "--out", str(out)]) == 2
    assert "the client took 4 local steps, its declared epochs and batch give 6" in \
        capsys.readouterr().err
    assert main(["fedavg-invert", "--update", str(path), "--plugin", "user_models",
                 "--restarts", "0", "--out", str(out)]) == 2
    assert "restarts 0: expected an integer >= 1" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.filterwarnings("ignore::gradleak.fedavg.FitWarning")
def test_the_cli_replays_the_clients_steps(tmp_path, capsys) -> None:
    path, _ = recorded_update(tmp_path)
    out = tmp_path / "out"
    assert main(["fedavg-invert", "--update", str(path), "--plugin", "user_models",
                 "--method", "sim", "--epochs", "2", "--iters", "3", "--truth",
                 str(tmp_path / "truth.safetensors"), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["sim"]["labels_inferred_right"] == 4
    assert 0.0 <= summary["sim"]["l_sim"] < 1.0


def test_separate_needs_auxiliary_images_of_the_clients_shape(tmp_path, capsys) -> None:
    path, _ = recorded_update(tmp_path)
    out = tmp_path / "out"
    assert main(["fedavg-invert", "--update", str(path), "--plugin", "user_models",
                 "--method", "sme", "separate", "--out", str(out)]) == 2
    assert "--method separate starts from auxiliary images of the task" in \
        capsys.readouterr().err
    save_file({"images": torch.rand(5, 1, 6, 6)}, str(tmp_path / "small.safetensors"))
    assert main(["fedavg-invert", "--update", str(path), "--plugin", "user_models",
                 "--method", "separate", "--reference", str(tmp_path / "small.safetensors"),
                 "--out", str(out)]) == 2
    assert "--reference images are (1, 6, 6)" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.filterwarnings("ignore::gradleak.fedavg.FitWarning")
def test_the_class_mean_start_reads_labelled_auxiliary_images(tmp_path, capsys) -> None:
    path, _ = recorded_update(tmp_path)
    out = tmp_path / "out"
    save_file({"images": torch.rand(5, 1, 8, 8)}, str(tmp_path / "unlabelled.safetensors"))
    assert main(["fedavg-invert", "--update", str(path), "--plugin", "user_models",
                 "--start", "class-mean", "--reference", str(tmp_path / "unlabelled.safetensors"),
                 "--out", str(out)]) == 2
    assert "--start class-mean begins from each label's mean auxiliary image" in \
        capsys.readouterr().err
    assert main(["fedavg-invert", "--update", str(path), "--plugin", "user_models",
                 "--start", "class-mean", "--reference", "digits", "--out", str(out)]) == 2
    assert "--reference images are (1, 28, 28)" in capsys.readouterr().err
    assert not out.exists()
    assert main(["fedavg-invert", "--update", str(path), "--plugin", "user_models",
                 "--start", "class-mean", "--reference", str(tmp_path / "aux.safetensors"),
                 "--iters", "2", "--truth", str(tmp_path / "truth.safetensors"),
                 "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert json.loads((out / "audit.json").read_text())["options"]["attack"]["start"] == \
        "class-mean"
    assert summary["sme"]["labels_inferred_right"] == 4


def test_training_free_refuses_a_four_image_update_before_any_work(tmp_path, capsys) -> None:
    path, _ = recorded_update(tmp_path)
    out = tmp_path / "out"
    assert main(["fedavg-invert", "--update", str(path), "--plugin", "user_models",
                 "--method", "training-free", "sme", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert str(path) in error and "declares 4 images" in error
    assert not out.exists()


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_training_free_reads_one_images_recorded_step_exactly(tmp_path, capsys, mode) -> None:
    """A user's Conv → BatchNorm → F.relu client, one image, one step, recorded as a Flower
    server would: the image to the wire's precision, nothing declared but the file (in train
    mode the image's statistics come from the running buffers' change)."""
    torch.manual_seed(0)
    model = TinyClassifier()
    model.norm.running_var.fill_(2.0)
    model.train(mode == "train")
    image = torch.rand(1, 1, 8, 8, generator=torch.Generator().manual_seed(5))
    w0 = copy.deepcopy(model.state_dict())
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    F.cross_entropy(model(image), torch.tensor([2])).backward()
    optimiser.step()
    meta = {"round": 1, "node_id": 3, "num_examples": 1, "shape": [1, 8, 8],
            "batchnorm": mode, "model": "tiny-classifier"}
    path = write_update(tmp_path / "node-3.safetensors", w0, model.state_dict(), meta)
    save_file({"images": image, "labels": torch.tensor([2])}, str(tmp_path / "truth.safetensors"))
    assert main(["fedavg-invert", "--update", str(path), "--plugin", "user_models",
                 "--method", "training-free", "--truth", str(tmp_path / "truth.safetensors"),
                 "--out", str(tmp_path / "out"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["training-free"]
    assert summary["labels_inferred_right"] == 1
    assert summary["exact"] == 1, summary
