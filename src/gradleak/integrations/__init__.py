"""Integrations with the libraries clients train with; each imports its library lazily."""
