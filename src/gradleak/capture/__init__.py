"""Capture: per-step gradients at a frozen θ0, next to the private frames, in HDF5."""

# Registers the HDF5 filters (LZ4, Zstd) capture files are written with, before any is read.
import hdf5plugin  # noqa: E402,F401
