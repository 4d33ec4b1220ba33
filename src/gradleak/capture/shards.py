"""Several shards of one capture, read as one: they must share θ0, the victim and the layout."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from gradleak.capture.reader import CaptureFile
from gradleak.errors import CaptureFileError
from gradleak.threat import Observation

SHARED_ATTRS = ("theta0_sha256", "layer_table", "victim_config", "algorithm", "roles")


def open_captures(paths: Sequence[str | os.PathLike[str]]) -> list[CaptureFile]:
    if not paths:
        raise CaptureFileError("no capture files given")
    files = [CaptureFile(p) for p in paths]
    first = files[0]
    for other in files[1:]:
        for key in SHARED_ATTRS:
            if other.attrs.get(key) != first.attrs.get(key):
                for handle in files:
                    handle.close()
                raise CaptureFileError(f"{other.path} and {first.path} differ in '{key}': shards "
                                       "of one capture must share the victim, θ0 and layout")
    return files


def concat_observations(observations: list[Observation]) -> Observation:
    """One observation over several shards; episode ids are made unique across files."""
    first = observations[0]
    offset, episode_ids = 0, []
    for observation in observations:
        episode_ids.append(observation.episode_ids + offset)
        offset += int(observation.episode_ids.max()) + 1 if len(observation) else 0
    return replace(first, gradients=np.concatenate([o.gradients for o in observations]),
                   episode_ids=np.concatenate(episode_ids),
                   step_in_episode=np.concatenate([o.step_in_episode for o in observations]))
