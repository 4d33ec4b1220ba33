"""The capture file's schema, in one place (documented in docs/data-format.md)."""

from __future__ import annotations

from dataclasses import dataclass

from gradleak.victims.base import LayerInfo, layers_from_json, layers_to_json  # noqa: F401

FORMAT = "gradleak-capture"
FORMAT_VERSION = 1
# version 2: some Linear weights stored as their factors (gradleak.capture.layout), which a
# version-1 reader would misread as too few gradient columns; dense files stay version 1
FACTORED_FORMAT_VERSION = 2
READABLE_VERSIONS = (FORMAT_VERSION, FACTORED_FORMAT_VERSION)
PARTIAL_SUFFIX = ".partial"
NEW_SUFFIX = ".new"  # OUT.partial while the writer lays it out (capture.writer)
LOCK_SUFFIX = ".lock"  # the one-writer lock (capture.lock)
SIDECAR_SUFFIX = ".json"  # the capture job's settings beside OUT
# every file a capture of OUT writes beside or instead of it: what a command that made the
# capture may remove again
OWN_SUFFIXES = ("", SIDECAR_SUFFIX, PARTIAL_SUFFIX, PARTIAL_SUFFIX + NEW_SUFFIX, LOCK_SUFFIX)


@dataclass(frozen=True)
class Column:
    """One per-step dataset: (N, *shape) of dtype."""

    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    private: bool = True  # ground truth: read for training on auxiliary data and scoring only


def step_columns(frame_shape: tuple[int, int, int], num_actions: int, hidden_size: int = 0
                 ) -> tuple[Column, ...]:
    """The per-step datasets; frames stored as the client had them, (H, W, C) uint8 (the
    input transform in attribute `roles` maps them to the network input); a recurrent victim's
    pre-step states too (`hidden_size` > 0)."""
    recurrent = (Column("hidden_states", "float32", (hidden_size,)),) if hidden_size else ()
    return recurrent + (
        Column("images", "uint8", tuple(frame_shape)),
        Column("goals", "float32", (3,)),
        Column("actions", "int64"),
        Column("rewards", "float32"),
        Column("values", "float32"),
        Column("log_probs", "float32"),
        Column("probs", "float32", (num_actions,)),
        Column("advantages", "float32"),
        Column("advantages_raw", "float32"),
        Column("returns", "float32"),
        Column("dones", "bool"),
        Column("terminated", "bool"),
        Column("episode_ids", "int64", private=False),
        Column("scene_ids", "int32", private=False),
        Column("step_in_episode", "int32", private=False),
    )


GRADIENTS = "gradients"
DEFENSES_ATTR = "defenses"  # JSON list of the defense chains applied to a defended copy
THETA0_GROUP = "theta0"
REQUIRED_ATTRS = ("format", "format_version", "victim", "victim_config", "theta0_sha256",
                  "algorithm", "loss", "layer_table", "components", "scenes", "split",
                  "num_rows", "num_episodes", "complete", "gradient_dim", "settings")


