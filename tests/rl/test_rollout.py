"""The rollout's channels-last victim copy: the same actions, log-probs and values."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from gradleak.rl.rollout import act, channels_last_convolutions, single_threaded_torch
from gradleak.victims import create_victim


@pytest.mark.parametrize("name,size", [("cnn", 84), ("cnn-small", 64), ("impala-small", 64),
                                       ("cnn-gru-small", 64)])
def test_channels_last_weights_leave_every_rollout_output_bit_for_bit(name: str,
                                                                      size: int) -> None:
    torch.manual_seed(0)
    victim = create_victim(name, frame_size=size).eval()
    rollout_copy = copy.deepcopy(victim)
    channels_last_convolutions(rollout_copy)
    convolutions = [m for m in rollout_copy.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convolutions and all(
        m.weight.is_contiguous(memory_format=torch.channels_last) and not m.weight.is_contiguous()
        for m in convolutions)
    for ours, theirs in zip(victim.state_dict().values(), rollout_copy.state_dict().values(),
                            strict=True):
        assert torch.equal(ours, theirs)
    frames = np.random.default_rng(1).integers(0, 256, (40, size, size, 3), dtype=np.uint8)
    goals = np.zeros((1, 3), np.float32)
    hidden = {key: None if not victim.recurrent else victim.initial_state(1).numpy()
              for key in ("plain", "channels_last")}
    with single_threaded_torch():  # as the rollout runs
        for frame in frames:
            steps = {key: act(model, frame[None], goals, torch.Generator().manual_seed(3),
                              hidden[key])
                     for key, model in (("plain", victim), ("channels_last", rollout_copy))}
            for field in ("actions", "log_probs", "values", "probs"):
                assert np.array_equal(getattr(steps["plain"], field),
                                      getattr(steps["channels_last"], field)), field
            hidden = {key: step.next_hidden for key, step in steps.items()}
