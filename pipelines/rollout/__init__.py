"""Rollout modes: batch and streaming producers, admission control, elastic resizing, dynamic sampling."""
