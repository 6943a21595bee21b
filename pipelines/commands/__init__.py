"""The command line's commands: ``asyncrl train`` and the rest (`cli`), replay, the twin's plan, fit and chaos."""
