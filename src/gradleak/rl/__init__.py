"""Reinforcement learning of the victim: the shared actor-critic loss, GAE, PPO/A2C."""
