"""Backends that run worker hosts: Ray actors (`ray`) and in-process objects (`local`)."""
