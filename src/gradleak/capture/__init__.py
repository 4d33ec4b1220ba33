"""Capture: per-step gradients at a frozen θ0, next to the private frames, in HDF5."""
