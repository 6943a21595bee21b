"""Checkpoints: the files, saving and restoring them, exporting a Hugging Face model."""
