"""A job's definition and entry point: config dataclasses, presets, validation, the CLI."""
