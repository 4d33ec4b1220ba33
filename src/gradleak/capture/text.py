"""How a capture's contents are named in messages and summaries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gradleak.victims.roles import Roles


def roles_text(roles: Roles) -> str:
    """One line: what the attacks will read in this capture."""
    parts = [f"heads {roles.policy_head} / {roles.value_head}"
             + ("" if roles.shared_features else " (separate features)"),
             f"closed form {', '.join(roles.linears)}"]
    if roles.conv_stack:
        convs = sum(step.kind == "conv" for step in roles.conv_stack)
        parts.append(f"{convs} convs into {roles.feature_linear or 'no Linear layer'}"
                     + ("" if roles.conv_chain else " (not a plain chain)"))
    parts += [f"{label} {name}" for label, name in (("frame", roles.frame_linear),
                                                    ("goal", roles.goal_input),
                                                    ("state", roles.recurrent_state)) if name]
    return "; ".join(parts)


def nonfinite_message(path: Path, rows: np.ndarray) -> str:
    return (f"{path}: dataset 'gradients' holds NaN/Inf in {len(rows)} row(s): "
            f"{row_list(rows)} (pass --skip-nonfinite to leave them out)")


def row_list(rows: np.ndarray, shown: int = 5) -> str:
    """`3, 17-19, 40` for the first few runs of consecutive rows."""
    runs: list[list[int]] = []
    for row in (int(r) for r in rows):
        if runs and row == runs[-1][1] + 1:
            runs[-1][1] = row
        else:
            runs.append([row, row])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:shown])
    return text + (", ..." if len(runs) > shown else "")


def describe_rows(rows: Any, count: int) -> str:
    """A row selection (slice, index, index array) as `first-last`."""
    if isinstance(rows, slice):
        start, stop, _ = rows.indices(count)
        return f"{start}-{stop - 1}"
    if isinstance(rows, (int, np.integer)):
        return str(int(rows))
    if isinstance(rows, tuple) and not rows:
        return "(all)"
    indices = np.asarray(rows).ravel()
    return f"{int(indices.min())}-{int(indices.max())}" if indices.size else "(none)"
