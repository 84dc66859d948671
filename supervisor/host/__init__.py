"""Adapters to the operating system: processes, signals, locks, the run identity, the prewarmed agent, atomic
files, careful opens, the collector pause. They know nothing of checkpoints, policy or the daemon."""
