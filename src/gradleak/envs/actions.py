"""The discrete action sets of the paper (5 actions) and its 10-action variant."""

from __future__ import annotations

from dataclasses import dataclass

from gradleak.errors import ConfigError

TURN_DEGREES = 15.0
LOOK_DEGREES = 15.0
PITCH_LIMIT = 30.0  # LookUp/LookDown are clamped to ±30°


@dataclass(frozen=True)
class Action:
    """One agent action. `kind` selects how the engine executes it; the numbers are its size."""

    name: str
    kind: str  # "move", "turn", "look", "crouch"
    forward: int = 0  # +1 ahead, -1 back (move)
    strafe: int = 0  # +1 right, -1 left (move)
    degrees: float = 0.0  # turn: + is counter-clockwise (left); look: + is up
    crouch: bool = False


MOVE_AHEAD = Action("MoveAhead", "move", forward=1)
ROTATE_LEFT = Action("RotateLeft", "turn", degrees=TURN_DEGREES)
ROTATE_RIGHT = Action("RotateRight", "turn", degrees=-TURN_DEGREES)
LOOK_DOWN = Action("LookDown", "look", degrees=-LOOK_DEGREES)
LOOK_UP = Action("LookUp", "look", degrees=LOOK_DEGREES)

ACTION_SETS: dict[int, tuple[Action, ...]] = {
    5: (MOVE_AHEAD, ROTATE_LEFT, ROTATE_RIGHT, LOOK_DOWN, LOOK_UP),
    10: (MOVE_AHEAD, ROTATE_LEFT, ROTATE_RIGHT, LOOK_DOWN, LOOK_UP,
         Action("MoveBack", "move", forward=-1),
         Action("MoveLeft", "move", strafe=-1),
         Action("MoveRight", "move", strafe=1),
         Action("Crouch", "crouch", crouch=True),
         Action("Stand", "crouch", crouch=False)),
}


def action_set(num_actions: int) -> tuple[Action, ...]:
    if num_actions not in ACTION_SETS:
        raise ConfigError(f"num_actions={num_actions}: expected one of "
                          f"{sorted(ACTION_SETS)} (the paper's 5-action set or the 10-action set)")
    return ACTION_SETS[num_actions]


def wrap_degrees(angle: float) -> float:
    """Angle in (-180, 180]: the shortest signed rotation."""
    return (angle + 180.0) % 360.0 - 180.0


MIRRORED = {"RotateLeft": "RotateRight", "RotateRight": "RotateLeft", "MoveLeft": "MoveRight",
            "MoveRight": "MoveLeft"}


def mirrored_actions(num_actions: int) -> tuple[int, ...]:
    """For each action, the one that does the same in a left-right mirrored world."""
    names = [action.name for action in action_set(num_actions)]
    return tuple(names.index(MIRRORED.get(name, name)) for name in names)
