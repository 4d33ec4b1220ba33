"""DoomNav on the real engine: determinism and the exact semantics of each action."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from helpers import write_test_wad

import gradleak.envs  # noqa: F401  (registers gradleak/DoomNav-v0)
from gradleak.envs.actions import ACTION_SETS
from gradleak.envs.doomnav import UNITS_PER_METRE, DoomNavConfig, DoomNavEnv, EngineError
from gradleak.errors import ConfigError

OPEN_SPACE_SCENE = "MAP01/r00"
ACTIONS_10 = {a.name: i for i, a in enumerate(ACTION_SETS[10])}


@pytest.fixture
def env() -> DoomNavEnv:
    env = DoomNavEnv(DoomNavConfig(num_actions=10, frame_size=32, scenes=[OPEN_SPACE_SCENE]))
    yield env
    env.close()


def rollout(seed: int, actions: list[int]) -> np.ndarray:
    env = gym.make("gradleak/DoomNav-v0", scenes=["MAP07/r00", "MAP01/r01"], frame_size=32)
    observation, _ = env.reset(seed=seed)
    frames = [observation["image"]]
    for action in actions:
        observation, *_ = env.step(action)
        frames.append(observation["image"])
    env.close()
    return np.stack(frames)


def test_same_seed_and_actions_give_identical_frames() -> None:
    actions = list(np.random.default_rng(0).integers(0, 5, size=40))
    first, second = rollout(11, actions), rollout(11, actions)
    assert np.array_equal(first, second)
    assert not np.array_equal(first, rollout(12, actions))


def test_an_episode_is_the_same_whichever_map_the_engine_was_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine starts on the first episode's map (one map load fewer); an episode must not
    depend on that, nor on the map played before it, or a resumed capture would differ."""
    import gradleak.envs.doomnav as doomnav

    started_on: list[str] = []
    make_game = doomnav._make_game
    monkeypatch.setattr(doomnav, "_make_game", lambda catalog, map_name: started_on.append(
        map_name) or make_game(catalog, map_name))
    actions = np.random.default_rng(1).integers(0, 5, size=12)

    def episode(before: list[str]) -> np.ndarray:
        """MAP07/r00's episode of seed 5, after an episode on each scene of `before`."""
        env = DoomNavEnv(DoomNavConfig(frame_size=32, scenes=[*before, "MAP07/r00"]))
        try:
            for scene in before:
                env.reset(seed=9, options={"scene": scene})
                env.step(0)
            observation, _ = env.reset(seed=5, options={"scene": "MAP07/r00"})
            return np.stack([observation["image"]] + [env.step(int(a))[0]["image"]
                                                      for a in actions])
        finally:
            env.close()

    fresh, after_another_map = episode([]), episode(["MAP01/r01"])
    assert started_on == ["MAP07", "MAP01"]
    assert np.array_equal(fresh, after_another_map)


def test_rotate_left_then_right_returns_the_heading(env: DoomNavEnv) -> None:
    _, info = env.reset(seed=0)
    start = info["angle"]
    _, _, _, _, left = env.step(ACTIONS_10["RotateLeft"])
    assert (left["angle"] - start) % 360 == pytest.approx(15.0, abs=0.01)
    _, _, _, _, back = env.step(ACTIONS_10["RotateRight"])
    assert back["angle"] == pytest.approx(start, abs=0.01)


def test_move_ahead_moves_a_fixed_distance_in_open_space(env: DoomNavEnv) -> None:
    distances = []
    for seed in range(4):
        _, info = env.reset(seed=seed)
        _, _, _, _, after = env.step(ACTIONS_10["MoveAhead"])
        dx = np.subtract(after["position"], info["position"])
        distances.append(np.hypot(*dx) / UNITS_PER_METRE)
        heading = np.degrees(np.arctan2(dx[1], dx[0])) % 360
        assert heading == pytest.approx(info["angle"] % 360, abs=1.0)
    assert np.allclose(distances, 0.24, atol=0.01)  # one tic of thrust, settled


def test_move_back_and_strafe_go_the_right_way(env: DoomNavEnv) -> None:
    _, info = env.reset(seed=1)
    angle = np.radians(info["angle"])
    forward, left = np.array([np.cos(angle), np.sin(angle)]), np.array([-np.sin(angle),
                                                                          np.cos(angle)])
    for name, direction in (("MoveBack", -forward), ("MoveLeft", left), ("MoveRight", -left)):
        before = env.step(ACTIONS_10["RotateLeft"])[4]  # steer, then undo: heading is exact
        before = env.step(ACTIONS_10["RotateRight"])[4]
        after = env.step(ACTIONS_10[name])[4]
        step = np.subtract(after["position"], before["position"])
        assert np.dot(step, direction) / np.linalg.norm(step) > 0.99, name


def test_look_is_clamped_to_thirty_degrees(env: DoomNavEnv) -> None:
    env.reset(seed=0)
    pitches = [env.step(ACTIONS_10["LookUp"])[4]["pitch"] for _ in range(3)]
    assert pitches == pytest.approx([-15.0, -30.0, -30.0], abs=0.01)  # PITCH < 0 looks up
    assert env.step(ACTIONS_10["LookDown"])[4]["pitch"] == pytest.approx(-15.0, abs=0.01)


def test_crouch_lowers_the_view_and_stand_restores_it(env: DoomNavEnv) -> None:
    _, info = env.reset(seed=2)
    crouched = env.step(ACTIONS_10["Crouch"])[4]["view_height"]
    moved = env.step(ACTIONS_10["MoveAhead"])[4]["view_height"]  # stays down while moving
    standing = env.step(ACTIONS_10["Stand"])[4]["view_height"]
    assert info["view_height"] == pytest.approx(41.0)  # Doom's eye height
    assert crouched == pytest.approx(20.5) and moved == pytest.approx(20.5)
    assert standing == pytest.approx(41.0)


def test_goal_vector_and_reward_follow_the_distance(env: DoomNavEnv) -> None:
    observation, info = env.reset(seed=3)
    assert observation["goal"][0] == pytest.approx(min(info["distance_m"] / 10, 1), abs=1e-6)
    assert np.hypot(*observation["goal"][1:]) == pytest.approx(1.0, abs=1e-5)
    _, reward, _, _, after = env.step(ACTIONS_10["MoveAhead"])
    progress = info["distance_m"] - after["distance_m"]
    assert reward == pytest.approx(progress - env.config.step_cost, abs=1e-6)


def test_episode_is_cut_after_max_steps() -> None:
    env = DoomNavEnv(DoomNavConfig(frame_size=32, max_steps=5, scenes=[OPEN_SPACE_SCENE]))
    env.reset(seed=0)
    flags = [env.step(1)[2:4] for _ in range(5)]
    env.close()
    assert flags[-1] == (False, True) and all(f == (False, False) for f in flags[:-1])


def test_a_user_pwad_runs_in_the_engine(tmp_path: Path) -> None:
    wad = write_test_wad(tmp_path / "rooms.wad")
    env = DoomNavEnv(DoomNavConfig(wad=str(wad), frame_size=32, scenes=["MAP01/r00"]))
    _, info = env.reset(seed=0)
    after = env.step(0)[4]
    env.close()
    assert info["position"][0] < 512  # region 0 is room A: room B loses cells to its pool
    assert np.hypot(*np.subtract(after["position"], info["position"])) > 7.0


def test_unknown_scene_and_setting_are_rejected() -> None:
    with pytest.raises(ConfigError, match="MAP01 has"):
        DoomNavEnv(DoomNavConfig(scenes=["MAP01/r99"]))
    with pytest.raises(ConfigError, match="no setting 'fov'"):
        DoomNavEnv(fov=90)
    with pytest.raises(ConfigError, match="num_actions=7"):
        DoomNavEnv(DoomNavConfig(num_actions=7))


def test_a_step_before_the_first_reset_is_refused_without_an_engine() -> None:
    env = DoomNavEnv(DoomNavConfig(frame_size=32, scenes=["MAP01/r00"]))
    with pytest.raises(EngineError, match="call reset"):
        env.step(0)
    assert env._game is None
    env.close()
