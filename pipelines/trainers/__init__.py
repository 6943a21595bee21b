"""The trainers: the async `Trainer` (GRPO, PPO) that wires a run's parts, and the synchronous baseline."""
