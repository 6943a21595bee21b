"""Prompts and answers: tasks, data files, held-out evaluation."""
