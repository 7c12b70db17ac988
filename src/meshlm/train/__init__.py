"""Training: the loop, checkpoints, metrics."""
