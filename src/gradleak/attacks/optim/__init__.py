"""Optimisation baselines: DLG and Inverting Gradients with the victim's exact loss."""
