"""The trainer's plumbing: processes and devices, metrics, checkpoints, the LR schedule."""
