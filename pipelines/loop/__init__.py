"""The train loop and what it drives: the trainer, the loop state, the stages, weight sync, precompute-ahead."""
