"""Weight sync between policy and rollout: transports, the collective channel, the rollout's side."""
