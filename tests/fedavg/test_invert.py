"""invert_update on a user's model and state dicts: BatchNorm as the client ran it, what the
running statistics reveal, and one clear error for each way the inputs can be wrong."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad

from user_models import TinyClassifier

from gradleak.errors import CheckpointError, ConfigError
from gradleak.fedavg import ClientForward, FitWarning, Normalize, invert_update
from gradleak.fedavg.forward import running_targets
from gradleak.fedavg.update_file import read_update, write_update


def data(count: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(count, 1, 8, 8, generator=generator), \
        torch.randint(0, 5, (count,), generator=generator)


def trained(model: nn.Module, images, labels, lr: float, steps: int, batch: int = 2):
    """torch's own train-mode loop, as a client runs it: (w0, w_T) state dicts."""
    w0 = copy.deepcopy(model.state_dict())
    model.train()
    optimiser = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        index = torch.arange(len(images))[(step * batch) % len(images):][:batch]
        optimiser.zero_grad()
        F.cross_entropy(model(images[index]), labels[index]).backward()
        optimiser.step()
    return w0, copy.deepcopy(model.state_dict())


def test_the_train_mode_gradient_equals_autograd_on_each_minibatch() -> None:
    torch.manual_seed(0)
    model = TinyClassifier()
    images, labels = data(4)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    client = ClientForward(buffers={n: b.clone() for n, b in model.named_buffers()},
                           transform=Normalize(0.5, 0.25), batchnorm="train", batch=2)
    gradient = grad(lambda w: client.loss(model, w, images, labels)[0])(weights)
    model.train()
    model.zero_grad()
    losses = [F.cross_entropy(model(Normalize(0.5, 0.25)(images[i:i + 2])), labels[i:i + 2])
              for i in (0, 2)]
    torch.stack(losses).mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(gradient[name], p.grad, rtol=1e-5, atol=1e-7)
    # and nothing was written into the buffers the functional pass read
    torch.testing.assert_close(client.buffers["norm.running_mean"], torch.zeros(4))


def test_running_statistics_reveal_the_batch_statistics_exactly_when_weights_stay() -> None:
    torch.manual_seed(0)
    model = TinyClassifier()
    images, labels = data(2)
    w0, wT = trained(model, images, labels, lr=0.0, steps=7)  # every step sees one batch
    targets = running_targets(model, w0, wT, steps=7)
    conv = model.stem(images).detach()
    torch.testing.assert_close(targets["norm"][0], conv.mean((0, 2, 3)), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(targets["norm"][1], conv.var((0, 2, 3)), rtol=1e-4, atol=1e-6)


@pytest.mark.filterwarnings("ignore:the dummy data explain:gradleak.fedavg.FitWarning")
def test_the_counter_gives_steps_and_a_wrong_batchnorm_mode_is_said() -> None:
    torch.manual_seed(0)
    model = TinyClassifier()
    images, labels = data(4)
    w0, wT = trained(model, images, labels, lr=0.1, steps=4)
    result = invert_update(TinyClassifier(), w0, wT, samples=4, shape=(1, 8, 8), batchnorm="train",
                           iterations=3, hyperparameters={"lr": 0.1, "batch": 2})
    assert result.training["steps_used"] == 4 and result.running_stats is not None
    with pytest.warns(FitWarning, match="running statistics changed"):
        invert_update(TinyClassifier(), w0, wT, samples=4, shape=(1, 8, 8), batchnorm="eval",
                      iterations=2, labels=labels)


def test_every_wrong_input_gets_one_clear_error() -> None:
    torch.manual_seed(0)
    model = TinyClassifier()
    images, labels = data(4)
    w0, wT = trained(model, images, labels, lr=0.1, steps=2)
    run = dict(samples=4, shape=(1, 8, 8), iterations=1, labels=labels)
    wrapped = {f"1.{k}": v for k, v in w0.items()}
    with pytest.raises(ConfigError, match=r"lacks .*stem\.weight.*holds 1\.stem\.weight.*"
                                          r"renames"):
        invert_update(TinyClassifier(), wrapped, wT, **run)
    with pytest.raises(ConfigError, match="lacks 1 of TinyClassifier's parameters \\(out.bias\\)"):
        invert_update(TinyClassifier(), {k: v for k, v in w0.items() if k != "out.bias"}, wT, **run)
    with pytest.raises(ConfigError, match="w_T\\['stem.weight'\\] is torch.int64"):
        invert_update(TinyClassifier(), w0, {**wT, "stem.weight": wT["stem.weight"].long()}, **run)
    with pytest.raises(ConfigError, match="labels: 3 given, the client trained on 4"):
        invert_update(TinyClassifier(), w0, wT, **{**run, "labels": labels[:3]})
    with pytest.raises(ConfigError, match="values must lie in 0..4"):
        invert_update(TinyClassifier(), w0, wT, **{**run, "labels": torch.tensor([0, 1, 2, 9])})
    with pytest.raises(ConfigError, match=r"maps \[0, 1\] to \[-2, 2\], outside the model's "
                                          r"input range \[-1, 1\]"):
        invert_update(TinyClassifier(), w0, wT, **run, input_transform=Normalize(0.5, 0.25),
                      input_range=(-1, 1))
    with pytest.raises(ConfigError, match="needs the client's learning rate"):
        invert_update(TinyClassifier(), w0, wT, **{**run, "labels": None})
    with pytest.raises(ConfigError, match="lacks BatchNorm running statistics"):
        invert_update(TinyClassifier(), {k: v for k, v in w0.items() if "running" not in k},
                      wT, **run, batchnorm="eval")
    with pytest.raises(ConfigError, match="batchnorm='training'"):
        invert_update(TinyClassifier(), w0, wT, **run, batchnorm="training")
    with pytest.raises(ConfigError, match="Normalize std"):
        Normalize(0.5, 0.0)


def test_a_poor_fit_is_a_warning_not_silence() -> None:
    torch.manual_seed(0)
    model = TinyClassifier()
    images, labels = data(4)
    w0, wT = trained(model, images, labels, lr=0.1, steps=2)
    wrong = (labels + 1) % 5  # labels that cannot explain the output bias's change
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = invert_update(TinyClassifier(), w0, wT, samples=4, shape=(1, 8, 8), labels=wrong,
                               batchnorm="train", iterations=3, hyperparameters={"batch": 2})
    assert result.l_sim > 0.2
    assert any(issubclass(w.category, FitWarning) and "poorly" in str(w.message)
               for w in caught)


def test_update_files_round_trip_and_foreign_files_are_refused(tmp_path) -> None:
    torch.manual_seed(0)
    w0, wT = trained(TinyClassifier(), *data(4), lr=0.1, steps=2)
    path = write_update(tmp_path / "u.safetensors", w0, wT,
                        {"round": 1, "node_id": 3, "num_examples": 4, "shape": [1, 8, 8]})
    update = read_update(path)
    assert update.wT["norm.num_batches_tracked"].dtype == torch.int64
    for name in w0:
        torch.testing.assert_close(update.w0[name], w0[name])
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match="no 'gradleak' metadata"):
        read_update(tmp_path / "other.safetensors")
    with pytest.raises(ConfigError, match="lacks num_examples"):
        write_update(tmp_path / "v.safetensors", w0, wT, {"round": 1, "node_id": 3,
                                                          "shape": [1, 8, 8]})
    assert not (tmp_path / "v.safetensors").exists()


def test_label_counts_have_one_entry_per_class_of_the_model() -> None:
    from gradleak.fedavg.invert import InversionResult

    result = InversionResult(images=torch.zeros(2, 1, 4, 4), labels=torch.tensor([1, 1]),
                             labels_inferred=True, l_sim=0.0, method="sme", training={},
                             batchnorm="train", running_stats=None, seconds=0.0,
                             path_position=0.5, classes=5)
    assert result.summary()["label_counts"] == [0, 2, 0, 0, 0]
