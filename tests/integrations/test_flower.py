"""A Flower run as a user writes it (ServerApp + ClientApps, in-process, no Ray, no network),
audited by AuditStrategy: what it records is what the client sent, and it leaks."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("flwr")

from flower_app import (  # noqa: E402
    BatchNormNet,
    Net,
    SigmoidNet,
    client_app,
    local_training,
    partition,
    server_app,
)
from helpers import CHROMIUM, render_in_chromium  # noqa: E402

from gradleak.errors import ConfigError  # noqa: E402
from gradleak.fedavg import Normalize, invert_update  # noqa: E402
from gradleak.fedavg.audit import AuditOptions, Truth  # noqa: E402
from gradleak.fedavg.update_file import read_update  # noqa: E402
from gradleak.integrations.flower import AuditStrategy, run_in_process  # noqa: E402

NODES = [{"partition-id": i} for i in range(2)]


def truth(count: int):
    def lookup(node: int, _reply) -> Truth:
        return Truth(*partition(node - 1000, count))
    return lookup


def audited_run(tmp_path, model_class=Net, count=2, epochs=2, batch=2, rounds=1, lr=0.05,
                workers=0, wrap=None, mods=None, **audit):
    out = tmp_path / "audit"
    options = {"methods": ("ig",), "iterations": 50, "truth": truth(count),
               "hyperparameters": {"epochs": epochs, "batch": batch}, **audit}

    def strategy_fn(inner):
        inner = wrap(inner) if wrap is not None else inner
        return AuditStrategy(inner, model_fn=model_class, shape=(1, 16, 16), out=out,
                             input_transform=Normalize(0.5, 0.5), workers=workers, **options)

    run_in_process(server_app(strategy_fn, model_class, rounds=rounds, lr=lr),
                   client_app(model_class, mods, count=count, epochs=epochs, batch=batch),
                   NODES)
    return out


def test_an_audit_that_cannot_run_says_why_at_once_and_is_marked_failed(tmp_path, capsys) -> None:
    """No epochs or batch size declared (Flower's template keeps them in the run config, which
    the server never sees): each client is refused when its update arrives, with the reason on
    the console, and the audit file says failed, not complete."""
    out = audited_run(tmp_path, hyperparameters={})
    audit = json.loads((out / "audit.json").read_text())
    assert audit["status"] == "failed" and not audit["rows"]
    assert {f["node_id"] for f in audit["failures"]} == {1000, 1001}
    console = capsys.readouterr().err
    assert console.count("not audited: labels were not given") == 2
    assert "needs the client's local step count: the round's config holds ['lr', 'server-round']" in console
    assert "AuditStrategy(hyperparameters={'local-epochs'" in console
    assert f"-> {out / 'report.html'}" in console


@pytest.mark.slow
def test_the_recorded_update_is_what_the_client_sent_and_labels_are_inferred(tmp_path) -> None:
    out = audited_run(tmp_path, workers=1)  # the inversion in a worker process
    audit = json.loads((out / "audit.json").read_text())
    assert audit["status"] == "complete" and len(audit["rows"]) == 2
    for node in (1000, 1001):
        update = read_update(out / "updates" / "round-001" / f"node-{node}.safetensors")
        assert update.meta["num_examples"] == 2 and update.meta["config"]["lr"] == 0.05
        model = Net()
        model.load_state_dict(update.w0)
        images, labels = partition(node - 1000)
        local_training(model, images, labels, 0.05, seed=node - 1000)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(update.wT[name], value, rtol=0, atol=1e-6)
    # no BatchNorm: the output bias's change gives every label
    assert audit["summary"]["ig"]["labels_inferred_right"] == 4
    assert audit["summary"]["ig"]["labels_inferred_of"] == 4
    assert "FedAvg audit" in (out / "report.html").read_text()


def test_the_flower_report_renders_whole_in_chromium(tmp_path) -> None:
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    out = audited_run(tmp_path, methods=("ig", "sme"), iterations=5)
    text = (out / "report.html").read_text()
    assert text.index("verdict") < text.index("<figure")
    attrs, _ = render_in_chromium(out / "report.html", tmp_path)
    assert int(attrs["tables"]) == text.count("<table>") >= 2
    assert int(attrs["images"]) == 4 and attrs["images-loaded"] == "4"  # 2 clients × 2
    assert attrs["cut-off"] == "0"


@pytest.mark.slow
def test_a_one_image_one_step_update_is_inverted_to_30_db(tmp_path) -> None:
    out = audited_run(tmp_path, SigmoidNet, count=1, epochs=1, batch=1, lr=0.01,
                      methods=())  # record only
    update = read_update(out / "updates" / "round-001" / "node-1000.safetensors")
    image, label = partition(0, 1)
    result = invert_update(SigmoidNet(), update.w0, update.wT, samples=1, shape=(1, 16, 16),
                           input_transform=Normalize(0.5, 0.5), method="ig", iterations=400,
                           hyperparameters={"lr": 0.01, "steps": 1}, lr_images=0.1, tv=1e-4)
    assert result.labels_inferred and result.labels.tolist() == label.tolist()
    mse = float((result.images - image).pow(2).mean())
    assert 10 * torch.log10(torch.tensor(1 / mse)) >= 30.0


def test_a_one_image_clients_single_step_is_read_exactly_by_the_training_free_walk(
        tmp_path) -> None:
    """DLG's kind of sigmoid CNN through Flower: nothing declared (no rate, no steps), the
    image to the wire's precision, its label from the bias's sign."""
    out = audited_run(tmp_path, SigmoidNet, count=1, epochs=1, batch=1, lr=0.01,
                      methods=("training-free",), hyperparameters={})
    audit = json.loads((out / "audit.json").read_text())
    assert audit["status"] == "complete" and len(audit["rows"]) == 2
    summary = audit["summary"]["training-free"]
    assert summary["exact"] == 2 and summary["labels_inferred_right"] == 2


@pytest.mark.filterwarnings("ignore::gradleak.fedavg.FitWarning")  # 5 iterations fit nothing
def test_batchnorm_clients_send_an_int_counter_that_gives_the_step_count(tmp_path) -> None:
    out = audited_run(tmp_path, BatchNormNet, methods=())
    update = read_update(out / "updates" / "round-001" / "node-1001.safetensors")
    assert update.wT["bn1.num_batches_tracked"].dtype == torch.int64
    result = invert_update(BatchNormNet(), update.w0, update.wT, samples=2, shape=(1, 16, 16),
                           input_transform=Normalize(0.5, 0.5), batchnorm="train",
                           iterations=5, hyperparameters={"lr": 0.05, "batch": 2})
    assert result.training["steps_used"] == 2  # 2 epochs × 1 batch, read off the counter
    assert result.running_stats is not None


@pytest.mark.filterwarnings("ignore::gradleak.fedavg.FitWarning")
def test_flowers_clipping_mod_is_audited_as_it_leaves_the_updates(tmp_path) -> None:
    from flwr.clientapp.mod import fixedclipping_mod
    from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping

    def clipped(inner):
        return DifferentialPrivacyClientSideFixedClipping(
            inner, noise_multiplier=1.0, clipping_norm=0.05, num_sampled_clients=2)

    out = audited_run(tmp_path, wrap=clipped, mods=[fixedclipping_mod], iterations=5)
    audit = json.loads((out / "audit.json").read_text())
    assert [round(r["update_norm"], 6) for r in audit["rows"]] == [0.05, 0.05]
    assert "Every update has the same norm, 0.05: a clipping bound" in \
        (out / "report.html").read_text()


def test_audit_settings_are_checked_before_any_round(tmp_path) -> None:
    from flwr.serverapp.strategy import FedAvg

    with pytest.raises(ConfigError, match="picklable"):
        AuditStrategy(FedAvg(), model_fn=lambda: Net(), shape=(1, 16, 16), out=tmp_path / "a")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="not a Flower audit"):
        AuditStrategy(FedAvg(), model_fn=Net, shape=(1, 16, 16), out=foreign)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    with pytest.raises(ConfigError, match="methods"):
        AuditStrategy(FedAvg(), model_fn=Net, shape=(1, 16, 16), out=tmp_path / "b",
                      methods=("fedleak",))
    with pytest.raises(ConfigError, match="needs truth"):
        AuditStrategy(FedAvg(), model_fn=Net, shape=(1, 16, 16), out=tmp_path / "c",
                      labels="known")
    with pytest.raises(ConfigError, match=r"'separate' .* reference= images of shape \(M, 1"):
        AuditStrategy(FedAvg(), model_fn=Net, shape=(1, 16, 16), out=tmp_path / "d",
                      methods=("separate",))
    with pytest.raises(ConfigError, match="'training-free' on the client's Net: .* maxpool"):
        AuditStrategy(FedAvg(), model_fn=Net, shape=(1, 16, 16), out=tmp_path / "g",
                      methods=("training-free",))
    with pytest.raises(ConfigError, match="start 'class-mean' .* reference_labels="):
        AuditStrategy(FedAvg(), model_fn=Net, shape=(1, 16, 16), out=tmp_path / "e",
                      options=AuditOptions(attack={"start": "class-mean"}),
                      reference=torch.rand(4, 1, 16, 16))
    with pytest.raises(ConfigError, match=r"start 'class-mean' .* shape \(M, 1, 16, 16\)"):
        AuditStrategy(FedAvg(), model_fn=Net, shape=(1, 16, 16), out=tmp_path / "f",
                      options=AuditOptions(attack={"start": "class-mean"}),
                      reference=torch.rand(4, 1, 8, 8), reference_labels=torch.arange(4))


@pytest.mark.parametrize("settings, fragment", [
    ({"shape": "abc"}, "shape='abc': expected (C, H, W)"),
    ({"shape": (1, 8)}, "shape=(1, 8): expected (C, H, W)"),
    ({"shape": (0, -8, 8)}, "shape=(0, -8, 8)"),
    ({"shape": (1, 8, 8)}, "shape=(1, 8, 8): model_fn's Net fails on images of that shape"),
    ({"input_transform": "normalize"}, "input_transform='normalize'"),
    ({"clients": -2}, "clients=-2"),
    ({"clients": "abc"}, "clients='abc'"),
    ({"clients": []}, "clients=[]"),
])
def test_a_strategy_that_would_fail_in_a_round_is_refused_at_construction(
        tmp_path, settings, fragment) -> None:
    from flwr.serverapp.strategy import FedAvg

    arguments = {"model_fn": Net, "shape": (1, 16, 16), "out": tmp_path / "a", **settings}
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        AuditStrategy(FedAvg(), **arguments)
    assert not (tmp_path / "a").exists()
