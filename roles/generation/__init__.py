"""The rollout worker: its config, its request-level generation, its preemption notice."""
