"""Environments: DoomNav on ViZDoom, and an adapter for any RGB Gymnasium environment."""

import gymnasium as gym

ENV_ID = "gradleak/DoomNav-v0"

if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="gradleak.envs.doomnav:DoomNavEnv")
