"""Recovery: the supervisor, fault classification, signals, heartbeats."""
