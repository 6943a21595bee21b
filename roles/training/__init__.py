"""The trained roles: policy, reference and critic workers, their sharding strategy, LoRA, the RL math."""
