"""The one name registry behind engines, episodes, environments, tools, reward functions and tasks."""

from __future__ import annotations

import sys

import pytest

from asyncrl.pipelines.datasets import data
from asyncrl.roles.agentic import environments, episodes, tools
from asyncrl.roles.scoring import reward
from asyncrl.roles.engines import base as engines
from asyncrl.roles.errors import EpisodeConfigError, UnknownNameError
from asyncrl.roles.registry import Registry


def test_every_registry_of_the_roles_and_pipelines_is_the_one_helper():
    tables = [engines._ENGINES, episodes._EPISODES, environments._ENVS, tools._TOOLS, reward._REWARD_FNS,
              data._TASKS]
    assert [type(t) for t in tables] == [Registry] * 6
    assert [t.kind for t in tables] == ["generation engine", "episode", "environment", "tool", "reward function",
                                        "task"]


def test_a_taken_name_is_refused_unless_replaced_and_the_same_entry_again_is_harmless():
    reg: Registry[object] = Registry("widget", how_to_register="Register one with add().")
    a, b = object(), object()
    assert reg.add("w", a) is a
    assert reg.add("w", a) is a  # a module imported twice registers the same object again
    with pytest.raises(ValueError, match=r"^a widget named 'w' is already registered; pick another name or pass "
                                         r"replace=True$"):
        reg.add("w", b)
    assert reg.get("w") is a  # the refused entry did not land
    assert reg.add("w", b, replace=True) is b
    assert reg.get("w") is b


def test_an_unknown_name_lists_the_known_ones_and_says_how_to_register():
    reg: Registry[int] = Registry("engine", how_to_register="Register one with @register_engine(name).")
    reg.add("zeta", 1)
    reg.add("alpha", 2)
    with pytest.raises(UnknownNameError) as info:
        reg.get("nope")
    assert str(info.value) == ("no engine named 'nope'; known: ['alpha', 'zeta']. Register one with "
                               "@register_engine(name).")
    assert reg.find("nope") is None and "nope" not in reg and list(reg) == ["alpha", "zeta"]


def test_the_error_type_is_the_registrys_own():
    with pytest.raises(EpisodeConfigError, match=r"^no tool named 'no_such_tool'; known: \["):
        tools.get_tool("no_such_tool")
    with pytest.raises(UnknownNameError, match=r"^no task named 'no_such_task'; known: \['arith', "):
        data.get_task("no_such_task")


def test_a_check_refuses_an_entry_before_it_is_registered():
    reg: Registry[object] = Registry("episode", how_to_register=".")

    def must_be_callable(entry: object) -> None:
        if not callable(entry):
            raise TypeError("not callable")

    with pytest.raises(TypeError, match="not callable"):
        reg.decorator("e", check=must_be_callable)(42)
    assert "e" not in reg
    assert reg.decorator("e", check=must_be_callable)(len) is len


def test_a_lazy_entry_imports_its_module_on_first_lookup(tmp_path, monkeypatch):
    (tmp_path / "lazy_widget_mod.py").write_text(
        f"import sys\nsys.modules[{__name__!r}].LAZY.add('lazy', 'registered on import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "lazy" not in LAZY and LAZY.names() == ["lazy"]  # listed before it is imported
    assert "lazy_widget_mod" not in sys.modules
    assert LAZY.get("lazy") == "registered on import"
    assert "lazy_widget_mod" in sys.modules


def test_the_episode_and_environment_checks_still_refuse_a_non_async_entry():
    with pytest.raises(EpisodeConfigError, match="must be an `async def`"):
        episodes.register_episode("test_registry_sync_episode")(lambda llm, sample: None)
    assert "test_registry_sync_episode" not in episodes.registered_episodes()

    class SyncStep:
        def step(self, action):  # not async
            return action

    with pytest.raises(EpisodeConfigError, match="step must be `async def step"):
        environments.register_environment("test_registry_sync_env")(SyncStep)
    assert "test_registry_sync_env" not in environments.environment_names()


LAZY: Registry[str] = Registry("widget", how_to_register=".", lazy={"lazy": "lazy_widget_mod"})
