"""The public face of ``asyncrl.roles``: every exception of roles/errors.py is listed there and
re-exported from the package, and ``__all__`` names exactly what the package exposes."""

from __future__ import annotations

import inspect

import asyncrl.roles
from asyncrl.errors import AsyncRLError
from asyncrl.roles import errors


def test_every_roles_error_is_listed_and_re_exported_from_asyncrl_roles():
    defined = {n for n, v in vars(errors).items() if inspect.isclass(v) and issubclass(v, BaseException)
               and v.__module__ == errors.__name__}
    assert set(errors.__all__) == defined
    assert {"EpisodeError", "EpisodeConfigError", "TrajectoryError"} <= defined
    for name in errors.__all__:
        assert name in asyncrl.roles.__all__, name
        assert getattr(asyncrl.roles, name) is getattr(errors, name)
        cls = getattr(errors, name)
        assert issubclass(cls, errors.RolesError) and issubclass(cls, AsyncRLError)
        assert cls.__doc__.startswith(("Raised ", "Base class")), name


def test_the_episode_errors_subclass_the_builtins_a_caller_catches():
    from asyncrl.roles import EpisodeConfigError, EpisodeError, TrajectoryError

    assert issubclass(TrajectoryError, ValueError) and issubclass(EpisodeConfigError, ValueError)
    assert issubclass(EpisodeError, RuntimeError)


def test_all_names_exactly_the_public_attributes_of_asyncrl_roles():
    assert len(asyncrl.roles.__all__) == len(set(asyncrl.roles.__all__))
    for name in asyncrl.roles.__all__:
        assert hasattr(asyncrl.roles, name), name
    public = {n for n, v in vars(asyncrl.roles).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert public == set(asyncrl.roles.__all__) - {"arithmetic", "functional"}
