"""One error family for everything a user can get wrong.

Messages name the file or field, what was expected and what was found, so a user never has
to read a traceback from inside numpy or h5py to learn what to fix.
"""

from __future__ import annotations


class GradleakError(Exception):
    """Base class: the CLI prints these as one line and exits with status 2."""


class ConfigError(GradleakError):
    """An unknown name (victim, preset, map, rule) or an out-of-range setting."""


class WadError(GradleakError):
    """A missing, unreadable or unsupported Doom WAD file."""


class CheckpointError(GradleakError):
    """A checkpoint that is missing, malformed, or does not match its victim config."""


class CaptureFileError(GradleakError):
    """A capture file that is truncated, foreign, inconsistent, or holds non-finite values."""


class TrainingError(GradleakError):
    """A training run that diverged (its loss or weights turned NaN/Inf)."""


class DataFileError(GradleakError):
    """A dataset file (FEMNIST, EMNIST, CIFAR-100) that is missing or malformed."""


class DiskFullError(GradleakError):
    """The device an output goes to has no room for it: what was written before stays whole
    (a capture's partial file resumes once there is space)."""


def expect(condition: bool, error: type[GradleakError], message: str) -> None:
    """Raise `error(message)` unless `condition` holds (keeps validation code flat)."""
    if not condition:
        raise error(message)
