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


# (scale, x shift, y shift) of grid_sample's affine map from one frame to the next, per DoomNav
# action: the best on a grid over 200 random-walk pairs per action on the cpu-bench training
# scenes (64×64); it cuts the frame-to-frame MSE from about 0.0115 to 0.005 for turns and looks.
CAMERA_MOTION = {"MoveAhead": (0.95, 0.0, 0.0), "RotateLeft": (1.0, -0.3, 0.0),
                 "RotateRight": (1.0, 0.3, 0.0), "LookDown": (1.0, 0.0, 0.45),
                 "LookUp": (1.0, 0.0, -0.45)}


@dataclass(frozen=True)
class ActionFacts:
    """What an environment declares about its actions, for attacks that can use it: which
    action does the same in a left-right mirrored world, and how each moves the camera
    ((scale, dx, dy) of the image). None: the environment does not say, and attacks go without
    (no mirroring augmentation, no motion prior)."""

    mirror: tuple[int, ...] | None = None
    camera_motion: tuple[tuple[float, float, float], ...] | None = None


def action_facts(env_settings: dict, num_actions: int) -> ActionFacts:
    """From a capture's `env_config` attribute: DoomNav's action table declares both; any
    other environment (a Gymnasium id) declares neither."""
    if env_settings.get("backend", "doomnav") != "doomnav" or num_actions not in ACTION_SETS:
        return ActionFacts()
    names = [action.name for action in action_set(num_actions)]
    return ActionFacts(mirror=mirrored_actions(num_actions),
                       camera_motion=tuple(CAMERA_MOTION.get(name, (1.0, 0.0, 0.0))
                                           for name in names))
