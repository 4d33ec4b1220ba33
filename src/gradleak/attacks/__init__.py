"""Attacks: they read an Observation (never the private Target) and return a Reconstruction."""
