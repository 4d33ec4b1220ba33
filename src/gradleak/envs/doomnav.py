"""`gradleak/DoomNav-v0`: point-goal navigation in the maps of a Doom WAD (ViZDoom, headless).

Exact actions matter here: the attack recovers actions from gradients, and a "RotateLeft" that
turns 14.1° one step and 15.8° the next would blur what the frames encode. So turns and looks
steer to a stored target angle with the engine's delta buttons, and a move is a fixed thrust
followed by settle tics until the player's momentum has died out (26 tics measured; 28 used).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from gradleak.envs.actions import PITCH_LIMIT, Action, action_set, wrap_degrees
from gradleak.envs.frames import resize_area
from gradleak.envs.geometry import UNITS_PER_METRE
from gradleak.envs.scenes import Scene, SceneCatalog, cache_root
from gradleak.envs.wad import default_wad_path
from gradleak.envs.watchdog import child_pids, unwatch, watch
from gradleak.errors import ConfigError, GradleakError

ENGINE_WIDTH, ENGINE_HEIGHT = 160, 120
CROUCH_TICS = 7  # the view height settles 6 tics after crouching or standing (measured)
SPAWN_ATTEMPTS = 20
WARP_SETTLE_TICS = 4  # the eye height is 4, 20.5, then 41 units in the tics after a warp
ENGINE_LOST_Z = -32000.0  # the engine reports z = -32768 when a warp lands inside a thing


class EngineError(GradleakError):
    """The game engine did something the environment cannot recover from."""


@dataclass
class DoomNavConfig:
    """Everything that defines the task; saved next to every output."""

    wad: str | None = None  # None: freedoom2.wad shipped inside the vizdoom package
    frame_size: int = 64
    num_actions: int = 5
    max_steps: int = 100
    success_distance_m: float = 1.0
    step_cost: float = 0.01
    success_bonus: float = 2.5
    goal_min_m: float = 2.0
    goal_max_m: float = 8.0
    thrust_tics: int = 1  # one tic of thrust moves 7.5-7.75 map units, about 0.24 m
    settle_tics: int = 28
    scenes: list[str] = field(default_factory=list)  # scene names; reset() samples among them

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


BUTTONS = ("MOVE_FORWARD", "MOVE_BACKWARD", "MOVE_LEFT", "MOVE_RIGHT", "TURN_LEFT_RIGHT_DELTA",
           "LOOK_UP_DOWN_DELTA", "CROUCH")
VARIABLES = ("POSITION_X", "POSITION_Y", "POSITION_Z", "ANGLE", "PITCH", "CAMERA_POSITION_Z")


class DoomNavEnv(gym.Env):
    """Gymnasium environment; observation = {"image": uint8 (H, W, 3), "goal": float32 (3,)}."""

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, config: DoomNavConfig | None = None, render_mode: str | None = None,
                 catalog: SceneCatalog | None = None, **overrides: Any) -> None:
        config = config or DoomNavConfig()
        for key, value in overrides.items():
            if not hasattr(config, key):
                raise ConfigError(f"DoomNav has no setting {key!r}")
            setattr(config, key, value)
        self.config = config
        self.render_mode = render_mode
        self.actions: tuple[Action, ...] = action_set(config.num_actions)
        self.catalog = catalog or SceneCatalog(config.wad)
        self.scenes = [Scene.parse(s) for s in config.scenes] or self.catalog.scenes("train")
        for scene in self.scenes:
            self._check_scene(scene)
        size = config.frame_size
        self.observation_space = gym.spaces.Dict({
            "image": gym.spaces.Box(0, 255, (size, size, 3), np.uint8),
            "goal": gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
        })
        self.action_space = gym.spaces.Discrete(len(self.actions))
        self._game: Any = None
        self._engine_pids: set[int] = set()
        self._map: str | None = None
        self._frame = np.zeros((size, size, 3), np.uint8)

    # -- gymnasium API -----------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        scene = options.get("scene")
        scene = Scene.parse(scene) if isinstance(scene, str) else scene
        if scene is None:
            scene = self.scenes[int(self.np_random.integers(len(self.scenes)))]
        self._check_scene(scene)
        self.scene = scene
        self._start_episode(scene)
        self._steps = 0
        self._distance = self._goal_distance_m()
        return self._observation(), self._info(success=False)

    def step(self, action: int):
        if self._game is None:
            raise EngineError("DoomNav steps only after its first reset(): call reset() first")
        if not 0 <= int(action) < len(self.actions):
            raise ConfigError(f"action {action} is outside 0..{len(self.actions) - 1}")
        self._apply(self.actions[int(action)])
        self._steps += 1
        engine_ended = self._game.is_episode_finished()
        if not engine_ended:
            self._read_state()
        distance = self._goal_distance_m()
        success = distance <= self.config.success_distance_m
        reward = (self._distance - distance) - self.config.step_cost
        reward += self.config.success_bonus if success else 0.0
        self._distance = distance
        truncated = (self._steps >= self.config.max_steps or engine_ended) and not success
        info = self._info(success=success)
        info["engine_ended"] = engine_ended
        return self._observation(), float(reward), bool(success), bool(truncated), info

    def render(self) -> np.ndarray:
        return self._frame.copy()

    def close(self) -> None:
        if self._game is not None:
            self._game.close()
            self._game = None
            unwatch(self._engine_pids)

    # -- engine ------------------------------------------------------------------------------
    def _start_engine(self, map_name: str) -> None:
        """On the first episode's map, which the engine's start loads: not a second map."""
        before = child_pids()
        self._game = _make_game(self.catalog, map_name)
        self._engine_pids = child_pids() - before
        watch(self._engine_pids)  # killed with this process, however it dies
        self._map = map_name

    def _check_scene(self, scene: Scene) -> None:
        # the count, not the geometry: loading all 25 train maps' geometry cost the capture's
        # rollout process 70 ms before its first episode; an episode loads its map's
        regions = self.catalog.region_count(scene.map_name)
        if not 0 <= scene.region < regions:
            raise ConfigError(f"scene {scene.name}: map {scene.map_name} has {regions} regions")

    def _start_episode(self, scene: Scene) -> None:
        if self._game is None:
            self._start_engine(scene.map_name)
        game = self._game
        geometry = self.catalog.geometry(scene.map_name)
        points = geometry.spawn_points(scene.region)
        if self._map != scene.map_name:
            game.set_doom_map(scene.map_name)
            self._map = scene.map_name
        for _ in range(SPAWN_ATTEMPTS):
            spawn = points[int(self.np_random.integers(len(points)))]
            self._goal = self._pick_goal(points, spawn)
            game.set_seed(int(self.np_random.integers(2**31 - 1)))
            game.new_episode()
            game.send_game_command("god")  # does not persist across episodes
            game.send_game_command(f"warp {int(spawn[0])} {int(spawn[1])}")
            self._target_angle = float(self.np_random.integers(24)) * 15.0
            self._target_pitch = 0.0
            self._crouched = False
            self._vars = self._variables_after(WARP_SETTLE_TICS)
            self._apply_tics(self._steering(), 1)
            self._read_state()
            x, y, z = self._vars[:3]
            if (z > ENGINE_LOST_Z and abs(x - spawn[0]) < 0.5 and abs(y - spawn[1]) < 0.5):
                return
        raise EngineError(f"scene {scene.name}: the engine refused {SPAWN_ATTEMPTS} spawn points "
                          "in a row; the map's geometry may use features the scene builder "
                          "ignores")

    def _pick_goal(self, points: np.ndarray, spawn: np.ndarray) -> np.ndarray:
        distance = np.hypot(*(points - spawn).T) / UNITS_PER_METRE
        band = (distance >= self.config.goal_min_m) & (distance <= self.config.goal_max_m)
        choices = np.nonzero(band)[0]
        if len(choices) == 0:  # a small region: the farthest point it has
            choices = np.array([int(np.argmax(distance))])
        return points[int(choices[self.np_random.integers(len(choices))])]

    def _steering(self) -> list[float]:
        """Button values that bring heading and pitch exactly to their stored targets."""
        angle, pitch = self._vars[3], self._vars[4]
        buttons = [0.0] * len(BUTTONS)
        # TURN_LEFT_RIGHT_DELTA > 0 turns right (ANGLE decreases); LOOK_UP_DOWN_DELTA > 0 looks
        # up (PITCH decreases).
        buttons[4] = -wrap_degrees(self._target_angle - angle)
        buttons[5] = pitch - self._target_pitch
        buttons[6] = 1.0 if self._crouched else 0.0
        return buttons

    def _apply(self, action: Action) -> None:
        if action.kind == "turn":
            self._target_angle = (self._target_angle + action.degrees) % 360.0
        elif action.kind == "look":  # PITCH > 0 looks down
            self._target_pitch = float(np.clip(self._target_pitch - action.degrees,
                                               -PITCH_LIMIT, PITCH_LIMIT))
        elif action.kind == "crouch":
            self._crouched = action.crouch
        buttons = self._steering()
        if action.kind == "move":
            buttons[0], buttons[1] = float(action.forward > 0), float(action.forward < 0)
            buttons[2], buttons[3] = float(action.strafe < 0), float(action.strafe > 0)
            self._apply_tics(buttons, self.config.thrust_tics, update=False)
            self._apply_tics(self._hold(), self.config.settle_tics)
        elif action.kind == "crouch":
            self._apply_tics(buttons, CROUCH_TICS)
        else:
            self._apply_tics(buttons, 1)

    def _hold(self) -> list[float]:
        buttons = [0.0] * len(BUTTONS)
        buttons[6] = 1.0 if self._crouched else 0.0
        return buttons

    def _apply_tics(self, buttons: list[float], tics: int, update: bool = True) -> None:
        game = self._game
        if game.is_episode_finished():
            return
        game.set_action(buttons)
        game.advance_action(1, update and tics == 1)
        if tics > 1:  # delta buttons act on every tic they are set: clear them after the first
            game.set_action(buttons[:4] + [0.0, 0.0] + buttons[6:])
            game.advance_action(tics - 1, update)

    def _variables_after(self, tics: int) -> np.ndarray:
        self._game.advance_action(tics, True)
        return np.asarray(self._game.get_state().game_variables, dtype=np.float64)

    def _read_state(self) -> None:
        state = self._game.get_state()
        if state is None:
            return
        self._vars = np.asarray(state.game_variables, dtype=np.float64)
        size = self.config.frame_size
        self._frame = resize_area(state.screen_buffer, size, size)

    # -- observation -------------------------------------------------------------------------
    def _goal_distance_m(self) -> float:
        return float(math.hypot(self._goal[0] - self._vars[0],
                                self._goal[1] - self._vars[1])) / UNITS_PER_METRE

    def _observation(self) -> dict[str, np.ndarray]:
        dx, dy = self._goal[0] - self._vars[0], self._goal[1] - self._vars[1]
        bearing = math.atan2(dy, dx) - math.radians(self._vars[3])
        goal = np.array([min(self._goal_distance_m() / 10.0, 1.0), math.sin(bearing),
                         math.cos(bearing)], dtype=np.float32)
        return {"image": self._frame.copy(), "goal": goal}

    def _info(self, success: bool) -> dict[str, Any]:
        return {"scene": self.scene.name, "position": (float(self._vars[0]), float(self._vars[1])),
                "angle": float(self._vars[3]), "pitch": float(self._vars[4]),
                "view_height": float(self._vars[5] - self._vars[2]),
                "distance_m": self._goal_distance_m(), "success": success, "engine_ended": False}


def _make_game(catalog: SceneCatalog, map_name: str) -> Any:
    import vizdoom as vzd  # deferred: the engine module is only needed once an env resets

    game = vzd.DoomGame()
    if catalog.wad.is_iwad:
        game.set_doom_game_path(str(catalog.wad.path.resolve()))
    else:  # a PWAD's maps run on top of the shipped IWAD's resources
        game.set_doom_game_path(str(default_wad_path()))
        game.set_doom_scenario_path(str(catalog.wad.path.resolve()))
    game.set_doom_map(map_name)
    # The engine writes its ini file beside its config path: keep it out of the user's cwd.
    config_dir = cache_root() / "vizdoom"
    config_dir.mkdir(parents=True, exist_ok=True)
    game.set_doom_config_path(str(config_dir / "_vizdoom.ini"))
    game.set_window_visible(False)
    game.set_screen_resolution(vzd.ScreenResolution.RES_160X120)
    game.set_screen_format(vzd.ScreenFormat.RGB24)
    game.set_render_hud(False)
    game.set_render_weapon(False)
    game.set_render_crosshair(False)
    game.set_render_messages(False)
    game.add_game_args("-nomonsters +freelook 1 +sv_cheats 1")
    game.set_available_buttons([getattr(vzd.Button, b) for b in BUTTONS])
    game.set_available_game_variables([getattr(vzd.GameVariable, v) for v in VARIABLES])
    game.set_episode_start_time(10)  # input is ignored for the first ~7 tics of an episode
    game.set_episode_timeout(0)
    game.set_mode(vzd.Mode.PLAYER)
    # The engine process also leaves a `_vizdoom` folder in its working directory: start it
    # in the cache folder rather than in the user's.
    previous = os.getcwd()
    os.chdir(config_dir)
    try:
        game.init()
    finally:
        os.chdir(previous)
    return game
