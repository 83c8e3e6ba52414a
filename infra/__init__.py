"""A run's plumbing: its directory and checkpoints, stopping, trackers, several processes, FSDP2, weights I/O."""
