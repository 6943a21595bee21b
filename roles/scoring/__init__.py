"""Rewards: the reward worker, reward functions, the arithmetic task's checker."""
