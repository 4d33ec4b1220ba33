"""gradleak: measure how much a shared gradient stream leaks."""

__version__ = "0.1.0"
