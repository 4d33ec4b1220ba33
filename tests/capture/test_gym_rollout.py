"""`gradleak.rollout`: a CleanRL-style agent run in the user's own Gymnasium environment (frame
stacks, channels first) at θ0, its GAE and normalisation as declared, recorded as the client
sends it; everything it cannot handle refused before the first step."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

import gradleak
import gradleak.capture.gym_rollout
from gradleak.attacks.analytic import recover_analytically
from gradleak.capture.reader import CaptureFile
from gradleak.errors import ConfigError
from gradleak.victims.transform import InputTransform

SIZE, STACK, ACTIONS = 16, 4, 3
CLEANRL = {"vf_coef": 0.5, "ent_coef": 0.01, "clip_coef": 0.1}
# gradleak's loss is c_v·(V − R)²; CleanRL's 0.5·(V − R)² times vf_coef
LOSS = {"value": 0.5 * CLEANRL["vf_coef"], "entropy": CLEANRL["ent_coef"],
        "clip": CLEANRL["clip_coef"]}


class Dots(gym.Env):
    """A dot on a textured 16×16 floor, seen as the last four grayscale frames stacked channels
    first, as Gymnasium's FrameStackObservation gives them. Actions move it left, right or not;
    reward 1 on the right half; the episode ends at the right edge or after 9 steps."""

    observation_space = gym.spaces.Box(0, 255, (STACK, SIZE, SIZE), np.uint8)
    action_space = gym.spaces.Discrete(ACTIONS)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.floor = self.np_random.integers(0, 120, (SIZE, SIZE), dtype=np.uint8)
        self.position, self.t = self.np_random.integers(2, SIZE - 2, 2), 0
        self.frames = [self.draw()] * STACK
        return np.stack(self.frames), {}

    def draw(self) -> np.ndarray:
        frame = self.floor.copy()
        frame[self.position[0], self.position[1]] = 255
        return frame

    def step(self, action: int):
        self.position[1] = np.clip(self.position[1] + (-1, 1, 0)[int(action)], 0, SIZE - 1)
        self.position[0] = np.clip(self.position[0] + self.np_random.integers(-1, 2), 0, SIZE - 1)
        self.t += 1
        self.frames = [*self.frames[1:], self.draw()]
        reward = float(self.position[1] >= SIZE // 2)
        return (np.stack(self.frames), reward, bool(self.position[1] == SIZE - 1),
                self.t >= 9, {})


class Agent(nn.Module):
    """CleanRL's Atari agent, small: a shared conv body on x / 255, actor and critic heads."""

    def __init__(self) -> None:
        super().__init__()
        self.network = nn.Sequential(nn.Conv2d(STACK, 8, 4, 2), nn.ReLU(), nn.Flatten(),
                                     nn.Linear(8 * 7 * 7, 32), nn.ReLU())
        # the count as CleanRL reads it, envs.single_action_space.n: a NumPy integer
        self.actor, self.critic = nn.Linear(32, Dots.action_space.n), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.network(x / 255.0)
        return self.actor(hidden), self.critic(hidden)


@pytest.fixture
def agent() -> Agent:
    torch.manual_seed(0)
    return Agent()


def victim_of(agent: Agent) -> gradleak.victims.Victim:
    return gradleak.wrap(agent, policy_head="actor", value_head="critic", feed="frames-chw",
                         transform=InputTransform(SIZE, SIZE, STACK, stack=STACK))


def replay(rollout: gradleak.capture.gym_rollout.EnvRollout, seed: int, value
           ) -> tuple[list[np.ndarray], list[float], list[float]]:
    """The environment driven by the rollout's own actions: each step's observation, reward
    and the bootstrap each episode ends with (V of the observation it stopped at, 0 after a
    terminal), for checking the rollout against."""
    observations, rewards, bootstraps = [], [], []
    for episode in np.unique(rollout.episode_ids):
        env = Dots()
        observation, _ = env.reset(seed=seed + int(episode))
        terminated = False
        for action in rollout.actions[rollout.episode_ids == episode]:
            observations.append(observation)
            observation, reward, terminated, _, _ = env.step(int(action))
            rewards.append(reward)
        bootstraps.append(0.0 if terminated else float(value(observation[None])[0]))
    return observations, rewards, bootstraps


def test_a_rollout_is_the_agent_at_theta0_in_its_own_environment(agent: Agent) -> None:
    def value(observations: np.ndarray) -> np.ndarray:
        return agent(torch.from_numpy(observations).float())[1][:, 0].detach().numpy()

    rollout = gradleak.rollout(victim_of(agent), Dots(), 40, gamma=0.9, lam=0.8, seed=3)
    assert len(rollout) == 40 and rollout.images.shape == (40, SIZE, SIZE, STACK)
    observations, rewards, bootstraps = replay(rollout, 3, value)
    # the stored frames are the observations, channels last; episodes end where the env ends
    assert np.array_equal(rollout.images, np.stack(observations).transpose(0, 2, 3, 1))
    assert np.array_equal(rollout.rewards, np.float32(rewards))
    assert np.abs(rollout.values - value(np.stack(observations))).max() < 1e-5
    # GAE(γ, λ) per episode, the last one cut at 40 steps and bootstrapped like a truncation
    expected = []
    for episode, bootstrap in zip(np.unique(rollout.episode_ids), bootstraps):
        mine = rollout.episode_ids == episode
        v, r = rollout.values[mine].astype(np.float64), rollout.rewards[mine]
        following = np.append(v[1:], bootstrap)
        running, part = 0.0, []
        for t in range(len(r) - 1, -1, -1):
            running = r[t] + 0.9 * following[t] - v[t] + 0.9 * 0.8 * running
            part.insert(0, running)
        expected += part
    assert np.abs(rollout.advantages_raw - np.array(expected)).max() < 1e-5
    assert np.array_equal(rollout.advantages, rollout.advantages_raw)  # "none" declared
    assert np.abs(rollout.returns - (rollout.advantages_raw + rollout.values)).max() < 1e-5
    assert len(np.unique(rollout.episode_ids)) >= 4  # several episodes, each from its seed


@pytest.mark.parametrize("norm", ["episode", "minibatch:8", "rollout"])
def test_advantages_are_normalised_as_declared(agent: Agent, norm: str) -> None:
    rollout = gradleak.rollout(victim_of(agent), Dots(), 32, advantage_norm=norm, seed=1)
    used, raw = rollout.advantages.astype(np.float64), rollout.advantages_raw
    groups = {"episode": [rollout.episode_ids == e for e in np.unique(rollout.episode_ids)],
              "minibatch:8": [np.arange(32) // 8 == k for k in range(4)],
              "rollout": [np.ones(32, bool)]}[norm]
    ddof = 0 if norm == "episode" else 1
    for group in groups:
        assert abs(used[group].mean()) < 1e-5
        if group.sum() > 1:
            assert abs(used[group].std(ddof=ddof) - 1) < 1e-3
            scale = raw[group].std(ddof=ddof) + 1e-8  # an affine map of the raw ones
            assert np.abs(used[group] - (raw[group] - raw[group].mean()) / scale).max() < 1e-4


def test_a_cleanrl_agent_is_recorded_as_it_sends_its_gradient(agent: Agent, tmp_path: Path
                                                               ) -> None:
    """Each row of the capture is CleanRL's own PPO loss gradient for that step alone at θ0
    (the ratio is 1 there), and the closed form reads every action back off it."""
    victim = victim_of(agent)
    rollout = gradleak.rollout(victim, Dots(), 24, gamma=0.99, lam=0.95,
                               advantage_norm="minibatch:8", seed=5)
    out = tmp_path / "cleanrl.h5"
    assert rollout.record(victim, out, loss=LOSS, split="heldout")["rows"] == 24
    with CaptureFile(out) as capture:
        observation = capture.observation()
        assert np.array_equal(capture.target().advantages, rollout.advantages)
    names = [layer.name for layer in observation.layers]
    for t in (0, 11, 23):
        logits, values = agent(torch.from_numpy(rollout.images[t:t + 1]).permute(0, 3, 1, 2)
                               .float())
        log_pi = logits.log_softmax(-1)
        entropy = -(log_pi.exp() * log_pi).sum()
        advantage, ret = float(rollout.advantages[t]), float(rollout.returns[t])
        loss = (-advantage * log_pi[0, rollout.actions[t]]
                + CLEANRL["vf_coef"] * 0.5 * (values[0, 0] - ret) ** 2
                - CLEANRL["ent_coef"] * entropy)
        parameters = dict(agent.named_parameters())
        own = torch.autograd.grad(loss, [parameters[n] for n in names])
        flat = torch.cat([g.flatten() for g in own]).numpy()
        row = observation.gradients[t]
        assert np.abs(row - flat).max() < 1e-5 * max(1.0, np.abs(flat).max())
    assert np.array_equal(recover_analytically(observation).actions, rollout.actions)


class Floats(Dots):
    observation_space = gym.spaces.Box(0.0, 1.0, (STACK, SIZE, SIZE), np.float32)


class FiveActions(Dots):
    action_space = gym.spaces.Discrete(5)


@pytest.mark.parametrize("env, settings, fragment", [
    (lambda: gym.vector.SyncVectorEnv([Dots, Dots]), {}, "expected one gymnasium.Env"),
    (Floats, {}, "not uint8 frames; pass frame="),
    (FiveActions, {}, "actions are Discrete(5); the victim's policy has 3"),
    (Dots, {"frame": lambda o: o[:2].transpose(1, 2, 0)},
     "became a frame of uint8 (16, 16, 2); the victim's frames are uint8 (16, 16, 4)"),
    (Dots, {"steps": 0}, "steps=0, expected a positive integer"),
    (Dots, {"gamma": 1.5}, "gamma=1.5"),
    (Dots, {"advantage_norm": "batch"}, "advantage normalisation 'batch'"),
])
def test_what_a_rollout_cannot_handle_is_refused_before_a_step(agent: Agent, env, settings: dict,
                                                               fragment: str) -> None:
    options = {"steps": 8, **settings}
    with pytest.raises(ConfigError) as error:
        gradleak.rollout(victim_of(agent), env(), **options)
    assert fragment in str(error.value), str(error.value)


def test_a_rollout_is_recorded_only_at_the_weights_it_ran_at(agent: Agent, tmp_path: Path
                                                            ) -> None:
    victim = victim_of(agent)
    rollout = gradleak.rollout(victim, Dots(), 8, gamma=0.9)
    with pytest.raises(ConfigError, match="GAE used gamma=0.9"):
        rollout.record(victim, tmp_path / "a.h5", loss={**LOSS, "gamma": 0.99})
    with torch.no_grad():
        victim.get_submodule(victim.roles().policy_head).bias.add_(0.1)  # an update since
    with pytest.raises(ConfigError, match="weights changed since the rollout"):
        rollout.record(victim, tmp_path / "b.h5", loss=LOSS)
    assert not list(tmp_path.iterdir())
