"""Every way ``@register`` and ``register_dispatch_mode`` refuse a bad declaration.

Each path of ``asyncrl/register.py`` that raises :class:`~asyncrl.RegistrationError`
is hit once, and its message is pinned: it names what is wrong and how to fix it.
No Ray: registration happens when the class body runs.
"""

from __future__ import annotations

import pytest

from asyncrl import Dispatch, Execute, Mode, RegistrationError, register, register_dispatch_mode
from asyncrl.dispatch import collect_list, dispatch_one_to_all
from asyncrl.register import DispatchMode, get_dispatch_mode


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(RegistrationError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_an_unknown_mode_name_lists_the_known_ones():
    msg = _error(register, dispatch_mode="NOT_A_MODE")
    prefix = "unknown dispatch mode 'NOT_A_MODE'; known modes: "
    suffix = ". Register your own with asyncrl.register_dispatch_mode(Dispatch.custom(...))"
    assert msg.startswith(prefix) and msg.endswith(suffix), msg
    known = msg[len(prefix):-len(suffix)].split(", ")
    assert {"ALL_TO_ALL", "DP_COMPUTE", "DP_COMPUTE_METRIC", "ONE_TO_ALL"} <= set(known)
    assert known == sorted(known)


def test_a_dispatch_mode_of_the_wrong_type():
    assert _error(get_dispatch_mode, 3) == "dispatch_mode must be a DispatchMode or a registered name, got int"


def test_a_second_mode_under_a_taken_name_needs_replace():
    first = register_dispatch_mode(Dispatch.custom("test_registration_dup", dispatch_one_to_all, collect_list))
    second = Dispatch.custom("test_registration_dup", dispatch_one_to_all, collect_list)
    assert _error(register_dispatch_mode, second) == (
        "a dispatch mode named 'test_registration_dup' is already registered; pick another name or pass replace=True")
    assert register_dispatch_mode(first) is first  # the same object again is not a clash
    assert register_dispatch_mode(second, replace=True) is second
    assert get_dispatch_mode("test_registration_dup") is second


def test_register_dispatch_mode_takes_only_a_dispatch_mode():
    assert _error(register_dispatch_mode, "ONE_TO_ALL") == "register_dispatch_mode expects a DispatchMode, got str"


def test_a_mode_whose_functions_are_not_callable():
    msg = _error(DispatchMode, "broken", dispatch_one_to_all, None)
    assert msg == "dispatch mode 'broken': dispatch and collect must both be callables"


def test_a_bare_register_without_parentheses():
    def method(self):
        return 1

    assert _error(register, method) == "@register needs parentheses: write @register() or @register(dispatch_mode=...)"


def test_a_bad_execute_mode():
    assert _error(register, Dispatch.ONE_TO_ALL, "rank_zero") == (
        "execute_mode must be an asyncrl.Execute, got 'rank_zero'")


def test_both_mode_and_concurrent():
    assert _error(register, mode=Mode.CONCURRENT, concurrent=True) == "pass either mode= or concurrent=, not both"


def test_a_mode_that_is_not_a_mode():
    assert _error(register, mode="concurrent") == "mode must be an asyncrl.Mode, got 'concurrent'"


def test_a_method_registered_twice():
    @register()
    def ping(self):
        return 1

    assert _error(register(execute_mode=Execute.RANK_ZERO), ping) == "ping is registered twice"


def test_register_decorates_only_callables():
    assert _error(register(), 42) == "@register decorates methods, got int"


def test_a_concurrent_method_must_be_async():
    def slow(self):
        return 1

    assert _error(register(concurrent=True), slow) == (
        "test_a_concurrent_method_must_be_async.<locals>.slow: concurrent mode needs an `async def` method "
        "(a plain def would block the worker's event loop); make it async or drop concurrent")
